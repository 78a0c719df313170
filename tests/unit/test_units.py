from __future__ import annotations

import pytest

from distorefs.errors import ConfigError
from distorefs.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64 kib", 65536),
        ("4G", 4 * 10**9),
        ("4GB", 4 * 10**9),
        ("4Gi", 4 * 2**30),
        ("2Mi", 2 * 2**20),
    ],  # fmt: skip
)
def test_parse_size_accepts_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_names_an_unknown_unit() -> None:
    with pytest.raises(ConfigError, match=r"^unknown size unit 'XB' in '5XB'"):
        parse_size("5XB")


def test_parse_size_rejects_text_that_is_no_size() -> None:
    with pytest.raises(ConfigError, match=r"^not a size: 'lots'"):
        parse_size("lots")


def test_format_size_uses_binary_units() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30 // 2) == "1.5 GiB"
