"""``export``: the full logical tensors of a checkpoint as one safetensors file.

Tensors are assembled one at a time into a single reusable buffer the size of the largest one and
streamed into a temporary file published by rename, so memory is bounded by the largest tensor
whatever the checkpoint size, and the output appears complete or not at all.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ckpttool import registry
from ckpttool.assemble import assemble, check_coverage
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import UsageError
from ckpttool.formats.base import PieceReader
from ckpttool.io import atomic_output, check_output, checking_crcs, make_parents, refuse_overlap
from ckpttool.manifest import KINDS, Item, Manifest

_ALIGN = 8


MASTER_SUFFIX = ".fp32"


@dataclass(slots=True, kw_only=True)
class ExportResult:
    output: str
    written: list[Item] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    """the name each written item has in the output (parallel to ``written``)"""
    skipped: list[tuple[Item, str]] = field(default_factory=list)
    """items not written, with the reason (non-tensor values, dtypes safetensors cannot hold)"""
    nbytes: int = 0


def select(items: list[Item], *, kind: str = "all", pattern: str | None = None) -> list[tuple[str, Item]]:
    """(output name, item) pairs to export.

    ``kind="master"`` gives the complete fp32 model the optimizer holds, as a loadable state dict:
    each master copy ``<param>.fp32`` under its parameter's name, completed with the module tensors
    (frozen parameters, buffers) that have no master copy, which is what DeepSpeed's
    zero_to_fp32 produces.
    """
    if kind != "all" and kind not in KINDS:
        raise UsageError(f"--kind {kind!r}: expected one of all, {', '.join(KINDS)}")
    try:
        rx = re.compile(pattern) if pattern else None
    except re.error as exc:
        raise UsageError(f"--filter {pattern!r}: not a regular expression ({exc})") from None
    if kind == "master":
        masters = {i.name.removesuffix(MASTER_SUFFIX): i for i in items if i.kind == "master"}
        pairs = list(masters.items())
        pairs += [(i.name, i) for i in items if i.kind == "param" and i.is_tensor and i.name not in masters]
    else:
        pairs = [(i.name, i) for i in items if kind == "all" or i.kind == kind]
    chosen = [(n, i) for n, i in pairs if rx is None or rx.search(n)]
    if not chosen and items:  # an empty output would be written and called done
        asked = " ".join(([f"--kind {kind}"] if kind != "all" else []) + ([f"--filter {pattern!r}"] if pattern else []))
        names = ", ".join(i.name for i in items[:3])
        raise UsageError(
            f"{asked or 'the selection'}: no item of the checkpoint's {len(items):,} matches",
            hint=f"its items are named like {names}; 'ckpttool ls' lists them all",
        )
    return chosen


def safetensors_selection(
    manifest: Manifest, *, kind: str = "all", pattern: str | None = None
) -> tuple[list[tuple[str, Item]], list[tuple[Item, str]]]:
    """The (output name, item) pairs a safetensors file can hold, each checked to tile its tensor,
    and the selected items it cannot hold, with the reason."""
    pairs: list[tuple[str, Item]] = []
    skipped: list[tuple[Item, str]] = []
    for name, item in select(list(manifest.items.values()), kind=kind, pattern=pattern):
        if not item.is_tensor:
            skipped.append((item, "not a tensor"))
        elif lookup_dtype(item.dtype or "").safetensors is None:
            skipped.append((item, f"safetensors has no {item.dtype} dtype"))
        else:
            check_coverage(item)
            pairs.append((name, item))
    if not pairs and skipped:  # an empty file would be written and called done
        raise UsageError(
            f"nothing to write: the {len(skipped):,} item(s) selected hold no tensor safetensors can store "
            f"({skipped[0][0].name}: {skipped[0][1]})",
            hint="select tensors (--kind param, --filter), or convert --to torch or dcp, which keep other values",
        )
    return pairs, skipped


@checking_crcs()  # a flipped bit in the source stops the run
def export(
    path: str | Path,
    output: str | Path,
    *,
    kind: str = "all",
    pattern: str | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write the selected tensors of the checkpoint at ``path`` to ``output`` (safetensors).

    ``progress(done, total)`` is called with byte counts after each tensor."""
    out_path = Path(output)
    refuse_overlap(out_path, source=path)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force to replace it")
    check_output(out_path, force=force, directory=False, example="model.safetensors")
    from ckpttool.convert import refuse_findings  # (convert builds on this module)

    adapter, manifest = registry.describe(path)
    refuse_findings(manifest)
    result = ExportResult(output=str(out_path))
    pairs, result.skipped = safetensors_selection(manifest, kind=kind, pattern=pattern)
    result.names = [n for n, _ in pairs]
    result.written = [i for _, i in pairs]

    total = sum(tensor_nbytes(i) for i in result.written)
    make_parents(out_path)
    with adapter.reader(manifest) as reader, atomic_output(out_path) as f:
        write_safetensors(
            f,
            list(zip(result.names, result.written, strict=True)),
            reader,
            metadata={"format": "pt", "ckpttool.source_format": manifest.format},
            progress=None if progress is None else lambda n: progress(n, total),
        )
    result.nbytes = total
    return result


def write_safetensors(
    f: BinaryIO,
    pairs: list[tuple[str, Item]],
    reader: PieceReader,
    *,
    metadata: dict[str, str],
    progress: Callable[[int], None] | None = None,
    buffer: np.ndarray | None = None,
) -> None:
    """Stream ``pairs`` (output name, tensor item) into one safetensors file: the header first (every
    shape is known from the manifest), then each tensor assembled into one reusable buffer."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, item in pairs:
        assert item.dtype is not None and item.shape is not None
        n = tensor_nbytes(item)
        header[name] = {
            "dtype": lookup_dtype(item.dtype).safetensors,
            "shape": list(item.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _ALIGN)
    if buffer is None:
        buffer = np.empty(max((tensor_nbytes(i) for _, i in pairs), default=0), dtype=np.uint8)
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    done = 0
    for _, item in pairs:
        assert item.dtype is not None and item.shape is not None
        n = tensor_nbytes(item)
        view = buffer[:n].view(lookup_dtype(item.dtype).numpy).reshape(item.shape)
        assemble(reader, item, out=view)
        f.write(buffer[:n].data)
        done += n
        if progress is not None:
            progress(done)


def tensor_nbytes(item: Item) -> int:
    assert item.dtype is not None and item.shape is not None
    return math.prod(item.shape) * lookup_dtype(item.dtype).itemsize
