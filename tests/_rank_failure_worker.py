"""Run by test_reshard_dist under torchrun: the ckpttool CLI, with rank 1's share of the output
files failing as a damaged source would (CorruptFileError), to test that every rank fails and
nothing is published."""

from __future__ import annotations

import os
import sys

from ckpttool import reshard
from ckpttool.cli import main
from ckpttool.errors import CorruptFileError

if os.environ.get("RANK") == "1":

    def _fail(self, tmp, indices, workers, progress):
        raise CorruptFileError("model_optim_rng.pt: injected failure", hint="restore it", path="model_optim_rng.pt")

    reshard._FileExec.write_files = _fail  # type: ignore[method-assign]

sys.argv = ["ckpttool", *sys.argv[1:]]
main()
