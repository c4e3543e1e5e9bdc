"""Harnesses with the bugs rehearse must catch (used by tests/test_rehearse.py)."""

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
