"""The environment layer: QWEN4EXP_* variables, read by pydantic-settings' own env source.

`QWEN4EXP_SLOTS=2`, `QWEN4EXP_SERVER__PORT=9000` (the nested delimiter is a double underscore), a whole table
or list as JSON (`QWEN4EXP_DEVICES='[{"name": "cuda:0", "role": "target"}]'`), plus the plain
`QWEN4EXP_API_KEY` / `QWEN4EXP_ADMIN_KEY` that a systemd EnvironmentFile holds. An empty variable counts as
unset, so a template line `QWEN4EXP_API_KEY=` does not turn into an empty key.
The mapping is injectable (tests, `qwen4exp check` for another host's environment): nothing here reads
os.environ unless told to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError
from pydantic_settings.sources.utils import parse_env_vars

from .errors import ConfigError, suggest

# Set while load_settings validates what it merged: its environment layer (the mapping it was given) is in
# there, so Settings does not read os.environ a second time.
ENV_LAYER_MERGED: ContextVar[bool] = ContextVar("env_layer_merged", default=False)

PREFIX = "QWEN4EXP_"
DELIMITER = "__"
# Plain names for the two secrets; the nested spelling (QWEN4EXP_SERVER__API_KEY) works too.
PLAIN_SECRETS = {"api_key": ("server", "api_key"), "admin_key": ("server", "admin_key")}
# Our prefix, but not settings: they choose the profile, or belong to other parts of qwen4exp.
NOT_SETTINGS = {"profile", "profile_path", "cache"}


class EnvSource(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping, with the plain secret names and a refusal of
    variables that look like settings but name none (QWEN4EXP_SEVER__PORT would otherwise be ignored)."""

    def __init__(self, settings_cls: type, environ: Mapping[str, str] | None = None, strict: bool = True):
        # strict=False leaves unknown variables to `unknown()`, so a loader can report them beside other problems.
        self.environ = dict(os.environ if environ is None else environ)
        self.strict = strict
        super().__init__(settings_cls, env_ignore_empty=True)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # The one change from the base class: read the given mapping, not os.environ.
        return parse_env_vars(self.environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def __call__(self) -> dict[str, Any]:
        if self.strict and self.unknown():
            raise ConfigError(self.unknown())
        try:
            data = super().__call__()
        except SettingsError as err:         # a JSON table or list that does not parse
            field = re.search(r'field "(\w+)"', str(err))
            name = self.variable_for((field.group(1),)) if field else None
            raise ConfigError(f"environment ({name or PREFIX + '*'}): not valid JSON: {err.__cause__ or err}") from None
        for plain, (table, key) in PLAIN_SECRETS.items():
            value = self.env_vars.get((PREFIX + plain).lower())
            if value is None:
                continue
            section = data.setdefault(table, {})
            if key in section and section[key] != value:
                raise ConfigError(f"environment: {PREFIX}{plain.upper()} and {PREFIX}{table.upper()}{DELIMITER}"
                                  f"{key.upper()} are both set, to different values; keep one of them")
            section[key] = value
        return data

    def variable_for(self, loc: tuple) -> str | None:
        """The variable a value at `loc` came from: the longest matching nested name, or a plain secret."""
        names = {k.lower(): k for k in self.environ if self.environ[k] != ""}
        parts = [str(p) for p in loc if not isinstance(p, int)]
        candidates = [PREFIX + DELIMITER.join(parts)]
        candidates += [PREFIX + plain for plain, target in PLAIN_SECRETS.items() if tuple(parts) == target]
        candidates += [PREFIX + DELIMITER.join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]
        return next((names[c.lower()] for c in candidates if c.lower() in names), None)

    def _tables(self) -> list[str]:
        """The settings that are tables of their own ([server], [prefix_cache])."""
        return [name for name, field in self.settings_cls.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]

    def unknown(self) -> list[str]:
        """Variables that look meant as settings but name none (QWEN4EXP_SEVER__PORT), one problem each."""
        fields = list(self.settings_cls.model_fields)
        problems = []
        for name in self.environ:
            if not name.upper().startswith(PREFIX) or self.environ[name] == "":
                continue
            rest = name[len(PREFIX):].lower()
            top = rest.split(DELIMITER)[0]
            if top in fields or rest in PLAIN_SECRETS or rest in NOT_SETTINGS:
                continue
            close = suggest(top, fields, cutoff=0.8)
            # A table's key written with one underscore (QWEN4EXP_SERVER_API_KEY): ignored, it would leave the
            # server without its key, so it is refused with the spelling meant.
            table = next((t for t in self._tables() if rest.startswith(t + "_")), None)
            if table is not None:
                problems.append(f"environment ({name}): not a setting (did you mean {PREFIX}{table.upper()}"
                                f"{DELIMITER}{rest[len(table) + 1:].upper()}? a table's keys follow a double "
                                f"underscore)")
                continue
            # Only names that look meant for us are refused: other QWEN4EXP_* variables may belong to tools.
            if DELIMITER in rest or close is not None:
                hint = f" (did you mean {PREFIX}{close.upper()}{rest[len(top):].upper()}?)" if close else ""
                problems.append(f"environment ({name}): not a setting{hint}")
        return problems
