"""Run by test_reshard_dist under torchrun: the ckpttool CLI, each argument written ``A|B`` given
as ``A`` on rank 0 and ``B`` on rank 1, to test that ranks given different reshards are refused."""

from __future__ import annotations

import os
import sys

from ckpttool.cli import main

rank = int(os.environ.get("RANK", "0"))
sys.argv = ["ckpttool", *(a.split("|")[rank] if "|" in a else a for a in sys.argv[1:])]
main()
