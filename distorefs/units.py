"""Parsing and printing of byte sizes such as `512MiB` and `4GiB`."""

from __future__ import annotations

import re

from distorefs.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
SIZE_RULE = "K, KB, M, MB, G, GB, T, TB are powers of 1000; Ki, KiB, Mi, MiB, Gi, GiB, Ti, TiB powers of 1024"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Return the number of bytes in `text` (`4096`, `512MiB`, `4GiB`, `1.5GB`).

    Raises ConfigError naming the text when the number or the unit is not understood.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 512MiB, 4GiB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"unknown size unit {unit!r} in {text!r} ({SIZE_RULE})")
    return int(float(number) * factor)


def format_size(size_bytes: int) -> str:
    """Return `size_bytes` in binary units with one decimal: `1.5 GiB`."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
