"""The settings schema: every key a profile may hold, with its type, default and meaning, and the rules
between keys.

Values TOML cannot say directly ("auto", sizes, durations, "none", "never") are read by one validator each,
so a wrong value gets one clear message instead of a list of failed union branches. Every table forbids
unknown keys: a misspelt key is an error, never a silently ignored line. Settings are frozen once loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, PrivateAttr, SecretStr,
                      field_validator, model_validator)
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import KeyedValueError, suggest
from .sizes import parse_optional_size, parse_positive_seconds, parse_seconds, parse_size

TRAINED_CONTEXT = 262144
# QSA averages keys in blocks of 4 tokens: every cut (context, chunk, restore point) falls on a block edge.
COMPRESS_RATIO = 4
# chunk = "auto" is a fixed number per device kind, not a measurement, so the chunk grid that snapshots are
# cut on stays the same across a re-fit, a park and a restart. On a GPU every chunk reads all experts' weights:
# on the H200 a 16K prompt took 1.09 s at 512, 0.27 s at 2048 (same time per chunk, so decode rows wait no
# longer beside a prefill), for 0.6 GiB more chunk workspace in the fit (docs/PERFORMANCE.md).
AUTO_CHUNK = {"cuda": 2048, "cpu": 64}
ROLES = ("target", "split", "snapshots")


def _field(default: Any, expected: str, meaning: str, **constraints: Any) -> Any:
    """A field that knows what it expects (for error messages) and what it means (for docs/CONFIG.md)."""
    return Field(default, description=meaning, json_schema_extra={"expected": expected}, **constraints)


def _tokens(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected 'auto' or a whole number of tokens, got {value!r}")
    if not 0 < value <= TRAINED_CONTEXT or value % COMPRESS_RATIO:
        raise ValueError(f"expected 'auto' or a multiple of {COMPRESS_RATIO} (the QSA block) from {COMPRESS_RATIO} "
                         f"to {TRAINED_CONTEXT} (the trained context), got {value}")
    return value


MAX_DRAFTS = 7     # engine_config.MAX_DRAFTS (tests/test_config.py checks they agree)


def _drafts(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DRAFTS:
        raise ValueError(f"expected 'auto' or a number of drafted tokens from 0 to {MAX_DRAFTS}, got {value!r}")
    return value


def _auto_size(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_size(value)


def _device_name(value: Any) -> str:
    name = value.strip().lower() if isinstance(value, str) else ""
    if name == "cuda":
        return "cuda:0"
    if name == "cpu":
        return name
    if re.fullmatch(r"cuda:\d+", name):
        return f"cuda:{int(name[5:])}"
    hint = " (ROCm GPUs are cuda:N to torch too)" if name.startswith(("hip", "rocm", "gpu", "amd")) else ""
    raise ValueError(f"expected 'cpu' or 'cuda:N', got {value!r}{hint}")


def _roles(value: Any) -> tuple[str, ...]:
    roles = [value] if isinstance(value, str) else value
    if not isinstance(roles, (list, tuple)) or not roles:
        raise ValueError(f"expected a role or a list of roles ({', '.join(ROLES)}), got {value!r}")
    out: list[str] = []
    for role in roles:
        word = role.strip().lower() if isinstance(role, str) else role
        if word not in ROLES:
            close = suggest(str(word), ROLES)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ValueError(f"unknown role {role!r}{hint}: the roles are {', '.join(ROLES)}")
        if word not in out:
            out.append(word)
    return tuple(out)


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _dtype(value: Any) -> Any:
    return {"bf16": "bfloat16", "fp32": "float32"}.get(_lower(value), _lower(value))


def _not_bool(value: Any) -> Any:
    """`slots = true` is a mistake, not 1 (pydantic would read it so)."""
    if isinstance(value, bool):
        raise ValueError(f"got {str(value).lower()}, a boolean")
    return value


def _body_size(value: Any) -> int:
    size = parse_size(value)
    if size < 1024:
        raise ValueError(f"{size} bytes would refuse every request's body; at least 1KiB")
    return size


Whole = Annotated[int, BeforeValidator(_not_bool)]
Tokens = Annotated[int | Literal["auto"], PlainValidator(_tokens)]
Size = Annotated[int, PlainValidator(parse_size)]
OptionalSize = Annotated[int | None, PlainValidator(parse_optional_size)]
AutoSize = Annotated[int | Literal["auto"], PlainValidator(_auto_size)]
Seconds = Annotated[float | None, PlainValidator(parse_seconds)]
PositiveSeconds = Annotated[float, PlainValidator(parse_positive_seconds)]


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Device(_Table):
    name: Annotated[str, PlainValidator(_device_name)] = _field(
        ..., "'cpu' or 'cuda:N'", "A torch device: `cpu` or `cuda:N` (ROCm GPUs are `cuda:N` too).")
    role: Annotated[tuple[Literal["target", "split", "snapshots"], ...], BeforeValidator(_roles)] = _field(
        ..., "'target', 'split', 'snapshots' or a list of them",
        "What the device does: `target` runs the slots, the embedding, the LM head and the layers it keeps, with "
        "their caches (exactly one device); `split` holds a run of whole decoder layers and their caches beside the "
        "target, as many as the planner places there (none when the target holds them all); `snapshots` holds the "
        "prefix snapshots (at most one; `cpu` means pinned system memory).")
    memory_limit: OptionalSize = _field(
        None, "a size like '30GiB', or 'none'",
        "Cap on what qwen4exp allocates on this device; overrides `device_memory_limit` for it.")
    memory: OptionalSize = _field(
        None, "a size like '32GiB', or 'none'",
        "This device's total memory, for `qwen4exp plan --estimate` on a box that is not this one; serving measures "
        "the device instead.")

    @property
    def kind(self) -> str:
        return self.name.split(":")[0]


class PrefixCache(_Table):
    enabled: bool = _field(True, "true or false", "Keep prefix snapshots and restore them for repeated prefixes.")
    resident_limit: AutoSize = _field(
        "auto", "'auto' or a size like '48GiB'",
        "Most bytes of snapshots kept; least recently used ones are evicted. `auto`: the daemon decides at start.")
    spacing: Tokens = _field(
        "auto", "'auto' or a multiple of 4", "Tokens between restore points; `auto` = the chunk. Divides the chunk.")


class Server(_Table):
    host: str = _field("127.0.0.1", "an address or host name", "Address the API listens on.", min_length=1)
    port: Whole = _field(8077, "a port from 1 to 65535", "TCP port of the API.", ge=1, le=65535)
    api_key: SecretStr | None = _field(
        None, "a non-empty string", "Bearer key for the inference endpoints (/generate, /v1/*); none: open.")
    admin_key: SecretStr | None = _field(
        None, "a non-empty string", "Bearer key for the admin endpoints (/park, /unpark); none: open.")
    queue_limit: Whole = _field(64, "a whole number of at least 1", "Requests waiting for a slot before 429.", ge=1)
    max_body_bytes: Annotated[int, PlainValidator(_body_size)] = _field(
        8 * 2**20, "a size like '8MiB', at least 1KiB", "Largest request body accepted.")
    request_timeout: Seconds = _field(
        600.0, "seconds, a duration like '10m', or 'never'",
        "Longest a request may take, queue, prefill and decode together; past it the answer is 408 with what it "
        "generated (in a stream: an error event).")
    header_timeout: PositiveSeconds = _field(
        10.0, "seconds or a duration like '30s'",
        "Longest a connection may take to send a request's headers, counted from its opening or its last "
        "answer (so an idle keep-alive connection is closed after this long).")
    body_timeout: PositiveSeconds = _field(
        60.0, "seconds or a duration like '2m'", "Longest a request's body may take to arrive; past it, 408.")
    max_connections: Whole = _field(
        1024, "a whole number of at least 1",
        "Connections open at once; past it, a new connection is answered 503 with Retry-After and closed.", ge=1)

    @field_validator("api_key", "admin_key")
    @classmethod
    def _not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("an empty key would accept an empty bearer token; leave the key out to serve without one")
        return value


class Settings(BaseSettings):
    """A whole profile. Build it with `load_settings` (which records where each value came from)."""
    model_config = SettingsConfigDict(env_prefix="QWEN4EXP_", env_nested_delimiter="__", case_sensitive=False,
                                      extra="forbid", frozen=True)

    description: str = _field("", "a string", "One line shown by `qwen4exp profiles`.")
    model: str = _field("tiny", "a checkpoint directory, a .gguf file, a Hugging Face id (org/repo[:QUANT]) or 'tiny'",
                        "Checkpoint directory (published layout), GGUF file, Hugging Face id (`org/repo`, "
                        "`org/repo:QUANT`), or `tiny`: the embedded model.",
                        min_length=1)
    devices: tuple[Device, ...] = _field(
        (Device(name="cpu", role=("target",)),), "a list of [[devices]] tables", "The devices and their roles.")
    dtype: Annotated[Literal["float32", "bfloat16"], BeforeValidator(_dtype)] = _field(
        "float32", "'float32' or 'bfloat16'", "Weights and activations dtype (recurrent state stays float32).")
    slots: Whole = _field(4, "a whole number from 1 to 16", "Requests served at once, each with the full context.",
                        ge=1, le=16)
    max_ctx: Tokens = _field("auto", "'auto' or a multiple of 4 up to 262144",
                             "Context per slot; `auto`: the largest that fits, measured at start.")
    chunk: Tokens = _field("auto", "'auto' or a multiple of 4",
                           "Prompt tokens per prefill forward; `auto`: 512 on a GPU target, 64 on the CPU.")
    cuda_graphs: bool = _field(True, "true or false",
                               "Replay each decode step from a CUDA graph on a GPU target; `false` runs it eagerly.")
    compile_decode: bool = _field(False, "true or false",
                                  "torch.compile the decode step on a GPU target (fewer, fused kernels; slower start).")
    decode_beside_prompts: bool = _field(False, "true or false",
                                         "Queue the other slots' decode steps between the layers of a prompt chunk of "
                                         "up to 512 rows, while the host launches it (no token changes).")
    batch_prompts: bool = _field(False, "true or false",
                                 "Run the waiting slots' prompt chunks in one forward while their rows fit one chunk, "
                                 "each computed as alone; on a GPU they share the experts' weight reads.")
    mtp: Annotated[int | Literal["auto"], PlainValidator(_drafts)] = _field(
        "auto", f"'auto' or a number from 0 to {MAX_DRAFTS}",
        "Speculative decoding with the model's MTP head: up to this many drafted tokens per slot and step, each "
        "slot as many as its recent acceptance pays for; the output is the same as with 0. `auto`: 3 where the "
        "backend verifies a step's positions together, else 0 (today: 0 everywhere, docs/ENGINE.md says why).")
    mtp_weights: str | None = _field(
        None, "a checkpoint directory or a Hugging Face id (org/repo)",
        "A GGUF model's MTP head (llama.cpp's converter leaves it out): the directory or Hugging Face id of a "
        "safetensors release of the same model (Qwen's bfloat16 or FP8), of which config.json, the index and the "
        "shards holding the `mtp.*` tensors are read (an id fetches only those). Without it a GGUF model does not "
        "draft.", min_length=1)
    hot_experts: Whole = _field(
        0, "a whole number from 0 to 512",
        "With `split` devices: this many of each split layer's experts, the most routed, are also kept on the target, "
        "whose decode steps run the pairs routed to them (chosen at each load from the counts while serving, or a "
        "calibration prompt at the first).", ge=0, le=512)
    ple: Annotated[Literal["auto", "device", "host"], BeforeValidator(_lower)] = _field(
        "auto", "'auto', 'device' or 'host'",
        "Where a GGUF's quantized PLE n-gram table lives: `host` keeps it in pinned system memory (the GPU reads the "
        "rows a token looks up in place); `auto`: there when that fits a longer context.")
    device_memory_limit: OptionalSize = _field(
        None, "a size like '120GiB', or 'none'", "Cap on what qwen4exp allocates on each device it uses.")
    headroom: Annotated[float, BeforeValidator(_not_bool)] = _field(
        0.1, "a fraction from 0 to 0.5", "Share of each device's memory that `max_ctx = \"auto\"` leaves free.",
        ge=0, le=0.5)
    park_after_idle: Seconds = _field(None, "seconds, a duration like '30m', or 'never'",
                                      "Park (free the GPUs) after this long without requests.")
    park_level: Annotated[Literal["release", "offload"], BeforeValidator(_lower)] = _field(
        "release", "'release' or 'offload'",
        "What a park keeps: `release` frees the weights (unpark reads the checkpoint again); `offload` keeps them in "
        "pinned system memory (unpark copies them back at the link's speed; needs that much free system memory).")
    # Off by default: an operator's /park (to lend the GPU) must not be undone by the next client.
    wake_on_request: bool = _field(False, "true or false", "A request to a parked daemon unparks it (else 503).")
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = _field(
        "info", "'debug', 'info', 'warning' or 'error'", "Least severe log records written.")
    prefix_cache: PrefixCache = _field(PrefixCache(), "a [prefix_cache] table", "Prefix snapshots.")
    server: Server = _field(Server(), "a [server] table", "The HTTP API.")

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    _profile: Path | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        from .env import ENV_LAYER_MERGED, EnvSource  # the env layer reads this schema: import it late
        if ENV_LAYER_MERGED.get():     # load_settings merged the environment it was given already
            return (init_settings,)
        return init_settings, EnvSource(settings_cls)

    @field_validator("model")
    @classmethod
    def _model_path(cls, value: str) -> str:
        value = value.strip()
        return value if value == "tiny" else str(Path(value).expanduser())

    @model_validator(mode="after")
    def _rules_between_keys(self) -> "Settings":
        names = [d.name for d in self.devices]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise KeyedValueError("devices", f"{twice} is listed twice; give one entry a list: role = [...]")
        targets = [d.name for d in self.devices if "target" in d.role]
        if len(targets) != 1:
            raise KeyedValueError("devices", f"exactly one device must have role 'target' (it runs the slots); "
                                             f"found {len(targets)}{': ' + ', '.join(targets) if targets else ''}")
        if "split" in self.target.role:
            raise KeyedValueError("devices", f"{self.target.name} is the target; 'split' is for the other devices "
                                             "that hold part of the model")
        if len([d for d in self.devices if "snapshots" in d.role]) > 1:
            raise KeyedValueError("devices", "at most one device may have role 'snapshots'")
        if isinstance(self.chunk, int) and isinstance(self.max_ctx, int) and self.chunk > self.max_ctx:
            raise KeyedValueError("chunk", f"chunk ({self.chunk}) is larger than max_ctx ({self.max_ctx})",
                                  others=("max_ctx",))
        if self.mtp_weights is not None and (self.model == "tiny" or Path(self.model).is_dir()):
            raise KeyedValueError("mtp_weights", f"gives a GGUF model its MTP head; model = {self.model!r} is a "
                                  f"safetensors checkpoint, which brings its own head (or has none)")
        if self.chunk_tokens % self.restore_spacing:
            raise KeyedValueError("prefix_cache.spacing", f"the restore spacing ({self.restore_spacing}) must "
                                  f"divide the chunk ({self.chunk_tokens}): snapshots sit at chunk ends")
        return self

    @property
    def target(self) -> Device:
        return next(d for d in self.devices if "target" in d.role)

    @property
    def split_devices(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if "split" in d.role)

    @property
    def snapshot_device(self) -> Device | None:
        """The device named for snapshots, or None: then the engine's rule applies (pinned host memory beside a
        discrete GPU, the device itself when it is integrated, plain memory on the CPU)."""
        return next((d for d in self.devices if "snapshots" in d.role), None)

    @property
    def chunk_tokens(self) -> int:
        if isinstance(self.chunk, int):
            return self.chunk
        auto = AUTO_CHUNK[self.target.kind]
        return min(auto, self.max_ctx) if isinstance(self.max_ctx, int) else auto

    @property
    def restore_spacing(self) -> int:
        spacing = self.prefix_cache.spacing
        return spacing if isinstance(spacing, int) else self.chunk_tokens

    @property
    def profile_path(self) -> Path | None:
        return self._profile

    def memory_limit_for(self, device: Device) -> int | None:
        """A device's own limit, else `device_memory_limit` (on the CPU it is the capacity the context is
        fitted to, since there is no allocator cap to set)."""
        if device.memory_limit is not None:
            return device.memory_limit
        return self.device_memory_limit
