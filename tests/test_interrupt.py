"""Ctrl-C never lands where the standard library's thread-pool code holds a lock (ckpttool.interrupt).

``compress`` Ctrl-C'd in the first milliseconds of its write once hung for good instead of exiting 130
(CI, session 52): the interrupt escaped ``Condition.__enter__`` with the idle semaphore's lock held,
and the pool's shutdown waited for workers blocked on it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ckpttool import interrupt

ROOT = Path(__file__).resolve().parent.parent


def _frame_of(thread: threading.Thread):
    """The innermost Python frame of ``thread`` once it has blocked."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
        if frame is not None and frame.f_code.co_filename == threading.__file__:
            time.sleep(0.05)  # (blocked, not passing through)
            again = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
            if again is frame and again.f_lineno == frame.f_lineno:
                return frame
        time.sleep(0.01)
    raise AssertionError(f"{thread.name} did not block in threading")


def _ctrl_c_default() -> None:
    """In a child before it runs: SIGINT's default action, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def alarm_quiet():
    """The retry alarm the deferring handler sets, cancelled afterwards."""
    previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    interrupt._state["pending"] = False


def test_an_interrupt_defers_inside_condition_enter_and_raises_in_a_blocking_wait(alarm_quiet):
    """Deterministic: the handler is called with the frames where a thread blocks. Taking a
    Condition's lock (``Condition.__enter__``, where an interrupt would leave it held) defers and
    arms the retry; waiting on a Condition, a queue or a thread's end raises, as those clean up."""
    cond = threading.Condition()
    done = threading.Event()
    cond.acquire()  # the entering thread blocks taking it
    entering = threading.Thread(target=lambda: cond.__enter__() and None, name="entering", daemon=True)
    waiting = threading.Thread(target=lambda: done.wait(), name="waiting", daemon=True)
    joining = threading.Thread(target=lambda: waiting.join(), name="joining", daemon=True)
    for t in (entering, waiting, joining):
        t.start()
    try:
        f_enter, f_wait, f_join = (_frame_of(t) for t in (entering, waiting, joining))
        assert f_enter.f_code.co_name == "__enter__"

        interrupt._on_signal(signal.SIGINT, f_enter)  # deferred: no exception
        assert interrupt._state["pending"]
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= interrupt.RETRY_S
        interrupt._on_signal(signal.SIGALRM, f_enter)  # still there: deferred again
        with pytest.raises(KeyboardInterrupt):
            interrupt._on_signal(signal.SIGALRM, sys._getframe())  # out in the caller's code
        assert not interrupt._state["pending"]
        interrupt._on_signal(signal.SIGALRM, sys._getframe())  # an alarm with nothing pending: nothing

        for frame in (f_wait, f_join):
            with pytest.raises(KeyboardInterrupt):
                interrupt._on_signal(signal.SIGINT, frame)
    finally:
        cond.release()
        done.set()
        for t in (entering, waiting, joining):
            t.join(5)


def test_sigterm_raises_terminated_and_is_not_turned_back_into_ctrl_c(alarm_quiet):
    """SIGTERM raises ``Terminated`` (a KeyboardInterrupt: every cleanup path takes it as Ctrl-C;
    the CLI exits 143 with 'terminated'); a Ctrl-C arriving while it waits does not replace it."""
    here = sys._getframe()
    with pytest.raises(interrupt.Terminated):
        interrupt._on_signal(signal.SIGTERM, here)
    cond = threading.Condition()
    cond.acquire()
    entering = threading.Thread(target=lambda: cond.__enter__() and None, daemon=True)
    entering.start()
    try:
        inside = _frame_of(entering)
        interrupt._on_signal(signal.SIGTERM, inside)  # deferred
        interrupt._on_signal(signal.SIGINT, inside)  # deferred, still a SIGTERM
        with pytest.raises(interrupt.Terminated):
            interrupt._on_signal(signal.SIGALRM, here)
    finally:
        cond.release()
        entering.join(5)


CHILD = textwrap.dedent(
    """
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from ckpttool import interrupt

    assert interrupt.install()
    try:  # (the signal may land while print returns, once the parent has read the line)
        print("ready", flush=True)
        while True:  # a pool started, fed and shut down over and over: Ctrl-C lands anywhere in it
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(abs, range(64)))
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


def test_ctrl_c_anywhere_in_a_busy_thread_pool_exits(tmp_path):
    """End to end: SIGINT at random moments of a loop that starts, feeds and shuts down thread pools
    (without the handler, 3 in 200 hung for ever or lost the
    interrupt in a weak-reference callback); each must exit 130 within seconds."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(20261124)
    codes: Counter[int | str] = Counter()
    for _ in range(40):
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_ctrl_c_default,
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
            codes[proc.returncode] += 1
            assert b"Traceback" not in err, err.decode()[-2000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            codes["hung"] += 1
    assert codes == {130: 40}, dict(codes)


def test_install_leaves_an_ignored_sigint_alone_and_still_takes_sigterm():
    """A background job's ignored SIGINT stays ignored. Its SIGTERM is still taken: it was left at
    its default action with SIGINT, so ``kill`` of a background ``delta apply`` exited 143 without
    a word and left its temporary directory behind."""
    code = textwrap.dedent(
        """
        import os, signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from ckpttool import interrupt
        print(interrupt.install(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):
                pass
        except interrupt.Terminated:
            print("terminated")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "terminated"], out
    both = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    out = subprocess.run(
        [sys.executable, "-c", both + "from ckpttool import interrupt; print(interrupt.install())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False"  # (nothing of ours to take)


def test_no_retry_outlives_the_command():
    """A Ctrl-C deferred in a command's last milliseconds (after it published its output) left its
    retry alarm armed; the interpreter's teardown puts SIGALRM's default action back, and the alarm
    then killed the process (exit -14 in CI, delta apply). At exit the retry is cancelled: here an
    exit handler that runs after ckpttool's finds no alarm (it would raise in it, or kill)."""
    code = textwrap.dedent(
        """
        import atexit, signal, time
        atexit.register(time.sleep, 0.5)  # (runs after ckpttool's: exit handlers run last first)
        from ckpttool import interrupt
        assert interrupt.install()
        interrupt._state["pending"] = signal.SIGINT  # as a deferral leaves it
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=_ctrl_c_default,  # (a background job's ignored SIGINT would leave install() off)
    )
    assert (out.returncode, out.stderr) == (0, "")


def test_a_ctrl_c_after_the_command_finished_leaves_its_exit_status():
    """A Ctrl-C in the interpreter's teardown (after the command published and said so) killed the
    process by SIGINT (exit -2: the session-54 flake of the crash-safety test, reproduced by sending
    SIGINT 0.22-0.27 s into an inspect of 0.25 s). Once the command is done, both signals stay
    ignored (a mask, the first fix, held for the main thread only: another thread took them): here
    a handler that runs after ckpttool's sends both, and the status is the command's."""
    code = textwrap.dedent(
        """
        import atexit, os, signal, sys, threading, time

        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()  # (a thread the kernel may pick)

        def late():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)

        atexit.register(late)  # (runs after ckpttool's: exit handlers run last first)
        sys.argv = ["ckpttool", "inspect", "fixtures/dcp/fsdp2"]
        from ckpttool.cli import main
        main()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        preexec_fn=_ctrl_c_default,
    )  # fmt: skip
    assert (out.returncode, out.stderr) == (0, ""), out.stderr[-500:]
    assert "dcp checkpoint" in out.stdout


def test_a_ctrl_c_as_disarm_begins_leaves_the_exit_status():
    """A Ctrl-C landing as ``disarm`` began (Python checks for signals as a function starts, and
    ``disarm`` had not yet set SIGINT aside) was raised out of the cli's ``finally``: a traceback
    and exit 1 after the seal was published (the crash-safety test in CI, session 72). Here the
    signal is delivered inside ``disarm``'s first call and inside the ``signal.signal`` it calls,
    the two places the CI traces showed, and the status stays the command's."""
    code = textwrap.dedent(
        """
        import os, signal, sys
        from ckpttool import interrupt
        real_setitimer, real_signal = signal.setitimer, signal.signal
        sent = []

        def send_once(fn):
            def wrapped(*args):
                if not sent:
                    sent.append(fn.__name__)
                    interrupt._on_signal(signal.SIGINT, sys._getframe())
                return fn(*args)
            return wrapped

        which = sys.argv[1]
        assert interrupt.install()
        if which == "setitimer":
            signal.setitimer = send_once(real_setitimer)
        else:
            signal.signal = send_once(real_signal)
        interrupt.disarm()
        assert sent == [which], sent
        os.kill(os.getpid(), signal.SIGINT)  # (ignored from here on)
        print("ended")
        """
    )
    for which in ("setitimer", "signal"):
        out = subprocess.run(
            [sys.executable, "-c", code, which], cwd=ROOT, capture_output=True, text=True, timeout=60,
            preexec_fn=_ctrl_c_default,
        )  # fmt: skip
        assert (out.returncode, out.stdout, out.stderr) == (0, "ended\n", ""), (which, out.stderr[-500:])


def test_a_ctrl_c_caught_after_leaving_a_string_exec_still_exits_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves code run from a string (exec, as dataclasses
    and namedtuples make their methods at import) as unhandled even when caught, and under
    ``python -m`` kills the process by SIGINT after its teardown: ``python -m ckpttool`` Ctrl-C'd
    0.14-0.19 s in exited -2 about one time in four (the session-54 flake). The exit handler clears
    the mark."""
    (tmp_path / "probe.py").write_text(
        "import sys, threading, time\nfrom ckpttool import interrupt\nassert interrupt.install()\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"  # (a thread the kill may reach)
        "try:\n    exec('raise KeyboardInterrupt')\nexcept KeyboardInterrupt:\n    sys.exit(130)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "probe"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        preexec_fn=_ctrl_c_default,
    )  # fmt: skip
    assert (out.returncode, out.stderr) == (130, ""), out


def test_a_ctrl_c_while_the_command_line_loads_is_one_word_and_130():
    """Ctrl-C in the 0.1-0.3 s the command spends importing numpy, typer and rich, before it takes
    SIGINT over, printed a KeyboardInterrupt traceback from inside some import. The package takes
    SIGINT while it loads when the process is the ckpttool command: here the Ctrl-C arrives right
    after the package is imported, as the rest loads. A program importing ckpttool as a library
    keeps Python's handler."""
    code = textwrap.dedent(
        """
        import os, signal, sys
        sys.argv = ["-m", "inspect", "fixtures/dcp/fsdp2"]  # (as python -m ckpttool has it while it loads)
        sys.orig_argv = [sys.executable, "-m", "ckpttool", "inspect", "fixtures/dcp/fsdp2"]
        import ckpttool
        os.kill(os.getpid(), signal.SIGINT)
        import ckpttool.cli
        print("went on")
        """
    )
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=_ctrl_c_default)
    out = subprocess.run([sys.executable, "-c", code], **run)  # type: ignore[call-overload]
    assert (out.returncode, out.stderr, out.stdout) == (130, "interrupted\n", ""), out.stderr[-500:]
    library = "import signal, ckpttool; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = subprocess.run([sys.executable, "-c", library], **run)  # type: ignore[call-overload]
    assert out.stdout.strip() == "True", out.stderr
    # a module of it run as a program (a rehearsal's worker, running the user's harness) keeps it too
    worker = (
        "import signal, sys\nsys.argv = ['-m']\nsys.orig_argv = [sys.executable, '-m', 'ckpttool.rehearse', 'worker']\n"
        "import ckpttool\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    out = subprocess.run([sys.executable, "-c", worker], **run)  # type: ignore[call-overload]
    assert out.stdout.strip() == "True", out.stderr
    # and the real command, Ctrl-C'd at moments through its imports: after the interpreter's own
    # start (site and its .pth files, about 40 ms, Python's), never a traceback
    codes: Counter[int] = Counter()
    for delay in (0.08, 0.1, 0.12, 0.15, 0.2):
        p = subprocess.Popen(
            [sys.executable, "-m", "ckpttool", "inspect", "fixtures/dcp/fsdp2"], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_ctrl_c_default,
        )  # fmt: skip
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1].decode()
        codes[p.returncode] += 1
        assert "Traceback" not in err or "<frozen site>" in err, err[-800:]
        assert p.returncode in (0, 130), (delay, p.returncode, err[-300:])


def test_a_ctrl_c_while_reshard_starts_its_workers_is_not_lost(tmp_path, monkeypatch):
    """reshard's workers start with Ctrl-C and SIGTERM ignored (this process alone stops them); a
    Ctrl-C in that window was dropped with them, and the reshard ran on to the end. It now waits,
    blocked, and lands once the workers have started: the pool is stopped and nothing is
    published; the handlers and the signal mask are as they were."""
    from ckpttool import reshard
    from ckpttool.reshard import Target
    from tests.conftest import FIXTURES

    class Signalled(reshard.ProcessPoolExecutor):  # type: ignore[misc]
        def submit(self, *args, **kwargs):  # the SIGINT comes while the first worker starts
            if not hasattr(self, "_sent"):
                self._sent = True
                signal.raise_signal(signal.SIGINT)
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(reshard, "ProcessPoolExecutor", Signalled)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in a background job)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    out = tmp_path / "out"
    try:
        with pytest.raises(KeyboardInterrupt):
            reshard.reshard(FIXTURES / "megatron" / "legacy_tp2pp2", out, Target(tp=1, pp=2), workers=2)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not out.exists() and not [p.name for p in tmp_path.iterdir()]


_SIGNALLED_RESHARD = """
import os, signal, sys, threading
from ckpttool import reshard
from ckpttool.cli import main

real = reshard.ProcessPoolExecutor.submit
sent = [getattr(signal, name) for name in sys.argv[1].split(",")]

def submit(self, *args, **kwargs):  # the signals come, to the whole process, as the first worker starts
    if not getattr(self, "_sent", False):
        self._sent = True
        for sig in sent:
            os.kill(os.getpid(), sig)
    return real(self, *args, **kwargs)

reshard.ProcessPoolExecutor.submit = submit
threading.Thread(target=threading.Event().wait, daemon=True).start()  # (as a progress bar's refresh thread)
sys.argv = ["ckpttool", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize(("signals", "codes"), [("SIGINT", {130}), ("SIGINT,SIGTERM", {130, 143})])
def test_signals_while_reshard_starts_its_workers_stop_it_with_another_thread_running(signals, codes, tmp_path):
    """The same through the command, with a second thread in the process (rich's progress bar has
    one on a terminal): a Ctrl-C sent to the process while the workers start was taken by that
    thread, ignored, and lost while the signals were ignored rather than held back; a Ctrl-C and a
    SIGTERM together cut the stopping of the workers short (the second one raised inside it), and
    workers left writing into the temporary output. Each run now ends with 130 (143), every worker
    gone and nothing beside the destination."""
    from tests.conftest import FIXTURES, cli_env

    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_RESHARD, signals, "reshard", str(FIXTURES / "megatron" / "legacy_tp2pp2"),
         "-o", str(out), "--tp", "1", "--pp", "2", "--workers", "2"],
        capture_output=True, text=True, timeout=120, preexec_fn=_ctrl_c_default, env=cli_env(),
    )  # fmt: skip
    assert r.returncode in codes and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    time.sleep(0.5)  # (a worker left running would write on into the temporary output)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [], list(tmp_path.iterdir())


_CTRL_C_AS_A_WORKER_SPAWNS = """
import os, signal, sys, threading
from multiprocessing import util
from ckpttool.cli import main

real = util.spawnv_passfds

def spawnv_passfds(*args, **kwargs):  # the Ctrl-C comes once the first worker runs, before its instructions are sent
    pid = real(*args, **kwargs)
    if "spawn_main" in str(args) and not getattr(util, "_sent", False):  # (not the resource tracker)
        util._sent = True
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**7):  # (another thread takes it; the main thread raises at a check in here)
            pass
    return pid

util.spawnv_passfds = spawnv_passfds
threading.Thread(target=threading.Event().wait, daemon=True).start()  # (a thread the signal is delivered to)
sys.argv = ["ckpttool", *sys.argv[1:]]
main()
"""


def test_a_ctrl_c_between_a_workers_start_and_its_instructions_waits_for_them(tmp_path):
    """A Ctrl-C taken by another thread while the main thread started a worker was raised between
    the worker's start and the write of its instructions (signal masks hold a thread's delivery,
    not where Python raises): the worker read an empty pipe and printed an EOFError traceback
    under "interrupted" (CI, once). Starting the workers now holds Ctrl-C and SIGTERM back until
    every one has what it needs; the command then stops them and exits 130 without a traceback."""
    from tests.conftest import FIXTURES, cli_env

    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AS_A_WORKER_SPAWNS, "reshard", str(FIXTURES / "megatron" / "legacy_tp2pp2"),
         "-o", str(out), "--tp", "1", "--pp", "2", "--workers", "2"],
        capture_output=True, text=True, timeout=120, preexec_fn=_ctrl_c_default, env=cli_env(),
    )  # fmt: skip
    assert r.returncode == 130 and r.stderr.strip() == "interrupted", (r.returncode, r.stderr)
    time.sleep(0.5)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [], list(tmp_path.iterdir())


def test_held_raises_a_ctrl_c_as_its_block_ends_and_puts_the_handler_back():
    """Used as a library (Python's own SIGINT handler in place), the held block runs to its end and
    the Ctrl-C it held is raised there, once; the handler is Python's again afterwards."""
    from ckpttool import interrupt

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ran = []
    try:
        with pytest.raises(KeyboardInterrupt), interrupt.held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            ran.append("rest of the block")
        assert ran == ["rest of the block"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupt.held():
            ran.append("a block with none")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ran == ["rest of the block", "a block with none"]
