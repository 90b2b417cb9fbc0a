"""Configuration errors: one exception an operator can act on, and the wording of pydantic's complaints.

Every message names where the value came from (a profile file, an environment variable, the command line),
the key as a dotted path, and what was expected. Values of secret keys and of unknown keys are never
repeated: a misspelt `api_kye = "..."` must not print the key into a journal.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

from pydantic import ValidationError


class ConfigError(ValueError):
    """A profile, variable or flag that cannot be used as given. `problems` holds one line per problem."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(message)


class ConfigWarning(UserWarning):
    """Valid, but probably not what the operator meant (or not servable on this machine)."""


class KeyedValueError(ValueError):
    """Raised inside cross-field validators so the message can name the key it is about, not the whole model."""

    def __init__(self, key: str, message: str, others: tuple[str, ...] = ()):
        self.key, self.others = key, others      # `others`: the keys the rule weighs `key` against
        super().__init__(message)


def suggest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The closest choice to a likely typo, or None when nothing is close."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def dotted(loc: tuple) -> str:
    """('devices', 0, 'role') -> 'devices[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _schema_key(loc: tuple) -> str:
    """The key as the schema knows it, without list indices: devices[0].role -> devices.role."""
    return ".".join(str(p) for p in loc if not isinstance(p, int))


def describe_validation_error(err: ValidationError, *, source_of: Callable[[tuple], str],
                              expected_of: Callable[[str], str | None], keys: list[str],
                              secret_keys: set[str]) -> ConfigError:
    """Turn pydantic's errors into one ConfigError: source, dotted key, what was expected, a suggestion."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, KeyedValueError):       # a rule between keys: it says which key it is about
            loc = tuple(cause.key.split("."))
        key, schema_key = dotted(loc), _schema_key(loc)
        where = source_of(loc)
        if isinstance(cause, KeyedValueError) and cause.others:
            # Each key's own layer, where they differ: --context 8 against a profile's chunk names both.
            named = {k: source_of(tuple(k.split("."))) for k in (cause.key, *cause.others)}
            if len(set(named.values())) > 1:
                where = " and ".join(f"{source} ({k})" for k, source in named.items())
        if e["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key {key}{_did_you_mean(schema_key, keys)}")
            continue
        message = str(cause) if cause is not None else e["msg"]
        expected = expected_of(schema_key)
        quiet = not loc or schema_key in secret_keys or isinstance(cause, KeyedValueError)
        shown = "" if quiet else f" = {e['input']!r}"
        line = f"{where}: {key or '(profile)'}{shown}: {message}"
        if expected and cause is None:          # pydantic's own wording says what failed, not what would do
            line += f" (expected {expected})"
        problems.append(line)
    return ConfigError(problems)


def _did_you_mean(key: str, keys: list[str]) -> str:
    """A close key in the same table, else the same name in another table (e.g. `port` at the top level)."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    close = suggest(leaf, siblings)
    if close is not None:
        return f" (did you mean {parent + '.' if parent else ''}{close}?)"
    elsewhere = [k for k in keys if k.rpartition(".")[2] == leaf]
    if elsewhere:
        return f" (did you mean {elsewhere[0]}?)"
    table = f"[{parent}]" if parent else "the top level"
    return f"; the keys of {table} are: {', '.join(siblings)}"
