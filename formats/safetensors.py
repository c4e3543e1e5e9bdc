"""safetensors files: one file, a directory of them, or a ``*.safetensors.index.json`` set.

Headers are parsed by hand (8-byte length + JSON) with the checks of the safetensors spec
(``tensor.rs::validate``): bounded header length, known dtypes, ``end - begin == numel * itemsize``,
offsets contiguous from 0 and ending at the end of the file. No torch needed. Directories written by
DCP's ``HuggingFaceStorageWriter`` (shards with ``DCP_SHARDING_INFO``) are left to the dcp adapter,
which uses :func:`read_header` and :class:`SafetensorsReader` from here.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool.dtypes import BY_SAFETENSORS, carrier
from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    FormatNotRecognizedError,
    IncompleteCheckpointError,
    UnsafePickleError,
    raise_together,
)
from ckpttool.formats.base import Detection, PieceReader
from ckpttool.geometry import Box
from ckpttool.io import FileCache, RandomAccessFile, confine, left_out, list_files, open_regular, outside
from ckpttool.manifest import FileRecord, Item, Layout, Manifest, Piece, StateName
from ckpttool.naming import classify
from ckpttool.values import unique_keys

MAX_HEADER = 100_000_000
SHARDING_INFO = "DCP_SHARDING_INFO"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    """torch dtype name"""
    shape: tuple[int, ...]
    begin: int
    """absolute byte offset in the file"""
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    file: str
    size: int
    tensors: list[TensorEntry]
    """in data order"""
    metadata: dict[str, str]


def read_header(path: Path, display: str) -> Header:
    """Parse and validate a safetensors header; reads only the header bytes."""
    with RandomAccessFile(path, display=display) as f:
        if f.size < 8:
            raise CorruptFileError(
                f"{display} is {f.size} bytes: too short for a safetensors header (8 bytes of length, then the "
                "JSON): the save stopped before it wrote the header",
                hint="use another checkpoint, or save this one again",
                path=display,
                rule="truncated-file",
            )
        (n,) = struct.unpack("<Q", f.read(0, 8))
        if n <= MAX_HEADER and 8 + n > f.size and f.read(8, 1) == b"{":
            # a sane length and the JSON begun: the file was cut inside its header, not some other file
            raise CorruptFileError(
                f"{display}: cut short inside its header: the header is {n:,} bytes after the 8-byte length "
                f"but the file ends after {f.size:,} bytes",
                hint="the save or a copy stopped early; use another checkpoint or restore the file from a copy",
                path=display,
                rule="truncated-file",
            )
        if n > MAX_HEADER or 8 + n > f.size:
            raise CorruptFileError(
                f"{display}: header length field says {n:,} bytes but the file is {f.size:,} bytes "
                f"(limit {MAX_HEADER:,}): not a safetensors file, or its first bytes are damaged",
                hint="check that the file is what its name says, or restore it from a copy",
                path=display,
            )
        raw = f.read(8, n)
        size = f.size
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptFileError(f"{display}: header is not valid JSON ({exc})", path=display) from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{display}: header is not a JSON object", path=display)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptFileError(f"{display}: __metadata__ must map strings to strings", path=display)
    data_len = size - 8 - n
    entries: list[TensorEntry] = []
    for name, spec in header.items():
        entries.append(_entry(display, name, spec, 8 + n))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 8 + n
    for e in entries:
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else "leaves a gap after the previous tensor"
            raise CorruptFileError(
                f"{display}: tensor {e.name} starts at data byte {e.begin - 8 - n:,} and {what} "
                f"(expected {pos - 8 - n:,})",
                path=display,
            )
        pos = e.end
    if pos - 8 - n != data_len:
        if pos - 8 - n > data_len:
            raise CorruptFileError(
                f"{display} is {size:,} bytes but its header places tensor data through byte {pos:,}: "
                "the file was cut short (copy or download interrupted?)",
                hint="fetch the file again",
                path=display,
                rule="truncated-file",
            )
        raise CorruptFileError(
            f"{display}: {data_len - (pos - 8 - n):,} bytes after the last tensor are not described by the header",
            path=display,
        )
    return Header(file=display, size=size, tensors=entries, metadata=meta)


def written_metadata(manifest: Manifest) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file ckpttool writes from ``manifest``: a safetensors
    source's own (its files' entries that agree; a model card's ``modelspec.*``, a trainer's notes),
    then ``format`` (``pt``) and the source's format. It was dropped whole."""
    carried: dict[str, str] = {}
    clash: set[str] = set()
    for meta in (manifest.extras.get("metadata") or {}).values() if manifest.format == "safetensors" else ():
        for k, v in meta.items():
            if carried.setdefault(k, v) != v:
                clash.add(k)
    return {
        **{k: v for k, v in carried.items() if k not in clash},
        "format": "pt",
        "ckpttool.source_format": manifest.format,
    }


def _entry(display: str, name: str, spec: Any, base: int) -> TensorEntry:
    # (fields beside those three are ignored, as safetensors' own loader ignores them: refused, a
    # file it reads was a corrupt-file error)
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise CorruptFileError(f"{display}: entry {name!r} is not {{dtype, shape, data_offsets}}", path=display)
    code, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    dt = BY_SAFETENSORS.get(code) if isinstance(code, str) else None
    if dt is None:
        raise CorruptFileError(f"{display}: tensor {name} has unknown dtype {code!r}", path=display)
    if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise CorruptFileError(f"{display}: tensor {name} has invalid shape {shape!r:.80}", path=display)
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise CorruptFileError(f"{display}: tensor {name} has invalid data_offsets {offsets!r:.80}", path=display)
    nbytes = math.prod(shape) * dt.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptFileError(
            f"{display}: tensor {name} is {dt.safetensors}{shape} = {nbytes:,} bytes but data_offsets span "
            f"{offsets[1] - offsets[0]:,}",
            path=display,
        )
    return TensorEntry(name, dt.name, tuple(shape), base + offsets[0], base + offsets[1])


def _index_files(path: Path) -> list[Path]:
    """The index files in ``path`` (not one :func:`left_out` counts absent)."""
    return sorted(
        p for p in path.iterdir() if p.name.endswith(".safetensors.index.json") and not left_out(path, p.name)
    )


def has_sharding_info(path: Path) -> bool:
    """Whether a directory holds safetensors shards written by DCP's HuggingFaceStorageWriter."""
    for p in sorted(q for q in path.glob("*.safetensors") if outside(path, q) is None)[:1]:
        try:
            return SHARDING_INFO in read_header(p, p.name).metadata
        except CkptError:
            return False
    return False


_VARIANT = re.compile(r"^(.+)\.([A-Za-z0-9_-]+)\.safetensors$")
"""a Hugging Face variant of a model file (``model.fp16.safetensors`` beside ``model.safetensors``)"""


def _refuse_variants(root: Path, files: list[str]) -> None:
    """A folder holding a model file and its Hugging Face variants (``model.safetensors`` and
    ``model.fp16.safetensors``: the same tensors in another dtype, loaded with ``variant="fp16"``)
    and no index: several models, not the shards of one. Refused naming them (exit 3), one to give."""
    stems = {f.removesuffix(".safetensors") for f in files}
    variants = sorted(f for f in files if (m := _VARIANT.match(f)) and m[1] in stems)
    if not variants:
        return
    bases = sorted({m[1] + ".safetensors" for f in variants if (m := _VARIANT.match(f))})
    shown = bases + variants
    raise FormatNotRecognizedError(
        str(root),
        {"safetensors": "a model file and its variants"},
        message=f"{root}: a folder of {len(shown)} safetensors models, not one: {', '.join(shown[:5])}"
        f"{' …' if len(shown) > 5 else ''} (Hugging Face variants: the same tensors, another dtype)",
        hint=f"give one of them, such as {root / bases[0]}",
    )


class SafetensorsAdapter:
    name = "safetensors"

    def detect(self, path: Path) -> Detection:
        if path.is_file():
            if path.name.endswith(".safetensors"):
                return Detection(True, "a .safetensors file")
            if _safetensors_header(path):  # (a link into the Hugging Face hub cache leads to blobs/<sha>)
                return Detection(True, "a safetensors file (by its header; its name has no .safetensors)")
            return Detection(False, f"{path.name} is not a .safetensors file")
        if _index_files(path):
            return Detection(True, f"found {_index_files(path)[0].name}")
        if any(path.glob("*.safetensors")):
            if has_sharding_info(path):
                return Detection(False, "safetensors shards written by DCP's HF storage writer (read as dcp)")
            return Detection(True, "found *.safetensors files")
        if _trainer_without_model(path):  # (its model file deleted or not yet written: said as missing)
            return Detection(True, "a Hugging Face Trainer checkpoint (trainer_state.json), no model file", weak=True)
        return Detection(False, "no *.safetensors file or *.safetensors.index.json")

    def describe(self, path: Path) -> Manifest:
        index_name: str | None = None
        weight_map: dict[str, str] | None = None
        unread: CkptError | None = None  # an index that does not read: the shards checked beside it
        if path.is_file():
            root, files = path.parent, [path.name]
        else:
            root = path
            indexes = _index_files(path)
            if indexes:
                index_name = indexes[0].name
                try:
                    weight_map = _read_index(path, index_name)
                except (CorruptFileError, IncompleteCheckpointError) as exc:
                    unread, index_name = exc, None
            if weight_map is not None:
                files = list(dict.fromkeys(weight_map.values()))
            else:
                files = sorted(p.name for p in path.glob("*.safetensors") if not p.is_dir())
                _refuse_variants(path, files)
        if path.is_dir() and not files and unread is None and _trainer_without_model(path):
            raise IncompleteCheckpointError(
                f"{path}: model.safetensors is missing: a Hugging Face Trainer checkpoint keeps its model's weights "
                "there (or in shards with model.safetensors.index.json) beside trainer_state.json",
                hint="restore the model file(s) from a copy, or use another checkpoint",
                path="model.safetensors",
                rule="missing-file",
            )
        manifest = Manifest(root=str(root), format=self.name, layout=Layout(world_size=None))
        damaged: list[CkptError] = []  # every shard missing, cut short or unreadable named, not the first
        if path.is_dir() and weight_map is None:  # (no index to name them: the shards' own numbering)
            damaged += [*([unread] if unread else []), *_unnumbered_shards(files)]
        found: dict[str, Path] = {}
        for rel in files:
            gone = left_out(root, rel)  # (verify's second look past links out: such a shard as absent)
            full = found[rel] = (
                Path(root, rel) if gone else Path(confine(root, rel, named_by=index_name or "the listing"))
            )
            # (a folder named as a shard is the shard replaced: its read says so, below)
            if full.is_dir() and weight_map is not None and not rel.endswith(".safetensors"):
                raise CorruptFileError(
                    f"{index_name}: names {rel!r} as the shard of "
                    f"{next(n for n, f in (weight_map or {}).items() if f == rel)}, which is a directory, not a file",
                    hint="restore the index from its source: its weight_map gives each tensor's .safetensors file",
                    path=index_name,
                )
            if gone or not full.exists():
                damaged.append(
                    IncompleteCheckpointError(
                        f"{rel}: shard named by the index is missing",
                        hint="download the missing shard",
                        path=rel,
                        rule="missing-file",
                    )
                )
        for rel, full in found.items():
            if not full.exists() or left_out(root, rel):
                continue
            try:
                header = read_header(full, rel)
            except (CorruptFileError, IncompleteCheckpointError) as exc:
                damaged.append(exc)
                continue
            manifest.files.append(FileRecord(path=rel, size=header.size, role="data"))
            if weight_map is not None and (astray := [e.name for e in header.tensors if weight_map.get(e.name) != rel]):
                damaged.append(_astray(rel, astray, weight_map, index_name or ""))
                continue
            for e in header.tensors:
                if e.name in manifest.items:
                    held = manifest.items[e.name].pieces
                    raise CorruptFileError(
                        f"{rel}: tensor {e.name} is also in {held[0].file if held else 'another shard'}: two files "
                        "of one model hold the same tensor",
                        hint="a shard copied over another, or two models' files in one folder: give one file, or "
                        "restore the shards from the model's source",
                        path=rel,
                    )
                manifest.add(
                    Item(
                        name=e.name,
                        kind=classify(e.name, is_tensor=True),
                        dtype=e.dtype,
                        shape=e.shape,
                        pieces=[
                            Piece(
                                file=rel,
                                locator={"begin": e.begin, "end": e.end},
                                box=Box.whole(e.shape),
                                nbytes=e.end - e.begin,
                            )
                        ],
                    )
                )
            if header.metadata:
                manifest.extras.setdefault("metadata", {})[rel] = header.metadata
        if weight_map is not None and index_name is not None:
            damaged += _shards_the_index_leaves_out(root, files, index_name)
        bad = {e.path for e in damaged}  # (their tensors are not read: not said again as missing)
        if (
            weight_map is not None
            and index_name is not None
            and (missing := [n for n, f in weight_map.items() if n not in manifest.items and f not in bad])
        ):
            damaged.append(
                CorruptFileError(
                    f"{index_name}: places {len(missing)} tensor(s) in shards that do not hold them: "
                    + ", ".join(f"{n} in {weight_map[n]}" for n in missing[:4])
                    + (" …" if len(missing) > 4 else ""),
                    hint="a shard from another save, or an index edited since: download the checkpoint's "
                    "shards and index again",
                    path=index_name,
                )
            )
        raise_together(damaged)
        if weight_map is not None and index_name is not None:
            manifest.files.append(FileRecord(path=index_name, size=(root / index_name).stat().st_size, role="metadata"))
        if path.is_dir():
            known = {f.path for f in manifest.files}
            manifest.files += [
                FileRecord(path=rel, size=size, role="aux") for rel, size in list_files(path) if rel not in known
            ]
            _trainer_state(root, manifest)
            if weight_map is None and unread is None:
                manifest.extras.setdefault("findings", []).extend(_index_missing(files))
        return manifest

    def reader(self, manifest: Manifest) -> SafetensorsReader:
        return SafetensorsReader(manifest)


_TRAINER_FILES: list[tuple[re.Pattern[str], tuple[StateName, ...], tuple[str, ...]]] = [
    (re.compile(r"optimizer\.pt"), ("optimizer",), ("state", "param_groups")),
    (re.compile(r"scheduler\.pt"), ("scheduler",), ()),
    (re.compile(r"rng_state(_\d+)?\.pth"), ("rng",), ("python", "cpu")),
]
"""Hugging Face ``Trainer``'s files beside the model (``_save_optimizer_and_scheduler``,
``_save_rng_state``): the training state each holds and the keys its dict has (a file that does
not read as such holds none)"""


def _trainer_without_model(path: Path) -> bool:
    """A Trainer checkpoint folder (``trainer_state.json``) holding no model file at all: neither
    safetensors, nor a ``.bin`` model (``save_safetensors=False``, a PEFT adapter), nor a folder (an
    FSDP save's ``pytorch_model_fsdp_0/``; a Trainer's ``output_dir``, which ``save_state`` gives a
    ``trainer_state.json`` of its own beside the ``checkpoint-N`` folders)."""
    if not (path / "trainer_state.json").is_file() or any(path.glob("*.safetensors*")):
        return False
    try:  # (a folder, FSDP's pytorch_model_fsdp_0/ or checkpoint-N/, or a .bin model: a model it has)
        with os.scandir(path) as entries:
            return not any(
                e.is_dir(follow_symlinks=False) or (e.name.endswith(".bin") and e.name != "training_args.bin")
                for e in entries
            )
    except OSError:
        return False


def _trainer_state(root: Path, manifest: Manifest) -> None:
    """The training state a Hugging Face ``Trainer`` checkpoint keeps beside its safetensors model,
    noted in ``extras["state_files"]`` (state -> file): the optimizer's and the scheduler's
    ``state_dict()`` in ``optimizer.pt`` and ``scheduler.pt``, each process's RNG in
    ``rng_state[_N].pth``, and ``trainer_state.json``'s ``global_step``, the step, from which the
    Trainer also finds its place in the data (it skips the batches of the epoch already trained).
    Their pickles are read (not their tensors) with the plain torch.save allowlist; one that does
    not read, or is not such a dict, holds no state (a ``corrupt-file`` finding in
    ``extras["findings"]``; verify also checks the file as an archive). One whose pickle names a
    class the allowlist lacks (the run's own scheduler) holds its state unchecked (an
    ``unsafe-pickle`` warning); one where any global the pickle names runs code (``posix.system``,
    :func:`~ckpttool._unpickle.hostile`) holds none (an ``unsafe-pickle`` error, which ``seal``
    refuses)."""
    from ckpttool.formats import _pt
    from ckpttool.formats.torchsave import ALLOWLIST

    found: dict[str, str] = {}
    unread: dict[str, str] = {}
    findings: list[dict[str, Any]] = []
    for f in manifest.files:
        if f.role != "aux" or "/" in f.path:
            continue
        if f.path == "trainer_state.json":
            step = _global_step(root, f)
            if isinstance(step, int):
                manifest.step = step
                found.update(dict.fromkeys(("step", "dataloader"), f.path))
                named = re.fullmatch(r"checkpoint-(\d+)", root.name)
                if named and int(named[1]) != step:  # (Trainer names each save after its global step)
                    findings.append(
                        {
                            "rule": "step-mismatch",
                            "file": f.path,
                            "message": f"{f.path} gives global_step {step}, but Trainer named this save "
                            f"{root.name} after the step it saved: the state is another save's, or the "
                            "folder was renamed",
                            "hint": "take trainer_state.json (and the optimizer, scheduler and RNG files) from "
                            f"the save of step {named[1]}, or use the checkpoint folder of step {step}",
                        }
                    )
            else:
                unread[f.path] = step
            continue
        for pattern, states, keys in _TRAINER_FILES:
            if not pattern.fullmatch(f.path):
                continue  # (each rank's rng_state_N.pth read, not the first)
            try:
                archive, obj, _ = _pt.load(root, f.path, ALLOWLIST)
                archive.close()
            except UnsafePickleError as exc:
                bad = exc.hostile  # (of every global the pickle names, not only the first refused)
                name = bad or exc.global_name
                if not bad:  # a class of the run's own (a custom scheduler's): its state held, unchecked
                    found.update({s: found.get(s, f.path) for s in states})
                findings.append(
                    {
                        "rule": "unsafe-pickle",
                        "severity": "error" if bad else "warning",
                        "file": f.path,
                        "message": f"{f.path}: its pickle refers to {name}, "
                        + (
                            "which runs code or reaches the system; refused without running it, so the "
                            f"{states[0]} state in it is not there"
                            if bad
                            else "which ckpttool does not load; the training state in it is not checked"
                        ),
                        "hint": "the file is hostile: do not load it with torch.load(weights_only=False); resume from "
                        "another checkpoint, or from this one without the file"
                        if bad
                        else "a class of the run's own is expected here; anything else may be hostile: do not "
                        "load the file with torch.load(weights_only=False)",
                    }
                )
                continue
            except CkptError as exc:
                unread[f.path] = str(exc).removeprefix(f"{f.path}: ")
                continue
            other = next(
                (o for _, o, k in _TRAINER_FILES if k and k != keys and isinstance(obj, dict) and set(k) <= obj.keys()),
                None,
            )
            if isinstance(obj, dict) and all(k in obj for k in keys) and other is None:
                found.update({s: found.get(s, f.path) for s in states})
            elif other is not None:  # (a scheduler's dict is any dict, so not one of another file's)
                unread[f.path] = f"expected {states[0]} state, found {other[0]} state (a dict of " + (
                    f"{', '.join(map(repr, list(obj)[:4]))}): another of the Trainer's files copied over it"
                )
            else:
                what = f"a dict with {', '.join(map(repr, keys))}" if keys else "a dict"
                unread[f.path] = f"expected {what} ({states[0]} state), found " + (
                    f"a dict of {', '.join(map(repr, list(obj)[:4]))}" if isinstance(obj, dict) else type(obj).__name__
                )
    findings += _rng_gaps([f.path for f in manifest.files if f.role == "aux" and "/" not in f.path])
    if found:
        manifest.extras["state_files"] = found
    findings += [
        {
            "rule": "corrupt-file",
            "file": rel,
            "message": f"{rel}: {why}; the training state it holds does not read",
            "hint": "restore it from where the checkpoint was copied from, or resume from another checkpoint",
        }
        for rel, why in unread.items()
    ]
    if findings:
        manifest.extras.setdefault("findings", []).extend(findings)


def _rng_gaps(names: list[str]) -> list[dict[str, Any]]:
    """A ``missing-file`` finding for the processes' ``rng_state_N.pth`` absent between the lowest
    and the highest N present: Trainer saves one per process (``_save_rng_state``), and on resume a
    process whose file is missing only logs it and goes on with fresh RNG state, so the run does not
    replay. (Files missing below the lowest or above the highest cannot be told: a node's own disk
    holds its processes' files alone under ``save_on_each_node``, and the world size is not saved.)
    One finding for all of them."""
    held = sorted(int(m[1]) for n in names if (m := re.fullmatch(r"rng_state_(\d+)\.pth", n)))
    gaps = sorted(set(range(held[0], held[-1] + 1)) - set(held)) if held else []
    if not gaps:
        return []
    missing = [f"rng_state_{n}.pth" for n in gaps]
    named = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return [
        {
            "rule": "missing-file",
            "file": missing[0],
            "message": f"{named} {'is' if len(missing) == 1 else 'are'} missing: Trainer saves one RNG state per "
            f"process, and those of processes {held[0]} to {held[-1]} but these are here; "
            f"{'that process' if len(missing) == 1 else 'those processes'} would resume with fresh RNG state, and "
            "the run would not replay",
            "hint": "restore the files from the save, or resume from another checkpoint",
            "stops_writes": False,  # (no writer carries the Trainer's RNG files: they are left behind, and said)
        }
    ]


_TRAINER_STATE_HEAD = 1 << 20
"""bytes of ``trainer_state.json`` read at most: its log grows with the run, and ``Trainer`` writes
the keys sorted, two spaces in, ``global_step`` among the first"""
_GLOBAL_STEP = re.compile(rb'\n  "global_step": (\d{1,18}),?\n')


def _global_step(root: Path, f: FileRecord) -> int | str:
    """``trainer_state.json``'s ``global_step``, or why it has none: found as ``Trainer`` writes it
    in the file's first MiB, else from the whole file parsed where it is no larger."""
    try:
        with open(confine(root, f.path), "rb") as fh:
            head = fh.read(_TRAINER_STATE_HEAD + 1)
    except OSError as exc:
        return f"not readable ({exc.strerror})"
    if (m := _GLOBAL_STEP.search(head)) is not None and head.lstrip().startswith(b"{"):
        return int(m[1])
    if len(head) > _TRAINER_STATE_HEAD:
        return f"no global_step where Trainer writes it, in the first {_TRAINER_STATE_HEAD:,} bytes"
    try:
        state = json.loads(head)
    except (ValueError, RecursionError) as exc:
        return f"not readable JSON ({exc})"
    step = state.get("global_step") if isinstance(state, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    return f"expected a global_step (a count of steps), found {step!r}"


def _astray(rel: str, names: list[str], weight_map: dict[str, str], index_name: str) -> CkptError:
    """Shard ``rel`` holds tensors ``names`` that the index places in another shard, or nowhere."""
    said = [
        f"{n} ({'the index places it in ' + weight_map[n] if n in weight_map else 'not in the index'})" for n in names
    ]
    return CorruptFileError(
        f"{rel}: holds {len(names)} tensor(s) {index_name} does not place there: {', '.join(said[:4])}"
        + (" …" if len(said) > 4 else ""),
        hint="a shard from another save, or an index edited since: download the checkpoint's shards and index again",
        path=rel,
    )


NUMBERED = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.safetensors$")


def _index_missing(files: list[str]) -> list[dict[str, Any]]:
    """A warning for shards numbered as Hugging Face numbers them (``model-00001-of-00002``) found
    without the index it writes beside them: the tensors read from the shards themselves, but
    ``from_pretrained`` finds the shards through ``model.safetensors.index.json`` and cannot load
    them without it."""
    stems = sorted({m[1] for f in files if (m := NUMBERED.match(f)) and int(m[3]) > 1})
    return [
        {
            "rule": "missing-file",
            "severity": "warning",
            "file": f"{stem}.safetensors.index.json",
            "message": f"{stem}.safetensors.index.json is missing: the {stem}-NNNNN-of-NNNNN.safetensors shards are "
            "written with it, and transformers' from_pretrained finds them through it (ckpttool reads the "
            "shards themselves)",
            "hint": "restore the index from the checkpoint's source",
            "stops_writes": False,
        }
        for stem in stems
    ]


def _shards_the_index_leaves_out(root: Path, files: list[str], index_name: str) -> list[CkptError]:
    """Shards of the index's own numbered set (``model-00002-of-00002.safetensors`` beside an index
    naming ``model-00001-of-00002``) that the index names no tensor of: every tensor they hold is
    left out of the checkpoint (a loader never opens them), so the index was edited or comes from
    another save."""
    sets = {(m[1], int(m[3])) for f in files if (m := NUMBERED.match(f))}
    named = set(files)
    left = sorted(
        p.name
        for p in root.glob("*.safetensors")
        if p.name not in named and (m := NUMBERED.match(p.name)) and (m[1], int(m[3])) in sets
    )
    return [
        CorruptFileError(
            f"{index_name}: names no tensor of {name}, a shard of its own numbered set: the tensors that shard "
            "holds are left out of the checkpoint (a loader never opens it)",
            hint="the index was edited or comes from another save: download the index again (or verify the shards "
            "alone, without it)",
            path=index_name,
        )
        for name in left
    ]


def _unnumbered_shards(files: list[str]) -> list[CkptError]:
    """Shards their siblings' names say exist (``model-00002-of-00003.safetensors``: three of them,
    as Hugging Face numbers them) and that are not here: one ``missing-file`` error each."""
    numbered = [(m[1], int(m[2]), int(m[3])) for f in files if (m := NUMBERED.match(f))]
    sets = {(stem, total) for stem, _, total in numbered if 0 < total <= 100_000}
    held = {(stem, i, total) for stem, i, total in numbered}
    return [
        IncompleteCheckpointError(
            f"{name}: missing; its siblings {stem}-NNNNN-of-{total:05d}.safetensors number {total} shards",
            hint="download the missing shard",
            path=name,
            rule="missing-file",
        )
        for stem, total in sorted(sets)
        for i in range(1, total + 1)
        if (stem, i, total) not in held
        for name in [f"{stem}-{i:05d}-of-{total:05d}.safetensors"]
    ]


def _read_index(root: Path, name: str) -> dict[str, str]:
    try:
        with open_regular(confine(root, name, named_by="the listing", kind="index"), name) as fh:
            index = json.load(fh, object_pairs_hook=unique_keys)  # (a name twice: json keeps the last)
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptFileError(
            f"{name}: not a readable JSON index ({exc})",
            hint="restore the index from its source: its weight_map gives each tensor one .safetensors file",
            path=name,
        ) from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:  # (an index is written for a model of shards, never of none)
        found = "no weight_map" if wm is None else f"a weight_map of type {type(wm).__name__}"
        found = "an empty weight_map, which places no tensor in any shard" if wm == {} else found
        raise CorruptFileError(
            f"{name}: expected a weight_map of tensor name -> shard file, found {found}",
            hint="restore the index from its source",
            path=name,
        )
    for key, value in wm.items():
        if not isinstance(value, str) or not value.strip("./"):
            raise CorruptFileError(
                f"{name}: weight_map gives {key!r} the shard {value!r}, not a file name",
                hint="restore the index from its source: its weight_map gives each tensor's .safetensors file",
                path=name,
            )
    return wm


def read_range(files: FileCache, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
    """Read a piece stored as C-ordered values at bytes ``begin..end`` of its file."""
    assert item.dtype is not None
    begin, end = piece.locator["begin"], piece.locator["end"]
    shape = piece.box.sizes if piece.flat is None else (piece.flat[1],)
    if out is None:
        out = np.empty(shape, dtype=carrier(item.dtype))
    buf = out.reshape(-1).view(np.uint8).data
    if len(buf) != end - begin:
        raise CorruptFileError(
            f"{piece.file}: {item.name} spans {end - begin} bytes, expected {len(buf)}", path=piece.file
        )
    files.get(piece.file).read_into(begin, buf)
    return out


class SafetensorsReader(PieceReader):
    def read(self, piece: Piece, item: Item, out: np.ndarray | None = None) -> np.ndarray:
        return read_range(self.files, piece, item, out)

    def read_object(self, item: Item) -> Any:
        raise CorruptFileError(f"{item.name}: safetensors files hold no objects", path=self.manifest.root)

    def raw_span(self, piece: Piece, item: Item) -> tuple[int, int] | None:
        return piece.locator["begin"], piece.locator["end"] - piece.locator["begin"]


def _safetensors_header(path: Path) -> bool:
    """Whether a file starts as safetensors files do (:func:`starts_as_safetensors`)."""
    try:
        with open(path, "rb") as fh:
            return starts_as_safetensors(fh.read(9), os.fstat(fh.fileno()).st_size)
    except OSError:
        return False


def starts_as_safetensors(head: bytes, size: int | None = None) -> bool:
    """Whether a file's first bytes are a safetensors file's: an 8-byte little-endian header length
    (that fits in the file, its ``size`` where known), then the JSON header's ``{``."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return n >= 2 and (size is None or n <= size - 8)


ADAPTER = SafetensorsAdapter()
