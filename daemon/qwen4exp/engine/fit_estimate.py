"""`qwen4exp plan --estimate`: the memory plan for a box that is not this one, without weights or a device.

The measured fit (fit.py) measures four inputs on the device and hands them to the Rust planner. The estimate
computes the same four from the model's config and its quantization, and runs the same search
(fit.budget_planner, fit.settle_workspace) over them:

- weights: the model built as `load_model` builds it (engine/loading.build_model: the expert stacks, tables and
  projections a GGUF keeps quantized as QuantizedStacks) on the meta device, every parameter and buffer summed:
  exact (the full model at UD-Q4_K_XL: 111251465240 B, as the H200 fit measured). The quantized PLE table is
  counted apart, so `ple` = auto/device/host is decided as EngineConfig.resolve_context decides it.
- one slot's bytes per position and fixed bytes: a SequenceState of capacity 4096 and 8192 on the meta device,
  as fit_measure.measure_state takes them (on the CPU it reads the same nbytes; on CUDA the allocator's rise,
  which rounds each allocation).
- the floor chunk's workspace at a position: `chunk_workspace`, a formula over the shapes the chunk holds at
  its peak, with one calibrated constant per backend (below; docs/MEMORY.md gives its error against every
  measurement there is).
- capacity: the device's total memory as given (a profile's per-device `memory`, or --devices), less what the
  driver and the CUDA context hold on a GPU (CUDA_CONTEXT_BYTES), capped by a memory limit.

Nothing is verified: there is no device. Multi-device placement (a `split` device holding layers) is not in the
engine yet; `estimate_split` says what the planner's multi-device budget would give if it were, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .fit import FitError, budget_planner, floor_chunk, settle_workspace
from .memory import human_size

# ---- constants, each from a measurement ------------------------------------------------------------------------
# What a GPU's driver and CUDA context hold outside torch's allocator: the H200's total as torch reports it less the
# capacity the fit measured there (free + what the process had reserved), in the two full-model runs of 2026-12-04
# (docs/results/speed_h200_full_ud_q4_k_xl_2026-12-04.json and ..._ple_host_2026-12-04.json: 150109880320 B total,
# capacity 149391802368 and 149324693504 B): 685 and 749 MiB. The larger is kept. CUDA 13, torch 2.11; a ROCm
# card's is not measured, and this figure stands in for it.
H200_TOTAL_BYTES = 150109880320
CUDA_CONTEXT_BYTES = H200_TOTAL_BYTES - 149324693504

# The chunk's live activations per row, as copies of a token's rows in the layer where each backend peaks
# (`row_width`), one constant per backend, fitted by least squares (bytes at no rows, copies) over the measured
# workspaces less the counted terms of `chunk_workspace`:
# - Triton (bf16/fp16 on a GPU), peaking in a Gated DeltaNet layer (fla's chunk kernel):
#   docs/results/chunk_sweep_h200_5341396.json, the bench preset in bfloat16 at position 65536, chunks of 256..4096
#   rows: 304295 B/row = 9.90 x (15360 values x 2 B), 4.7 MiB at no rows; each sample within -15%..+6% (the
#   -15% is 22 MiB at 256 rows). Only the shipped per-layer shapes were measured.
# - torch (the CPU), peaking at QSA's selection: the tiny preset and the embedded tiny model in float32 on the 2-core
#   dev machine (2026-12-04, fit_measure.measure_workspace at positions 4096..32768, 256..2048 rows, 22 samples):
#   2.19 x (928 and 1184 values x 4 B) a row, 3.3 MiB at no rows; each sample within -7%..+11% (the +11% is 1.5 MiB
#   at the smallest, where repeated readings differ by as much). The selection term alone explains the slope in
#   position: a free factor on it fitted to 1.01.
GPU_ROW_COPIES, GPU_BASE_BYTES = 9.90, 4_893_000
CPU_ROW_COPIES, CPU_BASE_BYTES = 2.19, 3_505_000
# A quantized model's chunk dequantizes each layer's expert stacks whole (kernels/moe_blocks.dequantized_for) and
# the fit reads the allocator's reserved peak, which these blocks of 3.4 and 1.7 GB (full model) fragment. The one
# measured quantized fit (the full model at UD-Q4_K_XL, PLE table on the device, 4096-row floor chunk: 131072 a slot
# on the H200, 2026-12-04) puts its workspace at that context between 6.87 and 7.30 GiB. Factors on the stacks'
# dense bytes from 1.135 to 1.225 reproduce its answer (1.0, the bytes alone, gives 139264); 1.18 is the middle.
# So that comparison checks consistency, not the factor: no other quantized chunk was measured on a GPU.
GPU_DENSE_STACK_FACTOR = 1.18

STATE_PROBE = 4096          # fit.py's _STATE_PROBE: states of this capacity and twice it
PRESETS = ("bench", "full")  # `--model bench|full`: checkpoint/presets.py's shapes; `tiny` is the embedded model


class EstimateError(ValueError):
    """Bad estimate settings; the message names the flag or profile key."""


# ---- the model ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the estimate knows of a model, computed on the meta device."""
    label: str
    cfg: Any                          # engine.model.config.ModelConfig
    dtype: str
    quant: str                        # "dense" (a checkpoint directory), a GGUF mix, or "gguf file"
    weights: int                      # every parameter and buffer, the PLE table included
    ple_table: int                    # bytes of the quantized PLE table(s) (0: none, or a dense one)
    layers: tuple[int, ...]           # bytes of each decoder layer (the PLE table in its layer)
    per_position: int                 # one slot's state
    fixed: int
    layer_states: tuple[tuple[int, int], ...]   # one slot's state of each decoder layer: (per position, fixed)
    carried: int                      # one slot's carried state, kept once per draft position with mtp
    layer_carried: tuple[int, ...]    # ... of each decoder layer
    dense_stacks: int                 # one layer's expert stacks dequantized whole (0: the stacks are dense)
    trained: int
    layer_experts: tuple[int, ...] = ()   # one routed expert's bytes in each decoder layer (a hot copy's)

    def on_device(self, ple_on_host: bool) -> int:
        return self.weights - (self.ple_table if ple_on_host else 0)


def _torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_facts(model: str, quant: str | None, dtype: str, layers: int | None = None,
                mtp_weights: str | None = None) -> ModelFacts:
    """The model named by `--model` (a preset, `tiny`, a checkpoint directory or a .gguf file; the GGUF's header only)
    at `quant` (a gguf_writer mix or block type, for presets and directories) in `dtype`; a preset cut to `layers`
    as random_model cuts it; a GGUF's with the MTP head `mtp_weights` gives it (its headers only)."""
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.fp8 import block_size as fp8_block
    from ..checkpoint.gguf_loader import quantized_stacks
    from ..checkpoint.fp8_stacks import planned_fp8_stacks
    from ..checkpoint.gguf_writer import MIXES, ONE_TYPE, PlannedFile
    from .model.config import ConfigError, ModelConfig

    if quant is not None:              # mixes are written in lower case, block types in upper (gguf_writer)
        given, quant = quant, quant.lower() if quant.lower() in MIXES + ("fp8",) else quant.upper()
        if quant not in MIXES + ONE_TYPE + ("fp8",):
            raise EstimateError(f"--quant {given!r}: choose one of {', '.join(MIXES + ONE_TYPE)}, or fp8 (Qwen's "
                                f"FP8 checkpoint)")
    as_gguf = str(model).endswith(".gguf") or (model in PRESETS and quant not in (None, "fp8"))
    if mtp_weights and not as_gguf:
        raise EstimateError(f"--mtp-weights gives a GGUF model its MTP head; --model {model}"
                            f"{' --quant ' + quant if quant else ''} is not one (a preset is with a GGUF mix)")
    head_stacks = {}
    try:
        if model in PRESETS:
            from ..checkpoint.presets import preset_config
            config = preset_config(model, layers, dtype=dtype)
            if quant not in (None, "fp8"):
                config["text_config"]["mtp_num_hidden_layers"] = 0     # llama.cpp's converter drops the MTP head
            cfg, label, source = ModelConfig.from_dict(config, source=f"preset {model!r}"), f"preset {model}", None
        elif str(model).endswith(".gguf"):
            if quant is not None:
                raise EstimateError(f"--quant {quant}: a GGUF's types come from its header; --quant is for presets "
                                    f"and checkpoint directories")
            from ..checkpoint.gguf_file import GGUFCheckpoint
            source = GGUFCheckpoint(model)                  # headers only: no tensor is read
            cfg, label = source.model_config(), str(model)
        else:
            from ..checkpoint.loader import read_config
            from ..model_dir import EMBEDDED_MODEL
            path = EMBEDDED_MODEL if model == "tiny" else Path(model)
            if not (path / "config.json").is_file():
                raise EstimateError(f"--model {model!r}: --estimate reads a checkpoint directory's config.json, a "
                                    f".gguf file's metadata, 'tiny' or a preset ({', '.join(PRESETS)}); "
                                    f"Hugging Face ids are not fetched for an estimate")
            raw = read_config(str(path))
            cfg = ModelConfig.from_dict(raw, source=f"{path}/config.json")
            label, source = str(model), None
            if quant is None and fp8_block(raw, str(path)) is not None:   # an FP8 checkpoint: what it keeps float8
                quant = "fp8"
        if mtp_weights:
            from ..checkpoint.mtp_weights import head_source
            head = head_source(mtp_weights, cfg, label)
            cfg, head_stacks = head.cfg, head.stacks
    except (ConfigError, CheckpointError, OSError) as err:
        raise EstimateError(f"--model {model}: {err}") from None
    stacks = {}
    if source is not None:
        stacks = quantized_stacks(source, cfg) | head_stacks
    elif quant == "fp8":
        stacks = planned_fp8_stacks(cfg)
    elif quant is not None:
        stacks = quantized_stacks(PlannedFile(cfg, quant), cfg) | head_stacks
    kind = "gguf file" if source is not None else (quant or "dense")
    return _facts_from_shapes(cfg, stacks, dtype, label, kind)


def _facts_from_shapes(cfg, stacks: dict, dtype: str, label: str, quant: str) -> ModelFacts:
    import torch

    from .loading import quantized_ple_tables
    from .model.causal_lm import Qwen4ExpForCausalLM
    from .model.quantized import keep_quantized
    from .state import SequenceState

    torch_dtype = _torch_dtype(dtype)
    with torch.device("meta"):                  # as build_model builds it, nothing allocated
        model = Qwen4ExpForCausalLM(cfg)
        keep_quantized(model, stacks, torch_dtype)
    model = model.to(dtype=torch_dtype)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    ple = sum(table.blocks.numel() for table in quantized_ple_tables(model))
    layers = tuple(sum(t.numel() * t.element_size() for name, t in tensors.items()
                       if name.startswith(f"model.layers.{i}.")) for i in range(cfg.num_hidden_layers))
    extra = 1 if model.mtp is not None else 0

    def state(capacity: int) -> int:
        return SequenceState(cfg, capacity, "meta", torch_dtype, extra_attention_layers=extra).nbytes()

    # fit_measure.measure_state's arithmetic: the difference over the probe is per position, the rest fixed.
    per_position = -(-(state(2 * STATE_PROBE) - state(STATE_PROBE)) // STATE_PROBE)
    fixed = max(state(STATE_PROBE) - per_position * STATE_PROBE, 0)
    layer_states = per_layer_states(cfg, torch_dtype, extra)
    layer_carried = tuple(SequenceState(cfg, 1, "meta", torch_dtype).carried_by_layer())
    dense = 0
    for name in ("gate_up_proj", "down_proj"):
        shapes = [shape for key, (_, shape) in stacks.items() if key.endswith(f".experts.{name}")]
        dense += max((math.prod(shape) for shape in shapes), default=0) * torch_dtype.itemsize
    layer_experts = tuple(sum(t.numel() * t.element_size() for name, t in tensors.items()
                              if name.startswith(f"model.layers.{i}.mlp.experts.")) // cfg.num_experts
                          for i in range(cfg.num_hidden_layers))
    return ModelFacts(label, cfg, dtype, quant, weights, ple, layers, per_position, fixed, layer_states,
                      sum(layer_carried), layer_carried, dense, cfg.max_position_embeddings, layer_experts)


def per_layer_states(cfg, dtype, extra: int) -> tuple[tuple[int, int], ...]:
    """One slot's state of each decoder layer (its PLE state in it) as (bytes per position, fixed bytes), from
    states of STATE_PROBE and twice that on the meta device."""
    from .state import SequenceState

    small, _ = SequenceState(cfg, STATE_PROBE, "meta", dtype, extra_attention_layers=extra).nbytes_by_layer()
    large, _ = SequenceState(cfg, 2 * STATE_PROBE, "meta", dtype, extra_attention_layers=extra).nbytes_by_layer()
    return tuple(((b - a) // STATE_PROBE, a - (b - a) // STATE_PROBE * STATE_PROBE) for a, b in zip(small, large))


# ---- the chunk's workspace ----------------------------------------------------------------------------------------
def row_width(cfg, backend: str) -> int:
    """Values a token holds in the layer where the chunk peaks. Triton: a Gated DeltaNet layer, per value head its
    key and value rows and its row of the 64-token chunk's decay and system matrices (delta_rule.CHUNK), as fla's
    chunk kernel holds them. torch: a QSA layer at the selection, its hyper-connection streams, query and gate, key and
    value, and the indexer's queries and key (twice: the float32 copy the selection scores with)."""
    from .model.delta_rule import CHUNK

    if backend == "triton":
        return cfg.linear_num_value_heads * (cfg.linear_key_head_dim + cfg.linear_value_head_dim + CHUNK)
    return (cfg.hc_count * cfg.hidden_size + 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
            + 2 * (cfg.indexer_n_heads + 1) * cfg.indexer_head_dim)


def chunk_workspace(facts: ModelFacts, backend: str, position: int, rows: int) -> dict[str, int]:
    """The floor chunk's workspace at `position` (a `rows`-row chunk ending there, as fit_measure.measure_workspace
    runs it), term by term; the sum is what the planner is given. `backend`: "triton" (bf16/fp16 on a GPU: the
    kernels of kernels/) or "torch" (the torch forms: the CPU, float32)."""
    from ..kernels.moe_blocks import DENSE_FROM
    from .model import qsa, triton_ops

    cfg = facts.cfg
    itemsize = _torch_dtype(facts.dtype).itemsize
    ratio = cfg.indexer_compress_ratio
    n_blocks = position // ratio
    triton = backend == "triton"
    copies, base = (GPU_ROW_COPIES, GPU_BASE_BYTES) if triton else (CPU_ROW_COPIES, CPU_BASE_BYTES)
    terms = {"fixed": base, "activations": int(rows * copies * itemsize * row_width(cfg, backend))}
    # The RoPE table covers the position, grown in powers of two (Qwen4ExpForCausalLM.rope); cos and sin.
    table = 1 << max(12, (position - 1).bit_length())
    terms["rope table"] = 2 * table * cfg.rotary_dim * itemsize
    sparse = any(cfg.is_qsa(i) for i in range(cfg.num_hidden_layers)) and position > cfg.dense_limit
    if triton:
        if sparse:   # triton_ops._chunk_token_lists: int64 ranking keys of one query slice, the token lists
            slices = qsa.query_slices(rows, triton_ops.ranking_slice_rows(n_blocks), align=triton_ops.SLICE_ALIGN)
            slice_rows = max(last - first for first, last in slices)
            terms["ranking keys"] = slice_rows * n_blocks * 8
            terms["token lists"] = rows * (cfg.block_topk + 1) * ratio * 5
        if facts.dense_stacks and rows * cfg.num_experts_per_tok >= DENSE_FROM * cfg.num_experts:
            terms["dequantized experts"] = int(GPU_DENSE_STACK_FACTOR * facts.dense_stacks)
    elif sparse:     # qsa.Indexer.select_mask: the [rows, position] mask and one slice's float32 scores
        most = qsa._slice_rows(n_blocks, cfg.indexer_n_heads)
        slice_rows = max(last - first for first, last in qsa.query_slices(rows, most))
        # the einsum's [rows, blocks, heads] and its head sum (float32), the visibility mask (bool)
        terms["selection"] = rows * position + slice_rows * n_blocks * (4 * cfg.indexer_n_heads + 4 + 1)
    return terms


# ---- the box ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSize:
    """One device of the box: its role, its kind (cuda or cpu) and its total memory."""
    role: str                 # "target" or "split"
    name: str
    kind: str                 # "cuda" (ROCm too) or "cpu"
    total: int
    limit: int | None = None
    measured: bool = False    # `total` is what this process can hold there now (measured_size): nothing to take off
    integrated: bool = False  # a GPU whose memory is the system's (measured_size reads it; an estimate cannot)

    @property
    def holds_host_memory(self) -> bool:
        """Whether host memory is this device's memory: a PLE table kept in host memory takes from its share."""
        return self.kind == "cpu" or self.integrated

    @property
    def reserved(self) -> int:
        return CUDA_CONTEXT_BYTES if self.kind == "cuda" and not self.measured else 0

    @property
    def capacity(self) -> int:
        usable = self.total - self.reserved
        return usable if self.limit is None else min(usable, self.limit)

    def describe(self) -> str:
        text = f"{self.name} ({self.kind}) {human_size(self.total)}" + (" free now" if self.measured else "")
        if self.reserved:
            text += f" less {human_size(self.reserved)} for the driver and context"
        if self.limit is not None and self.limit < self.total - self.reserved:
            text += f", capped at {human_size(self.limit)}"
        return text


@dataclass
class Fit:
    """One search's answer (or why there is none) for one placement of the PLE table."""
    ple: str                                  # "device" or "host" (or "none": no quantized table)
    weights: int                              # on the target
    context: int | None = None
    chunk: int | None = None
    plan: Any = None                          # _core.Plan
    samples: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None
    split_layers: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # name: (first, last, bytes)


@dataclass
class Estimate:
    facts: ModelFacts
    backend: str
    target: DeviceSize
    splits: tuple[DeviceSize, ...]
    slots: int
    chunk: int
    chunk_floor: int
    headroom: float
    snapshots_on_device: bool
    ple: str                                   # the setting
    fit: Fit                                   # the engine's answer: the target alone
    drafts: int = 0                            # mtp's drafts per slot and step, as the engine would resolve them
    hot_experts: int = 0                       # each split layer's experts also kept on the target
    tried: list[Fit] = field(default_factory=list)
    split: Fit | None = None                   # what a split would hold (not served by the engine yet)
    split_tried: list[Fit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _drafts(mtp: int | str, facts: ModelFacts, backend: str, kind: str) -> int:
    """engine_config.resolve_mtp for a model that is not built: "auto" drafts where the backend verifies a step's
    positions together off a CPU."""
    from .limits import AUTO_DRAFTS, MAX_DRAFTS

    if mtp != "auto":
        if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= MAX_DRAFTS:
            raise EstimateError(f"mtp must be \"auto\" or a number of drafts from 0 to {MAX_DRAFTS}, got {mtp!r}")
        return mtp
    if not facts.cfg.mtp_num_hidden_layers or kind == "cpu" or backend != "triton":
        return 0
    from .model.triton_ops import TritonOps
    return AUTO_DRAFTS if TritonOps.rows_independent else 0


def backend_for(kind: str, dtype: str) -> str:
    """Which ops backend the engine would run (engine/model/backend.ops_for): the Triton kernels for bf16/fp16 on a
    GPU (every op builds for the checked targets, sm_90, gfx1201 and gfx1151: kernels/guard.NOT_BUILT is empty),
    else the torch forms."""
    return "triton" if kind == "cuda" and dtype in ("bfloat16", "float16") else "torch"


def estimate_plan(facts: ModelFacts, target: DeviceSize, splits: tuple[DeviceSize, ...] = (), *, slots: int = 4,
                  chunk: int, ple: str = "auto", headroom: float = 0.1, snapshots_on_device: bool | None = None,
                  max_ctx: int | str = "auto", max_chunk: int = 8192, mtp: int | str = 0,
                  hot_experts: int = 0) -> Estimate:
    """The plan for `facts` on `target` (and what `splits` would add), decided as the engine decides it: the PLE
    table on the device unless ple = "host", or "auto" on a GPU moves it to host memory when that fits a longer
    context (EngineConfig.resolve_context). `hot_experts`: copies of that many experts of each split layer on the
    target (engine/hot_experts.py)."""
    from .limits import MAX_SLOTS

    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise EstimateError(f"--slots must be a whole number from 1 to {MAX_SLOTS}, got {slots!r}")
    if ple not in ("auto", "device", "host"):
        raise EstimateError(f"--ple must be auto, device or host, got {ple!r}")
    if ple == "host" and not facts.ple_table:
        raise EstimateError("--ple host keeps a GGUF's quantized PLE table in host memory; this model's table is not "
                            "quantized (a safetensors checkpoint or a float mix): give --quant or a .gguf file")
    backend = backend_for(target.kind, facts.dtype)
    on_device = target.kind == "cpu" if snapshots_on_device is None else snapshots_on_device
    trained, step, floor = _search_range(facts, max_ctx)
    if splits and (isinstance(hot_experts, bool) or not isinstance(hot_experts, int)
                   or not 0 <= hot_experts <= facts.cfg.num_experts):
        raise EstimateError(f"hot_experts must be a whole number from 0 to the model's {facts.cfg.num_experts} "
                            f"experts, got {hot_experts!r}")
    est = Estimate(facts, backend, target, splits, slots, chunk, floor_chunk(chunk), headroom, on_device, ple,
                   fit=Fit("none", 0), drafts=_drafts(mtp, facts, backend, target.kind), hot_experts=hot_experts)
    if est.drafts:
        est.notes.append(f"mtp: each slot keeps its carried state for {est.drafts} draft positions "
                         f"({human_size(est.drafts * facts.carried)} a slot)")
    if floor < est.chunk_floor:
        raise EstimateError(f"the smallest context, {floor}, is shorter than the floor chunk of {est.chunk_floor} "
                            f"rows (--chunk {chunk})")
    if target.kind == "cuda":
        est.notes.append(f"{human_size(CUDA_CONTEXT_BYTES)} of each GPU counted as the driver's and the CUDA "
                         f"context's (measured on the H200, CUDA 13; not measured on ROCm)")
        if snapshots_on_device is None:
            est.notes.append("snapshots in host memory, as beside a discrete GPU; a unified-memory GPU as the target "
                             "keeps them in its memory: --snapshots device")
    if backend == "torch" and target.kind == "cuda":
        est.notes.append(f"{facts.dtype} on a GPU runs the torch forms, whose workspace constants were fitted on the "
                         f"CPU only")
    if backend == "torch" and facts.dense_stacks:
        est.notes.append("the torch forms dequantize a kept-quantized weight whole for a chunk: not in the workspace "
                         "formula")
    est.fit, est.tried = _decide(est, trained, step, floor, max_chunk, split=False)
    if splits:
        est.split, est.split_tried = _decide(est, trained, step, floor, max_chunk, split=True)
        held = [i for name, (first, last, _) in est.split.split_layers.items() for i in range(first, last + 1)
                if name in _keeping_hot_experts(splits)]
        if hot_experts and held:
            est.notes.append(f"hot experts: {hot_experts} of each of the {len(held)} split layers' experts also on the "
                             f"target ({human_size(hot_experts * sum(facts.layer_experts[i] for i in held))}, in "
                             f"its weights)")
        if est.split.ple == "host" and not all(d.holds_host_memory for d in splits):
            est.notes.append("split: the PLE table in host memory is counted only against split devices named "
                             "`cpu`; whether a GPU is integrated (its memory the system's) an estimate cannot tell "
                             "(serve reads it): with an integrated GPU as `split`, the table takes from its share")
    return est


def _decide(est: Estimate, trained: int, step: int, floor: int, max_chunk: int, split: bool) -> tuple[Fit, list[Fit]]:
    """EngineConfig.resolve_context's choice of where the PLE table lives: where `ple` says; with "auto" on a GPU,
    on the device unless host memory fits a longer context (or the device placement fits none)."""
    facts = est.facts

    def search(ple: str) -> Fit:
        return _best_split(est, ple, trained, step, floor, max_chunk) if split else \
            _search(est, ple, trained, step, floor, max_chunk)

    if not facts.ple_table:
        fit = search("none")
        return fit, [fit]
    chosen = search("host" if est.ple == "host" else "device")
    tried = [chosen]
    if est.ple == "auto" and est.target.kind == "cuda" and (chosen.context is None or chosen.context < trained):
        moved = search("host")
        tried.append(moved)
        if moved.context is not None and (chosen.context is None or moved.context > chosen.context):
            est.notes.append(f"ple = 'auto'{' (split)' if split else ''}: the PLE table "
                             f"({human_size(facts.ple_table)}) goes to host memory, which fits {moved.context} "
                             f"positions a slot against {chosen.context if chosen.context is not None else 'none'} "
                             f"with it on the device")
            chosen = moved
    return chosen, tried


def _search_range(facts: ModelFacts, max_ctx: int | str) -> tuple[int, int, int]:
    """(trained, step, floor) of the context search; a given number is checked, not searched (as `plan` does)."""
    trained = facts.trained
    if max_ctx == "auto":
        return min(262144, trained), 4096, 4096
    ratio = facts.cfg.indexer_compress_ratio
    if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or max_ctx <= 0 or max_ctx % ratio:
        raise EstimateError(f"--max-ctx {max_ctx} must be 'auto' or a positive multiple of the QSA compress ratio "
                            f"{ratio}")
    if max_ctx > trained:
        raise EstimateError(f"--max-ctx {max_ctx} is past the model's trained context of {trained} positions")
    return max_ctx, max_ctx, max_ctx


def _search(est: Estimate, ple: str, trained: int, step: int, floor: int, max_chunk: int,
            counts: tuple[int, ...] | None = None) -> Fit:
    """fit_context's search over estimated inputs: the same budget model, the same workspace sampling rounds.
    `counts`: the layers each split device holds (split_inputs), else the target holds everything."""
    from .. import _core

    facts, target = est.facts, est.target
    weights = facts.on_device(ple == "host")
    per_position, fixed = facts.per_position, facts.fixed + est.drafts * facts.carried
    fit = Fit(ple, weights)
    splits = []
    if counts is not None:
        on_target, splits = split_inputs(facts, est.splits, counts, ple == "host", est.hot_experts)
        weights = fit.weights = on_target.weights
        per_position, fixed = on_target.per_position, on_target.fixed + est.drafts * on_target.carried
        fit.split_layers = {part.device.name: (part.first, part.last, part.weights) for part in splits if part.layers}
    try:
        available = _core.DeviceBudget(target.name, target.capacity, bytes_per_position=0,
                                       headroom=est.headroom).available
    except _core.PlannerError as err:
        raise EstimateError(f"--headroom: {err}") from None
    if weights >= available:
        fit.error = (f"the weights alone, {human_size(weights)}, do not fit in the {human_size(available)} available "
                     f"on {target.name} ({human_size(target.capacity)} less {est.headroom:.0%} headroom)")
        return fit

    def planner():
        # Each split device runs the chunk through its layers: the same workspace line there.
        others = tuple(_core.DeviceBudget(
            part.device.name, _room(part.device, ple, facts), bytes_per_position=part.per_position * est.slots,
            weights=part.weights, slot_state=(part.fixed + est.drafts * part.carried) * est.slots,
            workspace=fit.samples if part.layers else [], slots=est.slots, headroom=est.headroom) for part in splits)
        return budget_planner(target.name, target.capacity, weights=weights, per_position=per_position, fixed=fixed,
                              samples=fit.samples, slots=est.slots, snapshots_on_device=est.snapshots_on_device,
                              headroom=est.headroom, trained=trained, step=step, floor=floor,
                              chunk_floor=est.chunk_floor, max_chunk=max_chunk, others=others,
                              snapshot=(facts.per_position, facts.fixed))     # a snapshot holds the whole state

    def estimate():
        try:
            return planner().estimate()
        except _core.PlannerError as err:
            raise FitError(str(err)) from None

    def sample(position: int) -> None:
        fit.samples.append((position, sum(chunk_workspace(facts, est.backend, position, est.chunk_floor).values())))

    try:
        plan = settle_workspace(sample, estimate, fit.samples, floor, trained)
    except FitError as err:
        fit.error = f"cannot fit {est.slots} slot(s) on {target.name}: {err}"
        return fit
    fit.context, fit.chunk, fit.plan = plan.context, min(plan.chunk, plan.context), plan
    return fit


def _best_split(est: Estimate, ple: str, trained: int, step: int, floor: int, max_chunk: int) -> Fit:
    """The layers each split device holds that fit the longest context: each split device in turn (the first takes
    the last layers), every count its room for weights allows, the whole search for each; the longest context
    wins, the fewest layers off the target on a tie (the target runs them without a hand-over). Where no count
    fits a context, the answer is the most layers tried, with its error."""
    from .. import _core

    layers = len(est.facts.layers)
    counts: list[int] = []
    best = None
    for j, device in enumerate(est.splits):
        room = _core.DeviceBudget(device.name, _room(device, ple, est.facts), bytes_per_position=0,
                                  headroom=est.headroom).available
        here = None              # this device's best count and its fit, given the counts before it
        for k in range(layers - sum(counts) + 1):
            trial = tuple(counts + [k] + [0] * (len(est.splits) - j - 1))
            held = split_inputs(est.facts, est.splits, trial, ple == "host", est.hot_experts)[1][j]
            if held.weights > room:
                break
            fit = _search(est, ple, trained, step, floor, max_chunk, trial)
            # Where nothing fits, the most layers off the target tell what is still missing.
            if here is None or (fit.context or 0) > (here[1].context or 0) or not (fit.context or here[1].context):
                here = (k, fit)
        counts.append(here[0])
        best = here
    return best[1]


def _room(device: DeviceSize, ple: str, facts: ModelFacts) -> int:
    """A split device's capacity, less the PLE table where it sits in host memory and host memory is the device's
    (1 byte at least: a budget's capacity is never 0, and nothing fits in it)."""
    return max(device.capacity - (facts.ple_table if ple == "host" and device.holds_host_memory else 0), 1)


@dataclass(frozen=True)
class DevicePart:
    """What one device holds of a split model: a run of layers (first..last, none when `layers` is 0), their
    weights and one slot's state of them."""
    device: DeviceSize
    layers: int
    first: int
    last: int
    weights: int
    per_position: int
    fixed: int
    carried: int          # one slot's carried state of these layers (kept per draft position)


def _keeping_hot_experts(splits: tuple[DeviceSize, ...]) -> set[str]:
    """The split devices whose layers keep hot experts on the target: GPUs, not host memory
    (hot_experts.hot_layers)."""
    return {device.name for device in splits if device.kind != "cpu"}


def split_inputs(facts: ModelFacts, splits: tuple[DeviceSize, ...], counts: tuple[int, ...], ple_on_host: bool,
                 hot_experts: int = 0) -> tuple[DevicePart, list[DevicePart]]:
    """The target's part and each split device's when split device j holds counts[j] whole layers, placed as
    placement.Placement.with_split places them: a layer's weights and its state go together; the target keeps the
    embedding, the LM head, the MTP head and its cache, the layers left, and copies of `hot_experts` experts of
    each split layer."""
    from .placement import Placement

    layer_bytes = list(facts.layers)
    if ple_on_host and facts.ple_table:        # the table sits in its layer's bytes; in host memory it is not
        for layer_id in facts.cfg.ple_layer_ids:
            layer_bytes[layer_id - 1] -= facts.ple_table // len(facts.cfg.ple_layer_ids)
    target = DeviceSize("target", "target", "", 0)
    placement = Placement.with_split(target.name, len(layer_bytes), [(d.name, c) for d, c in zip(splits, counts)])

    def part(device: DeviceSize) -> DevicePart:
        held = [i for i, name in enumerate(placement.layers) if name == device.name]
        return DevicePart(device, len(held), held[0] if held else 0, held[-1] if held else -1,
                          sum(layer_bytes[i] for i in held), sum(facts.layer_states[i][0] for i in held),
                          sum(facts.layer_states[i][1] for i in held), sum(facts.layer_carried[i] for i in held))

    parts = [part(device) for device in splits]
    on_target = part(target)
    # The target's own bytes besides its layers (embedding, LM head, MTP head and its cache): the whole model's less
    # what the split devices hold.
    keeping = _keeping_hot_experts(splits)
    hot = hot_experts * sum(facts.layer_experts[i] for i, name in enumerate(placement.layers) if name in keeping)
    return replace(on_target, weights=facts.on_device(ple_on_host) - sum(p.weights for p in parts) + hot,
                   per_position=facts.per_position - sum(p.per_position for p in parts),
                   fixed=facts.fixed - sum(p.fixed for p in parts)), parts


# ---- sizes from flags or a profile --------------------------------------------------------------------------------
def _given(device: DeviceSize, where: str) -> DeviceSize:
    """A device whose size the operator gave, refused where the driver's share leaves nothing (a forgotten unit)."""
    if device.total <= device.reserved:
        raise EstimateError(f"{where}: {human_size(device.total)} is no more than the {human_size(device.reserved)} "
                            f"the driver and context take: a size without its unit? (e.g. 80GiB)")
    return device


def parse_devices(text: str, kind: str, limit: int | None) -> tuple[DeviceSize, tuple[DeviceSize, ...]]:
    """--devices target=SIZE[,split=SIZE...] (sizes as profiles write them): the target and any split devices."""
    from ..config.sizes import parse_size

    target, splits = None, []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        role, _, size = part.partition("=")
        role = role.strip().lower()
        if role not in ("target", "split") or not size.strip():
            raise EstimateError(f"--devices: {part!r} is not ROLE=SIZE with ROLE target or split "
                                f"(e.g. --devices target=32GiB,split=128GiB)")
        try:
            total = parse_size(size.strip())
        except ValueError as err:
            raise EstimateError(f"--devices: {role}={size}: {err}") from None
        if total <= 0:
            raise EstimateError(f"--devices: {role}={size} must be more than 0 bytes")
        if role == "target":
            if target is not None:
                raise EstimateError("--devices names the target twice; one device is the target")
            target = _given(DeviceSize("target", "target", kind, total, limit), f"--devices {part}")
        else:
            splits.append(_given(DeviceSize("split", "split", kind, total), f"--devices {part}").total)
    if target is None:
        raise EstimateError(f"--devices {text!r} names no target (e.g. --devices target=32GiB)")
    names = ["split"] if len(splits) == 1 else [f"split{i + 1}" for i in range(len(splits))]
    return target, tuple(DeviceSize("split", name, kind, total) for name, total in zip(names, splits))


def measured_size(role: str, name, limit: int | None, host_reserve: int = 0) -> DeviceSize:
    """A device of this box as the engine would use it now: what it has free (fit_measure.usable_capacity, nothing
    held yet), capped by `limit`; a device whose memory is the host's less `host_reserve` (the prefix cache's share
    of host memory, EngineConfig.host_snapshot_reserve)."""
    from .fit_measure import usable_capacity
    from .memory import as_device
    from .snapshot import snapshots_share_device_memory

    device = as_device(name)
    free = usable_capacity(device, 0)[0]
    shares_host = snapshots_share_device_memory(device)     # the CPU, or a GPU whose memory is the system's
    if shares_host:
        free = max(free - host_reserve, 1)
    return DeviceSize(role, str(name), device.type, free, limit, measured=True,
                      integrated=device.type == "cuda" and shares_host)


def profile_devices(settings) -> tuple[DeviceSize, tuple[DeviceSize, ...]]:
    """The target and split devices of a profile, with each one's `memory` (required for an estimate)."""
    def size(device, role: str) -> DeviceSize:
        if device.memory is None:
            raise EstimateError(f"profile devices: {device.name} ({role}) has no `memory`: an estimate needs each "
                                f"device's total memory (memory = \"32GiB\"), or give --devices")
        return _given(DeviceSize(role, device.name, device.kind, device.memory,
                                 settings.memory_limit_for(device) if role == "target" else device.memory_limit),
                      f"profile devices: {device.name} ({role}) memory")

    return size(settings.target, "target"), tuple(size(d, "split") for d in settings.split_devices)
