"""Quantities with units in profiles: byte sizes ("32GiB") and durations ("10m").

Self-contained on purpose: the config layer must not import torch or the engine to read a profile.
TOML has no null, so the optional quantities take a word instead ("none" for a size, "never" for a time).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               # "32G" is what `free -g` and llama.cpp's flags say; read it the way they do (powers of 1024).
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_BINARY = [("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]


def _number_and_unit(text: str, what: str, example: str) -> tuple[Decimal, str]:
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as {what}: write a number with an optional unit, e.g. {example}")
    try:
        return Decimal(match.group(1)), match.group(2).lower()
    except InvalidOperation:
        raise ValueError(f"cannot read {text!r} as {what}") from None


def parse_size(value: object) -> int:
    """Bytes from 4096, "4096", "512MiB", "1.5GB", "32G". Binary units KiB/MiB/GiB/TiB (and K/M/G/T) are powers
    of 1024, KB/MB/GB/TB powers of 1000, any case. Fractions of a byte are dropped."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"a size is a number of bytes or a string like '32GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a size is a finite number of bytes, at least 0; got {value}")
        return int(value)
    number, unit = _number_and_unit(value, "a size", "'32GiB', '512MiB', '1.5GB' or '4096' (bytes)")
    scale = _SIZE_UNITS.get(unit)
    if scale is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}: use B, KiB, MiB, GiB, TiB (powers of 1024) "
                         f"or KB, MB, GB, TB (powers of 1000)")
    return int(number * scale)


def parse_optional_size(value: object) -> int | None:
    """A device's size or cap, or None for none given: "none" (TOML has no null) or a Python None from code. Zero
    is refused: no device holds nothing, and a cap of 0 would fit nothing (say "none" for no cap)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    size = parse_size(value)
    if size == 0:
        raise ValueError("must be more than 0 bytes (or 'none')")
    return size


def parse_seconds(value: object) -> float | None:
    """Seconds from 90, 1.5, "90s", "10m", "2h"; None for "never" (or None). Zero or less is refused:
    a timeout of zero would fail everything, so "never" must be said in words."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "never"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"a duration is seconds or a string like '10m', or 'never'; got {value!r}")
    if isinstance(value, str):
        number, unit = _number_and_unit(value, "a duration", "90, '90s', '10m', '2h' or 'never'")
        scale = _TIME_UNITS.get(unit)
        if scale is None:
            raise ValueError(f"unknown time unit {unit!r} in {value!r}: use s, m or h (or 'never')")
        value = float(number * scale)
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"a duration must be more than 0 seconds (write 'never' to turn it off), got {value}")
    return float(value)


def parse_positive_seconds(value: object) -> float:
    """Like parse_seconds, for limits that must exist (a connection deadline): 'never' is refused."""
    seconds = parse_seconds(value)
    if seconds is None:
        raise ValueError("this limit cannot be 'never': give seconds or a duration like '30s'")
    return seconds


def format_size(nbytes: int) -> str:
    """The shortest exact binary spelling: 34359738368 -> '32GiB', 1000 -> '1000B'."""
    for unit, scale in _BINARY:
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
