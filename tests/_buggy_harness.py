"""Harnesses with the bugs rehearse must catch (used by tests/test_rehearse.py; a class is its own
factory: ``--harness tests._buggy_harness:NanLater``)."""

from __future__ import annotations

import random

import torch

from ckpttool.harness.tinygpt import TinyGPTHarness


class ForgetsRng(TinyGPTHarness):
    """Claims to restore the RNG but leaves the fresh process's generator in place."""

    def restore(self, path: str) -> dict[str, bool]:
        state = torch.get_rng_state()
        restored = super().restore(path)
        torch.set_rng_state(state)
        return restored


class HiddenStream(TinyGPTHarness):
    """Restores everything it reports, but each run draws from an unseeded extra stream."""

    def step(self) -> float:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(random.random() * 1e-6)
                break
        return super().step()


class LoaderSkips(TinyGPTHarness):
    """Restores the dataloader one batch late, and its digest looks right (it reports the state
    from the checkpoint); only forcing the dataloader state fixes replay."""

    def restore(self, path: str) -> dict[str, bool]:
        restored = super().restore(path)
        self._reported = self.loader.state_dict()
        self.loader.cursor += 16
        return restored

    def digests(self) -> dict[str, str]:
        d = super().digests()
        if getattr(self, "_reported", None) is not None:
            from ckpttool.harness.tinygpt import _json_digest

            d["dataloader"] = _json_digest(self._reported)
            self._reported = None
        return d


def forgets_rng() -> ForgetsRng:
    return ForgetsRng()


def hidden_stream() -> HiddenStream:
    return HiddenStream()


def loader_skips() -> LoaderSkips:
    return LoaderSkips()


class NanLater(TinyGPTHarness):
    """Its loss is NaN from the second step on (a diverged run), in every run alike."""

    def step(self) -> float:
        loss = super().step()
        self._k = getattr(self, "_k", 0) + 1
        return float("nan") if self._k > 1 else loss


class Chatty(TinyGPTHarness):
    """Prints to stdout, bytes that are not UTF-8 among it, and a line at exit (a logger's "run
    finished"), after the result."""

    def step(self) -> float:
        import atexit
        import sys

        sys.stdout.buffer.write(b"\xff\xfe not utf-8\n")
        sys.stdout.flush()
        atexit.register(print, '{"restored": 1}')
        return super().step()


class RestoresNothing(TinyGPTHarness):
    def restore(self, path: str) -> dict[str, bool]:
        super().restore(path)
        return {}


class FailsAtStep2(TinyGPTHarness):
    def step(self) -> float:
        self._k = getattr(self, "_k", 0) + 1
        if self._k == 2:
            raise RuntimeError("out of memory")
        return super().step()


class HangsAtStep2(TinyGPTHarness):
    """Waits for ever in its second step (a collective whose peer died), with a child process of
    its own running (a data loader's worker); writes the child's pid to $HANG_PIDFILE."""

    def step(self) -> float:
        self._k = getattr(self, "_k", 0) + 1
        if self._k == 2:
            import os
            import subprocess
            import sys
            import time

            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.environ["HANG_PIDFILE"], "w") as f:
                f.write(str(child.pid))
            print("waiting for the other ranks", flush=True)
            time.sleep(600)
        return super().step()


class NoisyUpdate(TinyGPTHarness):
    """Replays its losses, but each update adds noise in the last bits (atomics on a GPU): the state
    after a step differs from run to run."""

    def step(self) -> float:
        loss = super().step()
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(random.random() * 1e-12)
                break
        return loss


class LoaderSkipsNoForce(LoaderSkips):
    force = None  # type: ignore[assignment]
