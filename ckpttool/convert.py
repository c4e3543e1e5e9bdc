"""``convert``: the same tensors in another format.

``--to dcp``: a PyTorch DCP checkpoint at ``--world-size`` ranks (default: the source's), every
tensor cut along dim 0 as FSDP2 cuts it, non-tensor state kept (read through the restricted
unpickler): what ``dcp.load`` reads. ``--to safetensors``: the Hugging Face layout: ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` of at most ``--max-shard-size`` each plus
``model.safetensors.index.json``. ``--to torch``: one ``torch.save`` file, ``model.pt``, of the
whole state dict (for a DCP source what ``dcp_to_torch_save`` writes). Tensors are streamed one at
a time (memory: the largest tensor), the output directory is built beside the destination and
published by one rename.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool._directwrite import open_direct
from ckpttool.assemble import check_coverage, refuse_unexpandable
from ckpttool.errors import CkptError, CorruptFileError, UsageError
from ckpttool.export import (
    describe_split,
    refuse_findings,
    refuse_unreadable,
    safetensors_selection,
    select,
    tensor_nbytes,
    unused_note,
    unused_states,
    write_safetensors,
)
from ckpttool.formats.base import Adapter
from ckpttool.formats.safetensors import written_metadata
from ckpttool.io import (
    check_output,
    checking_crcs,
    fsync_tree,
    publish_dir,
    refuse_overlap,
    replacing,
    staged_dir,
)
from ckpttool.manifest import KEPT_BESIDE, Item, Manifest

FRAMEWORKS = ("megatron", "megatron-dist", "deepspeed", "deepspeed-universal")
"""targets written by ``reshard``'s writers at the source's own layout"""
TARGETS = ("safetensors", "dcp", "torch", *FRAMEWORKS)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


DEFAULT_SHARD_SIZE = "5GB"


def parse_size(text: str, option: str = "--max-shard-size", *, lowercase_b_is_bits: bool = True) -> int:
    """``5GB`` -> 5e9, ``512MiB`` -> 512 * 2**20, ``1000`` -> 1000 bytes. ``lowercase_b_is_bits``:
    ``5Gb`` refused, being 5 gigabits where Hugging Face reads a ``max_shard_size`` (``--max-shard-size``'s
    rule); else read as bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(f"{option} {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    spelled = m.group(2) or ""
    if lowercase_b_is_bits and len(spelled) == 2 and spelled.endswith("b"):
        raise UsageError(
            f"{option} {text!r}: a lowercase b is bits where Hugging Face reads this size "
            f"({spelled} = 1/8 {spelled[0].upper()}B); write {m.group(1)}{spelled[0].upper()}B for bytes"
        )
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise UsageError(f"{option} {text!r}: a size of at least one byte, such as 5GB, 500MB or 2GiB")
    return size


@dataclass(slots=True, kw_only=True)
class ConvertResult:
    output: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    nbytes: int = 0
    """bytes of tensors written"""
    objects: int = 0
    """the other items written: scheduler, counters, RNG state, pickled objects"""
    skipped: list[tuple[Item, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """what the output holds otherwise than the source (items left out, carried unread, ...)"""
    sealed: bool = False
    """the output carries its seal (``ckpttool.manifest.json``), written before it was published"""


def _shards(pairs: list[tuple[str, Item]], limit: int) -> list[list[tuple[str, Item]]]:
    """Greedy, in checkpoint order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[tuple[str, Item]]] = [[]]
    size = 0
    for name, item in pairs:
        n = tensor_nbytes(item)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, item))
        size += n
    return [s for s in shards if s]


MAX_RANKS = 1 << 20
"""the largest world size a target may have: beyond it a size is a typo (a plan of that many files
would take minutes and gigabytes before saying anything)"""


_UNREADABLE = "restore the file from the save, or leave the item out with --filter (the output would lack it)"


@checking_crcs()  # a flipped bit in the source stops the run
def convert(
    src: str | Path,
    dst: str | Path,
    *,
    to: str = "safetensors",
    max_shard_size: str | None = None,
    world_size: int | None = None,
    kind: str = "all",
    pattern: str | None = None,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    split_rules: dict[str, int | None] | None = None,
    seal_output: bool = True,
) -> ConvertResult:
    """``max_shard_size``: the largest safetensors shard (default 5GB); ``split_rules``: the
    ``--split-rule`` patterns a legacy Megatron source at TP > 1 is read with; ``seal_output``: the
    output is sealed in its staging directory, then published (as ``reshard``'s)."""
    if to not in TARGETS:
        raise UsageError(f"--to {to!r}: ckpttool converts to {', '.join(TARGETS)} so far")
    limit = parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if max_shard_size is not None and to != "safetensors":  # (ignored, the output would not be what was asked)
        raise UsageError(
            f"--max-shard-size sets the size of safetensors shards; it does not apply to --to {to}",
            hint="the files of the other formats are one per rank (dcp, megatron, deepspeed) or one (torch)",
        )
    if world_size is not None and not 1 <= world_size <= MAX_RANKS:
        raise UsageError(f"--world-size {world_size:,}: expected 1 to {MAX_RANKS:,} ranks")
    if world_size is not None and to != "dcp":  # (it would be ignored: the output would not be what was asked)
        raise UsageError(
            f"--world-size sets the ranks of a DCP output; it does not apply to --to {to}",
            hint="'ckpttool reshard' changes TP, PP and DP sizes",
        )
    out = Path(dst)
    refuse_overlap(out, source=src)
    replaces = check_output(out, force=force, directory=True, example="hf/")
    if out.exists() and not force:
        raise UsageError(f"{out} exists", hint="choose another -o path or pass --force to replace it")
    if to in FRAMEWORKS:
        return _framework(
            src,
            out,
            to,
            kind=kind,
            pattern=pattern,
            force=force,
            progress=progress,
            split_rules=split_rules or {},
            seal_output=seal_output,
        )
    from ckpttool.ranks import torchrun_world

    if torchrun_world() is not None:  # every rank would write the same files and race to publish them
        raise UsageError(
            f"--to {to} is written by one process; run it without torchrun",
            hint=f"under torchrun, the ranks share the work of convert --to {', '.join(FRAMEWORKS)}",
        )
    adapter, manifest = describe_split(src, split_rules or {})
    refuse_findings(manifest)
    if kind == "all" and pattern is None:  # (the whole state asked for: not written without some of it)
        refuse_left_behind(manifest, f"convert --to {to}", f"ckpttool convert SRC -o DST --to {to} --kind param")
    refuse_changed_since_sealed(Path(src), manifest)
    # (a selection that leaves the word embeddings out writes neither copy, as export says)
    chosen = (
        None if kind == "all" and pattern is None else select(list(manifest.items.values()), kind=kind, pattern=pattern)
    )
    refuse_copies_apart(manifest, to, None if chosen is None else (i.name for _, i in chosen))
    finish = functools.partial(_seal_staged, out=out) if seal_output else None
    with replacing(replaces):
        result = _plain_target(adapter, manifest, out, to, limit, world_size, kind, pattern, progress, finish)
    result.sealed = seal_output
    result.notes += left_behind(manifest)
    if kind in ("all", "optim"):  # (the moments written without them)
        result.notes += unread_state(manifest, to)
    return result


def refuse_changed_since_sealed(src: Path, manifest: Manifest) -> None:
    """A source that carries its ckpttool seal (``ckpttool.manifest.json`` beside its files): its
    data files that hold no checksums of their own (safetensors, raw bytes; the CRC-32s of
    torch.save archives are checked as they are read) hashed against the seal before anything is
    written, so that a byte changed since it was sealed is not carried, and sealed again, into the
    output. A seal that does not read is left to ``verify`` to report."""
    from ckpttool.formats import _pt
    from ckpttool.hashing import hash_files
    from ckpttool.seal import Seal, default_seal_path

    path = default_seal_path(src)
    if not path.is_file():
        return
    try:
        sealed = Seal.load(path)
    except CkptError:
        return
    want = {f.path: f.checksum for f in sealed.head.files if f.checksum}
    root = Path(manifest.root)
    rels = [
        f.path
        for f in manifest.files
        if f.role == "data" and f.path in want and not f.path.endswith((*_pt.SUFFIXES, ".distcp"))
    ]
    if not rels:
        return
    got, _ = hash_files(root, rels, {}, sealed.algo)
    changed = [rel for rel in rels if got[rel].digest != want[rel]]
    if changed:
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])}{' …' if len(changed) > 4 else ''})"
        raise CorruptFileError(
            f"{changed[0]}: differs from the seal the source carries ({path.name}){more if len(changed) > 1 else ''}: "
            "its bytes changed since it was sealed; nothing was written",
            hint="'ckpttool verify SRC' names the tensors that changed; restore the file from a good copy",
            path=changed[0],
            rule="checksum-mismatch",
        )


def refuse_left_behind(manifest: Manifest, command: str, model_alone: str) -> None:
    """Refuse (before anything is written) to write the whole training state of a checkpoint that
    keeps part of it in files its format does not read (a Hugging Face Trainer's ``optimizer.pt``,
    ``scheduler.pt`` and ``rng_state.pth`` beside ``model.safetensors``): the output would hold the
    model alone, with exit 0. ``model_alone``: the command that writes the model only."""
    held = {k: f for k, f in (manifest.extras.get("state_files") or {}).items() if k in KEPT_BESIDE}
    if held:  # (the step and the dataloader's place, from trainer_state.json, the output's metadata keeps)
        files = ", ".join(dict.fromkeys(str(f) for f in held.values()))
        raise UsageError(
            f"{command} writes the whole training state, but this checkpoint keeps its {', '.join(held)} in "
            f"{files} beside the model, which ckpttool does not carry into another layout or format yet",
            hint=f"write the model alone with '{model_alone}', and copy those files beside the output to keep them",
        )


def refuse_copies_apart(manifest: Manifest, to: str, written: Iterable[str] | None = None) -> None:
    """Refuse a target of another format than Megatron's for a Megatron legacy save whose MTP stage
    trained its own copy of the word embeddings apart from the first stage's (``extras
    ["copies_apart"]``: ``--decoupled-lr`` at PP > 1, or MTP layers in a later chunk of the first
    pipeline rank): a checkpoint of one embedding would keep one copy and drop the other's training,
    as Megatron's own targets refuse to (``megatron_write``'s source problems). ``written``: the
    names an output of a selection writes (an export's --filter or --kind), refused only where they
    hold the word embeddings (a selection without them writes neither copy)."""
    apart = manifest.extras.get("copies_apart")
    if apart is None:
        return
    if written is not None and not any(n.startswith("embedding.word_embeddings.") for n in written):
        return
    from ckpttool.formats.megatron_write import TWO_EMBEDDINGS_HINT

    why = (
        "the MTP stage's copy of the word embeddings is never synced with the first stage's on the first pipeline rank"
        if apart == "first rank"
        else "with --decoupled-lr at PP > 1 megatron-core gave the MTP stage's copy of the word embeddings the "
        "default LR"
    )
    raise UsageError(
        f"{'export' if to == 'export' else f'--to {to}'}: the source's run trained two word embeddings ({why}), and "
        "a checkpoint of one would keep one of them and drop the other's training",
        hint=TWO_EMBEDDINGS_HINT,
    )


def unread_state(manifest: Manifest, target: str) -> list[str]:
    """A note naming the optimizer state of a Megatron legacy checkpoint that only Megatron's own
    writers carry (read from the rank files' pickles, not items of the manifest): Adam's steps, the
    param groups, the fp16 loss scaler, and the data position (``args.consumed_train_samples``).
    Written to another format (``target``), the output lacks them. Likewise a DeepSpeed fp16 run's
    dynamic loss scaler, which only DeepSpeed's files keep."""
    carry = ("megatron", "megatron-dist") if manifest.format.startswith("megatron") else (manifest.format,)
    if target in carry:
        return []
    # (top-level values of megatron-core's own classes, or tensors in a torch_dist common.pt, that
    # other formats' readers refuse: extras["not_carried"])
    kept = manifest.extras.get("not_carried") or []
    apart = (
        [f"not carried: {', '.join(kept[:4])}{' …' if len(kept) > 4 else ''} (values other formats' readers refuse)"]
        if kept
        else []
    )
    return apart + _unread_pickled(manifest)


def _unread_pickled(manifest: Manifest) -> list[str]:
    unread = list(manifest.extras.get("unread_state") or [])
    data = (manifest.extras.get("state_in_metadata") or {}).get("dataloader")
    if data is not None and manifest.format.startswith("megatron"):  # (no other format's writer has a place for it)
        unread.append(f"the dataloader position, {data}")
    if not unread:
        return []
    effects = (
        ["starts Adam's bias correction and the learning rates afresh"] if manifest.extras.get("unread_state") else []
    ) + (
        ["reads the data from its first sample again"]
        if data is not None and manifest.format.startswith("megatron")
        else []
    )
    if manifest.format.startswith("megatron"):
        carriers = "only --to megatron and megatron-dist carry them"
    else:
        carriers = f"only --to {manifest.format} carries them"
        effects = ["starts the fp16 loss scale afresh"] if "the fp16 loss scaler" in unread else effects
    return [
        f"not carried: {'; '.join(unread)}, kept in the {manifest.format} checkpoint's pickles ({carriers}): "
        f"a run resumed from the output {' and '.join(effects)}"
    ]


def left_behind(manifest: Manifest) -> list[str]:
    """A note naming the training state a checkpoint keeps in files its format does not read (a
    Hugging Face Trainer's ``optimizer.pt`` beside ``model.safetensors``): the output does not
    carry it."""
    held = manifest.extras.get("state_files") or {}
    if not held:
        return []
    files = ", ".join(dict.fromkeys(str(f) for f in held.values()))
    return [
        f"not carried: the training state in {files} ({', '.join(held)}), which the checkpoint keeps beside the "
        "model; copy those files beside the output to keep them"
    ]


def _plain_target(
    adapter: Adapter,
    manifest: Manifest,
    out: Path,
    to: str,
    limit: int,
    world_size: int | None,
    kind: str,
    pattern: str | None,
    progress: Callable[[int], None] | None,
    finish: Callable[[Path], None] | None = None,
) -> ConvertResult:
    """``convert`` to dcp, torch or safetensors (the layout kept: one writer for the whole state).
    ``finish``: called with the staging directory once every file is written, before it is
    published (the seal)."""
    result = ConvertResult(output=str(out))
    if to == "dcp":
        from ckpttool.formats.dcp_write import dcp_items, write_dcp

        pairs = select(list(manifest.items.values()), kind=kind, pattern=pattern)
        keep, result.notes = dcp_items(manifest, [i for _, i in pairs], hint=_UNREADABLE)
        renamed = {i.name: name for name, i in pairs if name != i.name}  # (--kind master: under the params' names)
        ws = world_size or manifest.layout.world_size or 1
        result.files = write_dcp(
            adapter, manifest, out, world_size=ws, items=keep, names=renamed, progress=progress, finish=finish
        )
        result.tensors = sum(1 for i in keep if i.is_tensor)
        result.objects = len(keep) - result.tensors
        result.nbytes = sum(tensor_nbytes(i) for i in keep if i.is_tensor)
        return result
    if to == "torch":
        return _torch(adapter, manifest, out, kind=kind, pattern=pattern, progress=progress, finish=finish)
    pairs, result.skipped = safetensors_selection(manifest, kind=kind, pattern=pattern)
    dropped = set(unused_states(manifest))  # (as the DCP and torch targets leave them out)
    result.notes += unused_note(manifest, "safetensors", (i.name for _, i in pairs if i.name in dropped))
    pairs = [(name, i) for name, i in pairs if i.name not in dropped]
    if not pairs:
        raise UsageError(
            "nothing to write: the tensors selected are those of a parameter megatron-core never uses",
            hint="select others (--kind, --filter)",
        )
    refuse_unexpandable((i for _, i in pairs), written=True)
    shards = _shards(pairs, limit)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    with staged_dir(out) as tmp:
        buffer = np.empty(max((tensor_nbytes(i) for _, i in pairs), default=0), dtype=np.uint8)
        weight_map: dict[str, str] = {}
        with adapter.reader(manifest) as reader:
            for fname, shard in zip(names, shards, strict=True):
                with open_direct(tmp / fname) as fh:
                    write_safetensors(
                        fh,
                        shard,
                        reader,
                        buffer=buffer,
                        progress=progress,
                        metadata=written_metadata(manifest),
                    )
                    fh.flush()
                    os.fsync(fh.fileno())
                weight_map.update({name: fname for name, _ in shard})
        total = sum(tensor_nbytes(i) for _, i in pairs)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            names.append("model.safetensors.index.json")
        if finish is not None:
            finish(tmp)
        fsync_tree(tmp)
        publish_dir(tmp, out)
    result.files, result.tensors, result.nbytes = names, len(pairs), total
    return result


def _seal_staged(tmp: Path, *, out: Path) -> None:
    """Seal the staging directory ``tmp`` of a convert output as the directory it becomes (``out``):
    its files read back, hashed and their zip CRC-32s checked, as ``ckpttool seal`` does."""
    from ckpttool.seal import seal

    seal(tmp, published_as=out)


def _torch(
    adapter: Adapter,
    manifest: Manifest,
    out: Path,
    *,
    kind: str,
    pattern: str | None,
    progress: Callable[[int], None] | None,
    finish: Callable[[Path], None] | None = None,
) -> ConvertResult:
    """``--to torch``: one ``torch.save`` file, ``model.pt``, of the whole state dict. A DCP source
    is nested back as it was saved (``.metadata``'s planner data), which makes the file
    ``dcp_to_torch_save``'s, byte for byte; other sources give a flat ``{name: value}``. Tensors
    are produced one at a time into one buffer; non-tensor values are re-pickled from the
    restricted unpickler's stand-ins."""
    from ckpttool.formats import _ptwrite
    from ckpttool.formats.dcp import nesting

    dropped = set(unused_states(manifest))
    chosen = select(list(manifest.items.values()), kind=kind, pattern=pattern)
    refuse_unreadable((i for _, i in chosen), hint=_UNREADABLE)
    keep = [(name, i) for name, i in chosen if i.name not in dropped]
    notes = unused_note(manifest, "torch.save", (i.name for _, i in chosen if i.name in dropped))
    result = ConvertResult(output=str(out), files=["model.pt"], notes=notes)
    paths = nesting(manifest) if all(name == i.name for name, i in keep) else None
    if paths:  # a --filter that kept some entries of a list: those keys flat (a list with holes is no
        # state dict torch saves; a path not the key's own, as a hostile map has, is left to _place)
        from ckpttool.formats.dcp import is_own_path
        from ckpttool.formats.dcp_write import with_holes

        for name in with_holes({n: paths[n] for n, _ in keep if n in paths and is_own_path(n, paths[n])}):
            paths[name] = (name,)
    with staged_dir(out) as tmp, adapter.reader(manifest) as reader:
        tree: dict[Any, Any] = {}
        budget = [len(keep)]  # list slots the nesting may open in all: one per entry
        for name, item in keep:
            value: Any
            if item.is_tensor:
                check_coverage(item)
                value = _ptwrite.assembled(reader, item)
                result.tensors += 1
                result.nbytes += tensor_nbytes(item)
            else:
                value = _ptwrite.carried(reader, item)
                result.objects += 1
            _place(tree, paths.get(name, (name,)) if paths else (name,), value, name, budget)
        written = _ptwrite.save(tree, tmp / "model.pt")
        if progress is not None:
            progress(written)
        if finish is not None:
            finish(tmp)
        fsync_tree(tmp)
        publish_dir(tmp, out)
    return result


def _place(root: dict[Any, Any], path: tuple[Any, ...], value: Any, name: str, budget: list[int]) -> None:
    """Put ``value`` at ``path`` in the nested state dict, as DCP's ``set_element`` does: a string
    step is a dict key, an integer step a list index (lists padded with None). ``budget[0]``: the
    list slots still allowed (a hostile map could otherwise ask for huge lists)."""

    def grow(node: list[Any], index: int) -> None:
        more = index + 1 - len(node)
        if more > 0:
            budget[0] -= more
            if budget[0] < 0:
                raise CorruptFileError(
                    f".metadata: planner_data asks for list index {index} for {name!r}, more list entries than "
                    "the checkpoint has items",
                    hint="the metadata is damaged or hostile",
                    path=".metadata",
                )
            node.extend([None] * more)

    node: Any = root
    for step, following in itertools.pairwise(path):
        empty: Any = [] if type(following) is int else {}
        if isinstance(node, dict):
            node = node.setdefault(step, empty)
        elif isinstance(node, list) and type(step) is int:
            grow(node, step)
            if node[step] is None:
                node[step] = empty
            node = node[step]
        else:
            break
        if not isinstance(node, (dict, list)):
            break
    else:
        last = path[-1]
        if isinstance(node, dict) and type(last) is str and last not in node:
            node[last] = value
            return
        if isinstance(node, list) and type(last) is int and (last >= len(node) or node[last] is None):
            grow(node, last)
            node[last] = value
            return
    raise CorruptFileError(
        f".metadata: planner_data puts {name!r} at {path}, where another entry already is",
        hint="the metadata is damaged or hostile",
        path=".metadata",
    )


def _framework(
    src: str | Path,
    out: Path,
    to: str,
    *,
    kind: str,
    pattern: str | None,
    force: bool,
    progress: Callable[[int], None] | None,
    split_rules: dict[str, int | None],
    seal_output: bool = True,
) -> ConvertResult:
    """``--to megatron|megatron-dist|deepspeed|deepspeed-universal``: ``reshard`` with the layout unchanged (a framework
    checkpoint keeps every entry: no ``--kind`` or ``--filter``)."""
    from ckpttool.ranks import torchrun_world
    from ckpttool.reshard import Target, reshard

    if kind != "all" or pattern is not None:
        raise UsageError(
            f"--to {to} writes the whole training state; --kind and --filter apply to safetensors, dcp and torch only",
            hint=f"drop --kind and --filter to write --to {to}, or write the selection --to safetensors, dcp or torch",
        )
    target = Target(to=to, split_rules=split_rules)
    done = reshard(
        src, out, target, force=force, progress=progress, command=f"convert --to {to}", seal_output=seal_output
    )
    ranks = torchrun_world()
    if ranks is not None and ranks[0] != 0:  # rank 0 reports for all
        return ConvertResult(output=str(out), nbytes=done.plan.nbytes)
    tensors, objects = done.tensors, done.objects
    if tensors is None or objects is None:  # (unsealed, nobody described it: "wrote 0 tensors" was said)
        from ckpttool import registry

        _, written = registry.describe(out)
        tensors = sum(1 for i in written.items.values() if i.is_tensor)
        objects = len(written.items) - tensors
    return ConvertResult(
        output=str(out),
        files=sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
        tensors=tensors,
        objects=objects,
        nbytes=done.plan.nbytes,
        notes=done.plan.notes,
        sealed=done.sealed,
    )
