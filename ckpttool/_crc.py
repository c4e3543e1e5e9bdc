"""CRC-32 with the zip polynomial, the checksum of every record in a ``torch.save`` archive.

ISA-L's (``isal``) runs at memory speed on x86-64 and ARM64 (14 GB/s against zlib's 2.3 GB/s on
the machines of ``docs/benchmarks.md``), gives the same values and releases the GIL as zlib's does.
Where it is not installed, zlib's is used.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without isal wheels
    from zlib import crc32

__all__ = ["crc32"]
