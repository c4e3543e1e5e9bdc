"""torch.save archives rewritten with one member changed (for the hostile corpus and the fuzzers)."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable


def replace_member(archive: bytes, suffix: str, change: Callable[[bytes], bytes]) -> bytes:
    """``archive`` with its one member ending in ``suffix`` replaced by ``change(member)``; every
    member stored, as torch writes them, with a fixed timestamp so the result is reproducible."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        members = [(info.filename, z.read(info)) for info in z.infolist()]
    hit = [n for n, _ in members if n.endswith(suffix)]
    assert len(hit) == 1, (suffix, hit)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, body in members:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            z.writestr(info, change(body) if name == hit[0] else body)
    return buf.getvalue()
