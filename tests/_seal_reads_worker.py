"""Run by test_reshard_dist under torchrun: the ckpttool CLI, with rank 0 writing to ``READ_LOG``
(JSON) the files its seal reads back, to test that it reads none of the other ranks'."""

from __future__ import annotations

import json
import os
import sys

from ckpttool import seal
from ckpttool.cli import main

if os.environ.get("RANK") == "0":
    _hash_files = seal.hash_files
    _read: list[str] = []

    def _logged(root, files, *args, **kwargs):
        _read.extend(files)
        with open(os.environ["READ_LOG"], "w") as fh:
            json.dump(_read, fh)
        return _hash_files(root, files, *args, **kwargs)

    seal.hash_files = _logged  # type: ignore[assignment]

sys.argv = ["ckpttool", *sys.argv[1:]]
main()
