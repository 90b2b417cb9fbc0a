"""Every kernel a prompt can launch, compiled before the first request.

Triton builds a binary for each kind of a kernel's int arguments (1, a multiple of 16, any other) and each set of
its constexprs. The counts that follow a prompt's length (a chunk's rows, its expert pairs, the ids it looks up)
are not specialized on (the kernels' do_not_specialize), so what tells a prompt chunk's binaries apart is its
kind: one token, a few (the block products' few-row kernel past 16 rows goes to the dequantized GEMM), a short
chunk (the hyper-connection mix takes another form past 64 rows and again past hyper.SHORT_ROWS; quantized
experts run small row blocks below 24 pairs an expert, full ones from there, and their stacks are dequantized whole
from 64 pairs an expert: kernels/moe.py's GroupedForm), a whole chunk, from the prompt's start or past QSA's dense
reach (where the indexer ranks blocks). Chunks start on the chunk grid
(restores too: spacings divide the chunk), so their positions are multiples of 16 alike.

`warm_up` runs one chunk of each kind on a free slot's state and empties it again. A prompt of any length then
runs binaries that exist (tests/test_kernel_builds.py holds the launches of many lengths to these), instead of
compiling on a request's path: seconds on a machine's first start, a load from Triton's cache after that. The
decode step needs none of this: its CUDA graph is captured when the engine is made.
"""

from __future__ import annotations

import torch

from ..kernels import hyper, moe
from .memory import release_cached_blocks
from .model.causal_lm import Qwen4ExpForCausalLM
from .state import SequenceState

# One token; a few (more than the block products' 16 rows, the experts' tiles dequantized); a short chunk's most.
PROMPT_ROWS = (1, 37, hyper.SHORT_ROWS)


def full_row_blocks_from(cfg) -> int:
    """The fewest rows of a chunk whose quantized experts run full row blocks (moe.grouped_form)."""
    return -(-moe.SMALL_BELOW * cfg.num_experts // cfg.num_experts_per_tok)


def warm_up_chunks(cfg, chunk: int, capacity: int) -> list[tuple[int, int]]:
    """(start position, rows) of each kind of prompt chunk that a slot of `capacity` tokens can hold."""
    past_dense = (cfg.dense_limit // chunk + 1) * chunk      # the first chunk-grid position past the dense reach
    rows = sorted({*(r for r in (*PROMPT_ROWS, full_row_blocks_from(cfg)) if r < chunk), chunk})
    return [(start, n) for start in (0, past_dense) for n in rows if start + n <= capacity]


def warm_up(model: Qwen4ExpForCausalLM, state: SequenceState, chunk: int, device: torch.device,
            drafting: bool = False) -> None:
    """Each kind of prompt chunk through `model` on `state` (a free slot's: emptied again after; its K/V past
    the start position hold whatever they held, which nothing reads once it is emptied); with `drafting` (an
    engine with mtp), through the MTP head too, which takes each prompt chunk's positions into its cache."""
    width, dtype = model.config.hc_count * model.config.hidden_size, model.lm_head.weight.dtype
    try:
        for start, rows in warm_up_chunks(model.config, chunk, state.capacity):
            state.reset()
            state.length = start
            ids = torch.zeros(rows, dtype=torch.long, device=device)
            model(ids, state)
            if drafting:
                model.draft_chunk(torch.zeros(rows, width, dtype=dtype, device=device), ids, state, start)
    finally:
        state.reset()
        release_cached_blocks(device)
