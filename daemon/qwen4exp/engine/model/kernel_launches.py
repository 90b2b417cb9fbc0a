"""Every kernel launch the engine makes for a model config on a GPU target, recorded without the GPU.

The model is built on the meta device (no memory) under guard.compiling_for(target): it picks the Triton ops,
and every choice a kernel makes from its device's limits (pipeline stages) reads the target's. Then it runs the
shapes the engine runs: prompt chunks (whole chunks of 512-4096 tokens, a prompt's last chunk of any length;
at the start of a prompt, where QSA is still dense, and past the indexer's dense reach), decode steps of 1-16 rows
and, for a model with an MTP head, the verify steps of speculative decoding; ahead_of_time.build compiles what
was recorded. tests/test_kernel_builds.py runs this for the bench and full presets and each of
guard.CHECKED_TARGETS; `qwen4exp kernels` prints it for one target.
"""

from __future__ import annotations

import sys

import torch

from ...checkpoint.gguf_loader import quantized_stacks
from ...checkpoint.gguf_writer import PlannedFile
from ...kernels import ahead_of_time, guard
from ...kernels import delta_rule as delta_rule_kernels
from ..engine_config import MAX_SLOTS
from ..state import SequenceState, StateBatch
from .causal_lm import Qwen4ExpForCausalLM
from .config import ModelConfig
from .ops import TorchOps
from .quantized import keep_quantized, regroup_q8_0
from .triton_ops import TritonOps

CHUNKS = (1, 37, 256, 512, 1024, 2048, 4096)   # a last chunk of any length (256: the short mix form); whole 512-4096
DECODE_ROWS = range(1, MAX_SLOTS + 1)
CAPACITY = 65536                           # a multiple of the planner's granule, as fitted contexts are
DTYPE = torch.bfloat16


class OwnKernels(TritonOps):
    """The Triton backend without fla's chunked delta rule (fla's kernels are fla's to build for each GPU): a
    long prompt chunk's delta rule in its torch form, as on an install without fla."""

    def delta_rule(self, q, k, v, a, b, a_log, dt_bias, recurrent, step):
        ours = step.decode or delta_rule_kernels.runs_token_loop(q.shape[0])
        form = TritonOps if ours else TorchOps
        return form.delta_rule(self, q, k, v, a, b, a_log, dt_bias, recurrent, step)


def _op_in_flight() -> str:
    """The ops-backend method that launches the kernel being recorded (the innermost on the stack)."""
    frame = sys._getframe(2)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), TritonOps) and not frame.f_code.co_name.startswith("_"):
            return frame.f_code.co_name
        frame = frame.f_back
    return "model"


def quantized_for(config: ModelConfig, gguf: str) -> dict:
    """What a GGUF keeps quantized, for `record`: of the file at path `gguf`, or of a file of `config` at the
    mix named `gguf` (gguf_writer.MIXES or one block type); for one of our FP8 block types, what an FP8 checkpoint
    of `config` keeps float8 in it (checkpoint/fp8.py)."""
    from ...checkpoint import fp8
    from ...checkpoint.gguf_file import GGUFCheckpoint, is_gguf
    from ...checkpoint.fp8_stacks import planned_fp8_stacks

    if gguf in fp8.KEPT_TYPES:      # every weight an FP8 checkpoint keeps float8, in this one type where it fits
        run = fp8.KEPT_TYPES[gguf]
        return {name: (gguf, shape) for name, (_, shape) in planned_fp8_stacks(config, (run, run)).items()
                if shape[-1] % run == 0}

    return quantized_stacks(GGUFCheckpoint(gguf) if is_gguf(gguf) else PlannedFile(config, gguf), config)


def record(config: ModelConfig, target: guard.Target, chunks=CHUNKS, decode_rows=DECODE_ROWS,
           device: torch.device | None = None, quantized: dict | None = None, starts: tuple[int, ...] | None = None,
           capacity: int = CAPACITY) -> list[ahead_of_time.Launch]:
    """The distinct kernel launches of prefill and decode for `config` on `target` (guard.NOT_BUILT's ops
    included: they are what is left out there, and why). With a GPU `device` (of `target`), the kernels also run
    there, and each launch keeps the hash of the binary Triton's launcher compiled for it. `quantized`: the
    weights a GGUF keeps as blocks (quantized_for), as build_model takes them. `starts`: the positions the prompt
    chunks start at (default: the prompt's start and the first grid position past QSA's dense reach), in states
    of `capacity` positions."""
    device = device or torch.device("meta")
    with guard.compiling_for(target), ahead_of_time.recording(_op_in_flight, launch=device.type != "meta") as launches:
        with device:
            model = Qwen4ExpForCausalLM(config)
            keep_quantized(model, quantized or {}, DTYPE)
            regroup_q8_0(model)          # as a load does (engine/loading.py)
            model = model.to(DTYPE)
        model.ops = OwnKernels()   # every kernel of ours, also those NOT_BUILT leaves out on this target
        # QSA attends densely while a query sees no more than the indexer's budget; a chunk on the engine's
        # grid (multiples of the largest chunk) past that point ranks the blocks.
        for start in starts or (0, (config.dense_limit // max(chunks) + 1) * max(chunks)):
            for chunk in chunks:
                state = SequenceState(config, capacity, device, DTYPE)
                state.length = start
                model(torch.zeros(chunk, dtype=torch.long, device=device), state)
        rope = model.rope_table(capacity, device)
        for rows in decode_rows:
            states = StateBatch(config, rows, capacity, device, DTYPE)
            ids = torch.zeros(rows, dtype=torch.long, device=device)
            model.decode_rows(ids, ids, torch.ones(rows, dtype=torch.bool, device=device), states, rope)
        if model.mtp is not None:
            _record_drafter(model, chunks, decode_rows, capacity, device, rope)
            _record_verify(model, decode_rows, capacity, device, rope)
    return ahead_of_time.distinct(launches)


def _record_verify(model: Qwen4ExpForCausalLM, decode_rows, capacity: int, device: torch.device, rope) -> None:
    """A verify step's launches (speculative decoding, model/verify.py), the MTP head's pass over its positions
    included: the positions go through the row-wise kernels together and through the per-phase ops' kernels that
    take every sub-step in one launch. Two sub-steps a row: no kernel specializes on their count."""
    for rows in decode_rows:
        states = model.new_state_batch(rows, capacity, device)
        states.allocate_history(1)
        ids = torch.zeros(2 * rows, dtype=torch.long, device=device)
        on = torch.ones(2 * rows, dtype=torch.bool, device=device)
        _, streams = model.verify_rows(ids, ids, on, states, rope, 2)
        model.draft_rows(streams, ids, ids, on, states, rope, 2)


def _record_drafter(model: Qwen4ExpForCausalLM, chunks, decode_rows, capacity: int, device: torch.device,
                    rope) -> None:
    """The MTP head's launches: over a prompt's chunks (its cache filled as drafting reads it) and over each decode
    step's rows (a draft). Its layer may take kernels the main layers do not: a GGUF's quantized experts beside the
    dense ones of a head from a safetensors release."""
    width = model.config.hc_count * model.config.hidden_size
    for chunk in chunks:
        state = model.new_state(capacity, device)
        model.draft_chunk(torch.zeros(chunk, width, dtype=DTYPE, device=device),
                          torch.zeros(chunk, dtype=torch.long, device=device), state, 0)
    for rows in decode_rows:
        states = model.new_state_batch(rows, capacity, device)
        ids = torch.zeros(rows, dtype=torch.long, device=device)
        model.draft_rows(torch.zeros(rows, width, dtype=DTYPE, device=device), ids, ids,
                         torch.ones(rows, dtype=torch.bool, device=device), states, rope)
