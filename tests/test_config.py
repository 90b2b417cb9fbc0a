"""Profiles and settings: precedence, shipped profiles, the /etc override, errors an operator can act on,
secrets that never print, sizes and durations."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from qwen4exp.config import (ConfigError, ConfigWarning, check_profile, explain, find_profile, list_profiles,
                             load_settings, parse_assignments, parse_seconds, parse_size, schema_keys)
from qwen4exp.config.sources import SHIPPED_DIR

SECRET = "sekrit-7c1f"


@pytest.fixture
def etc(tmp_path):
    """An empty stand-in for /etc/qwen4exp, so the host's own profiles cannot change a result."""
    directory = tmp_path / "etc"
    directory.mkdir()
    return directory


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def env_for(etc: Path, **variables: str) -> dict[str, str]:
    return {"QWEN4EXP_PROFILE_PATH": str(etc), **variables}


def sources(settings) -> dict[str, tuple]:
    return {key: (value, source) for key, value, source in explain(settings)}


# --- precedence: command line > environment > profile > default ---

def test_each_layer_wins_over_the_next(etc, tmp_path):
    profile = write(tmp_path / "p.toml", 'slots = 2\nlog_level = "debug"\n[server]\nport = 9001\nqueue_limit = 7\n')
    env = env_for(etc, QWEN4EXP_SLOTS="3", QWEN4EXP_SERVER__PORT="9002")
    settings = load_settings(profile, overrides={"slots": 5, "max_ctx": None}, env=env)
    rows = sources(settings)
    assert rows["slots"] == (5, "command line")
    assert rows["server.port"] == (9002, "environment (QWEN4EXP_SERVER__PORT)")
    assert rows["server.queue_limit"] == (7, f"profile {profile}")      # env set one [server] key, not the table
    assert rows["log_level"] == ("debug", f"profile {profile}")
    assert rows["dtype"] == ("float32", "default")
    assert rows["max_ctx"] == ("auto", "default")                      # a None override means "not given"
    assert load_settings(profile, env=env).slots == 3
    assert load_settings(profile, env=env_for(etc)).slots == 2
    assert load_settings(write(tmp_path / "empty.toml", ""), env=env_for(etc)).slots == 4


def test_overrides_nested_dotted_and_from_set_flags(etc):
    flags = parse_assignments(["server.port=9100", "max_ctx=auto", "chunk=128", "server.host=0.0.0.0"])
    assert flags == {"server.port": 9100, "max_ctx": "auto", "chunk": 128, "server.host": "0.0.0.0"}
    settings = load_settings("tiny", overrides={**flags, "prefix_cache": {"enabled": False}}, env=env_for(etc))
    assert (settings.server.port, settings.chunk, settings.server.host) == (9100, 128, "0.0.0.0")
    assert settings.prefix_cache.enabled is False and settings.prefix_cache.resident_limit == 64 * 2**20
    with pytest.raises(ConfigError, match="not key=value"):
        parse_assignments(["slots"])


def test_plain_key_variables_and_empty_ones(etc):
    env = env_for(etc, QWEN4EXP_API_KEY=SECRET, QWEN4EXP_ADMIN_KEY=SECRET + "-admin", QWEN4EXP_SLOTS="")
    settings = load_settings("tiny", env=env)
    assert settings.server.api_key.get_secret_value() == SECRET
    assert settings.server.admin_key.get_secret_value() == SECRET + "-admin"
    assert settings.slots == 4                                          # an empty variable counts as unset
    assert sources(settings)["server.api_key"][1] == "environment (QWEN4EXP_API_KEY)"
    with pytest.raises(ConfigError, match="keep one of them"):
        load_settings("tiny", env={**env, "QWEN4EXP_SERVER__API_KEY": "other"})


def test_settings_alone_read_the_process_environment(monkeypatch):
    from qwen4exp.config import Settings
    monkeypatch.setenv("QWEN4EXP_SLOTS", "2")
    monkeypatch.setenv("QWEN4EXP_API_KEY", SECRET)
    settings = Settings()
    assert settings.slots == 2 and settings.server.api_key.get_secret_value() == SECRET
    monkeypatch.setenv("QWEN4EXP_SEVER__PORT", "1")
    with pytest.raises(ConfigError, match="not a setting"):
        Settings()


def test_profile_from_environment_and_the_embedded_default(etc):
    assert load_settings(env=env_for(etc)).profile_path == SHIPPED_DIR / "tiny.toml"
    assert load_settings(env=env_for(etc, QWEN4EXP_PROFILE="h200")).profile_path == SHIPPED_DIR / "h200.toml"


# --- shipped profiles and where profiles are found ---

@pytest.mark.parametrize("name, slots", [("tiny", 4), ("h200", 4), ("h200-chat", 16), ("qwen-next-r9700-strix", 4)])
def test_shipped_profiles_load(name, slots, etc):
    settings = load_settings(name, env=env_for(etc))
    assert settings.description and settings.slots == slots
    assert all(source != "default" for key, _, source in explain(settings)
               if key in ("model", "dtype", "max_ctx", "chunk", "devices", "server.port"))


def test_shipped_profile_contents(etc):
    tiny, h200, strix = (load_settings(n, env=env_for(etc)) for n in ("tiny", "h200", "qwen-next-r9700-strix"))
    assert (tiny.model, tiny.target.name, tiny.dtype, tiny.max_ctx) == ("tiny", "cpu", "float32", 4096)
    assert tiny.server.api_key is None and tiny.server.port == 8077 and tiny.prefix_cache.enabled
    assert (h200.target.name, h200.dtype, h200.max_ctx) == ("cuda:0", "bfloat16", "auto")
    assert h200.snapshot_device.name == "cpu"
    assert h200.prefix_cache.resident_limit == "auto" and (h200.restore_spacing, h200.chunk_tokens) == (2048, 4096)
    assert not h200.batch_prompts and h200.decode_beside_prompts
    chat = load_settings("h200-chat", env=env_for(etc))
    assert (chat.slots, chat.batch_prompts, chat.chunk_tokens, chat.max_ctx) == (16, True, 4096, "auto")
    assert [d.name for d in strix.split_devices] == ["cuda:1"] and strix.target.name == "cuda:0"
    assert [n for n, _, _ in list_profiles(env_for(etc))] == ["h200", "h200-chat", "qwen-next-r9700-strix", "tiny"]


def test_etc_overrides_a_shipped_profile(etc):
    mine = write(etc / "h200.toml", 'description = "ours"\nslots = 2\n[[devices]]\nname = "cuda:3"\nrole = "target"\n')
    settings = load_settings("h200", env=env_for(etc))
    assert settings.profile_path == mine and settings.slots == 2 and settings.target.name == "cuda:3"
    listed = {name: (path, text) for name, path, text in list_profiles(env_for(etc))}
    assert listed["h200"] == (mine, "ours") and listed["tiny"][0] == SHIPPED_DIR / "tiny.toml"


def test_unknown_profile_lists_the_available_ones(etc):
    with pytest.raises(ConfigError) as err:
        load_settings("h100", env=env_for(etc))
    assert "did you mean h200" in str(err.value)
    assert "available: h200, h200-chat, qwen-next-r9700-strix, tiny" in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        find_profile("/nowhere/x.toml")


def test_a_mistyped_profile_path_is_refused_not_passed_over(etc, tmp_path):
    """With QWEN4EXP_PROFILE_PATH pointing nowhere, `h200` would have been the shipped profile, not the operator's."""
    write(etc / "h200.toml", 'slots = 2\n')
    for wrong, said in ((tmp_path / "etc-typo", " is not a directory (it does not exist)"),
                        (etc / "h200.toml", " is not a directory")):
        with pytest.raises(ConfigError, match=re.escape(f"QWEN4EXP_PROFILE_PATH: {wrong}{said}")):
            load_settings("h200", env={"QWEN4EXP_PROFILE_PATH": f"{wrong}{os.pathsep}{etc}"})
    assert load_settings("h200", env=env_for(etc)).slots == 2


# --- errors ---

def test_unknown_key_names_file_key_and_suggestion(etc, tmp_path):
    profile = write(tmp_path / "p.toml", "port = 1\n[server]\nprot = 9000\n[sever]\nhost = 'x'\n")
    with pytest.raises(ConfigError) as err:
        load_settings(profile, env=env_for(etc))
    text = str(err.value)
    assert f"profile {profile}: unknown key server.prot (did you mean server.port?)" in text
    assert "unknown key port (did you mean server.port?)" in text and "unknown key sever (did you mean server?)" in text


def test_unknown_environment_variable(etc):
    with pytest.raises(ConfigError, match=r"SEVER__PORT\): not a setting \(did you mean QWEN4EXP_SERVER__PORT"):
        load_settings("tiny", env=env_for(etc, QWEN4EXP_SEVER__PORT="1"))
    with pytest.raises(ConfigError, match=r"QWEN4EXP_SERVER__PROT\): unknown key server.prot"):
        load_settings("tiny", env=env_for(etc, QWEN4EXP_SERVER__PROT="1"))
    assert load_settings("tiny", env=env_for(etc, QWEN4EXP_CACHE="/tmp/x")).slots == 4   # not ours: left alone


def test_a_tables_key_with_one_underscore_is_refused_not_ignored(etc, monkeypatch):
    """QWEN4EXP_SERVER_API_KEY ignored would serve without the key the operator set: refused, once, with the
    spelling meant; the process environment is not read a second time beside the one given."""
    with pytest.raises(ConfigError) as err:
        load_settings("tiny", env=env_for(etc, QWEN4EXP_SERVER_API_KEY="secret"))
    assert str(err.value) == ("environment (QWEN4EXP_SERVER_API_KEY): not a setting (did you mean "
                              "QWEN4EXP_SERVER__API_KEY? a table's keys follow a double underscore)")
    monkeypatch.setenv("QWEN4EXP_SEVER__PORT", "1")           # this process's, not the environment given
    assert load_settings("tiny", env=env_for(etc)).server.port == 8077


@pytest.mark.parametrize("key", ["device_memory_limit", "devices"])
def test_a_memory_cap_of_zero_is_refused_where_it_is_written(etc, tmp_path, key):
    text = 'device_memory_limit = 0\n' if key == "device_memory_limit" else \
        '[[devices]]\nname = "cpu"\nrole = "target"\nmemory_limit = "0B"\n'
    profile = write(tmp_path / "p.toml", 'model = "tiny"\n' + text)
    with pytest.raises(ConfigError, match=f"profile {profile}: .*must be more than 0 bytes \\(or 'none'\\)"):
        load_settings(profile, env=env_for(etc))


def test_wrong_type_names_file_key_value_and_expectation(etc, tmp_path):
    profile = write(tmp_path / "p.toml", '[server]\nport = "http"\n[prefix_cache]\nresident_limit = "12 parsecs"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(profile, env=env_for(etc))
    text = str(err.value)
    assert f"profile {profile}: server.port = 'http'" in text and "expected a port from 1 to 65535" in text
    assert "prefix_cache.resident_limit = '12 parsecs'" in text and "unknown size unit 'parsecs'" in text


@pytest.mark.parametrize("text, match", [
    ('[[devices]]\nname = "cuda:0"\nrole = "target"\n[[devices]]\nname = "cuda:1"\nrole = "target"\n',
     "exactly one device must have role 'target'"),
    ("max_ctx = 1002\n", "multiple of 4"),
    ("max_ctx = 512\nchunk = 1024\n", "chunk = 1024|larger than max_ctx"),
    ("chunk = 96\n[prefix_cache]\nspacing = 64\n", "prefix_cache.spacing: the restore spacing"),
    ('[[devices]]\nname = "rocm:0"\nrole = "target"\n', "ROCm GPUs are cuda:N"),
    ('[[devices]]\nname = "cpu"\nrole = "targt"\n', "did you mean 'target'"),
    ("slots = 17\n", r"slots = 17: .*expected a whole number from 1 to 16"),
    ("headroom = 0.6\n", r"headroom = 0.6: .*expected a fraction from 0 to 0.5"),
    ("hot_experts = -1\n", r"hot_experts = -1: .*expected a whole number from 0 to 512"),
])
def test_rules_between_and_within_keys(etc, tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(write(tmp_path / "p.toml", text), env=env_for(etc))


def test_toml_syntax_error_names_line_and_column(etc, tmp_path):
    profile = write(tmp_path / "p.toml", "slots = 4\n[server\nport = 1\n")
    with pytest.raises(ConfigError, match=re.escape(f"{profile}:2:8: TOML syntax error at line 2, column 8")):
        load_settings(profile, env=env_for(etc))


# --- secrets ---

def test_secrets_never_print(etc, tmp_path):
    settings = load_settings("tiny", env=env_for(etc, QWEN4EXP_API_KEY=SECRET, QWEN4EXP_ADMIN_KEY=SECRET + "a"))
    shown = [repr(settings), str(settings), repr(explain(settings)), settings.model_dump_json()]
    assert not any(SECRET in text for text in shown)
    assert sources(settings)["server.api_key"][0] == "**********"
    profile = write(tmp_path / "p.toml", f'[server]\napi_kye = "{SECRET}"\nadmin_key = 71234\n')
    with pytest.raises(ConfigError) as err:
        load_settings(profile, env=env_for(etc))
    assert SECRET not in str(err.value) and "71234" not in str(err.value) and "server.admin_key" in str(err.value)


# --- sizes and durations ---

def test_sizes_and_durations(etc, tmp_path):
    assert parse_size("32GiB") == 32 * 2**30 and parse_size("1.5GB") == 1_500_000_000 and parse_size(4096) == 4096
    assert parse_size("512 mib") == 512 * 2**20 and parse_size("32G") == 32 * 2**30
    assert parse_seconds("10m") == 600 and parse_seconds(90) == 90 and parse_seconds("never") is None
    for bad in ("-1GiB", "lots", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="write 'never'"):
        parse_seconds(0)
    profile = write(tmp_path / "p.toml", 'device_memory_limit = "120GiB"\npark_after_idle = "30m"\n[prefix_cache]\n'
                                         'resident_limit = "48GiB"\n[server]\nrequest_timeout = "never"\n')
    settings = load_settings(profile, env=env_for(etc, QWEN4EXP_SERVER__MAX_BODY_BYTES="1MiB"))
    assert settings.device_memory_limit == 120 * 2**30 and settings.park_after_idle == 1800
    assert settings.prefix_cache.resident_limit == 48 * 2**30 and settings.server.request_timeout is None
    assert settings.server.max_body_bytes == 2**20
    unlimited = load_settings(profile, overrides={"device_memory_limit": "none"}, env=env_for(etc))
    assert unlimited.device_memory_limit is None


# --- check ---

def test_check_accepts_tiny_and_a_checkpoint_refuses_a_missing_model(etc, tmp_path, tiny_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_profile("tiny", env=env_for(etc)).model == "tiny"
        profile = write(tiny_checkpoint.parent / "p.toml", f'model = "{tiny_checkpoint.name}"\n')
        settings = check_profile(profile, env=env_for(etc))          # a relative model is the profile's
        assert settings.model == str(tiny_checkpoint)
    with pytest.raises(ConfigError, match="model = '/srv/models/Qwen3.8-Flash-Next-UD-Q4_K_XL-00001-of-00003.gguf' "
                                          "is not a usable GGUF: .*no such GGUF file"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_profile("h200", env=env_for(etc))


def test_check_warns_but_does_not_fail(etc, tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    profile = write(tmp_path / "p.toml", 'hot_experts = 8\n[server]\nhost = "0.0.0.0"\n[[devices]]\nname = "cuda:1"\n'
                                         'role = "target"\n')
    with pytest.warns(ConfigWarning) as caught:
        check_profile(profile, env=env_for(etc))
    text = " | ".join(str(w.message) for w in caught)
    assert "cuda:1 is not visible here" in text and "no api_key" in text
    assert "hot_experts = 8 does nothing without a split device" in text
    profile.write_text(f'[server]\napi_key = "{SECRET}"\n')
    profile.chmod(0o644)
    with pytest.warns(ConfigWarning) as caught:
        check_profile(profile, env=env_for(etc))
    text = " | ".join(str(w.message) for w in caught)
    assert "/park and /unpark take no key" in text and "every user can read it" in text


# --- the docs and the frozen result ---

def test_every_key_is_documented():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    missing = [key for key in schema_keys() if f"`{key}`" not in doc]
    assert not missing, f"docs/CONFIG.md does not describe {missing}"


def test_the_slot_limit_is_the_engines_and_the_decode_row_kernels():
    """A profile may ask for as many slots as the engine takes, and no more than the decode step's row kernel
    serves: past its rows the dense products of every step would go to F.linear."""
    from qwen4exp.config import Settings
    from qwen4exp.engine.engine_config import MAX_SLOTS, EngineConfig
    from qwen4exp.kernels.row_products import MAX_ROWS

    limits = [m.le for m in Settings.model_fields["slots"].metadata if hasattr(m, "le")]
    assert limits == [MAX_SLOTS] == [MAX_ROWS]
    assert EngineConfig(slots=MAX_SLOTS).slots == MAX_SLOTS
    with pytest.raises(ValueError, match=f"from 1 to {MAX_SLOTS}"):
        EngineConfig(slots=MAX_SLOTS + 1)


def test_settings_are_frozen(etc):
    settings = load_settings("tiny", env=env_for(etc))
    with pytest.raises(ValueError, match="frozen"):
        settings.slots = 8
    with pytest.raises(ValueError, match="frozen"):
        settings.server.port = 1
    assert settings.slots == 4 and settings.server.port == 8077


@pytest.mark.parametrize("text, message", [
    ('slots = true\n', "slots = True: got true, a boolean"),
    ('[server]\nmax_body_bytes = 0\n', "server.max_body_bytes = 0: 0 bytes would refuse every request's body"),
    ('[devices]\nname = "cpu"\nrole = "target"\n', "devices = {'name': 'cpu', 'role': 'target'}: Input should be"),
])
def test_a_value_of_the_wrong_kind_is_refused_and_blamed_on_its_file(etc, tmp_path, text, message):
    profile = write(tmp_path / "p.toml", 'model = "tiny"\n' + text)
    with pytest.raises(ConfigError, match=re.escape(f"profile {profile}: {message}")):
        load_settings(profile, env=env_for(etc))


def test_a_profile_saved_with_a_byte_order_mark_reads_as_without(etc, tmp_path):
    profile = tmp_path / "bom.toml"
    profile.write_bytes(b"\xef\xbb\xbfmodel = \"tiny\"\nslots = 2\n")
    assert load_settings(profile, env=env_for(etc)).slots == 2


@pytest.mark.parametrize("key, shown", [("slots.x", "slots"), ("server.port.x", "server.port")])
def test_a_table_made_on_the_command_line_is_blamed_on_it(etc, tmp_path, key, shown):
    """`--set slots.x=1` turns the profile's `slots = 2` into a table: the command line wrote the bad value."""
    profile = write(tmp_path / "p.toml", 'slots = 2\n[server]\nport = 9001\n')
    with pytest.raises(ConfigError, match=re.escape(f"command line: {shown} = {{'x': 1}}")):
        load_settings(profile, overrides=parse_assignments([f"{key}=1"]), env=env_for(etc))


def test_a_rule_between_keys_set_in_two_layers_names_both(etc, tmp_path):
    profile = write(tmp_path / "p.toml", 'model = "tiny"\nchunk = 64\n')
    with pytest.raises(ConfigError, match=re.escape(f"profile {profile} (chunk) and command line (max_ctx): chunk: "
                                                    "chunk (64) is larger than max_ctx (8)")):
        load_settings(profile, overrides={"max_ctx": 8}, env=env_for(etc))
    both = write(tmp_path / "q.toml", 'model = "tiny"\nchunk = 64\nmax_ctx = 8\n')
    with pytest.raises(ConfigError, match=re.escape(f"profile {both}: chunk: chunk (64) is larger than max_ctx")):
        load_settings(both, env=env_for(etc))
