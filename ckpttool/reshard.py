"""``reshard``: the same training state at a new parallel layout.

A *plan* lists, for each output file, its tensors and bytes and the memory its writer needs (the
largest output tensor plus the largest source piece read into a temporary). The executor writes
the files into a directory beside the destination, one file per task, over ``--workers``
processes, each process holding one tensor at a time; it then writes the format's tracker files,
seals the directory (``ckpttool.manifest.json``) and publishes it with one rename. A run that
dies leaves the destination absent (or, with ``--force``, as it was until the final rename).

Targets so far: Megatron legacy at any TP/PP (from Megatron legacy) and PyTorch DCP at any world
size (from any format). See ``docs/reshard.md``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ckpttool import registry
from ckpttool.convert import parse_size
from ckpttool.errors import UsageError
from ckpttool.io import fsync_dir, temp_dir_beside
from ckpttool.manifest import Manifest

OVERHEAD = 300 * 10**6
"""Memory of a worker process besides its tensor buffers (the interpreter, torch, the manifest)."""


@dataclass(slots=True, kw_only=True)
class Target:
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    dp: int | None = None
    ep: int | None = None
    to: str | None = None
    split_rules: dict[str, int | None] = field(default_factory=dict)
    vocab_padding: str = "keep"


@dataclass(slots=True, kw_only=True)
class PlanFile:
    path: str
    nbytes: int
    tensors: int
    peak: int
    """bytes of buffers the writer of this file holds at once"""


@dataclass(slots=True, kw_only=True)
class Plan:
    source: str
    source_format: str
    source_layout: dict[str, Any]
    format: str
    layout: dict[str, Any]
    files: list[PlanFile]
    workers: int
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def peak(self) -> int:
        """Estimated peak memory: the ``workers`` largest per-file peaks plus each worker's overhead."""
        peaks = sorted((f.peak for f in self.files), reverse=True)[: self.workers]
        return sum(peaks) + self.workers * OVERHEAD

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_format": self.source_format,
            "source_layout": self.source_layout,
            "format": self.format,
            "layout": self.layout,
            "workers": self.workers,
            "files": [{"path": f.path, "nbytes": f.nbytes, "tensors": f.tensors, "peak": f.peak} for f in self.files],
            "nbytes": self.nbytes,
            "peak_memory": self.peak,
            "notes": self.notes,
        }


_RULE = re.compile(r"^(?P<re>.+)=(?P<dim>\d+|none|replicated)$")


def parse_split_rules(rules: list[str]) -> dict[str, int | None]:
    """``--split-rule 'adapter\\.weight$=0'``: regular expression = dim (or ``none``: replicated)."""
    out: dict[str, int | None] = {}
    for text in rules:
        m = _RULE.match(text)
        if m is None:
            raise UsageError(f"--split-rule {text!r}: expected REGEX=DIM (DIM a number, or 'none' for replicated)")
        try:
            re.compile(m["re"])
        except re.error as exc:
            raise UsageError(f"--split-rule {text!r}: {exc}") from None
        out[m["re"]] = int(m["dim"]) if m["dim"].isdigit() else None
    return out


# -- Megatron legacy ------------------------------------------------------------------------------

_WRITER: Any = None


def _megatron_init(root: str, manifest: Manifest, target: Any, rules: dict[str, Any]) -> None:
    global _WRITER
    from ckpttool.formats.megatron_write import LegacyWriter

    _WRITER = LegacyWriter(Path(root), manifest, target, rules)


def _megatron_task(t: int, p: int, out: str) -> int:
    assert _WRITER is not None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with _legacy_adapter().reader(_WRITER.manifest) as reader:
        return int(_WRITER.write(t, p, Path(out), reader, None))


def _legacy_adapter() -> Any:
    from ckpttool.formats.megatron import MegatronLegacyAdapter

    return MegatronLegacyAdapter()


def _largest_piece(manifest: Manifest) -> int:
    return max((p.nbytes for i in manifest.items.values() for p in i.pieces), default=0)


# -- the command ----------------------------------------------------------------------------------


def plan(src: str | Path, target: Target, *, workers: int = 1, max_memory: str | None = None) -> tuple[Plan, Any]:
    """The plan for ``target``, and the object that executes it. Raises UsageError for a target the
    checkpoint cannot take, before anything is written."""
    adapter, manifest = registry.describe(src)
    fmt = target.to or _default_format(manifest.format)
    src_layout = {k: v for k, v in _layout(manifest).items() if v is not None}
    executor: _MegatronExec | _DcpExec
    if fmt == "megatron":
        executor = _plan_megatron(adapter, manifest, target)
    elif fmt == "dcp":
        executor = _plan_dcp(adapter, manifest, target)
    else:
        raise UsageError(
            f"--to {fmt!r}: reshard writes megatron (legacy, from Megatron legacy) and dcp so far",
            hint="'ckpttool convert --to safetensors' writes the Hugging Face layout",
        )
    files = executor.files()
    limit = parse_size(max_memory, option="--max-memory") if max_memory else None
    need = max((f.peak for f in files), default=0) + OVERHEAD
    if limit is not None and need > limit:
        raise UsageError(
            f"--max-memory {max_memory}: writing {max(files, key=lambda f: f.peak).path} alone needs about "
            f"{need / 1e6:,.0f} MB (its largest tensor, the largest source piece, {OVERHEAD // 10**6} MB of process)",
            hint="raise --max-memory",
        )
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    n = max(1, min(workers, len(files)))
    if limit is not None:
        while (
            n > 1
            and Plan(source="", source_format="", source_layout={}, format="", layout={}, files=files, workers=n).peak
            > limit
        ):
            n -= 1
    result = Plan(
        source=str(src),
        source_format=manifest.format,
        source_layout=src_layout,
        format=fmt,
        layout=executor.layout,
        files=files,
        workers=n,
        notes=list(executor.notes),
    )
    if n < workers and len(files) >= workers:
        result.notes.append(f"--workers {workers} reduced to {n} to stay within --max-memory {max_memory}")
    return result, executor


def _default_format(source: str) -> str:
    return {"megatron": "megatron", "dcp": "dcp"}.get(source, "dcp")


def _layout(manifest: Manifest) -> dict[str, Any]:
    lay = manifest.layout
    return {"world_size": lay.world_size, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "vpp": lay.vpp}


class _MegatronExec:
    def __init__(self, adapter: Any, manifest: Manifest, target: Target) -> None:
        from ckpttool.formats.megatron import MegatronLegacyAdapter
        from ckpttool.formats.megatron_write import LegacyWriter, MegatronTarget

        if not isinstance(adapter, MegatronLegacyAdapter):
            raise UsageError(
                f"--to megatron reshards Megatron legacy checkpoints; this one is {manifest.format} "
                f"({type(adapter).__name__})",
                hint="'ckpttool convert --to dcp' or '--to safetensors' writes other formats",
            )
        if target.vpp not in (None, 1):
            raise UsageError("--vpp: writing virtual pipeline stages is not supported yet")
        if target.ep not in (None, 1) or target.dp is not None:
            raise UsageError("--ep and --dp do not apply to Megatron legacy files (one file per TP x PP rank)")
        tp = target.tp or manifest.layout.tp or 1
        pp = target.pp or manifest.layout.pp or 1
        if target.vocab_padding not in ("keep", "megatron"):
            raise UsageError(f"--vocab-padding {target.vocab_padding!r}: expected keep or megatron")
        self.mtarget = MegatronTarget(tp=tp, pp=pp, repad_vocab=target.vocab_padding == "megatron")
        self.root = manifest.root
        self.manifest = manifest
        self.rules = target.split_rules
        self.writer = LegacyWriter(Path(manifest.root), manifest, self.mtarget, self.rules)
        self.layout = {"tp": tp, "pp": pp}
        self.notes: list[str] = []
        args = self.writer.args
        rows = self.writer.rows
        emb = manifest.items.get("embedding.word_embeddings.weight")
        padded = rows or (emb.shape[0] if emb is not None and emb.shape else None)
        if padded is not None:
            div = self.writer.vocab_divisor(
                getattr(args, "vocab_size", None), getattr(args, "make_vocab_size_divisible_by", None), padded
            )
            if div is not None:
                self.notes.append(
                    f"the vocabulary stays padded to {padded} rows: resume with --make-vocab-size-divisible-by {div} "
                    "(recorded in args), or reshard with --vocab-padding megatron"
                )
        if (manifest.layout.tp, manifest.layout.pp) != (tp, pp) and any(
            i.kind == "rng" for i in manifest.items.values()
        ):
            self.notes.append(
                f"RNG state: rank (t, p) gets source rank (t mod {manifest.layout.tp}, p mod {manifest.layout.pp})'s"
            )
        self._planned = self.writer.files()
        largest = _largest_piece(manifest)
        self._files = [
            PlanFile(path=f.path, nbytes=f.nbytes, tensors=f.tensors, peak=f.largest + largest) for f in self._planned
        ]

    def files(self) -> list[PlanFile]:
        return self._files

    def run(self, tmp: Path, workers: int, progress: Callable[[int], None] | None) -> None:
        tasks = [(f.rank[0], f.rank[1], str(tmp / f.path)) for f in self._planned]
        if workers <= 1:
            with _legacy_adapter().reader(self.manifest) as reader:
                for t, p, out in tasks:
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
                    self.writer.write(t, p, Path(out), reader, progress)
        else:
            with ProcessPoolExecutor(
                workers,
                mp_context=get_context("spawn"),
                initializer=_megatron_init,
                initargs=(self.root, self.manifest, self.mtarget, self.rules),
            ) as pool:
                for n in pool.map(_megatron_task, *zip(*tasks, strict=True)):
                    if progress is not None:
                        progress(n)
        name, text = self.writer.tracker()
        (tmp / name).write_text(text)


class _DcpExec:
    def __init__(self, adapter: Any, manifest: Manifest, target: Target) -> None:
        from ckpttool.formats.dcp_write import chunk_boxes

        if target.tp not in (None, 1) or target.pp not in (None, 1) or target.ep not in (None, 1):
            raise UsageError(
                "--to dcp: a DCP checkpoint is saved from one world of ranks; give its size with --dp "
                "(--tp, --pp and --ep do not apply)"
            )
        self.adapter, self.manifest = adapter, manifest
        self.world = target.dp or manifest.layout.world_size or 1
        if self.world < 1:
            raise UsageError("--dp must be at least 1")
        self.items = [i for i in manifest.items.values() if not i.error]
        self.skipped = [i for i in manifest.items.values() if i.error]
        self.layout = {"world_size": self.world}
        self.notes = [f"not written (unreadable): {i.name}: {i.error}" for i in self.skipped]
        sizes = [0] * self.world
        counts = [0] * self.world
        largest = 0
        from ckpttool.dtypes import carrier

        for item in self.items:
            if not item.is_tensor or item.shape is None or item.dtype is None:
                counts[0] += 1
                continue
            sharded = sum(1 for p in item.pieces if p.replica == 0) > 1
            for r, box in enumerate(chunk_boxes(item.shape, self.world if sharded else 1)):
                if box is not None:
                    n = box.volume * carrier(item.dtype).itemsize
                    sizes[r] += n
                    counts[r] += 1
                    largest = max(largest, n)
        peak = 3 * largest + _largest_piece(manifest)  # the chunk, its copy and torch.save's bytes
        self._files = [PlanFile(path=".metadata", nbytes=0, tensors=0, peak=0)] + [
            PlanFile(path=f"__{r}_0.distcp", nbytes=sizes[r], tensors=counts[r], peak=peak) for r in range(self.world)
        ]

    def files(self) -> list[PlanFile]:
        return self._files

    def run(self, tmp: Path, workers: int, progress: Callable[[int], None] | None) -> None:
        from ckpttool.formats.dcp_write import write_dcp

        out = tmp / "dcp"
        write_dcp(self.adapter, self.manifest, out, world_size=self.world, items=self.items, progress=progress)
        for p in out.iterdir():
            os.replace(p, tmp / p.name)
        out.rmdir()


def _plan_megatron(adapter: Any, manifest: Manifest, target: Target) -> _MegatronExec:
    return _MegatronExec(adapter, manifest, target)


def _plan_dcp(adapter: Any, manifest: Manifest, target: Target) -> _DcpExec:
    return _DcpExec(adapter, manifest, target)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory below ``root`` (torch's zip writer does not fsync)."""
    dirs = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            dirs.append(path)
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        fsync_dir(d)


@dataclass(slots=True, kw_only=True)
class ReshardResult:
    plan: Plan
    output: str
    written: bool
    sealed: bool = False


def reshard(
    src: str | Path,
    dst: str | Path,
    target: Target,
    *,
    workers: int = 1,
    max_memory: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    seal_output: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ReshardResult:
    out = Path(dst)
    if Path(src).resolve() == out.resolve() or out.resolve().is_relative_to(Path(src).resolve()):
        raise UsageError(f"-o {out} is inside the source {src}", hint="write the resharded checkpoint elsewhere")
    if out.exists() and not force and not dry_run:
        raise UsageError(f"{out} exists", hint="choose another -o path or pass --force to replace it")
    the_plan, executor = plan(src, target, workers=workers, max_memory=max_memory)
    if dry_run:
        return ReshardResult(plan=the_plan, output=str(out), written=False)
    tmp = temp_dir_beside(out)
    try:
        executor.run(tmp, the_plan.workers, progress)
        sealed = False
        if seal_output:
            from ckpttool.seal import seal

            seal(tmp, workers=the_plan.workers)
            sealed = True
        _fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ReshardResult(plan=the_plan, output=str(out), written=True, sealed=sealed)


__all__ = ["Plan", "PlanFile", "ReshardResult", "Target", "parse_split_rules", "plan", "reshard"]
