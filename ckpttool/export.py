"""``export``: the full logical tensors of a checkpoint as one safetensors file.

Tensors are assembled one at a time into a single reusable buffer the size of the largest one and
streamed into a temporary file published by rename, so memory is bounded by the largest tensor
whatever the checkpoint size, and the output appears complete or not at all.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ckpttool import registry
from ckpttool.assemble import assemble, check_coverage, refuse_unexpandable
from ckpttool.dtypes import dtype as lookup_dtype
from ckpttool.errors import CkptError, CorruptFileError, IncompleteCheckpointError, PartOfCheckpointError, UsageError
from ckpttool.formats.base import Adapter, PieceReader
from ckpttool.formats.safetensors import NUMBERED, starts_as_safetensors, written_metadata
from ckpttool.formats.torchsave import refuse_a_part
from ckpttool.io import (
    atomic_output,
    check_output,
    checking_crcs,
    finish_partial,
    refuse_overlap,
    refuse_replacing_other_file,
)
from ckpttool.manifest import KINDS, Item, Manifest, Piece

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
    if kind == "param":  # (a parameter only the optimizer holds would be left out without a word)
        held = {i.name for i in items if i.kind == "param"}
        only = [
            name
            for i in items
            if i.kind == "master"
            and (name := i.name.removesuffix(MASTER_SUFFIX)) not in held
            and (rx is None or rx.search(name))
        ]
        if only:
            raise UsageError(
                f"--kind param: {len(only):,} parameter(s) ({', '.join(only[:3])}{' …' if len(only) > 3 else ''}) "
                "are held only as the optimizer's fp32 master copies (ZeRO-3 saves no module weights), which "
                "--kind param would leave out",
                hint="--kind master writes them under their parameters' names, with the module's other tensors "
                "(what zero_to_fp32 gives)",
            )
    chosen = [(n, i) for n, i in pairs if rx is None or rx.search(n)]
    if not chosen and items:  # an empty output would be written and called done
        asked = " ".join(([f"--kind {kind}"] if kind != "all" else []) + ([f"--filter {pattern!r}"] if pattern else []))
        names = ", ".join(i.name for i in items[:3])
        raise UsageError(
            f"{asked or 'the selection'}: no item of the checkpoint's {len(items):,} matches",
            hint=f"its items are named like {names}; 'ckpttool ls' lists them all",
        )
    return chosen


def refuse_unreadable(items: Iterable[Item], *, hint: str | None = None) -> None:
    """Refuse to write an output without an item of the source that could not be read (an unsafe
    pickle, damaged bytes): the output would be published, sealed and verified clean with that
    state gone. Exit 3, naming the first such item, its file and why."""
    items = list(items)
    refuse_unexpandable(items, written=True)  # (every writer makes room for a tensor before it reads it)
    bad = [i for i in items if i.error]
    if not bad:
        return
    first = bad[0]
    where = first.pieces[0].file if first.pieces else None
    more = (
        f" (and {len(bad) - 1} more: {', '.join(i.name for i in bad[1:4])}{' …' if len(bad) > 4 else ''})"
        if len(bad) > 1
        else ""
    )
    raise CorruptFileError(
        f"{where + ': ' if where else ''}{first.name} cannot be read ({first.error}){more}; nothing was written",
        hint=hint or "restore the file from the save, or use another checkpoint: the output would lack this state",
        path=where,
        rule="unsafe-pickle" if first.refused else "corrupt-file",
    )


def describe_split(path: str | Path, rules: Mapping[str, int | None]) -> tuple[Adapter, Manifest]:
    """Describe the checkpoint at ``path`` to write its full tensors: a legacy Megatron source read
    with ``--split-rule`` patterns ``rules``, and refused where a parameter has no rule (its TP
    ranks' parts would be read as copies: :func:`ckpttool.formats.megatron_write.check_split_rules`)."""
    from ckpttool.formats.megatron import user_split_rules
    from ckpttool.formats.megatron_write import check_split_rules

    with user_split_rules(rules):
        adapter, manifest = registry.describe(path)
    check_split_rules(manifest, rules)
    return adapter, manifest


def refuse_findings(manifest: Manifest) -> None:
    """Refuse to write from a checkpoint its format's reader found wrong while still reading it
    (``extras["findings"]``: a file a complete save has and this one lacks, a rank's file in
    another's place): an output would carry the damage, sealed. Exit 3 with the first finding.
    Likewise one rank file of a DeepSpeed or Megatron checkpoint read alone (:func:`refuse_a_part`),
    and one file of any checkpoint of several that holds only parts of its tensors
    (:func:`refuse_a_member`)."""
    refuse_a_part(manifest, manifest.root)
    refuse_a_member(manifest)
    from ckpttool.formats._pt import hostile_beside

    hostile_beside(Path(manifest.root), manifest)
    # (a finding that says it does not stop a write: damage the writers handle themselves, as a
    # DCP planner_data map, which the DCP writer leaves out and --to torch refuses with its reason)
    found = [f for f in manifest.extras.get("findings") or () if f.get("stops_writes", True)]
    if not found:
        return
    first = found[0]
    others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    cls = IncompleteCheckpointError if first["rule"] == "missing-file" else CorruptFileError
    raise cls(
        f"{first['message']}{others}; nothing was written",
        hint=first.get("hint") or "'ckpttool verify' lists what is wrong; restore the files from the save",
        path=first["file"],
        rule=first["rule"],
    )


def refuse_a_member(manifest: Manifest) -> None:
    """Refuse to write from one file of a checkpoint of several files (a per-rank shards' stage
    file, one shard of a safetensors set, a DCP save's Hugging Face shard of one rank's slices)
    that does not hold every tensor of that checkpoint whole: read alone, its pieces became whole
    tensors (a rank's slices published with their shapes) and the rest of the model went missing,
    sealed with exit 0. A file holding every tensor whole (a DDP rank's copy of the model) is a
    checkpoint by itself, and so is each of safetensors files side by side with no index nor shard
    numbers. The checkpoint is looked for in the file's folder and the three above it (a universal
    checkpoint's ``zero/<param>/<state>.pt``), a best effort: a folder that does not read is passed."""
    data = [f for f in manifest.files if f.role == "data"]
    if len(data) != 1:
        return
    file = Path(manifest.root, data[0].path)
    if not file.is_file():
        return
    # (a universal checkpoint's zero/<param>/<state>.pt: three up)
    for folder, whole, rel in registry.enclosing(file, 4):
        held = [f for f in whole.files if f.role == "data"]
        if len(held) < 2:
            continue
        if whole.format == "safetensors" and not (
            any(f.role == "metadata" for f in whole.files) or NUMBERED.match(Path(rel).name)
        ):
            return  # (files side by side with no index nor shard numbers: each a model of its own)
        partial = next(
            (
                item.name
                for item in whole.items.values()
                if item.is_tensor
                and item.kind in ("param", "master", "optim")  # (not a rank's own RNG, kept in its file only)
                and item.shape is not None
                and not any(_whole_in(p, item, rel) for p in item.pieces)
            ),
            None,
        )
        if partial is None:
            return  # (every tensor whole in it: a replica of the model)
        some = any(p.file == rel for p in whole.items[partial].pieces)
        why = (
            f"alone, it holds {'only a part' if some else 'nothing'} of {partial}, and maybe of others, which a "
            "checkpoint written from it would pass off as the whole"
        )
        raise PartOfCheckpointError(str(file), whole.format, str(folder), why)


def _whole_in(piece: Piece, item: Item, rel: str) -> bool:
    """Whether ``piece`` of ``item`` lies in file ``rel`` and holds the whole tensor."""
    return (
        piece.file == rel
        and piece.flat is None
        and tuple(piece.box.sizes) == tuple(item.shape or ())
        and not any(piece.box.offsets)
    )


def unused_states(manifest: Manifest) -> list[str]:
    """The items of parameters the source format knows nothing trains (``extras["unused"]``:
    megatron-core's output layer on a tied model's MTP last stage), with their optimizer state and
    main copies: a target that is not the source's format leaves them out, since its readers cannot
    tell such a parameter's zero moments from lost ones."""
    unused = set(manifest.extras.get("unused") or ())
    return [n for n in manifest.items if n in unused or n.rsplit(".", 1)[0] in unused]


def unused_note(manifest: Manifest, target: str, left_out: Iterable[str]) -> list[str]:
    """What a ``target`` output's plan says of the :func:`unused_states` it leaves out (none: nothing)."""
    if not any(left_out):
        return []
    return [
        f"left out: {', '.join(sorted(manifest.extras['unused']))} with its optimizer state, a parameter "
        "megatron-core allocates on a tied model's MTP last stage but never uses (its moments stay zero, "
        f"which a {target} reader cannot tell from lost state)"
    ]


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
    split_rules: Mapping[str, int | None] | None = None,
) -> ExportResult:
    """Write the selected tensors of the checkpoint at ``path`` to ``output`` (safetensors).

    ``progress(done, total)`` is called with byte counts after each tensor."""
    out_path = Path(output)
    refuse_overlap(out_path, source=path)
    if out_path.exists() and not force:
        raise UsageError(f"{out_path} exists", hint="choose another -o path or pass --force to replace it")
    replaces = check_output(out_path, force=force, directory=False, example="model.safetensors")
    if replaces:  # (an earlier export, or an empty file; other data under the name is not lost to --force)
        refuse_replacing_other_file(out_path, f"-o {output}", "a safetensors file", starts_as_safetensors)
    if out_path.suffix != ".safetensors":  # (read back, or by other tools, a file is known by its suffix)
        raise UsageError(
            f"-o {output}: export writes a safetensors file, which readers (ckpttool's among them) know by its "
            f".safetensors suffix",
            hint=f"name it {out_path.stem if out_path.suffix else 'model'}.safetensors; for a torch.save file, "
            "use ckpttool convert --to torch",
        )
    adapter, manifest = describe_split(path, split_rules or {})
    refuse_findings(manifest)
    from ckpttool.convert import refuse_changed_since_sealed, refuse_copies_apart

    # (a sealed source's bytes that hold no checksum of their own, safetensors': a flipped bit was
    # written into a clean new file with no seal, exit 0, where convert refused the same source)
    refuse_changed_since_sealed(Path(path), manifest)
    result = ExportResult(output=str(out_path))
    pairs, result.skipped = safetensors_selection(manifest, kind=kind, pattern=pattern)
    refuse_copies_apart(manifest, "export", (i.name for _, i in pairs))  # (one embedding written, as convert would)
    result.names = [n for n, _ in pairs]
    result.written = [i for _, i in pairs]
    refuse_unexpandable(result.written, written=True)

    total = sum(tensor_nbytes(i) for i in result.written)
    with adapter.reader(manifest) as reader, atomic_output(out_path, replace=replaces) as f:
        write_safetensors(
            f,
            list(zip(result.names, result.written, strict=True)),
            reader,
            metadata=written_metadata(manifest),
            progress=None if progress is None else lambda n: progress(n, total),
        )
        finish_partial()  # (a source member read in part is judged whole before the file appears)
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
    for name, _ in pairs:
        _writable_name(name)
    # the widest elements first (stable: the checkpoint's order within a width): every tensor then
    # starts at a multiple of its element size, as safetensors' own writer lays them out; in the
    # checkpoint's order one odd-sized bf16 or bool tensor left the fp32 ones after it misaligned,
    # which a zero-copy loader (a memory map viewed as the dtype) refuses
    pairs = sorted(pairs, key=lambda p: -lookup_dtype(p[1].dtype or "uint8").itemsize)
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


def _writable_name(name: str) -> None:
    """Refuse a tensor name a safetensors header cannot hold: ``__metadata__`` is the header's own
    entry (written, it replaced the metadata and neither safetensors nor ckpttool could read the
    file), and a lone surrogate (a pickle's str may hold one) is not UTF-8, which safetensors
    refuses while Python's JSON wrote it as an escape."""
    why = None
    if name == "__metadata__":
        why = "is the name of the header's own metadata entry"
    else:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            why = "is not valid UTF-8 (it holds a lone surrogate)"
    if why is not None:
        raise CkptError(
            f"the tensor named {name!r} cannot be written to a safetensors file: the name {why}",
            hint="leave it out with --filter, or write another format (convert --to torch or dcp)",
        )


def tensor_nbytes(item: Item) -> int:
    assert item.dtype is not None and item.shape is not None
    return math.prod(item.shape) * lookup_dtype(item.dtype).itemsize
