"""A single ``torch.save`` file holding a (nested) dict of tensors and plain values.

The zip archive is read with :mod:`ckpttool._torchzip`: ``data.pkl`` through the restricted
unpickler (tensors and plain Python values only), tensors located by byte offset and read on
demand. Nested names are flattened with dots, as DCP does (``optimizer.state.0.exp_avg``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from ckpttool.formats.base import Detection, PieceReader

from ckpttool import _torchzip, _unpickle
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CorruptFileError
from ckpttool.geometry import Box
from ckpttool.io import RandomAccessFile
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, Piece
from ckpttool.naming import classify
from ckpttool.values import find_step, flatten, set_value

ALLOWLIST: dict[tuple[str, str], Any] = {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS}
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19", b"\x80\x02\x8a")


class TorchSaveAdapter:
    name = "torch"

    def detect(self, path: Path) -> Detection:
        if not path.is_file():
            return Detection(False, "not a single file")
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == _ZIP_MAGIC:
            return Detection(True, "a zip archive (torch.save)")
        if head[:3] == _LEGACY_MAGIC[1]:
            return Detection(True, "a legacy (pre-1.6) torch.save pickle")
        return Detection(False, f"{path.name} is not a torch.save file (magic {head.hex()})")

    def describe(self, path: Path) -> Manifest:
        root, rel = path.parent, path.name
        manifest = Manifest(root=str(root), format=self.name, layout=Layout(world_size=1))
        with RandomAccessFile(path, display=rel) as f:
            if f.read(0, min(4, f.size)) != _ZIP_MAGIC:
                raise CorruptFileError(
                    f"{rel}: legacy (pre-1.6, non-zip) torch.save format, which ckpttool does not read",
                    hint="re-save it with a current torch: torch.save(torch.load(p, weights_only=True), p2)",
                    path=rel,
                )
            archive = _torchzip.Archive(f, display=rel, allow=ALLOWLIST)
            obj = archive.load()
            manifest.files.append(FileRecord(path=rel, size=f.size, role="data", ranks=[0]))
            leaves = flatten(obj) if isinstance(obj, dict) else [("", obj)]
            for name, value in leaves:
                name = name or "value"
                if isinstance(value, _unpickle.TensorRef):
                    archive.storage_span(value.storage.key)  # member exists, within the file
                    numel = math.prod(value.shape)
                    manifest.add(
                        Item(
                            name=name,
                            kind=classify(name, is_tensor=True),
                            dtype=value.dtype,
                            shape=value.shape,
                            pieces=[
                                Piece(
                                    file=rel,
                                    locator={
                                        "storage": value.storage.key,
                                        "storage_offset": value.storage_offset,
                                        "stride": list(value.stride),
                                    },
                                    box=Box.whole(value.shape),
                                    rank=0,
                                    nbytes=numel * lookup_dtype(value.dtype).itemsize,
                                )
                            ],
                        )
                    )
                else:
                    item = manifest.add(
                        Item(
                            name=name,
                            kind=classify(name, is_tensor=False),
                            pieces=[Piece(file=rel, locator={"path": name}, box=Box((), ()), rank=0)],
                        )
                    )
                    set_value(item, value)
        manifest.step = find_step(manifest.items)
        return manifest

    def reader(self, manifest: Manifest) -> TorchSaveReader:
        return TorchSaveReader(manifest)


class TorchSaveReader(PieceReader):
    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        self._archives: dict[str, _torchzip.Archive] = {}
        self._objects: dict[str, Any] = {}

    def _archive(self, rel: str) -> _torchzip.Archive:
        archive = self._archives.get(rel)
        if archive is None:
            archive = _torchzip.Archive(self.files.get(rel), display=rel, allow=ALLOWLIST)
            self._archives[rel] = archive
        return archive

    def read(self, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
        assert item.dtype is not None and item.shape is not None
        archive = self._archive(piece.file)
        loc = piece.locator
        storage = _unpickle.StorageRef(key=loc["storage"], dtype=item.dtype, numel=0, location="cpu")
        ref = _unpickle.TensorRef(storage, loc["storage_offset"], item.shape, tuple(loc["stride"]), item.dtype)
        return _torchzip.read_tensor(archive, ref, out)

    def read_object(self, item: Item) -> Any:
        rel = item.pieces[0].file
        if rel not in self._objects:
            self._objects[rel] = dict(flatten(self._archive(rel).load()))
        return self._objects[rel][item.pieces[0].locator["path"]]


ADAPTER = TorchSaveAdapter()
