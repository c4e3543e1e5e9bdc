"""Where ``reshard`` assembles its output tensors: on the CPU (numpy; the default) or on a GPU
(``--device cuda``).

On a GPU each output tensor, or each box of one that a writer asks for, is built in GPU memory:

* each source piece it needs is read from disk into one of two pinned host buffers, used in turn,
  and copied to the GPU asynchronously, so that the next piece is read while this one crosses;
* there it is cut and placed: box slices, the flat ranges of a ZeRO partition, the column cuts of
  a row-parallel split, the rows of a vocabulary (strided copies);
* the finished tensor is copied back into the pinned buffer the writer saves from, while the
  writer's own pipeline (``_ptwrite._filled_ahead``) is still writing the tensor before it.

Bytes move as integers of the dtype's width, never as floats, so the output is the CPU path's byte
for byte (NaN payloads and denormals included); ``tests/test_device.py`` compares the two. A value
whose width has no integer type (complex128) is assembled on the CPU.

The same code runs on the CPU through torch (``torch-cpu``, each copy done at once): the tests exercise it
where no GPU is present.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckpttool.errors import UsageError
from ckpttool.geometry import Box, intersect

PIN_MIN = 1 << 20
"""host buffers from this size up are pinned (page-locked) when a GPU assembles: copies from and to
them run at the bus's speed and overlap the CPU's work"""

CUDA_OVERHEAD = 500 * 10**6
"""host memory a process assembling on a GPU takes beyond the CPU path's: torch imported and a CUDA
context (the process measured 0.78 GB on the H200 machine of docs/benchmarks.md)"""


def pinned(n: int) -> int:
    """The host memory a buffer of ``n`` bytes takes when it is pinned: torch's pinned allocator
    rounds each block up to a power of two."""
    return n if n < PIN_MIN else 1 << (n - 1).bit_length()


_ACTIVE: Assembler | None = None


def active() -> Assembler | None:
    """The device assembling this process's tensors (None: the CPU, with numpy)."""
    return _ACTIVE


def resolve(spec: str) -> str:
    """``spec`` checked and made definite: ``cpu``, ``cuda:N`` (``cuda`` alone: this process's
    local rank under torchrun, else device 0) or ``torch-cpu``. Raises UsageError for a device this
    machine does not have, before anything is read or written."""
    if spec in ("cpu", "torch-cpu"):
        return spec
    kind, _, index = spec.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise UsageError(f"--device {spec!r}: choose cpu, cuda or cuda:N")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise UsageError(f"--device {spec}: torch is not importable ({exc})") from exc
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {spec}: this machine has no CUDA device torch can use (torch {torch.__version__})",
            hint="run with --device cpu (the default), or on a machine with a GPU and a CUDA build of torch",
        )
    count = torch.cuda.device_count()
    if index:
        n = int(index)
    else:
        local = os.environ.get("LOCAL_RANK", "")
        n = int(local) % count if local.isdigit() else 0
    if n >= count:
        raise UsageError(f"--device {spec}: this machine has {count} CUDA device{'s' if count > 1 else ''}")
    return f"cuda:{n}"


@contextlib.contextmanager
def using(spec: str | None) -> Iterator[Assembler | None]:
    """Assemble on ``spec`` (a :func:`resolve`-d name; None or ``cpu``: numpy) inside the block."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = None if spec is None or spec == "cpu" else Assembler(spec)
    try:
        yield _ACTIVE
    finally:
        if _ACTIVE is not None:
            _ACTIVE.close()
        _ACTIVE = previous


def start(spec: str | None) -> None:
    """Assemble on ``spec`` from now on, for the life of this process (a worker process)."""
    global _ACTIVE
    _ACTIVE = None if spec is None or spec == "cpu" else Assembler(spec)


def host_empty(n: int) -> np.ndarray:
    """At least ``n`` bytes of host memory for a writer to fill and save from: pinned when a GPU
    assembles (see :meth:`Assembler.host_empty`), plain otherwise."""
    return np.empty(n, dtype=np.uint8) if _ACTIVE is None else _ACTIVE.host_empty(n)


def describe(spec: str) -> str:
    """What ``spec`` is, for the plan's notes."""
    if not spec.startswith("cuda"):
        return spec
    import torch

    return f"{spec} ({torch.cuda.get_device_name(torch.device(spec))})"


class Assembler:
    """Assembles boxes of logical tensors on one torch device (see the module's description)."""

    def __init__(self, spec: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cpu" if spec == "torch-cpu" else spec)
        self.cuda = self.device.type == "cuda"
        self.lock = threading.Lock()
        self._host: list[Any] = [None, None]
        """the pinned staging buffers pieces are read into (torch uint8 tensors)"""
        self._staged: list[Any] = [None, None]
        """their twins on the device"""
        self._out: Any = None
        """the device buffer the tensor is built in"""
        self._done: list[Any] = [None, None]
        """per slot: its copy to the device is done and its values placed (both its buffers may be
        used again)"""
        self._finished: Any = None
        """the tensor's copy back to the host is done"""
        self._slot = 0
        if self.cuda:
            # one stream, the device's default: its copies and cuts run in order, each asynchronous
            # to this thread, which reads the next piece meanwhile (switching streams per copy costs
            # more, in torch's Python, than the overlap of a copy and a cut gains). The work runs
            # under _on_device(): the caller's current device is left as it is.
            self._done = [torch.cuda.Event(), torch.cuda.Event()]
            self._finished = torch.cuda.Event()
        self.moved = 0
        """bytes copied to the device so far"""

    # -- buffers -----------------------------------------------------------------------------

    def host_empty(self, n: int) -> np.ndarray:
        """At least ``n`` bytes of host memory: on a GPU from ``PIN_MIN`` up, the whole pinned block
        torch's allocator gives for them (:func:`pinned`), so that the values cross at the bus's
        speed; pinned memory no buffer holds any more is handed back first (:meth:`trim`)."""
        if not self.cuda or n < PIN_MIN:
            return np.empty(n, dtype=np.uint8)
        self.trim()
        # the array keeps the pinned tensor alive (torch makes it the array's base)
        return self.torch.empty(pinned(n), dtype=self.torch.uint8, pin_memory=True).numpy()

    def _grown(self, buf: Any, n: int) -> Any:
        """The device buffer ``buf``, or one of exactly ``n`` bytes when it is smaller."""
        if buf is not None and buf.numel() >= n:
            return buf
        return self.torch.empty(n, dtype=self.torch.uint8, device=self.device)

    def trim(self) -> None:
        """Hand back the pinned host memory no buffer holds any more: torch's pinned allocator keeps
        freed blocks for reuse, which would leave every outgrown buffer locked in RAM."""
        if not self.cuda:
            return
        torch = self.torch
        accelerator = getattr(torch, "accelerator", None)
        empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()

    def close(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        self._host = [None, None]
        self._staged = [None, None]
        self._out = None
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.trim()

    # -- assembling ---------------------------------------------------------------------------

    def assemble(self, reader: Any, item: Any, out: np.ndarray, box: Box | None) -> bool:
        """Fill ``out`` (C-contiguous, shaped like ``box``) with the values of ``item`` inside
        ``box`` (default: all of it), assembled on the device. False, having done nothing, when
        the dtype's width has no integer type to carry it."""
        torch = self.torch
        width = out.dtype.itemsize
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if width not in ints or not out.flags.c_contiguous:
            return False
        target = box or Box.whole(item.shape)
        if target.volume == 0:
            return True
        with self.lock, self._on_device():
            try:
                self._out = self._grown(self._out, target.volume * width)
                whole = self._out[: target.volume * width].view(ints[width]).reshape(target.sizes)
                for piece in item.pieces:
                    if piece.replica == 0:
                        self._place(reader, piece, item, target, whole, width, ints[width])
                host = torch.from_numpy(out.reshape(-1).view(np.uint8))
                host.copy_(self._out[: target.volume * width], non_blocking=self.cuda)
            finally:  # done, or failed: nothing may still be copying from or into the buffers
                if self.cuda:
                    self._finished.record()
                    self._finished.synchronize()
        return True

    def _place(self, reader: Any, piece: Any, item: Any, target: Box, whole: Any, width: int, dtype: Any) -> None:
        """Read what ``target`` needs of ``piece`` and place it in ``whole`` (the device tensor
        shaped like ``target``)."""
        from ckpttool.assemble import part_offset, regions

        if piece.flat is None:
            common = intersect(piece.box, target)
            if common is None:
                return
            # only the part needed, when it is contiguous in the stored piece; else all of it
            offset = part_offset(reader, piece, item, common, width)
            if offset is not None:
                file = reader.files.get(piece.file)
                staged = self._stage(common.volume * width, lambda buf: file.read_into(offset, buf.data))
                placements = [(common, common, 0)]
            else:
                staged = self._stage(piece.box.volume * width, lambda buf: self._read(reader, piece, item, buf))
                placements = [(common, piece.box, 0)]
        else:
            parts = regions(piece)
            if not any(intersect(b, target) for b in parts):
                return
            staged = self._stage(piece.flat[1] * width, lambda buf: self._read(reader, piece, item, buf))
            placements, pos = [], 0
            for region in parts:
                common = intersect(region, target)
                if common is not None:
                    placements.append((common, region, pos))
                pos += region.volume
        slot, n = staged
        values = self._staged[slot][:n].view(dtype)
        for common, region, pos in placements:
            src = values[pos : pos + region.volume].reshape(region.sizes)
            whole[common.slices(relative_to=target)] = src[common.slices(relative_to=region)]
        if self.cuda:
            self._done[slot].record()

    @staticmethod
    def _read(reader: Any, piece: Any, item: Any, buf: np.ndarray) -> None:
        from ckpttool.dtypes import carrier

        shape = piece.box.sizes if piece.flat is None else (piece.flat[1],)
        reader.read(piece, item, out=buf.view(carrier(item.dtype)).reshape(shape))

    def _stage(self, n: int, read: Any) -> tuple[int, int]:
        """Read ``n`` bytes (``read(host_buffer)``) into the next pinned slot and start their copy to
        the device; returns (slot, n). The slot's last use (its copy across and its values
        placed) must be done before it is read into again."""
        torch = self.torch
        slot = self._slot
        self._slot ^= 1
        if self.cuda:
            self._done[slot].synchronize()
        if self._host[slot] is None or self._host[slot].numel() < n:
            # grown a whole pinned block at a time, the outgrown one handed back first (no longer in
            # use: waited for above)
            self._host[slot] = self._staged[slot] = None
            self._host[slot] = torch.from_numpy(self.host_empty(n))
            self._staged[slot] = torch.empty(self._host[slot].numel(), dtype=torch.uint8, device=self.device)
        read(self._host[slot][:n].numpy())
        self._staged[slot][:n].copy_(self._host[slot][:n], non_blocking=self.cuda)
        self.moved += n
        return slot, n

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        return self.torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()


__all__ = [
    "CUDA_OVERHEAD",
    "PIN_MIN",
    "Assembler",
    "active",
    "describe",
    "host_empty",
    "pinned",
    "resolve",
    "start",
    "using",
]
