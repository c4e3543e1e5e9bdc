"""A single ``torch.save`` file holding a (nested) dict of tensors and plain values, given as the
file or as a directory holding only it (and its seal), as ``convert --to torch`` writes.

The zip archive is read with :mod:`ckpttool._torchzip`: ``data.pkl`` through the restricted
unpickler (tensors and plain Python values only), tensors located by byte offset and read on
demand. Nested names are flattened with dots, as DCP does (``optimizer.state.0.exp_avg``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ckpttool import _dtensor, _unpickle
from ckpttool.errors import CkptError, FormatNotRecognizedError, PartOfCheckpointError, UnsafePickleError
from ckpttool.formats import _pt
from ckpttool.formats.base import Detection
from ckpttool.geometry import Box
from ckpttool.harness import TRAJECTORY, TRAJECTORY_STATES
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, is_seal_name
from ckpttool.naming import classify
from ckpttool.values import find_step, flatten, is_container_leaf, set_value

# plain numeric numpy arrays too: RNG states (``np.random.get_state()``) that training loops save
# (Hugging Face's ``rng_state.pth``; Megatron's records, carried by ``convert --to torch``); and
# ``io.BytesIO`` values (a DCP checkpoint's, carried by ``convert --to torch``)
ALLOWLIST: dict[tuple[str, str], Any] = {
    **_unpickle.PLAIN,
    **_unpickle.TORCH_TENSORS,
    **_unpickle.numpy_arrays(),
    **_unpickle.BYTES_IO,
    **_dtensor.DTENSORS,
}


class TorchSaveAdapter:
    name = "torch"

    def detect(self, path: Path) -> Detection:
        if path.is_dir():
            file = _only_file(path)
            if file is None:
                return Detection(False, "not a single file, nor a directory holding one .pt/.pth/.bin file")
            verdict = self.detect(file)
            if verdict.matches:
                return Detection(True, f"a directory holding one torch.save file ({file.name})", weak=True)
            return verdict
        if not path.is_file():
            return Detection(False, "not a single file")
        if path.suffix == ".distcp":
            # torch.save records one after another, named by the directory's .metadata: the first
            # alone would pass for the whole file
            return Detection(False, f"{path.name} is one data file of the DCP checkpoint {path.parent}: give that")
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == _pt.ZIP_MAGIC:
            return Detection(True, "a zip archive (torch.save)")
        if head[:3] == _pt.LEGACY_MAGIC:
            return Detection(True, "a legacy (pre-1.6) torch.save pickle")
        if not head.strip(b"\0") and path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            # what a save killed before its first write leaves (or a crash, zeros): damage to report,
            # not an unknown format
            said = "is empty" if not head else "starts with zero bytes"
            return Detection(True, f"{path.name} {said}; its name says torch.save", weak=True)
        return Detection(False, f"{path.name} is not a torch.save file (magic {head.hex()})")

    def describe(self, path: Path) -> Manifest:
        if path.is_dir():  # what convert --to torch writes: DIR/model.pt (and the seal, if sealed)
            file = _only_file(path)
            if file is None:
                raise FormatNotRecognizedError(str(path), {"torch": "no single .pt/.pth/.bin file here"})
            path = file
        root, rel = path.parent, path.name
        try:
            archive, obj, size = _pt.load(root, rel, ALLOWLIST)
        except UnsafePickleError as exc:
            whole = _enclosing_checkpoint(path)
            if whole is None:
                raise
            fmt, folder = whole
            why = f"read alone, its pickle refers to {exc.global_name}, which a plain torch.save file may not"
            raise PartOfCheckpointError(str(path), fmt, str(folder), why) from None
        try:
            manifest = Manifest(root=str(root), format=self.name, layout=Layout(world_size=1))
            # (no rank: the file holds the whole state, whoever saved it)
            manifest.files.append(FileRecord(path=rel, size=size, role="data"))
            # (a list or tuple of tensors or dicts at the top is walked into as one under a key is)
            walked = isinstance(obj, dict) or (isinstance(obj, list | tuple) and not is_container_leaf(obj))
            leaves = flatten(obj) if walked else [("", obj)]
            placer = _pt.DTensorPlacer(rel)
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
                            pieces=[_pt.tensor_piece(rel, value)],
                        )
                    )
                elif isinstance(value, _dtensor.DTensorRef):
                    # one rank's part of the tensor (this file alone: the rest is in the other ranks')
                    parts = placer.parts(name, value)
                    pieces = [_pt.tensor_piece(rel, ref, box=Box(offset, ref.shape)) for ref, offset in parts]
                    archive.storage_span(value.local.storage.key)  # the member exists, inside the file
                    kind = classify(name, is_tensor=True)
                    manifest.add(Item(name=name, kind=kind, dtype=value.dtype, shape=value.shape, pieces=pieces))
                else:
                    item = manifest.add(
                        Item(
                            name=name,
                            kind=classify(name, is_tensor=False),
                            pieces=[_pt.object_piece(rel, name)],
                        )
                    )
                    set_value(item, value)
        finally:
            archive.close()
        manifest.step = find_step(manifest.items)
        whole = _enclosing_checkpoint(path) if _RANK_FILE.search(path.name) else None
        if whole is not None:
            # one rank's file of a checkpoint, read alone: verify says so (the rest went unchecked);
            # of DeepSpeed or Megatron, the commands that write a checkpoint refuse it (refuse_a_part)
            manifest.extras["file_of"] = {"format": whole[0], "folder": str(whole[1])}
        return manifest

    def reader(self, manifest: Manifest) -> _pt.PtReader:
        return _pt.PtReader(manifest, ALLOWLIST)


_NOT_ALONE = ("deepspeed", "megatron")
"""formats whose rank files are parts of one checkpoint, never one by themselves"""

_RANK_FILE = re.compile(
    r"^(mp_rank_\d+_model_states|zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states|layer_\d+-model_\d+-model_states"
    r"|bf16_zero_pp_rank_\d+_mp_rank_\d+_optim_states|model_optim_rng|distrib_optim|common"
    r"|shard_\d+(_of_\d+)?|checkpoint_step\d+_stage\d+)\.pt$|^([\w.-]*[_-])?rank_?\d+\.pth?$"
)
"""the names of rank files (those formats', and per-rank shards': a DDP rank's may be the whole
model, a TP or pipeline rank's is not); a ``pytorch_model.bin`` that zero_to_fp32 or a trainer
wrote beside a DeepSpeed checkpoint is a checkpoint of its own"""


def refuse_a_part(manifest: Manifest, given: str | Path) -> None:
    """Refuse to write a checkpoint from one rank file of a DeepSpeed or Megatron checkpoint read as
    a plain torch.save file: the output held its tensors as they lie in that file and nothing of
    the rest (a ZeRO run's model states became a checkpoint with no optimizer state, sealed; a
    ``distrib_optim.pt`` became flat buffers named by their dtypes)."""
    part = manifest.extras.get("file_of")
    if part and part["format"] in _NOT_ALONE:
        # a rank file that reads as plain torch.save (no framework class in its pickle): alone it is a
        # part (DeepSpeed's model states without its optimizer, a distrib_optim.pt's flat buffers)
        file = Path(manifest.root, manifest.files[0].path) if manifest.files else Path(given)
        why = "alone, this file holds a part of the state, which a checkpoint written from it would pass off as "
        why += "the whole"
        raise PartOfCheckpointError(str(file), part["format"], part["folder"], why)


def _enclosing_checkpoint(path: Path) -> tuple[str, Path] | None:
    """The checkpoint of another format that file ``path`` is part of (a Megatron or DeepSpeed rank
    file, Megatron ``torch_dist``'s ``common.pt``), looked for in the three folders above it: such a
    file alone refers to its framework's classes, which only that format's reader allows."""
    from ckpttool import registry

    for folder in list(path.parents)[:3]:
        try:
            adapter = registry.detect(folder)
        except CkptError:
            continue
        if adapter.name not in _OTHER_FILES:
            return adapter.name, folder
    return None


_OTHER_FILES = (TorchSaveAdapter.name, "safetensors", "dcp")
"""formats whose checkpoint holds no torch.save file of its own (``.distcp`` is refused apart): a
``.pt`` beside one (a Hugging Face Trainer's ``optimizer.pt`` beside ``model.safetensors``) is
read alone"""


def _only_file(directory: Path) -> Path | None:
    """The one ``.pt``/``.pth``/``.bin`` file of ``directory`` when it holds nothing else but its
    seal (``convert --to torch``'s output) and the trajectory ``rehearse`` reads beside it
    (``ckpttool.trajectory.json`` and ``.pt``, which docs/rehearse.md's own harness keeps beside
    its ``state.pt``); else None."""
    try:
        names = [
            e.name
            for e in os.scandir(directory)
            if not is_seal_name(e.name) and e.name not in (TRAJECTORY, TRAJECTORY_STATES)
        ]
    except OSError:
        return None
    if len(names) != 1 or not names[0].endswith(_pt.SUFFIXES):
        return None
    file = directory / names[0]
    return file if file.is_file() else None


ADAPTER = TorchSaveAdapter()
