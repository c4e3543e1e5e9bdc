"""``reshard``: the same training state at a new parallel layout.

A *plan* lists, for each output file, its tensors and bytes and the memory its writer needs (the
largest output tensor plus the largest source piece read into a temporary). The executor writes
the files into a directory beside the destination, one file per task, over ``--workers``
processes, each process holding one tensor at a time; it then writes the format's tracker files,
seals the directory (``ckpttool.manifest.json``) and publishes it with one rename. A run that
dies leaves the destination absent (or, with ``--force``, as it was until the final rename).

Targets so far: Megatron legacy and torch_dist at any TP/PP/VPP/EP or pipeline layout (from either),
DeepSpeed ZeRO-1/2/3 at any DP (from any of the three stages), DeepSpeed's universal
layout (from ZeRO-1/2 without TP or PP, ZeRO-3 without TP) and PyTorch DCP at any world size (from
any format). Each format's writer
(``formats/*_write.py``) plans its files (:class:`~ckpttool.formats.base.PlannedFile`), writes one
(``write``) and then what depends on all of them (``finish``). See ``docs/reshard.md``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context, resource_tracker
from pathlib import Path
from typing import Any

from ckpttool import device, interrupt, registry
from ckpttool.convert import (
    MAX_RANKS,
    parse_size,
    refuse_changed_since_sealed,
    refuse_copies_apart,
    refuse_left_behind,
    unread_state,
)
from ckpttool.errors import CkptError, CorruptFileError, UsageError
from ckpttool.export import refuse_findings
from ckpttool.hashing import Written, collecting_written, hash_bytes
from ckpttool.io import (
    check_crcs_from_now,
    check_output,
    checking_crcs,
    drain_partial,
    finish_partial,
    fsync_tree,
    publish_dir,
    refuse_overlap,
    replacing,
    staged_dir,
)
from ckpttool.manifest import Manifest
from ckpttool.ranks import torchrun_world

OVERHEAD = 300 * 10**6
"""Memory of a worker process besides its tensor buffers (the interpreter, torch, the manifest)."""


@dataclass(slots=True, kw_only=True)
class Target:
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    dp: int | None = None
    ep: int | None = None
    etp: int | None = None
    """Megatron: expert tensor-parallel ranks (None: the source's when it differs from its TP, else TP)"""
    to: str | None = None
    split_rules: dict[str, int | None] = field(default_factory=dict)
    vocab_padding: str = "keep"
    distributed_optimizer: bool | None = None
    """Megatron legacy: write the distributed optimizer's ``distrib_optim.pt`` (None: as the source)"""
    pp_first: int | None = None
    pp_last: int | None = None
    """Megatron: layers on the first / last pipeline stage (uneven pipeline; the other stages share
    the rest evenly). Neither given: even stages at a new ``pp``, the source's split when ``pp`` is
    not given."""
    pipeline_layout: str | None = None
    """Megatron: ``--pipeline-model-parallel-layout`` of the output (its stages give the virtual
    stages too). None: the source's when none of pp, vpp and the first/last layers is given."""
    zero_stage: int | None = None
    """DeepSpeed: the ZeRO stage of the output (1, 2 or 3; None: the source's)"""
    sub_group_size: int | None = None
    """DeepSpeed ZeRO-3 from ZeRO-1/2: ``zero_optimization.sub_group_size`` of the run that resumes
    (None: DeepSpeed's default)"""

    def __post_init__(self) -> None:
        # 0 is a size given, not "the source's" (None): the writers test sizes for truth
        for name in ("tp", "pp", "vpp", "dp", "ep", "etp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name} {value}: a parallel size must be at least 1")
            if value is not None and value > MAX_RANKS:
                raise UsageError(
                    f"--{name} {value:,}: more ranks than any run has (at most {MAX_RANKS:,}); "
                    "each rank gets files of its own",
                    hint="give the size of the run that will load the output",
                )
        given = [v for v in (self.tp, self.pp, self.dp, self.ep) if v is not None]
        if math.prod(given) > MAX_RANKS:
            raise UsageError(
                f"{' x '.join(map(str, given))} = {math.prod(given):,} ranks: more than any run has "
                f"(at most {MAX_RANKS:,})",
                hint="give the sizes of the run that will load the output",
            )


@dataclass(slots=True, kw_only=True)
class PlanFile:
    path: str
    nbytes: int
    tensors: int
    peak: int
    """bytes of buffers the writer of this file holds at once"""


def worker_overhead(on: str) -> int:
    """Memory of a worker process besides its tensor buffers, assembling ``on`` a device: on a GPU,
    torch and a CUDA context too."""
    return OVERHEAD + (device.CUDA_OVERHEAD if on != "cpu" else 0)


def peak_memory(files: list[PlanFile], workers: int, overhead: int = OVERHEAD) -> int:
    """Estimated peak memory: the ``workers`` largest per-file peaks plus each worker's overhead."""
    return sum(sorted((f.peak for f in files), reverse=True)[:workers]) + workers * overhead


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
    device: str = "cpu"
    """where the tensors are assembled (``cpu`` or ``cuda:N``)"""
    last: list[str] = field(default_factory=list)
    """the small files written once the planned ones are (metadata, trackers; the seal aside)"""

    @property
    def overhead(self) -> int:
        """memory of each worker process besides its buffers"""
        return worker_overhead(self.device)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def peak(self) -> int:
        return peak_memory(self.files, self.workers, self.overhead)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_format": self.source_format,
            "source_layout": self.source_layout,
            "format": self.format,
            "layout": self.layout,
            "workers": self.workers,
            "device": self.device,
            "files": [{"path": f.path, "nbytes": f.nbytes, "tensors": f.tensors, "peak": f.peak} for f in self.files],
            "nbytes": self.nbytes,
            "last_files": self.last,
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


# -- writers in worker processes -----------------------------------------------------------------

_WRITER: Any = None
_ADAPTER: Any = None
_MANIFEST: Manifest | None = None


def _init_worker(
    build: Callable[..., Any], args: tuple[Any, ...], adapter: Any, manifest: Manifest, on: str, parent: int
) -> None:
    global _WRITER, _ADAPTER, _MANIFEST
    watch_parent(parent)
    check_crcs_from_now()  # as the reshard that started this worker does
    device.start(on)
    _WRITER, _ADAPTER, _MANIFEST = build(*args), adapter, manifest


def watch_parent(parent: int, every: float = 0.5) -> None:
    """End this worker when the process that started it (``parent``) is gone: a reshard killed with
    SIGKILL (by the OOM killer, ``timeout -s KILL``, a scheduler) left its workers for ever, waiting
    on the pool's pipes with SIGINT and SIGTERM blocked as the pool started them, and finishing
    their files into a temporary directory no one would publish."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="ckpttool-watch-parent", daemon=True).start()


def _run_task(key: tuple[int, ...], out: str) -> Any:
    assert _WRITER is not None and _MANIFEST is not None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with collecting_written() as known, _ADAPTER.reader(_MANIFEST) as reader:  # (writers need not keep the manifest)
        result = _WRITER.write(*key, Path(out), reader, None)
    # the zip members this task read in part: the parent judges them with the others' parts
    return result, Path(out).stat().st_size, known, drain_partial()


def _build_legacy(root: str, manifest: Manifest, target: Any, rules: dict[str, Any]) -> Any:
    from ckpttool.formats.megatron_write import LegacyWriter

    return LegacyWriter(Path(root), manifest, target, rules)


def _build_dist(root: str, manifest: Manifest, target: Any, rules: dict[str, Any]) -> Any:
    from ckpttool.formats.megatron_dist_write import DistWriter

    return DistWriter(Path(root), manifest, target, rules)


def _build_dcp(manifest: Manifest, world: int, names: list[str]) -> Any:
    from ckpttool.formats.dcp_write import DcpWriter, dim0_cut

    return DcpWriter(world, [manifest.items[n] for n in names], cut=dim0_cut(manifest))


def _build_zero(root: str, manifest: Manifest, dp: int, stage: int, sub_group_size: int | None) -> Any:
    from ckpttool.formats.deepspeed_write import (
        Zero3From12Writer,
        Zero3FromUniversalWriter,
        Zero3Writer,
        ZeroFrom3Writer,
        ZeroFromUniversalWriter,
        ZeroModelParallelWriter,
        ZeroWriter,
        model_parallel,
    )

    if manifest.extras.get("variant") == "universal":
        of_zero3 = any(
            re.search(r"(^|/)zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$", f.path) for f in manifest.files
        )
        if of_zero3 and sub_group_size is not None:
            raise UsageError("--sub-group-size: a ZeRO-3 run's universal checkpoint keeps the sub-group size it had")
        if of_zero3 and stage in (None, 3):
            return Zero3FromUniversalWriter(Path(root), manifest, dp)
        if of_zero3:
            return ZeroFrom3Writer(Path(root), manifest, dp, stage)
        if stage == 3:
            return Zero3From12Writer(Path(root), manifest, dp, sub_group_size)
        return ZeroFromUniversalWriter(Path(root), manifest, dp, stage)
    source = manifest.layout.zero_stage
    if manifest.extras.get("variant") == "BF16_Optimizer":  # ZeRO-1's partitions, any stage refused in ZeroWriter
        if model_parallel(manifest):
            return ZeroModelParallelWriter(Path(root), manifest, dp, stage)
        return ZeroWriter(Path(root), manifest, dp, stage)
    if source in (1, 2) and stage in (None, 1, 2) and model_parallel(manifest):
        return ZeroModelParallelWriter(Path(root), manifest, dp, stage)
    if source == 3 and sub_group_size is not None:
        raise UsageError("--sub-group-size: a ZeRO-3 checkpoint keeps the sub-group size it was saved with")
    if source == 3 and stage == 3:
        return Zero3Writer(Path(root), manifest, dp)
    if source == 3:
        return ZeroFrom3Writer(Path(root), manifest, dp, stage)
    if stage == 3:
        return Zero3From12Writer(Path(root), manifest, dp, sub_group_size)
    return ZeroWriter(Path(root), manifest, dp, stage)


class _FileExec:
    """Output files written one per task by a format writer (``write(*key, out, reader, progress)``),
    in this process or over a pool of worker processes that each build the same writer; then the
    writer's ``finish(tmp, results)`` writes what depends on all of them (index, tracker)."""

    def __init__(
        self,
        adapter: Any,
        manifest: Manifest,
        build: Callable[..., Any],
        args: tuple[Any, ...],
        layout: dict[str, Any],
    ) -> None:
        self.adapter, self.manifest, self.build, self.args, self.layout = adapter, manifest, build, args, layout
        self.writer = build(*args)
        self.notes: list[str] = []
        self.planned = self.writer.files()
        self.known: dict[str, Written] = {}
        """what the writers hashed of the files they wrote, for the seal (by absolute path)"""
        self.partial: list[Any] = []
        """the zip members worker processes read in part (:func:`ckpttool.io.finish_partial`)"""
        self.device = "cpu"
        """where the tensors are assembled (:func:`ckpttool.device.resolve`)"""

    @functools.cached_property
    def largest_piece(self) -> int:
        """bytes of the source's largest piece (the temporary, or staging buffer, one is read into)"""
        return _largest_piece(self.manifest)

    def files(self) -> list[PlanFile]:
        """Each file with the memory its writer holds: its largest output tensor (two, one filled
        while the other is written) and the largest source piece, read into a temporary when it
        does not lie contiguously in the output."""
        from ckpttool.formats._ptwrite import written_peak

        largest = self.largest_piece

        def held(f: Any) -> int:
            if self.device == "cpu":
                return written_peak(f.largest) + largest
            # on a GPU: the scratch and two staging buffers for source pieces, pinned (rounded up)
            return device.pinned(written_peak(f.largest)) + 2 * device.pinned(largest)

        return [PlanFile(path=f.path, nbytes=f.nbytes, tensors=f.tensors, peak=held(f)) for f in self.planned]

    def run(self, tmp: Path, workers: int, progress: Callable[[int], None] | None) -> None:
        results = self.write_files(tmp, list(range(len(self.planned))), workers, progress)
        self.writer.finish(tmp, [results[i] for i in range(len(self.planned))])

    def write_files(
        self, tmp: Path, indices: list[int], workers: int, progress: Callable[[int], None] | None
    ) -> dict[int, Any]:
        """Write the planned files at ``indices`` into ``tmp``; returns each one's writer result."""
        results: dict[int, Any] = {}
        chosen = [self.planned[i] for i in indices]
        if workers <= 1 or len(chosen) <= 1:
            self._write_here(tmp, zip(indices, chosen, strict=True), results, progress)
            return results
        # this process writes files too, taking the next one as it finishes one, while the pool's
        # processes start (a spawned interpreter takes a while) and then beside them: --workers N is N
        # processes writing. The pool is handed a file each time one of its processes finishes one.
        #
        # the workers never see Ctrl-C or SIGTERM: this process alone handles them, stops the workers
        # and removes the output in flight. They start with both blocked (a spawned interpreter keeps
        # the signal mask it was started with, for its whole life), here blocked in this thread for
        # that while only: one that comes meanwhile reaches this process through another thread of
        # it (a progress bar's), or waits and lands as they are unblocked; never lost (ignoring them
        # instead lost those another thread took). Either is held back until every worker has been
        # sent its instructions (one raised between a worker's start and that write left it reading
        # an empty pipe, and it printed a traceback)
        todo = collections.deque(zip(indices, chosen, strict=True))
        lock = threading.Lock()
        stop = threading.Event()  # (a file failed, or this process is stopping the pool)
        done: queue.SimpleQueue[tuple[int, Future[Any]]] = queue.SimpleQueue()

        def take() -> tuple[int, Any] | None:
            with lock:
                return todo.popleft() if todo and not stop.is_set() else None

        def feed(pool: ProcessPoolExecutor, first: list[tuple[int, Future[Any]]]) -> None:
            """Hands the pool the next file as each of its files is done; posts each done one to
            ``done``. Stops at the first failure (raised at once by the caller, which stops the
            pool), not waiting for the files still being written."""
            running = {fut: i for i, fut in first}
            try:
                while running and not stop.is_set():
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        done.put((running.pop(fut), fut))
                        if fut.cancelled() or fut.exception() is not None:
                            stop.set()
                        elif (nxt := take()) is not None:
                            running[pool.submit(_run_task, nxt[1].key, str(tmp / nxt[1].path))] = nxt[0]
            except BaseException as exc:  # (the pool stopped under it: said, not lost)
                stop.set()
                failed: Future[Any] = Future()
                failed.set_exception(exc)
                done.put((-1, failed))

        def collect(block: bool) -> None:
            """Takes in the files the pool has written (with ``block``, until the feeder has
            ended); raises the first failure."""
            while len(results) < len(chosen):
                try:
                    i, fut = done.get(timeout=0.2) if block else done.get_nowait()
                except queue.Empty:  # (waited in steps: a Ctrl-C lands between them)
                    # (once the feeder has ended nothing more comes: what it posted last is taken first)
                    if block and ((feeder is not None and feeder.is_alive()) or not done.empty()):
                        continue
                    return
                result, nbytes, hashed, partial = fut.result()
                results[i] = result
                self.known.update(hashed)
                self.partial += partial
                if progress is not None:
                    progress(nbytes)

        def watched(nbytes: int) -> None:
            """``progress``, called by the writers as they go, also stops the file this process writes
            once the pool has failed one (not a file of many gigabytes later)."""
            if stop.is_set():
                raise _PoolFailed
            if progress is not None:
                progress(nbytes)

        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # (a signal raised here changed nothing)
        pool: ProcessPoolExecutor | None = None
        feeder: threading.Thread | None = None
        try:
            with interrupt.held():
                resource_tracker.ensure_running()  # (started later, it would unblock the two as it starts)
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
                try:
                    helpers = min(workers, len(chosen)) - 1
                    pool = ProcessPoolExecutor(
                        helpers,
                        mp_context=get_context("spawn"),
                        initializer=_init_worker,
                        initargs=(self.build, self.args, self.adapter, self.manifest, self.device, os.getpid()),
                    )
                    first = []
                    for _ in range(helpers):  # (the last files: this process starts on the first ones)
                        i, f = todo.pop()
                        first.append((i, pool.submit(_run_task, f.key, str(tmp / f.path))))
                    # (started with both signals blocked: a process it might start would keep them so)
                    feeder = threading.Thread(target=feed, args=(pool, first), name="ckpttool-feed", daemon=True)
                    feeder.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (a signal that waited lands here)
            try:  # (a file the pool failed to write stops the one in hand at its next progress, and take())
                self._write_here(tmp, iter(take, None), results, watched, between=lambda: collect(block=False))
            except _PoolFailed:
                pass  # (collect raises the pool's failure)
            collect(block=True)
            feeder.join()
            if len(results) < len(chosen):  # (not expected: every file the pool took is posted)
                raise RuntimeError(f"{len(chosen) - len(results)} files were left unwritten by the worker pool")
        except BaseException:
            stop.set()
            try:
                if pool is not None:
                    _stop(pool)
                if feeder is not None:
                    feeder.join()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        pool.shutdown(wait=True)
        return results

    def _write_here(
        self,
        tmp: Path,
        files: Iterable[tuple[int, Any]],
        results: dict[int, Any],
        progress: Callable[[int], None] | None,
        between: Callable[[], None] | None = None,
    ) -> None:
        """Writes ``files`` (index, planned file) in this process, into ``results``; ``between``
        runs after each."""
        with (
            device.using(self.device),
            collecting_written() as known,
            self.adapter.reader(self.manifest) as reader,
        ):
            for i, f in files:
                (tmp / f.path).parent.mkdir(parents=True, exist_ok=True)
                results[i] = self.writer.write(*f.key, tmp / f.path, reader, progress)
                if between is not None:
                    between()
        self.known.update(known)


_STOPS = (signal.SIGINT, signal.SIGTERM)


class _PoolFailed(Exception):
    """The worker pool failed a file: the one this process writes is given up."""


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop a worker pool at once (a task failed, or Ctrl-C): its processes are killed so that none
    writes into the output directory while it is being removed. A second Ctrl-C or SIGTERM while
    it does (one held back as the workers started comes with the first) does not cut it short: it
    is raised once every worker is gone."""
    procs = list(getattr(pool, "_processes", {}).values())  # the executor has no public handle on them
    manager = getattr(pool, "_executor_manager_thread", None)
    late: KeyboardInterrupt | None = None
    steps: list[Callable[[], Any]] = [
        lambda: pool.shutdown(wait=False, cancel_futures=True),
        *(proc.kill for proc in procs),
        *(proc.join for proc in procs),
        # its thread closes its wake-up pipe as it ends; at exit, concurrent.futures wakes every
        # pool's thread through that pipe, and a close between its check and its write printed an
        # "Exception ignored … Bad file descriptor" traceback under "interrupted" (CPython 3.11's race,
        # seen in CI under load): the thread is let end first
        *([lambda: manager.join(timeout=10)] if manager is not None else []),
    ]
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as exc:  # (each step may be taken again)
                late = exc
    if late is not None:
        raise late


def _largest_piece(manifest: Manifest) -> int:
    return max((p.nbytes for i in manifest.items.values() for p in i.pieces), default=0)


# -- the command ----------------------------------------------------------------------------------


def _build_universal(root: str, manifest: Manifest) -> Any:
    from ckpttool.formats.deepspeed_write import Universal3Writer, UniversalWriter

    if manifest.layout.zero_stage == 3:
        return Universal3Writer(Path(root), manifest)
    return UniversalWriter(Path(root), manifest)


def plan(
    src: str | Path,
    target: Target,
    *,
    workers: int = 1,
    max_memory: str | None = None,
    on: str = "cpu",
    command: str = "reshard",
) -> tuple[Plan, Any]:
    """The plan for ``target``, and the object that executes it, assembling tensors ``on`` a device
    (``cpu``, ``cuda``, ``cuda:N``: :mod:`ckpttool.device`). Raises UsageError for a target the
    checkpoint cannot take, or a device this machine lacks, before anything is written."""
    from ckpttool.formats.megatron import user_split_rules

    on = device.resolve(on)
    with user_split_rules(target.split_rules):  # (a legacy source's parts of those parameters joined)
        adapter, manifest = registry.describe(src)
    refuse_findings(manifest)
    model_alone = (
        "ckpttool convert SRC -o DST --to dcp --world-size N --kind param"
        if command == "reshard"
        else "ckpttool convert SRC -o DST --to safetensors --kind param"
    )
    refuse_left_behind(manifest, command, model_alone)
    fmt = target.to or _default_format(manifest.format)
    if target.distributed_optimizer is not None and fmt not in ("megatron", "megatron-dist"):
        raise UsageError(f"--[no-]distributed-optimizer applies to --to megatron and megatron-dist only, not {fmt}")
    if target.zero_stage is not None and fmt != "deepspeed":
        raise UsageError(
            f"--zero-stage applies to --to deepspeed only, not {fmt}",
            hint="drop --zero-stage, or give --to deepspeed",
        )
    if target.zero_stage is not None and target.zero_stage not in (1, 2, 3):
        raise UsageError(f"--zero-stage {target.zero_stage}: DeepSpeed's partitioned stages are 1, 2 and 3")
    if target.dp is not None and target.dp < 1:
        raise UsageError(f"--dp {target.dp}: the data-parallel size (or DCP world size) is at least 1")
    if target.sub_group_size is not None and target.sub_group_size < 0:
        raise UsageError(f"--sub-group-size {target.sub_group_size}: a count of elements, 0 or more")
    if target.sub_group_size is not None and target.zero_stage != 3:
        raise UsageError(
            "--sub-group-size (0 or more) applies with --zero-stage 3 from a ZeRO-1/2 checkpoint (a ZeRO-3 one "
            "records its own)",
            hint="add --zero-stage 3, or drop --sub-group-size",
        )
    if (target.pp_first is not None or target.pp_last is not None) and fmt not in ("megatron", "megatron-dist"):
        raise UsageError(f"--pp-first-layers and --pp-last-layers apply to Megatron targets only, not {fmt}")
    if target.vocab_padding != "keep" and fmt not in ("megatron", "megatron-dist"):
        raise UsageError(f"--vocab-padding applies to Megatron targets only, not {fmt}")
    if fmt not in ("megatron", "megatron-dist"):  # (the Megatron writers judge the rules themselves)
        from ckpttool.formats.megatron_write import check_split_rules

        check_split_rules(manifest, target.split_rules)
    if target.vpp is not None and fmt not in ("megatron", "megatron-dist"):
        raise UsageError(f"--vpp applies to Megatron targets only, not {fmt}")
    if target.pipeline_layout is not None:
        if not target.pipeline_layout.strip():  # (an unset shell variable: not the default layout)
            raise UsageError("--pipeline-layout '': expected the layers of every stage, such as 'E|tt|tt|L'")
        if fmt not in ("megatron", "megatron-dist"):
            raise UsageError(f"--pipeline-layout applies to Megatron targets only, not {fmt}")
        if target.vpp is not None or target.pp_first is not None or target.pp_last is not None:
            raise UsageError(
                "--pipeline-layout places every layer itself: drop --vpp, --pp-first-layers and --pp-last-layers"
            )
    src_layout = {k: v for k, v in _layout(manifest).items() if v is not None}
    executor: _FileExec
    if fmt in ("megatron", "megatron-dist"):
        executor = _MegatronExec(adapter, manifest, target, dist=fmt == "megatron-dist")
    elif fmt == "deepspeed":
        executor = _ZeroExec(adapter, manifest, target)
    elif fmt == "deepspeed-universal":
        executor = _UniversalExec(adapter, manifest, target)
    elif fmt == "dcp":
        executor = _DcpExec(adapter, manifest, target)
    else:
        raise UsageError(
            f"--to {fmt!r}: reshard writes megatron and megatron-dist (from Megatron legacy or "
            "torch_dist), deepspeed (from DeepSpeed ZeRO-1/2/3), deepspeed-universal (from ZeRO-1/2/3) and dcp (from "
            "anything) so far",
            hint="'ckpttool convert --to safetensors' writes the Hugging Face layout",
        )
    if fmt not in ("megatron", "megatron-dist"):  # (after the target's own refusals; Megatron's writers say it)
        refuse_copies_apart(manifest, fmt)
    executor.device = on
    files = executor.files()
    limit = parse_size(max_memory, option="--max-memory", lowercase_b_is_bits=False) if max_memory is not None else None
    overhead = worker_overhead(on)
    need = max((f.peak for f in files), default=0) + overhead
    if limit is not None and need > limit:
        raise UsageError(
            f"--max-memory {max_memory} ({limit:,} bytes): writing {max(files, key=lambda f: f.peak).path} alone "
            f"needs {need:,} bytes (its largest tensor, the largest source piece, {overhead // 10**6} MB of process)",
            hint="raise --max-memory" + (" or assemble on the CPU" if on != "cpu" else ""),
        )
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    n = max(1, min(workers, len(files)))
    while limit is not None and n > 1 and peak_memory(files, n, overhead) > limit:
        n -= 1
    result = Plan(
        source=str(src),
        source_format=manifest.format,
        source_layout=src_layout,
        format=fmt,
        layout=executor.layout,
        files=files,
        workers=n,
        notes=executor.notes,
        device=on,
        last=executor.writer.last_files(),
    )
    if n < workers and len(files) >= workers:
        result.notes.append(f"--workers {workers} reduced to {n} to stay within --max-memory {max_memory}")
    result.notes += unread_state(manifest, fmt)
    if on != "cpu":
        biggest = max((f.largest for f in executor.planned), default=0)
        gpu = n * (biggest + 2 * device.pinned(executor.largest_piece))
        result.notes.append(
            f"tensors assembled on {device.describe(on)}: about {gpu / 1e6:,.0f} MB of its memory "
            f"({n} worker{'s' if n > 1 else ''}: the largest output tensor and two source pieces each)"
        )
    return result, executor


def _default_format(source: str) -> str:
    return {"megatron": "megatron", "megatron-dist": "megatron-dist", "dcp": "dcp", "deepspeed": "deepspeed"}.get(
        source, "dcp"
    )


def _layout(manifest: Manifest) -> dict[str, Any]:
    lay = manifest.layout
    return {
        "world_size": lay.world_size,
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        "ep": lay.ep,
        "vpp": lay.vpp,
        "zero_stage": lay.zero_stage,
    }


class _MegatronExec(_FileExec):
    def __init__(self, adapter: Any, manifest: Manifest, target: Target, *, dist: bool = False) -> None:
        from ckpttool.formats.megatron import MegatronDistAdapter, MegatronLegacyAdapter
        from ckpttool.formats.megatron_write import MegatronTarget

        if not isinstance(adapter, MegatronLegacyAdapter | MegatronDistAdapter):
            raise UsageError(
                f"--to {'megatron-dist' if dist else 'megatron'} reshards Megatron legacy or torch_dist checkpoints; "
                f"this one is {manifest.format}",
                hint="'ckpttool convert --to dcp' or '--to safetensors' writes other formats",
            )
        if target.dp is not None:
            raise UsageError(
                "--dp does not apply to Megatron files (one per TP x PP x EP rank; the data-parallel size is "
                "chosen when the run resumes)",
                hint="drop --dp: the run resumes from these files at the data-parallel size it is started with",
            )
        _check_coverage(manifest)  # (the optimizer's moments too: a gap would be written as whatever memory held)
        tp = target.tp or manifest.layout.tp or 1
        pp = target.pp or manifest.layout.pp or 1
        if target.vocab_padding not in ("keep", "megatron"):
            raise UsageError(f"--vocab-padding {target.vocab_padding!r}: expected keep or megatron")
        uneven = (target.pp_first, target.pp_last)
        mtarget = MegatronTarget(
            tp=tp,
            pp=pp,
            repad_vocab=target.vocab_padding == "megatron",
            distributed_optimizer=target.distributed_optimizer,
            uneven=None if uneven == (None, None) and target.pp is None else uneven,
            vpp=target.vpp if target.vpp is not None else None if target.pp is None else 1,
            ep=target.ep,
            etp=target.etp,
            layout=target.pipeline_layout
            if target.pipeline_layout is not None
            else None
            if (target.pp, target.vpp, target.pp_first, target.pp_last) == (None, None, None, None)
            else "",
        )
        # the user's rules first, then those the source was read with (carried by a checkpoint
        # ckpttool wrote) as exact names: those a user's pattern matches are left to it, so that a
        # pattern is judged, and named, as the user gave it, once
        carried = manifest.extras.get("split_rules") or {}
        theirs = {n: d for n, d in carried.items() if not any(re.search(p, n) for p in target.split_rules)}
        rules = {**target.split_rules, **{f"^{re.escape(n)}$": d for n, d in theirs.items()}}
        args = (manifest.root, manifest, mtarget, rules)
        super().__init__(adapter, manifest, _build_dist if dist else _build_legacy, args, {"tp": tp, "pp": pp})
        if self.writer.vpp > 1:
            self.layout["vpp"] = self.writer.vpp
        if self.writer.ep > 1:
            self.layout["ep"] = self.writer.ep
        self.notes = self.writer.notes()


def _check_coverage(manifest: Manifest) -> None:
    """Every tensor of the source tiled exactly by its pieces, checked before anything is written (a
    writer would fill a gap with zeros, or with whatever its buffer held): a rank file of another
    run, read as this one's, leaves one."""
    from ckpttool.assemble import check_coverage

    for item in manifest.items.values():
        if item.is_tensor and item.shape is not None:
            try:
                check_coverage(item)
            except ValueError as exc:  # a piece outside its tensor
                where = item.pieces[0].file if item.pieces else None
                hint = "'ckpttool verify' gives details"
                raise CorruptFileError(f"{item.name}: {exc}", hint=hint, path=where) from None


class _ZeroExec(_FileExec):
    def __init__(self, adapter: Any, manifest: Manifest, target: Target) -> None:
        from ckpttool.formats.deepspeed import DeepSpeedAdapter

        if not isinstance(adapter, DeepSpeedAdapter):
            raise UsageError(
                f"--to deepspeed reshards DeepSpeed checkpoints; this one is {manifest.format}",
                hint="'ckpttool convert --to dcp' or '--to safetensors' writes other formats",
            )
        from ckpttool.formats.deepspeed_write import refuse_model_parallel_universal, stage3_settings

        universal = manifest.extras.get("variant") == "universal"
        if universal:  # (one refusal whatever the flags: no --tp, --pp or --dp would do)
            refuse_model_parallel_universal(manifest)
        lay = manifest.layout
        kept = {"--tp": lay.tp or 1, "--pp": lay.pp or 1, "--ep": lay.ep or 1, "--etp": 1}
        given = {"--tp": target.tp, "--pp": target.pp, "--ep": target.ep, "--etp": target.etp}
        if changed := [k for k, v in given.items() if v is not None and v != kept[k]]:
            raise UsageError(
                "--to deepspeed: only the data-parallel size (--dp) can change so far; "
                + ", ".join(f"{k} {given[k]}" for k in changed)
                + " would change the source's "
                + ", ".join(f"{k.removeprefix('--').upper()}={kept[k]}" for k in changed),
                hint="DeepSpeed's checkpoint.load_universal loads this universal checkpoint at any TP, PP and DP"
                if universal
                else "'ckpttool convert SRC -o DST --to deepspeed-universal' writes a universal checkpoint, which "
                "DeepSpeed loads at any TP, PP and DP",
            )
        _check_coverage(manifest)
        if universal and target.dp is None:
            raise UsageError(
                "--to deepspeed from a universal checkpoint needs the data-parallel size to write (it records none)",
                hint="ckpttool reshard SRC -o DST --to deepspeed --dp N",
            )
        dp = target.dp or manifest.layout.dp or 1
        stage = target.zero_stage or manifest.layout.zero_stage
        args = (manifest.root, manifest, dp, stage, target.sub_group_size)
        super().__init__(adapter, manifest, _build_zero, args, {"dp": dp, "zero_stage": stage})
        source = getattr(self.writer, "source_stage", manifest.layout.zero_stage)  # a universal one's run's
        stage = self.layout["zero_stage"] = self.writer.stage if stage is None else stage
        if stage != source:
            self.notes.append(
                f"ZeRO-{source} -> ZeRO-{stage}: resume with zero_optimization.stage {stage} "
                "in the config (the saved ds_config says so too)"
            )
        dropped = stage3_settings(getattr(self.writer, "model_obj", {}).get("ds_config")) if stage < 3 else {}
        if source == 3 and dropped:
            self.notes.append(
                f"ds_config: ZeRO-3's own settings dropped at ZeRO-{stage}, where they mean nothing ("
                + ", ".join(f"{k} {v!r}" for k, v in dropped.items())
                + "); put them back in the config if you resume at ZeRO-3 again"
            )
        if stage == 3 and manifest.layout.zero_stage != 3:
            from ckpttool.formats.deepspeed_write import SUB_GROUP_SIZE

            size = SUB_GROUP_SIZE if target.sub_group_size is None else target.sub_group_size
            self.notes.append(
                f"ZeRO-3 sub-groups of up to {size:,} elements per rank: resume with zero_optimization.sub_group_size "
                f"{size} (set it with --sub-group-size; DeepSpeed refuses a checkpoint cut otherwise)"
            )
        if dp != manifest.layout.dp and not universal:
            self.notes.append(
                f"ds_config in the checkpoint still says train_batch_size for DP={manifest.layout.dp}; "
                "DeepSpeed takes the batch sizes from the config you resume with"
            )


class _UniversalExec(_FileExec):
    def __init__(self, adapter: Any, manifest: Manifest, target: Target) -> None:
        from ckpttool.formats.deepspeed import DeepSpeedAdapter

        if not isinstance(adapter, DeepSpeedAdapter):
            raise UsageError(f"--to deepspeed-universal converts DeepSpeed checkpoints; this one is {manifest.format}")
        if any(v not in (None, 1) for v in (target.tp, target.pp, target.ep, target.etp)) or target.dp is not None:
            raise UsageError(
                "--to deepspeed-universal: a universal checkpoint has no parallel layout (DeepSpeed loads it at "
                "any DP size); drop --tp, --pp, --dp and --ep"
            )
        if manifest.extras.get("variant") == "universal":
            raise UsageError(
                "--to deepspeed-universal: this checkpoint is a universal one already",
                hint="'ckpttool reshard SRC -o DST --to deepspeed --dp N' writes ZeRO files from it",
            )
        _check_coverage(manifest)
        if manifest.layout.zero_stage not in (1, 2, 3):
            raise UsageError(
                f"--to deepspeed-universal: from ZeRO stage {manifest.layout.zero_stage} is not supported yet "
                "(from ZeRO-1/2/3 it is)",
                hint="'ckpttool convert --to dcp' keeps the state in a layout-free form",
            )
        super().__init__(adapter, manifest, _build_universal, (manifest.root, manifest), {})
        averaged = sorted(n for n, k in (getattr(self.writer, "kinds", None) or {}).items() if k == "average")
        if averaged and (manifest.layout.tp or 1) > 1:
            named = ", ".join(averaged[:3]) + (f" and {len(averaged) - 3} more" if len(averaged) > 3 else "")
            self.notes.append(
                f"the {manifest.layout.tp} TP ranks' copies of {named} are written as their mean (weights, fp32 "
                "copies and moments), as the model's universal_checkpoint_info asks (parameter_to_average_patterns; "
                "ds_to_universal does the same): where the copies differ, the output holds neither rank's values"
            )
        if cut := getattr(self.writer, "vocab_cut", []):  # (diff of source and output reports these shapes changed)
            self.notes.append(
                f"the fp32 copies and moments of {', '.join(cut[:3])}{' …' if len(cut) > 3 else ''} are cut to the "
                f"{self.writer.vocab_rows:,} rows of the vocabulary, their padding rows dropped, as the model's "
                "universal_checkpoint_info asks (vocabulary_parameter_patterns, original_vocab_size; ds_to_universal "
                "does the same): 'ckpttool diff' of the source and the output reports their shapes as changed"
            )
        if manifest.layout.zero_stage == 3:
            self.notes.append(
                "DeepSpeed 0.19.8's ZeRO-3 universal load restores no frozen parameter or buffer, gives every "
                "param group the first group's hyper-parameters and shares one Adam step among the sub-groups "
                "(seen with ds_to_universal's own output); '--to deepspeed --dp N' resumes a ZeRO-3 run at a new "
                "DP size exactly"
            )


class _DcpExec(_FileExec):
    def __init__(self, adapter: Any, manifest: Manifest, target: Target) -> None:
        if (
            target.tp not in (None, 1)
            or target.pp not in (None, 1)
            or target.ep not in (None, 1)
            or target.etp not in (None, 1)
        ):
            raise UsageError(
                "--to dcp: a DCP checkpoint is saved from one world of ranks; give its size with --dp "
                "(--tp, --pp and --ep do not apply)"
            )
        world = target.dp or manifest.layout.world_size or 1
        if world < 1:
            raise UsageError("--dp must be at least 1")
        from ckpttool.formats.dcp_write import dcp_items

        keep, notes = dcp_items(manifest, list(manifest.items.values()))
        super().__init__(
            adapter, manifest, _build_dcp, (manifest, world, [i.name for i in keep]), {"world_size": world}
        )
        self.notes = self.writer.notes() + notes


@dataclass(slots=True, kw_only=True)
class ReshardResult:
    plan: Plan
    output: str
    written: bool
    sealed: bool = False
    tensors: int | None = None
    """tensors the output holds (from its seal; None unsealed, and on ranks other than 0)"""
    objects: int | None = None
    """the other items the output holds (scheduler, counters, RNG, objects), as ``tensors``"""
    ranks: list[list[str]] = field(default_factory=list)
    """under torchrun: the files each rank wrote (rank order); empty in one process"""


# -- many processes, many nodes: the same command under torchrun ---------------------------------


def share(files: list[PlanFile], world: int) -> list[list[int]]:
    """The planned files' indices each rank writes: largest first, each to the rank with the fewest
    bytes so far (the same answer on every rank)."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += files[i].nbytes + 1  # + 1: files without tensor bytes spread too
    return [sorted(ix) for ix in out]


@dataclass(slots=True, kw_only=True)
class _Agreed:
    """What every torchrun rank must be given alike besides the plan (:func:`_same_on_every_rank`)."""

    out: Path
    target: Target
    seal: bool
    dry_run: bool


def _reshard_ranks(
    executor: _FileExec,
    the_plan: Plan,
    agreed: _Agreed,
    ranks: tuple[int, int],
    *,
    progress: Callable[[int], None] | None,
) -> ReshardResult:
    """Every rank writes its share of the output files into one staging directory (which must be on
    a file system all ranks see); rank 0 then writes what depends on all of them, seals and
    publishes. A failure on any rank fails every rank, and the staging directory is removed."""
    rank, world = ranks
    out = agreed.out
    with _process_group(world):
        _same_on_every_rank(the_plan, executor.manifest, agreed, world)
        shares = share(the_plan.files, world)
        if rank == 0:
            return _rank_zero(executor, the_plan, out, shares, seal_output=agreed.seal, progress=progress)
        _other_rank(executor, shares[rank], rank, the_plan.workers, progress)
        return ReshardResult(plan=the_plan, output=str(out), written=True, sealed=agreed.seal)


@contextlib.contextmanager
def _process_group(world: int) -> Iterator[None]:
    """torch.distributed's process group over gloo for the block (unless one is already up), of
    ``world`` ranks."""
    import datetime

    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    try:
        if dist.get_world_size() != world:
            raise UsageError(f"torch.distributed has {dist.get_world_size()} ranks but WORLD_SIZE says {world}")
        yield
    finally:
        if owned:
            dist.destroy_process_group()  # a process group left at exit aborts the interpreter


def _collective(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One of torch.distributed's collectives; another rank gone (killed, out of memory, crashed)
    or out of reach, which gloo says as a RuntimeError ("Connection closed by peer", a timeout),
    said as such: it was an internal error, "a bug in ckpttool"."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # (torch.distributed's DistError is one)
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CkptError(
            f"lost touch with the other torchrun ranks while {what}: {said[:300]}",
            hint="another rank stopped (killed, out of memory, crashed) or could not be reached: its own output says "
            "why; nothing was published, and the next run sweeps the staging directory",
        ) from None


def _same_on_every_rank(the_plan: Plan, manifest: Manifest, agreed: _Agreed, world: int) -> None:
    """Every rank must write its share of the same output: ranks given other arguments (another
    ``-o``, ``--dp``, format or layout, ``--vocab-padding``, split rules, uneven stages) or
    another source (a node's copy of it that differs) made their own plans, and their files landed
    in rank 0's output: a DCP directory with data files its ``.metadata`` never names, a Megatron
    checkpoint of two vocabulary sizes, each sealed, or an internal error. A dry run on some ranks
    only left the others waiting for it. Refused on every rank before anything is written, naming
    the first that differs."""
    import torch.distributed as dist

    target = {k: sorted(v.items()) if isinstance(v, dict) else v for k, v in asdict(agreed.target).items()}
    source = [
        manifest.format,
        manifest.step,
        sorted((f.path, f.size) for f in manifest.files if f.role != "seal"),
        sorted((i.name, i.dtype, i.shape, len(i.pieces)) for i in manifest.items.values()),
    ]
    mine = {
        "-o": os.path.abspath(agreed.out),
        "format": the_plan.format,
        "layout": {k: v for k, v in sorted(the_plan.layout.items())},
        "seal": agreed.seal,
        "dry-run": agreed.dry_run,
        "options": target,
        "source": hash_bytes(repr(source).encode(errors="surrogatepass"), "sha256"),
        "plan": [(f.path, f.nbytes) for f in the_plan.files],  # (last: the arguments that made it are named first)
    }
    every: list[Any] = [None] * world
    _collective("comparing the ranks' arguments", dist.all_gather_object, every, mine)
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            what = next(k for k in mine if theirs.get(k) != every[0].get(k))
            ours = every[0]
            if what == "options":
                key = next(k for k, v in theirs["options"].items() if ours["options"].get(k) != v)
                said = f"{key}={theirs['options'][key]!r} against rank 0's {ours['options'].get(key)!r}"
            else:
                said = {
                    "-o": f"-o {theirs['-o']} against rank 0's {ours['-o']}",
                    "format": f"--to {theirs['format']} against rank 0's {ours['format']}",
                    "layout": f"the layout {theirs['layout']} against rank 0's {ours['layout']}",
                    "plan": f"a plan of {len(theirs['plan'])} files against rank 0's {len(ours['plan'])}"
                    if len(theirs["plan"]) != len(ours["plan"])
                    else "a plan whose files are named or sized otherwise than rank 0's",
                    "seal": "--no-seal on one of them only",
                    "dry-run": "--dry-run on one of them only",
                    "source": "another source checkpoint than rank 0's (its files, sizes, step or tensors differ)",
                }[what]
            raise UsageError(
                f"under torchrun every rank must be given the same reshard: rank {r} has {said}; nothing was written",
                hint="give every rank the same arguments and the same source (torchrun passes the same command line "
                "to each; a node's own copy of the source must be the same checkpoint)",
            )


def _other_rank(
    executor: _FileExec, indices: list[int], rank: int, workers: int, progress: Callable[[int], None] | None
) -> None:
    """A rank other than 0 writes ``indices``; raises what any rank reported."""
    import torch.distributed as dist

    box: list[Any] = [None]
    # the staging directory, or rank 0's failure to make it
    _collective("waiting for rank 0's staging directory", dist.broadcast_object_list, box, src=0)
    if "error" in box[0]:
        raise _rank_error(box[0]["error"])
    status, results = _write_share(executor, Path(box[0]["tmp"]), indices, rank, workers, progress)
    # only rank 0 needs them: the results, and the digests taken while writing (which its seal takes
    # instead of reading the files back, alone, while every other rank waits)
    _collective(
        "sending rank 0 what this rank wrote", dist.gather_object, (status, results, executor.known), None, dst=0
    )
    _collective("waiting for rank 0 to seal and publish", dist.broadcast_object_list, box, src=0)  # None: published
    if box[0] is not None:
        raise _rank_error(box[0])


def _rank_zero(
    executor: _FileExec,
    the_plan: Plan,
    out: Path,
    shares: list[list[int]],
    *,
    seal_output: bool,
    progress: Callable[[int], None] | None,
) -> ReshardResult:
    """Rank 0's side of :func:`_reshard_ranks`: two broadcasts (the staging directory, then the
    outcome) and one gather, matched on the other ranks whatever fails. (A rank that dies outright
    takes the others with it: torchrun stops them all.)"""
    import torch.distributed as dist

    failure: dict[str, Any] | None = None
    announced = False
    try:
        with staged_dir(out) as tmp:
            _collective(
                "telling the ranks the staging directory", dist.broadcast_object_list, [{"tmp": str(tmp)}], src=0
            )
            announced = True
            status, results = _write_share(executor, tmp, shares[0], 0, the_plan.workers, progress)
            every: list[Any] = [None] * len(shares)
            _collective("gathering what the ranks wrote", dist.gather_object, (status, results, {}), every, dst=0)
            failure = next((st for st, _, _ in every if st is not None), None)
            if failure is not None:
                raise _rank_error(failure)
            merged: dict[int, Any] = {}
            for _, res, known in every:
                merged.update(res)
                executor.known.update(known)
            executor.writer.finish(tmp, [merged[i] for i in range(len(the_plan.files))])
            held = _seal_and_publish(tmp, out, the_plan.workers, seal_output, executor.known, executor.partial)
    except BaseException as exc:
        failure = failure or _describe(exc, 0, out)
        raise
    finally:
        try:
            outcome = [failure if announced else {"error": failure}]
            _collective("telling the ranks the outcome", dist.broadcast_object_list, outcome, src=0)
        except CkptError as exc:
            if failure is None:  # (else the failure on its way out is the one to say)
                raise CkptError(
                    f"{out} is published, but {exc.message}",
                    hint="the other ranks did not learn the outcome: their exit status is not this one",
                ) from None
    files = [[the_plan.files[i].path for i in ix] for ix in shares]
    return ReshardResult(
        plan=the_plan, output=str(out), written=True, sealed=seal_output, tensors=held[0], objects=held[1], ranks=files
    )


def _seal_and_publish(
    tmp: Path,
    out: Path,
    workers: int,
    seal_output: bool,
    known: dict[str, Written] | None = None,
    partial: list[Any] | None = None,
) -> tuple[int | None, int | None]:
    """Seal the written directory (unless told not to), flush it and rename it into place; returns
    how many tensors and other items the output holds (None when not sealed: nobody described it).
    ``known``: what the writers hashed as they wrote (those files are not read back)."""
    finish_partial(partial or ())  # a source member read in part is judged whole before anything is published
    held: tuple[int | None, int | None] = (None, None)
    if seal_output:
        from ckpttool.seal import seal

        sealed, _ = seal(tmp, workers=workers, published_as=out, known=known)
        tensors = sum(1 for item in sealed.manifest.items.values() if item.is_tensor)
        held = (tensors, len(sealed.manifest.items) - tensors)
    fsync_tree(tmp)
    publish_dir(tmp, out)
    return held


def _write_share(
    executor: _FileExec,
    tmp: Path,
    indices: list[int],
    rank: int,
    workers: int,
    progress: Callable[[int], None] | None,
) -> tuple[dict[str, Any] | None, dict[int, Any]]:
    """This rank's files; a failure is returned (for every rank to see), not raised."""
    if not tmp.is_dir():
        return {
            "kind": "UsageError",
            "message": f"the staging directory {tmp} that rank 0 made is not visible here",
            "hint": "under torchrun on several nodes, -o must be on a file system every node shares",
            "rank": rank,
        }, {}
    try:
        results = executor.write_files(tmp, indices, workers, progress)
        finish_partial(executor.partial)  # (each rank judges the members it read in part)
        executor.partial.clear()
        return None, results
    except Exception as exc:
        return _describe(exc, rank, tmp), {}


def _describe(exc: BaseException, rank: int, writing: Path | None = None) -> dict[str, Any]:
    """A rank's failure, for every rank to raise (:func:`_rank_error`); ``writing``: the output (or
    its staging directory), which a write error naming no file (a full disk) is said of."""
    from ckpttool.errors import CkptError

    if isinstance(exc, CkptError):
        return {"kind": type(exc).__name__, "message": exc.message, "hint": exc.hint, "path": exc.path, "rank": rank}
    if isinstance(exc, OSError):  # (the file system's answer, said as a single process says it: path and reason)
        from ckpttool.io import OS_ERROR_HINT, os_error_line, published_as

        output = None if writing is None else published_as(str(writing)) or writing
        return {"kind": "OSError", "message": os_error_line(exc, output), "hint": OS_ERROR_HINT, "rank": rank}
    return {"kind": type(exc).__name__, "message": f"{type(exc).__name__}: {exc}", "hint": None, "rank": rank}


def _rank_error(info: dict[str, Any]) -> Exception:
    """The error a rank reported, raised again on every rank (same class for ckpttool's own)."""
    from ckpttool import errors

    cls = getattr(errors, info["kind"], None)
    message = f"rank {info.get('rank', '?')}: {info['message']}"
    if isinstance(cls, type) and issubclass(cls, errors.CkptError) and cls.__init__ is errors.CkptError.__init__:
        return cls(message, hint=info.get("hint"), path=info.get("path"))
    return errors.CkptError(message, hint=info.get("hint") or "see that rank's output")


@checking_crcs()  # a flipped bit in the source stops the run: it is never sealed into the output
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
    on: str = "cpu",
    command: str = "reshard",
) -> ReshardResult:
    """Write ``src`` at the layout ``target`` to ``dst`` (see the module's description); ``on``:
    where the tensors are assembled (``cpu``, ``cuda``, ``cuda:N``); ``command``: the one the user
    ran, for the refusals (``convert --to megatron`` runs this)."""
    out = Path(dst)
    refuse_overlap(out, source=src)
    replaces = check_output(out, force=force, directory=True, example="resharded/")
    if out.exists() and not force:  # (a dry run says what the run would: it refuses too)
        raise UsageError(f"{out} exists", hint="choose another -o path or pass --force to replace it")
    the_plan, executor = plan(src, target, workers=workers, max_memory=max_memory, on=on, command=command)
    ranks = torchrun_world()
    agreed = _Agreed(out=out, target=target, seal=seal_output, dry_run=dry_run)
    if dry_run:
        if ranks is not None:  # (a dry run on some ranks only left the others waiting for it, 30 minutes)
            with _process_group(ranks[1]):
                _same_on_every_rank(the_plan, executor.manifest, agreed, ranks[1])
        return ReshardResult(plan=the_plan, output=str(out), written=False)
    refuse_changed_since_sealed(Path(src), executor.manifest)
    if ranks is not None:
        with replacing(replaces):
            return _reshard_ranks(executor, the_plan, agreed, ranks, progress=progress)
    with replacing(replaces), staged_dir(out) as tmp:
        executor.run(tmp, the_plan.workers, progress)
        held = _seal_and_publish(tmp, out, the_plan.workers, seal_output, executor.known, executor.partial)
    return ReshardResult(
        plan=the_plan, output=str(out), written=True, sealed=seal_output, tensors=held[0], objects=held[1]
    )


__all__ = ["Plan", "PlanFile", "ReshardResult", "Target", "parse_split_rules", "plan", "reshard"]
