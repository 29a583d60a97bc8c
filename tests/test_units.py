"""Sizes and storage-root rules, in-process."""

from __future__ import annotations

import pytest

from ckpt_service import roots
from ckpt_service.units import exact, human, parse_size
from converters.errors import OptionError


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 1000**3), ("256MiB", 256 * 1024**2), ("100KB", 100_000),
                                            (" 1.5 GiB ", 3 * 1024**3 // 2), ("7", 7), (42, 42), ("2k", 2048),
                                            ("0", 0)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5 XB", "-1MB", "1e9", "5GB5"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(OptionError, match="5GB, 256MiB"):
        parse_size(text)


def test_exact_and_human() -> None:
    assert [exact(n) for n in (5 * 1000**3, 256 * 1024**2, 1024, 1000, 1500, 0)] == [
        "5GB", "256MiB", "1KiB", "1KB", "1500", "0"]
    assert all(parse_size(exact(n)) == n for n in (5 * 1000**3, 256 * 1024**2, 3 * 1024**4, 12345))
    assert [human(n) for n in (999, 1000, 5 * 1000**3)] == ["999 B", "1.00 KB", "5.00 GB"]


@pytest.mark.parametrize(("a", "b", "overlaps"), [
    ("/data/run", "/data/run/out", True), ("/data/run/step", "/data/run", True), ("/data/run", "/data/run", True),
    ("/data/run", "/data/run2", False), ("/data/run", "/data/other", False),
    ("s3://bucket/run", "s3://bucket/run/export", True), ("s3://bucket/run", "s3://bucket/run-export", False),
    ("s3://bucket/run", "s3://other/run", False), ("s3://bucket/run", "/bucket/run", False)])
def test_overlap(a: str, b: str, overlaps: bool) -> None:
    assert roots.overlap(a, b) is overlaps
    assert roots.overlap(b, a) is overlaps
