"""A single ``torch.save`` file holding a (nested) dict of tensors and plain values.

The zip archive is read with :mod:`ckpttool._torchzip`: ``data.pkl`` through the restricted
unpickler (tensors and plain Python values only), tensors located by byte offset and read on
demand. Nested names are flattened with dots, as DCP does (``optimizer.state.0.exp_avg``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool import _unpickle
from ckpttool.errors import CorruptFileError
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection
from ckpttool.manifest import FileRecord, Item, Layout, Manifest
from ckpttool.naming import classify
from ckpttool.values import find_step, flatten, set_value

# plain numeric numpy arrays too: RNG states (``np.random.get_state()``) that training loops save
# (Hugging Face's ``rng_state.pth``; Megatron's records, carried by ``convert --to torch``)
ALLOWLIST: dict[tuple[str, str], Any] = {**_unpickle.PLAIN, **_unpickle.TORCH_TENSORS, **_unpickle.numpy_arrays()}
_LEGACY_MAGIC = b"\x80\x02\x8a"


class TorchSaveAdapter:
    name = "torch"

    def detect(self, path: Path) -> Detection:
        if not path.is_file():
            return Detection(False, "not a single file")
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == _pt.ZIP_MAGIC:
            return Detection(True, "a zip archive (torch.save)")
        if head[:3] == _LEGACY_MAGIC:
            return Detection(True, "a legacy (pre-1.6) torch.save pickle")
        return Detection(False, f"{path.name} is not a torch.save file (magic {head.hex()})")

    def describe(self, path: Path) -> Manifest:
        root, rel = path.parent, path.name
        if not _pt.is_torch_zip(path):
            raise CorruptFileError(
                f"{rel}: legacy (pre-1.6, non-zip) torch.save format, which ckpttool does not read",
                hint="re-save it with a current torch: torch.save(torch.load(p, weights_only=True), p2)",
                path=rel,
            )
        archive, obj, size = _pt.load(root, rel, ALLOWLIST)
        try:
            manifest = Manifest(root=str(root), format=self.name, layout=Layout(world_size=1))
            manifest.files.append(FileRecord(path=rel, size=size, role="data", ranks=[0]))
            leaves = flatten(obj) if isinstance(obj, dict) else [("", obj)]
            for name, value in leaves:
                name = name or "value"
                if isinstance(value, _unpickle.TensorRef):
                    archive.storage_span(value.storage.key)  # the member exists, inside the file
                    manifest.add(
                        Item(
                            name=name,
                            kind=classify(name, is_tensor=True),
                            dtype=value.dtype,
                            shape=value.shape,
                            pieces=[_pt.tensor_piece(rel, value, rank=0)],
                        )
                    )
                else:
                    item = manifest.add(
                        Item(
                            name=name,
                            kind=classify(name, is_tensor=False),
                            pieces=[_pt.object_piece(rel, name, rank=0)],
                        )
                    )
                    set_value(item, value)
        finally:
            archive.close()
        manifest.step = find_step(manifest.items)
        return manifest

    def reader(self, manifest: Manifest) -> _pt.PtReader:
        return _pt.PtReader(manifest, ALLOWLIST)


ADAPTER = TorchSaveAdapter()
