"""Where settings come from: profile files (found by name or by path) and command-line assignments.

A name is looked up in /etc/qwen4exp/ first, then in the profiles shipped with the daemon (profiles/ at the top
of the repository, inside the package once installed), so an operator overrides a shipped profile by writing one
of the same name under /etc/qwen4exp/. QWEN4EXP_PROFILE_PATH (directories separated by ':') replaces
/etc/qwen4exp (a user install, a test); the shipped ones always come last. With no profile given,
QWEN4EXP_PROFILE names one, else `tiny`, the embedded default.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError, suggest

ETC_DIR = Path("/etc/qwen4exp")


def shipped_dir(name: str) -> Path:
    """A folder shipped with the daemon (`profiles`, `systemd`): inside the installed package, where the wheel puts
    it (scripts/build_backend.py), else at the top of the checkout that an editable install imports from. With
    neither, the package's: a message about a missing file then names where it belongs."""
    package = Path(__file__).resolve().parent.parent
    installed, checkout = package / name, package.parent.parent / name
    return checkout if checkout.is_dir() and not installed.is_dir() else installed


SHIPPED_DIR = shipped_dir("profiles")
DEFAULT_PROFILE = "tiny"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)")


def profile_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where profile names are looked up, in order. A QWEN4EXP_PROFILE_PATH entry that is not a directory is
    refused: a mistyped path would otherwise hand a name over to the shipped profile of that name."""
    env = os.environ if env is None else env
    extra = env.get("QWEN4EXP_PROFILE_PATH", "")
    first = [Path(p).expanduser() for p in extra.split(os.pathsep) if p] if extra else [ETC_DIR]
    if extra:
        for directory in first:
            if not directory.is_dir():
                raise ConfigError(f"QWEN4EXP_PROFILE_PATH: {directory} is not a directory"
                                  + (" (it does not exist)" if not directory.exists() else ""))
    return first + [SHIPPED_DIR]


def is_path(profile: str | Path) -> bool:
    """A Path, or a string that reads as one ('./x.toml', '/etc/x.toml', 'x.toml'); anything else is a name."""
    return isinstance(profile, Path) or os.sep in profile or profile.endswith(".toml")


def find_profile(profile: str | Path, env: Mapping[str, str] | None = None) -> Path:
    """The file a profile name or path stands for."""
    if is_path(profile):
        path = Path(profile).expanduser()
        if not path.is_file():
            raise ConfigError(f"profile file {path} does not exist" if not path.exists()
                              else f"profile {path} is not a file")
        return path.absolute()
    name = str(profile)
    if not _NAME.match(name):
        raise ConfigError(f"{name!r} is not a profile name (letters, digits, '.', '_', '-') nor a path")
    dirs = profile_dirs(env)
    for directory in dirs:
        candidate = directory / f"{name}.toml"
        if candidate.is_file():
            return candidate
    available = [n for n, _, _ in list_profiles(env)]
    close = suggest(name, available)
    hint = f" (did you mean {close}?)" if close else ""
    raise ConfigError(f"no profile named {name!r}{hint}; looked in {', '.join(str(d) for d in dirs)}; "
                      f"available: {', '.join(available) or 'none'}")


def list_profiles(env: Mapping[str, str] | None = None) -> list[tuple[str, Path, str]]:
    """(name, path, description) of every profile a name can reach, sorted by name; a profile shadowed by one
    of the same name earlier in the search path is not listed (it cannot be reached by name)."""
    found: dict[str, tuple[str, Path, str]] = {}
    for directory in profile_dirs(env):
        try:
            files = sorted(directory.glob("*.toml"))
        except OSError:
            continue                                      # an unreadable /etc/qwen4exp hides nothing shipped
        for path in files:
            if path.stem not in found and _NAME.match(path.stem):
                found[path.stem] = (path.stem, path, _description(path))
    return [found[name] for name in sorted(found)]


def _description(path: Path) -> str:
    try:
        text = read_profile(path).get("description", "")
    except ConfigError as err:
        return f"(unreadable: {err})"
    return text if isinstance(text, str) else ""


def read_profile(path: Path) -> dict[str, Any]:
    """The TOML document; a syntax error names the file, line and column (path:line:column, as editors read)."""
    try:
        raw = Path(path).read_bytes()
        # A byte-order mark (Windows editors write one) is no part of the TOML.
        return tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read profile {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        message = str(err)
        position = _POSITION.search(message)
        if position is None:
            raise ConfigError(f"{path}: TOML syntax error: {message}") from None
        line, column = position.groups()
        raise ConfigError(f"{path}:{line}:{column}: TOML syntax error at line {line}, column {column}: "
                          f"{_POSITION.sub('', message)}") from None


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """`--set key=value` flags as overrides: {"server.port": 9000}. A value is read as a TOML value when it is
    one (9000, true, "x", [1, 2]) and kept as a string otherwise (auto, 0.0.0.0, 32GiB)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"command line: {item!r} is not key=value (e.g. server.port=9000)")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        out[key.strip()] = value
    return out
