"""`qwen4exp check`: validate a profile as the daemon would read it, without loading a model.

Errors (ConfigError) are what would stop the daemon: a bad key or value, a missing or unreadable checkpoint.
Warnings (ConfigWarning, through the warnings module so the CLI can collect them and a daemon logs them)
are what this machine cannot confirm or what is probably a mistake: a GPU torch cannot see here, snapshots on
a discrete GPU, an API open to the network without a key, a key in a world-readable profile.
"""

from __future__ import annotations

import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError, ConfigWarning
from .load import explain, load_settings
from .schema import Settings

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def check_profile(profile: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """The settings the daemon would serve with; raises ConfigError, warns ConfigWarning."""
    settings = load_settings(profile, overrides, env)
    sources = {key: source for key, _, source in explain(settings)}
    for message in _device_warnings(settings) + _policy_warnings(settings, sources):
        warnings.warn(message, ConfigWarning, stacklevel=2)
    # After the warnings, so a missing model does not hide them.
    _check_model(settings, sources["model"], sources["mtp_weights"])
    return settings


def _check_model(settings: Settings, source: str, head_from: str) -> None:
    """The checkpoint's config and weight files (or the GGUF's metadata and tensor types, and the MTP head that
    `mtp_weights` gives it), read from headers and the index only (no tensor data)."""
    if settings.model == "tiny":
        return                                  # written on first use; nothing to find
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.gguf_file import is_gguf
    from ..model_dir import hub_id

    found = hub_id(settings.model)
    path = Path(settings.model) if found is None else _hub_model_path(found, settings.model, source)
    if path is None:
        return                                  # a Hugging Face id still to be downloaded: warned
    cfg = check_model_files(path, source)
    if is_gguf(path):
        if settings.mtp_weights is not None and hub_id(settings.mtp_weights) is not None:
            warnings.warn(f"{head_from}: mtp_weights = {settings.mtp_weights!r} is a Hugging Face id: serve fetches "
                          f"its config, index and the shards holding mtp.* when it starts, and checks them then",
                          ConfigWarning, stacklevel=3)
        elif settings.mtp_weights is not None:
            from ..checkpoint.mtp_weights import head_source
            try:
                head_source(settings.mtp_weights, cfg, str(path))
            except CheckpointError as err:
                raise ConfigError(f"{head_from}: {err}") from None


def check_model_files(path: str | Path, source: str = "model"):
    """What a load reads first, from headers only (no tensor data): a GGUF's metadata, tensor types and tokenizer;
    a checkpoint directory's config, every shard's header (a truncated shard shows there) and tokenizer. Raises
    ConfigError naming the file; returns the GGUF's model config (None for a directory)."""
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.gguf_file import GGUFCheckpoint, is_gguf
    from ..checkpoint.loader import checkpoint_files, headers, read_config
    from ..tokenizer import Tokenizer

    path = Path(path)
    if is_gguf(path):
        try:
            checkpoint = GGUFCheckpoint(path)
            cfg = checkpoint.model_config()
            checkpoint.check_types()
            Tokenizer.from_path(path)
        except (CheckpointError, ValueError, OSError) as err:
            raise ConfigError(f"{source}: model = {str(path)!r} is not a usable GGUF: {err}") from None
        return cfg
    if not path.is_dir():
        what = "no such directory" if not path.exists() else "not a directory"
        raise ConfigError(f"{source}: model = {str(path)!r}: {what}; point it at a checkpoint directory "
                          f"(config.json + safetensors + tokenizer), a .gguf file, or write 'tiny'")
    try:
        read_config(path)
        headers(checkpoint_files(path))
        Tokenizer.from_path(path)
    except (CheckpointError, ValueError, OSError) as err:
        raise ConfigError(f"{source}: model = {str(path)!r} is not a usable checkpoint: {err}") from None
    return None


def _hub_model_path(found, model: str, source: str) -> Path | None:
    """A Hugging Face id's path in the cache when every file it needs is there (then checked like any path), else
    None with a warning (serve downloads them). The Hub is asked for the repo's listing, so a wrong id or quant or a
    gated repo fails here, but not for the files."""
    from ..hub import HubError, locate

    try:
        located = locate(found)
    except HubError as err:
        raise ConfigError(f"{source}: model = {model!r}: {err}") from None
    missing = located.missing
    if not missing:
        return located.path
    size = located.size_of(missing)
    what = (f"{model!r}: {len(missing)} of its files{'' if size is None else f' ({size / 2**30:.1f} GiB)'} are not "
            f"in the Hugging Face cache at {located.cache}")
    if located.cache_only:
        raise ConfigError(f"{source}: model = {what}, and {located.cache_only}")
    warnings.warn(f"{source}: model = {what} yet; serve downloads them when it starts", ConfigWarning, stacklevel=3)
    return None


def _device_warnings(settings: Settings) -> list[str]:
    gpus = [d for d in settings.devices if d.kind == "cuda"]
    if not gpus:
        return []
    try:
        import torch
    except ImportError:
        return ["devices: torch is not importable here, so the GPUs named were not checked"]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = []
    for device in gpus:
        index = int(device.name.split(":")[1])
        if index >= count:
            out.append(f"devices: {device.name} is not visible here (torch sees {count} GPU"
                       f"{'' if count == 1 else 's'}); the profile is valid but this machine cannot serve it")
            continue
        props = torch.cuda.get_device_properties(index)
        if "snapshots" in device.role and not props.is_integrated:
            out.append(f"devices: snapshots on {device.name} ({props.name}), a discrete GPU, compete with the "
                       f"slots' caches for its memory; name 'cpu' for pinned system memory instead")
    if settings.target.kind == "cuda" and settings.dtype == "float32":
        out.append("dtype: float32 on a GPU doubles the weights' memory; bfloat16 is the serving dtype")
    if settings.target.kind == "cuda" and any(d.kind == "cpu" for d in settings.split_devices):
        out.append("devices: layers split off to cpu run the torch forms on the host's cores, far slower than on the "
                   "GPU, and eagerly (the GPU's parts of a decode step replay graphs); the planner puts layers there "
                   "only when the GPU cannot hold the context")
    return out


def _policy_warnings(settings: Settings, sources: Mapping[str, str]) -> list[str]:
    server, out = settings.server, []
    if server.host not in _LOOPBACK and server.api_key is None:
        out.append(f"server.host = {server.host!r} serves beyond this machine with no api_key; "
                   f"set QWEN4EXP_API_KEY (e.g. in a systemd EnvironmentFile)")
    if server.api_key is not None and server.admin_key is None:
        out.append("server.api_key is set but server.admin_key is not: /park and /unpark take no key; "
                   "set QWEN4EXP_ADMIN_KEY")
    if server.api_key is not None and server.admin_key is not None \
            and server.api_key.get_secret_value() == server.admin_key.get_secret_value():
        out.append("server.admin_key equals server.api_key: every client could park the daemon")
    profile = settings.profile_path
    in_profile = [k for k in ("server.api_key", "server.admin_key") if sources.get(k, "").startswith("profile ")]
    if profile is not None and in_profile and profile.stat().st_mode & stat.S_IROTH:
        out.append(f"{profile} holds {' and '.join(in_profile)} and every user can read it; chmod 600 it, or move "
                   f"the keys to an EnvironmentFile (QWEN4EXP_API_KEY, QWEN4EXP_ADMIN_KEY)")
    if settings.hot_experts and any(d.kind == "cpu" for d in settings.split_devices):
        out.append(f"hot_experts = {settings.hot_experts}: layers on cpu keep none (their torch forms would compute "
                   f"every pair on both devices); only a GPU split device's layers do")
    if settings.hot_experts and not settings.split_devices:
        out.append(f"hot_experts = {settings.hot_experts} does nothing without a split device: every layer's experts "
                   f"are on the target already")
    if settings.park_after_idle is not None and not settings.wake_on_request:
        out.append("park_after_idle is set and wake_on_request is false: after an idle park every request gets "
                   "503 until someone calls /unpark")
    return out
