"""Profiles and settings: what the daemon serves, read from TOML profiles, QWEN4EXP_* variables and flags.

    load_settings(profile, overrides, env) -> Settings     command line > environment > profile > defaults
    explain(settings) -> [(key, value, source)]             for `qwen4exp profiles show`
    list_profiles(env) -> [(name, path, description)]       for `qwen4exp profiles`
    check_profile(profile) -> Settings                      for `qwen4exp check` (warns ConfigWarning)

See docs/CONFIG.md for every key.
"""

from .check import check_profile
from .errors import ConfigError, ConfigWarning
from .load import explain, load_settings, schema_keys
from .schema import Device, PrefixCache, Server, Settings
from .sizes import format_size, parse_seconds, parse_size
from .sources import find_profile, list_profiles, parse_assignments, profile_dirs

__all__ = [
    "ConfigError", "ConfigWarning", "Device", "PrefixCache", "Server", "Settings", "check_profile", "explain",
    "find_profile", "format_size", "list_profiles", "load_settings", "parse_assignments", "parse_seconds",
    "parse_size", "profile_dirs", "schema_keys",
]
