"""Ctrl-C (and SIGTERM) that never lands inside the standard library's lock handling.

Python raises ``KeyboardInterrupt`` in the main thread wherever it happens to be, and some of those
places leave a lock held: ``Condition.__enter__`` is Python code, so an interrupt right after the
lock underneath was taken escapes the ``with`` before it begins and nothing releases it. When the
main thread was queuing work for a thread pool (``ThreadPoolExecutor.submit`` checks its idle
semaphore, ``queue.Queue.put`` holds the queue's mutex), its workers then block on that lock for
ever, and the pool's shutdown, which waits for them, never returns: a command Ctrl-C'd in the first
milliseconds of its write hung instead of exiting 130 (seen once in about 40 tries of ``compress``).

:func:`install` replaces the interpreter's SIGINT handler by one that raises the same
``KeyboardInterrupt`` (and SIGTERM's default action by :class:`Terminated`, one of those), except
while the main thread runs inside ``threading``, ``queue`` or ``concurrent.futures``, or in a
weak-reference callback (whose exceptions Python prints and drops, Ctrl-C with them): there it
defers, and a timer asks again a few milliseconds later, by when that code has returned into the
caller's. Blocking waits (``Condition.wait`` waiting for its waiter lock, ``Thread.join``) are the
exception: the standard library releases or restores its locks when those are interrupted, and
deferring there would make Ctrl-C wait for the work being waited on."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

RETRY_S = 0.002
"""How soon a deferred Ctrl-C is asked again."""


def _where(module: str) -> str:
    """The source path a module's frames carry: its file, or its folder for a package."""
    file = str(importlib.import_module(module).__file__)
    return os.path.dirname(file) + os.sep if file.endswith("__init__.py") else file


_LOCK_CODE = tuple(
    _where(m)
    for m in (
        "threading",
        "queue",
        "concurrent.futures",  # (the package: _base, thread, process)
        # weak-reference callbacks, run wherever the collector happens to run: an exception
        # raised there is printed and dropped ("Exception ignored in"), and Ctrl-C lost with it
        "weakref",
        "_weakrefset",
    )
)


def _waiting_lines(fn: Any, *needles: str) -> frozenset[int]:
    """The line numbers of ``fn`` that block in a lock's ``acquire`` (or a thread handle's join)
    whose interruption the standard library cleans up after; none where its source is missing."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(first + i for i, text in enumerate(lines) if any(n in text for n in needles))


_WAITS: dict[Any, frozenset[int]] = {
    code: lines
    for code, lines in (
        (threading.Condition.wait.__code__, _waiting_lines(threading.Condition.wait, "waiter.acquire(")),
        *(
            (fn.__code__, _waiting_lines(fn, "lock.acquire(", "_handle.join("))
            for fn in (getattr(threading.Thread, "_wait_for_tstate_lock", None), threading.Thread.join)
            if fn is not None
        ),
    )
    if lines
}


def _unsafe(frame: FrameType | None) -> bool:
    """Whether raising in ``frame`` (the main thread's innermost) could leave a lock held."""
    if frame is None or not frame.f_code.co_filename.startswith(_LOCK_CODE):
        return False
    return frame.f_lineno not in _WAITS.get(frame.f_code, ())


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler ending or preempting the job, ``kill``): handled as Ctrl-C is, outputs
    in flight removed on the way out, and the command exits 143."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum in (signal.SIGINT, signal.SIGTERM) and _state["pending"] != signal.SIGTERM:
        _state["pending"] = signum  # (a SIGTERM is not turned back into a Ctrl-C by a later one)
    if not _state["pending"]:
        return  # an alarm ckpttool did not ask for
    if _state["held"]:
        return  # raised as the held block ends
    if _disarming(frame):
        return  # the command has ended: ignored, as from the end of disarm() on
    if _unsafe(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    _raise_pending()


def _disarming(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside :func:`disarm` (the signal arrived as it began, before it had
    set SIGINT aside: Python checks for signals as a function starts). Raised there, the interrupt
    replaced the command's chosen exit status by a traceback and exit 1, after its output was
    published."""
    while frame is not None:
        if frame.f_code is disarm.__code__:
            return True
        frame = frame.f_back
    return False


_state = {"pending": 0, "held": 0}
"""The signal waiting to be raised, 0 for none; how many :func:`held` blocks are running."""


def _raise_pending() -> None:
    pending, _state["pending"] = _state["pending"], 0
    if pending:
        raise Terminated if pending == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait while the block runs and are raised as it ends, for a step that must
    not stop halfway: a worker process started but not yet sent its instructions reads an empty
    pipe and prints a traceback of its own (a signal mask cannot do this: it holds back delivery to
    one thread, and a signal another thread takes is still raised in the main one). In the main
    thread only (elsewhere none is raised); where Python's own SIGINT handler is in place (ckpttool
    used as a library) it is swapped for the block's span."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    borrowed = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if borrowed:
        signal.signal(signal.SIGINT, _on_signal)
    _state["held"] += 1
    try:
        yield
    finally:
        try:
            if borrowed:  # (first: a Ctrl-C taken meanwhile is still held, and raised below)
                signal.signal(signal.SIGINT, signal.default_int_handler)
        finally:
            _state["held"] -= 1
        if not _state["held"]:
            _raise_pending()


def install() -> bool:
    """Take over SIGINT and SIGTERM (and SIGALRM, for the retry) in a command's process; returns
    whether it took either. Left alone off the main thread and where SIGALRM is taken. SIGINT is
    taken where it is Python's default handler (not where it is ignored, as in a background job
    of a script, or someone else's); SIGTERM where it has its default action, which kills the
    process without a word and leaves its temporary outputs for the next run to sweep (a
    background job's ``kill`` did, when SIGTERM was left alone with SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        return False
    take_int = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    take_term = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    if not take_int and not take_term:
        return False
    signal.signal(signal.SIGALRM, _on_signal)
    if take_int:
        signal.signal(signal.SIGINT, _on_signal)
    if take_term:
        signal.signal(signal.SIGTERM, _on_signal)
    atexit.register(disarm)
    return True


def disarm() -> None:
    """Once the command has ended (called then, and again at exit, after the interpreter has joined
    its threads): no retry left to fire, and no signal raised from here on. A SIGTERM that
    torchrun sends as the job ends, arriving while torch's own exit callbacks ran, was raised in
    one of them and printed as "Exception ignored in atexit callback" with a traceback. The
    interpreter's teardown puts SIGALRM's default action back, which kills the process: a Ctrl-C
    deferred in its last milliseconds (after the command published its output) ended it with
    SIGALRM (-14) instead of its exit status."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    # the command has finished and its exit status is chosen: a Ctrl-C or SIGTERM from here on is
    # ignored, in every thread (a mask would hold only this one's: OpenBLAS's threads took it). The
    # teardown puts the default action back for a handler of Python's, not for an ignored signal,
    # so one arriving in its last tens of milliseconds killed a process that had published its
    # output and said so (exit -2, "killed by SIGINT", where the command's own status was due)
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, signal.SIG_IGN)
    # CPython marks a KeyboardInterrupt that leaves code run from a string (a dataclass's generated
    # __init__ being made at import, when the Ctrl-C lands there) as unhandled, caught or not, and
    # under ``python -m`` then ends the process by SIGINT after its teardown (-2, not the 130 the
    # command chose). Every string evaluation clears that mark first: this one does
    exec("None")
