"""Run by test_reshard_dist under torchrun: the ckpttool CLI, with rank 1 killed (SIGKILL, as the
OOM killer would) right after writing its share of the output files, to test what rank 0 says."""

from __future__ import annotations

import os
import signal
import sys

from ckpttool import reshard
from ckpttool.cli import main

if os.environ.get("RANK") == "1":
    _write = reshard._FileExec.write_files

    def _write_then_die(self, tmp, indices, workers, progress):
        _write(self, tmp, indices, workers, progress)
        os.kill(os.getpid(), signal.SIGKILL)

    reshard._FileExec.write_files = _write_then_die  # type: ignore[method-assign]

sys.argv = ["ckpttool", *sys.argv[1:]]
main()
