"""Byte sizes as users write them: 16GiB, 512MiB, 1.5e9, 4096."""

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40,
}


def parse_bytes(value) -> int:
    """Returns a byte count from an int or a string such as '16GiB', '512MB', '1.5e9'."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        return parse_bytes(int(value))
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (examples: 4096, '512MiB', '16GiB', '1.5GB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
