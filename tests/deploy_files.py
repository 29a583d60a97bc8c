"""Readers for the deployment files, for tests/test_deploy.py (no Docker engine runs here).

- `Dockerfile`: the instructions of each stage, as Docker reads them (continuation lines joined, comment
  lines dropped), with ARG defaults, ENV values and exec-form (JSON) commands decoded.
- `DockerIgnore`: which paths of the build context `.dockerignore` keeps out (Docker's rules: the last
  matching pattern wins, `!` re-includes, a pattern matching a folder matches everything below it).
- `interpolate` and `read_env_file`: Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`
  and `${VAR:+alt}` substitution, and the `KEY=VALUE` lines of a `.env` file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Instruction:
    keyword: str
    text: str
    line: int

    def json(self) -> list[str]:
        """An exec-form argument (`["a", "b"]`); shell form is refused: it needs a shell in the image."""
        value = json.loads(self.text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in stage {self.name}, found {len(found)}"
        return found[0]

    def arg_defaults(self) -> dict[str, str]:
        values = {}
        for inst in self.all("ARG"):
            name, _, default = inst.text.partition("=")
            values[name.strip()] = default.strip()
        return values

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The stage's ENV values in order, `$VAR`/`${VAR}` expanded against earlier ones and `base`."""
        values: dict[str, str] = {}
        for inst in self.all("ENV"):
            for token in shlex.split(inst.text):
                name, sep, value = token.partition("=")
                assert sep, f"line {inst.line}: use ENV KEY=VALUE, not the legacy `ENV KEY VALUE` form"
                values[name] = expand(value, {**(base or {}), **values})
        return values

    def workdir(self) -> str:
        found = self.all("WORKDIR")
        return found[-1].text if found else "/"

    def copies(self) -> list[tuple[list[str], str, dict[str, str]]]:
        """Each COPY as (sources, destination, flags such as {"from": "build"})."""
        result = []
        for inst in self.all("COPY"):
            tokens = shlex.split(inst.text)
            flags = dict(t[2:].partition("=")[::2] for t in tokens if t.startswith("--"))
            paths = [t for t in tokens if not t.startswith("--")]
            result.append((paths[:-1], paths[-1], flags))
        return result


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]
    text: str

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        text = path.read_text()
        global_args: dict[str, str] = {}
        stages: list[Stage] = []
        for inst in _instructions(text):
            if inst.keyword == "FROM":
                words = inst.text.split()
                name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
                stages.append(Stage(expand(words[0], global_args), name))
            elif not stages:
                assert inst.keyword == "ARG", f"line {inst.line}: only ARG may come before the first FROM"
                name, _, default = inst.text.partition("=")
                global_args[name.strip()] = default.strip()
            else:
                stages[-1].instructions.append(inst)
        return cls(global_args, stages, text)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def _instructions(text: str) -> Iterator[Instruction]:
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also between continuation lines
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        pending = ""
        yield Instruction(keyword.upper(), rest.strip(), start)


def healthcheck_command(inst: Instruction) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK [--option=value ...] CMD ["exec", "form"] as (options, command)."""
    head, sep, command = inst.text.partition(" CMD ")
    assert sep, f"line {inst.line}: HEALTHCHECK needs CMD"
    options = dict(t[2:].partition("=")[::2] for t in head.split())
    return options, Instruction("CMD", command.strip(), inst.line).json()


# -- .dockerignore -------------------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


@dataclass
class DockerIgnore:
    rules: list[tuple[bool, str, re.Pattern[str]]]  # (re-include?, pattern, regex)

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        rules = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((negate, pattern, _pattern_regex(pattern)))
        return cls(rules)

    def excluded(self, relpath: str) -> bool:
        parts = relpath.strip("/").split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for negate, _, regex in self.rules:
            if any(regex.fullmatch(p) for p in prefixes):
                result = not negate
        return result

    def _may_reinclude_below(self, relpath: str) -> bool:
        return any(negate and (p.startswith(relpath + "/") or "*" in p) for negate, p, _ in self.rules)

    def context_files(self, root: Path) -> list[str]:
        """The files (relative paths) Docker sends as the build context of `root`."""
        found = []
        for folder, dirs, files in os.walk(root):
            rel = os.path.relpath(folder, root)
            rel = "" if rel == "." else rel + "/"
            dirs[:] = [d for d in dirs if not (self.excluded(rel + d) and not self._may_reinclude_below(rel + d))]
            found += [rel + f for f in files if not self.excluded(rel + f)]
        return sorted(found)


def copy_context(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)


# -- compose ------------------------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^{}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<colon>:?)(?P<op>[-?+])(?P<arg>.*))?", re.S)


def variables(text: str) -> set[str]:
    """Names of the variables a Compose file or string refers to."""
    names = set()
    for m in _VARIABLE.finditer(text):
        if m.group("escaped"):
            continue
        names.add(m.group("plain") or _BRACED.fullmatch(m.group("braced")).group("name"))  # type: ignore[union-attr]
    return names


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation on every string value of a loaded Compose document (keys stay as they are)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("plain"):
            return env.get(m.group("plain"), "")
        parsed = _BRACED.fullmatch(m.group("braced"))
        assert parsed is not None, f"unsupported interpolation: {m.group(0)}"
        name, op, arg = parsed.group("name"), parsed.group("op"), parsed.group("arg")
        current = env.get(name)
        missing = current is None or (parsed.group("colon") == ":" and current == "")
        if op is None:
            return current or ""
        if op == "-":
            return arg if missing else current  # type: ignore[return-value]
        if op == "?":
            if missing:
                raise ValueError(f"{name}: {arg}")
            return current  # type: ignore[return-value]
        return "" if missing else arg

    return _VARIABLE.sub(one, value)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (no quotes, no interpolation: the example keeps to that); comments skipped."""
    values = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), f"{path.name}:{number}: not KEY=VALUE"
        assert not value.startswith(("'", '"')) and "$" not in value, f"{path.name}:{number}: keep values plain"
        values[name] = value
    return values


def commented_keys(path: Path) -> set[str]:
    """KEY=VALUE lines that are commented out (`# KEY=VALUE`): documented but not set by default."""
    return set(re.findall(r"^#\s*([A-Z][A-Z0-9_]*)=", path.read_text(), re.M))
