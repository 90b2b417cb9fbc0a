"""What an engine is built from, decided once: from a profile's settings (`EngineConfig.from_settings`) for serve,
plan and generate, or from a bench's own flags. Every caller builds its engine with `Engine.from_config` and, when
max_ctx is "auto", resolves the context with `resolve_context`, so `plan` fits exactly as the daemon does and an
offline answer is cut on the chunk grid the daemon cuts on.

Plain values and no torch at import: the daemon pickles the config to its engine worker, and the daemon's own
process and its request-preparing processes never import torch. The methods that need torch import it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .limits import AUTO_DRAFTS, MAX_DRAFTS, MAX_SLOTS

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _size(tables) -> str:
    from .memory import human_size
    return human_size(sum(table.blocks.numel() for table in tables))


def _whole(key: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ValueError(f"engine setting {key} must be a whole number {span}, got {value!r}")


def resolve_mtp(mtp: int | str, model) -> int:
    """The most drafts per slot and step for a profile's `mtp` (speculative.py): "auto" gives AUTO_DRAFTS where the
    model has an MTP head and its ops backend verifies positions together (a verify step then costs little more
    than a plain one) off a CPU, whose steps are bound by the host's work that drafting adds to; else 0. A number
    is taken as it is."""
    if mtp == "auto":
        pays = model.rows_independent and model.lm_head.weight.device.type != "cpu"
        return AUTO_DRAFTS if model.mtp is not None and pays else 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= MAX_DRAFTS:
        raise ValueError(f"mtp must be \"auto\" or a number of drafts from 0 to {MAX_DRAFTS}, got {mtp!r}")
    return mtp


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # checkpoint directory (resolved); None: the caller builds the model
    device: str = "auto"                  # "cpu", "cuda", "cuda:N", or "auto": the GPU when torch sees one
    dtype: str = "auto"                   # one of DTYPE_NAMES, or "auto": bfloat16 on a GPU, float32 on the CPU
    slots: int = 4
    max_ctx: int | str = "auto"           # positions per slot, or "auto": the largest that fits, fitted on the device
    chunk: int = 512                      # prompt tokens per prefill forward
    restore_spacing: int | None = None    # tokens between prefix snapshots; None: the chunk
    prefix_cache: bool = False
    prefix_cache_limit: int | str = "auto"      # bytes of snapshots kept, or "auto" (decided from free memory)
    device_memory_limit: int | None = None      # cap on what the engine allocates on its device
    headroom: float = 0.1                 # share of each device's memory the context fit leaves free
    queue_limit: int = 64
    cuda_graphs: bool = True
    compile_decode: bool = False
    decode_beside_prompts: bool = False   # decode steps between a short prompt chunk's layers (engine.py)
    batch_prompts: bool = False           # several slots' prompt chunks in one forward (engine.py)
    ple: str = "auto"                     # where a GGUF's quantized PLE table lives: "device", "host", or "auto"
    mtp: int | str = "auto"               # most drafted tokens per slot and step, or "auto" (speculative.py)
    mtp_weights: str | None = None        # a GGUF model's MTP head: a safetensors checkpoint's directory
    split: tuple[tuple[str, int | None], ...] = ()   # devices holding layers beside the target: (name, memory limit)
    hot_experts: int = 0                  # a split layer's most routed experts also kept on the target (hot_experts.py)
    placement: Any = None                 # placement.Placement once decided (a reload keeps it), else None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"engine setting model must be a checkpoint directory, got {self.model!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"engine setting device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        if self.dtype not in (*DTYPE_NAMES, "auto"):
            raise ValueError(f"engine setting dtype must be one of {', '.join(DTYPE_NAMES)} or 'auto', "
                             f"got {self.dtype!r}")
        _whole("slots", self.slots, 1, MAX_SLOTS)
        if self.max_ctx != "auto":
            _whole("max_ctx", self.max_ctx, 1)
        _whole("chunk", self.chunk, 1)
        if self.restore_spacing is not None:
            _whole("restore_spacing", self.restore_spacing, 1)
        if self.prefix_cache_limit != "auto":
            _whole("prefix_cache_limit", self.prefix_cache_limit, 0)
        if self.device_memory_limit is not None:
            _whole("device_memory_limit", self.device_memory_limit, 1)
        _whole("queue_limit", self.queue_limit, 1)
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) \
                or not 0 <= self.headroom <= 0.5:
            raise ValueError(f"engine setting headroom must be a fraction from 0 to 0.5, got {self.headroom!r}")
        if self.ple not in ("auto", "device", "host"):
            raise ValueError(f"engine setting ple must be 'auto', 'device' or 'host', got {self.ple!r}")
        if self.mtp != "auto":
            _whole("mtp", self.mtp, 0, MAX_DRAFTS)
        if self.mtp_weights is not None and (not isinstance(self.mtp_weights, str) or not self.mtp_weights):
            raise ValueError(f"engine setting mtp_weights must be a checkpoint directory, got {self.mtp_weights!r}")
        _whole("hot_experts", self.hot_experts, 0)
        for entry in self.split:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]
                    and entry[0] != self.device and (entry[1] is None or isinstance(entry[1], int))):
                raise ValueError(f"engine setting split must list (device, memory limit or None) pairs of devices "
                                 f"other than the target, got {entry!r}")
        for key in ("prefix_cache", "cuda_graphs", "compile_decode", "decode_beside_prompts", "batch_prompts"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"engine setting {key} must be true or false, got {getattr(self, key)!r}")

    @classmethod
    def from_settings(cls, settings) -> "EngineConfig":
        """The engine a profile serves (config.Settings, already validated): every engine-side key, with the
        model's directory resolved and the target's own memory limit taking precedence."""
        from ..model_dir import resolve_head, resolve_model

        target, cache = settings.target, settings.prefix_cache
        return cls(model=str(resolve_model(settings.model)), device=target.name, dtype=settings.dtype,
                   slots=settings.slots, max_ctx=settings.max_ctx, chunk=settings.chunk_tokens,
                   restore_spacing=settings.restore_spacing, prefix_cache=cache.enabled,
                   prefix_cache_limit=cache.resident_limit, device_memory_limit=settings.memory_limit_for(target),
                   headroom=settings.headroom,
                   queue_limit=settings.server.queue_limit, cuda_graphs=settings.cuda_graphs,
                   compile_decode=settings.compile_decode, decode_beside_prompts=settings.decode_beside_prompts,
                   batch_prompts=settings.batch_prompts, ple=settings.ple, mtp=settings.mtp,
                   mtp_weights=str(resolve_head(settings.mtp_weights)) if settings.mtp_weights else None,
                   split=tuple((d.name, settings.memory_limit_for(d)) for d in settings.split_devices),
                   hot_experts=settings.hot_experts)

    @property
    def spacing(self) -> int:
        return self.restore_spacing or self.chunk

    # ---- the steps that need torch (called in the engine's process) -------------------------------
    def torch_device(self):
        from .loading import resolve_device
        from .memory import as_device
        return as_device(resolve_device(self.device))

    def dtype_on(self, device) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" else "float32"

    def load_model(self, progress: bool = False, hot_counts: dict[int, list[int]] | None = None):
        """(device, model): the devices' memory limits set first, so the load already stays under them, then the
        checkpoint loaded in this config's dtype: on the target, or with `split` devices placed over them all
        (`choose_placement`, unless a placement was kept from an earlier load), the split layers' hot experts
        copied to the target (`keep_hot_experts`, chosen from `hot_counts`)."""
        from .loading import load_model
        from .memory import set_device_memory_limit

        if self.model is None:
            raise ValueError("engine setting model is not set: there is no checkpoint to load")
        device = self.torch_device()
        if device.type == "cuda":            # the current device, where Triton launches (cuda:1 as the target too)
            import torch
            torch.cuda.set_device(device)
        set_device_memory_limit(device, self.device_memory_limit)
        for name, limit in self.split:
            set_device_memory_limit(name, limit)
        if self.hot_experts and self.split:     # before the load: a bad number fails in seconds, not minutes
            from .loading import model_config
            self.check_hot_experts(model_config(self.model).num_experts)
        placement, ple_on_host = self.placement, self.ple == "host"
        if self.split and placement is None:
            placement, ple_on_host = self.choose_placement(device)
        model = load_model(self.model, dtype=self.dtype_on(device), device=device, progress=progress,
                           ple_on_host=ple_on_host, placement=placement, mtp_weights=self.mtp_weights)
        self.keep_hot_experts(model, hot_counts)
        return device, model

    def keep_hot_experts(self, model, counts: dict[int, list[int]] | None = None) -> None:
        """Copy `hot_experts` of each split layer's experts to the target (hot_experts.py): the most counted in
        `counts` (pairs routed while serving), or, without any, in a calibration prompt run now (none without a
        split or with 0)."""
        from . import hot_experts

        if not self.hot_experts or not hot_experts.hot_layers(model):
            return
        self.check_hot_experts(model.config.num_experts)
        source = "serving"
        if not counts or not any(any(row) for row in counts.values()):
            from ..tokenizer import Tokenizer, TokenizerError
            try:
                tokenizer = Tokenizer.from_path(self.model) if self.model is not None else None
            except TokenizerError:          # a checkpoint without one: ids spread over the vocabulary instead
                tokenizer = None
            ids = hot_experts.calibration_ids(tokenizer, model.config.vocab_size)
            counts, source = hot_experts.calibrate(model, ids, self.chunk), "calibration"
        hot_experts.keep_hot(model, hot_experts.choose(counts, self.hot_experts), source)

    def choose_placement(self, device, facts=None):
        """(placement.Placement, whether the PLE table goes to host memory) for the split devices: the planner's
        choice over the model's byte counts (fit_estimate.estimate_plan, as `plan --estimate` shows it; `facts`:
        fit_estimate.ModelFacts, else read from the checkpoint) with each device's capacity read now, before
        anything is loaded. The context is fitted on the devices after."""
        from .fit import FitError
        from .fit_estimate import EstimateError, estimate_plan, measured_size, model_facts
        from .placement import Placement
        from .snapshot import snapshots_share_device_memory

        try:
            facts = facts or model_facts(self.model, None, self.dtype_on(device), mtp_weights=self.mtp_weights)
            reserve = self.host_snapshot_reserve(device)
            est = estimate_plan(facts, measured_size("target", device, self.device_memory_limit),
                                tuple(measured_size("split", name, limit, reserve) for name, limit in self.split),
                                slots=self.slots, chunk=self.chunk, ple=self.ple, max_ctx=self.max_ctx,
                                headroom=self.headroom, snapshots_on_device=snapshots_share_device_memory(device),
                                mtp=self.mtp, hot_experts=self.hot_experts)
        except EstimateError as err:
            raise FitError(f"placing layers on {', '.join(name for name, _ in self.split)}: {err}") from None
        fit = est.split
        if fit.context is None:
            raise FitError(f"no placement over {device} and {', '.join(name for name, _ in self.split)} fits a "
                           f"context: {fit.error}")
        counts = [(name, fit.split_layers[name][1] - fit.split_layers[name][0] + 1 if name in fit.split_layers
                   else 0) for name, _ in self.split]
        return Placement.with_split(str(device), facts.cfg.num_hidden_layers, counts), fit.ple == "host"

    def check_hot_experts(self, experts: int) -> None:
        if self.hot_experts > experts:
            raise ValueError(f"engine setting hot_experts ({self.hot_experts}) is more than the model's {experts} "
                             f"experts a layer")

    def fit_settings(self, device) -> dict[str, Any]:
        """The context fit's inputs for this engine on `device`, the same for `serve` and `plan`: the slots, the
        chunk it must hold at the last position (rounded up to the planner's granule), the memory limit and
        headroom, and whether prefix snapshots take the device's memory (where the snapshot backend puts them)."""
        from .fit import floor_chunk
        from .snapshot import snapshots_share_device_memory
        settings = dict(slots=self.slots, device=device, chunk_floor=floor_chunk(self.chunk),
                        memory_limit=self.device_memory_limit, headroom=self.headroom,
                        snapshots_on_device=snapshots_share_device_memory(device))
        return settings | ({"host_reserve": self.host_snapshot_reserve(device)} if self.split else {})

    def host_snapshot_reserve(self, device) -> int:
        """Bytes of host memory the prefix cache may fill beside a discrete target (its resident limit; 0 when it is
        off or its snapshots live on the target): a split device whose memory is the host's (`cpu`, an integrated
        GPU) keeps them free, since its layers' caches and the snapshots share that memory."""
        from .prefix_cache import auto_resident_limit
        from .snapshot import SnapshotBackend

        if not self.prefix_cache:
            return 0
        backend = SnapshotBackend.for_device(device)
        if backend.tier != "host" or device.type == "cpu":
            return 0
        return auto_resident_limit(backend) if self.prefix_cache_limit == "auto" else self.prefix_cache_limit

    def resolve_context(self, model, device, **fit_overrides):
        """The context to serve (fit.ContextChoice): max_ctx checked when it is a number, else fitted on `device`
        with `fit_settings`; `fit_overrides` are plan's what-ifs (headroom, verify, snapshot placement).

        ple = "auto" with a GGUF's quantized PLE table on a GPU: when the fit falls short of the model's trained
        context, the table moves to host memory (where the GPU reads the rows it looks up in place) if that fits
        a longer context, and the fit says so in its notes."""
        from .fit import resolve_max_ctx
        from .loading import quantized_ple_tables

        settings = self.fit_settings(device) | {"draft_positions": resolve_mtp(self.mtp, model)} | fit_overrides
        choice = resolve_max_ctx(self.max_ctx, model, **settings)
        tables = [table for table in quantized_ple_tables(model) if not table.host]
        # A split model's table went where choose_placement put it, before the load.
        if (self.ple != "auto" or device.type != "cuda" or not tables or choice.fit is None or self.split
                or choice.context >= model.config.max_position_embeddings):
            return choice
        for table in tables:
            table.keep_on_host()
        moved = resolve_max_ctx(self.max_ctx, model, **settings)
        if moved.context > choice.context:
            moved.fit.notes.append(f"ple = 'auto': the PLE table ({_size(tables)}) moved to host memory, which fits "
                                   f"{moved.context} positions a slot against {choice.context} with it on {device}")
            return moved
        for table in tables:                      # no longer: back where it was
            table.host = False
            table.to(device)
        return choice

    def as_loaded(self, model) -> "EngineConfig":
        """This config with what the load decided written in: `ple = "auto"` replaced by where the model's quantized
        PLE table is now, and a split model's placement. A context fitted for them counts on them: a later load
        (an unpark, a restarted worker) keeps the fitted context without fitting again, so it must load the same."""
        from dataclasses import replace

        from .loading import quantized_ple_tables

        config = self
        if self.split and self.placement is None:     # none split off: every layer on the target
            from .placement import Placement
            config = replace(config, placement=model.placement or Placement.single(self.torch_device(),
                                                                                   len(model.model.layers)))
        tables = quantized_ple_tables(model)
        if self.ple != "auto" or not tables:
            return config
        return replace(config, ple="host" if all(table.host for table in tables) else "device")

    def new_prefix_cache(self, model, device):
        """A prefix cache for this engine (it outlives an engine: a park keeps it), or None when it is off."""
        if not self.prefix_cache:
            return None
        from .prefix_cache import PrefixCache, auto_resident_limit
        from .snapshot import SnapshotBackend
        backend = SnapshotBackend.for_device(device)
        limit = auto_resident_limit(backend) if self.prefix_cache_limit == "auto" else self.prefix_cache_limit
        return PrefixCache(self.spacing, limit, backend, model.config.indexer_compress_ratio)
