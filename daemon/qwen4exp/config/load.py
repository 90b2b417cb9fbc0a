"""Loading settings: four layers merged in order, validated once, and where each value came from.

Precedence, highest first: command line > environment (QWEN4EXP_*) > profile file > defaults. A layer sets
single keys: QWEN4EXP_SERVER__PORT changes the port and keeps the profile's other [server] keys. A list
([[devices]]) is one value: a layer that sets it replaces the whole list.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from .env import ENV_LAYER_MERGED, EnvSource
from .errors import ConfigError, describe_validation_error
from .schema import Settings
from .sources import DEFAULT_PROFILE, find_profile, read_profile

DEFAULT = "default"
COMMAND_LINE = "command line"


def load_settings(profile: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Settings from a profile (a name, a path, or None for $QWEN4EXP_PROFILE or `tiny`), the environment
    (`env`, os.environ when None) and command-line overrides ({"server.port": 9000} or nested dicts; a None
    value means "not given"). Raises ConfigError with every problem found."""
    env = dict(os.environ if env is None else env)
    path = find_profile(profile if profile is not None else (env.get("QWEN4EXP_PROFILE") or DEFAULT_PROFILE), env)
    env_source = EnvSource(Settings, env, strict=False)
    layers = [  # lowest precedence first
        (_with_absolute_paths(read_profile(path), path.parent), lambda loc: f"profile {path}"),
        (_with_absolute_paths(env_source(), Path.cwd()), lambda loc: f"environment ({env_source.variable_for(loc)})"),
        (_with_absolute_paths(_nest(overrides or {}), Path.cwd()), lambda loc: COMMAND_LINE),
    ]
    merged: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    known = set(schema_keys())
    for data, label in layers:
        for loc, value in _leaves(data):
            if value != {} or ".".join(loc) not in known:     # an empty [server] table sets nothing
                sources.pop(loc, None)                         # the order of `sources` is the layers' order
                sources[loc] = label(loc)
        merged = _merge(merged, data)
    token = ENV_LAYER_MERGED.set(True)
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as err:
        error = describe_validation_error(
            err, source_of=lambda loc: _source_of(sources, loc), expected_of=_expected_of,
            keys=schema_keys(), secret_keys=_secret_keys())
        raise ConfigError(env_source.unknown() + error.problems) from None
    finally:
        ENV_LAYER_MERGED.reset(token)
    if env_source.unknown():
        raise ConfigError(env_source.unknown())
    settings._sources = {".".join(loc): label for loc, label in sources.items()}
    settings._profile = path
    return settings


def explain(settings: Settings) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every setting, in schema order. Secrets show as '**********'."""
    sources = {tuple(k.split(".")): v for k, v in settings._sources.items()}
    return [(".".join(loc), value, _source_of(sources, loc))
            for loc, value in _leaves(settings.model_dump(mode="json"))]


def schema_keys() -> list[str]:
    """Every key a profile may hold, dotted (devices.name for a key of each [[devices]] entry)."""
    return [".".join(loc) for loc, _ in _fields(Settings)]


def _fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    for name, field in model.model_fields.items():
        yield prefix + (name,), field
        inner = _model_in(field.annotation)
        if inner is not None:
            yield from _fields(inner, prefix + (name,))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The table model inside an annotation (Server, or Device inside tuple[Device, ...]), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _contains(annotation: Any, kind: type) -> bool:
    return annotation is kind or any(_contains(a, kind) for a in get_args(annotation))


def _expected_of(key: str) -> str | None:
    for loc, field in _fields(Settings):
        if ".".join(loc) == key and isinstance(field.json_schema_extra, dict):
            return field.json_schema_extra.get("expected")
    return None


def _secret_keys() -> set[str]:
    return {".".join(loc) for loc, field in _fields(Settings) if _contains(field.annotation, SecretStr)}


def _source_of(sources: Mapping[tuple[str, ...], str], loc: tuple) -> str:
    """The last layer that set `loc` or a key inside it (`--set slots.x=1` makes a table of a profile's `slots`; a
    [devices] table stands where [[devices]] belongs), else the layer that set the table or list it sits in; else
    the default."""
    parts = tuple(str(p) for p in loc if not isinstance(p, int))
    at_or_inside = [label for key, label in sources.items() if parts and key[:len(parts)] == parts]
    if at_or_inside:
        return at_or_inside[-1]
    for end in range(len(parts) - 1, 0, -1):
        if parts[:end] in sources:
            return sources[parts[:end]]
    return DEFAULT


def _leaves(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, prefix + (str(key),))
        else:
            yield prefix + (str(key),), value


def _merge(low: dict[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"server.port": 9000} -> {"server": {"port": 9000}}; nested dicts pass through; None means not given."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            value = _nest(value)
            if not value:
                continue
        *tables, leaf = str(key).split(".")
        node: dict[str, Any] = {}
        cursor = node
        for table in tables:
            cursor = cursor.setdefault(table, {})
        cursor[leaf] = value
        out = _merge(out, node)
    return out


def _with_absolute_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A relative model or mtp_weights path is relative to the profile that says it (or to the working directory
    for the environment and command line), so a daemon started by systemd from / finds the same directory. A Hugging
    Face id (`org/repo`, when nothing of that name exists there) stays as written; a path's `~` is expanded."""
    from ..model_dir import hub_id

    model, head = data.get("model"), data.get("mtp_weights")
    if isinstance(model, str) and model.strip() not in ("", "tiny") and not model.startswith("~") \
            and not Path(model).is_absolute() and hub_id(model.strip(), base) is None:
        data = {**data, "model": str(base / model)}
    if isinstance(head, str) and head.strip() and hub_id(head.strip(), base) is None:
        data = {**data, "mtp_weights": str(base / Path(head.strip()).expanduser())}
    return data
