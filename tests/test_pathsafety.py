"""The one path-safety module: names, inside/overlap on whole components, and its two users' refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_service import roots
from ckpt_service.service_errors import InvalidRequest, OutsideRoots
from converters import pathsafety, storage
from converters.config import EngineConfig, use
from converters.errors import FormatError, SourceError


@pytest.mark.parametrize(("name", "why"), [
    ("model.safetensors", None),
    ("sub/shard-00001.bin", None),
    ("../etc/passwd", "has '..', '.' or empty path segments"),
    ("a/./b", "has '..', '.' or empty path segments"),
    ("a//b", "has '..', '.' or empty path segments"),
    ("/etc/passwd", "is an absolute path or a URI"),
    ("s3://bucket/key", "is an absolute path or a URI"),
    ("C:evil", "is an absolute path or a URI"),
    ("\uff0e\uff0e/x", "has '..', '.' or empty path segments"),  # fullwidth dots: '..' once NFKC-normalised
    ("a%2e%2e", "holds percent-escapes"),
    ("a\nb", "holds control characters, lone surrogates or backslashes"),
    ("a\x7fb", "holds control characters, lone surrogates or backslashes"),
    ("a\ud800b", "holds control characters, lone surrogates or backslashes"),
    ("a\\b", "holds control characters, lone surrogates or backslashes"),
])
def test_bad_name(name: str, why: str | None) -> None:
    assert pathsafety.bad_name(name) == why


@pytest.mark.parametrize(("path", "root", "result"), [
    ("/data", "/data", True),
    ("/data/x/y", "/data", True),
    ("/data/x", "/data/", True),
    ("/data-other/x", "/data", False),
    ("/dat", "/data", False),
    ("s3://b/team-a/x", "s3://b/team-a", True),
    ("s3://b/team-ab/x", "s3://b/team-a", False),
    ("s3://c/team-a/x", "s3://b/team-a", False),
])
def test_inside(path: str, root: str, result: bool) -> None:
    assert pathsafety.inside(path, root) is result


@pytest.mark.parametrize(("a", "b", "result"), [
    ("/data/a", "/data/a/out", True),
    ("/data/a/out/", "/data/a", True),
    ("/data/a/", "/data/a", True),
    ("/data/a", "/data/ab", False),
    ("s3://b/src", "s3://b/src/out", True),
    ("s3://b/src", "s3://b/src2", False),
])
def test_overlap(a: str, b: str, result: bool) -> None:
    assert pathsafety.overlap(a, b) is result
    assert pathsafety.overlap(b, a) is result


def test_segments_below() -> None:
    assert pathsafety.segments_below(("a",), ("a", "b")) is True
    assert pathsafety.segments_below(("a", "b"), ("a",)) is False
    assert pathsafety.segments_below(("team-a",), ("team-ab",)) is False


def test_member_refuses_traversal(tmp_path: Path) -> None:
    with pytest.raises(FormatError) as err:
        storage.member(str(tmp_path), "../secret", "index.json")
    assert str(err.value) == ("index.json: names the data file '../secret', which has '..', '.' or empty path "
                              "segments; a checkpoint may only name files inside its own folder, so it was not read")
    assert storage.member(str(tmp_path), "a.bin", "index.json") == os.path.join(str(tmp_path), "a.bin")


def test_confinement_refuses_symlink_escape(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"x")
    (root / "ok.bin").write_bytes(b"ok")
    (root / "link.bin").symlink_to(outside / "secret.bin")
    with use(EngineConfig(read_roots=(str(root),))):
        assert storage.read_all(str(root / "ok.bin")) == b"ok"
        with pytest.raises(SourceError) as err:
            storage.read_all(str(root / "link.bin"))
    assert str(err.value) == (f"{root / 'link.bin'}: resolves outside the storage roots this process may read; "
                              "refusing to read it")


def test_roots_refuse_control_characters_and_escapes(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    allowed = [roots.parse_root(str(tmp_path / "root"))]
    for bad in (f"{tmp_path}/root/a\x01b", f"{tmp_path}/root/a\ud800b", f"{tmp_path}/root/a\\b"):
        with pytest.raises(InvalidRequest, match="control characters or backslashes in the URI"):
            roots.check(bad, allowed, field="source", purpose="read")
    with pytest.raises(OutsideRoots, match=r"'\.\.' path segments are not allowed"):
        roots.check(f"{tmp_path}/root/../outside", allowed, field="source", purpose="read")
    with pytest.raises(OutsideRoots, match="is outside the storage roots this server may read"):
        roots.check(f"{tmp_path}/root/link/x", allowed, field="source", purpose="read")


def test_roots_s3_prefixes() -> None:
    allowed = [roots.parse_root("s3://b/team-a/")]
    assert roots.check("s3://b/team-a/run/1", allowed, field="source", purpose="read") == "s3://b/team-a/run/1"
    with pytest.raises(OutsideRoots):
        roots.check("s3://b/team-ab/x", allowed, field="source", purpose="read")
    assert roots.overlap("s3://b/src", "s3://b/src/out") is True
    assert roots.overlap("s3://b/src", "s3://b/src2") is False
