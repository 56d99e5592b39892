"""Memory sizes as people write them (`2GB`, `512MiB`)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes in `text`, e.g. "2GB", "1.5 GiB", "800m"; a clear ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 2GB, 512MiB or 800MB")
    return int(float(match.group(1)) * _UNITS[unit])
