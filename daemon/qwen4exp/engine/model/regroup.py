"""Q8_0 weights regrouped after a load as Q8_0_256 (kernels/quant_tiles.LAYOUTS): eight blocks' scales, then their
256 quants, so each group's quants start 16-byte aligned and the kernels load them in vectors. The same bytes and
values: every product is unchanged (tests/test_quant_blocks.py), and a GGUF writer writes them back as Q8_0."""

from __future__ import annotations

import torch
from torch import nn

from . import quant_blocks
from .quantized import QuantizedStack
from .shared_input import SharedInputProjections


# Rows regrouped at a time: bounds the temporary a regroup allocates (the full model's LM head is 675 MB of blocks).
_REGROUP_BYTES = 64 << 20


@torch.no_grad()
def regroup_q8_0(model: nn.Module) -> int:
    """Every Q8_0 stack whose rows hold whole groups of 256 values becomes Q8_0_256 in place (quant_tiles.LAYOUTS:
    the same bytes and values, its quants 16-byte aligned for the kernels' loads), after the weights are loaded.
    The stacks regrouped."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedStack) and module.qtype == "Q8_0" and module.shape[-1] % 256 == 0:
            rows = module.blocks.view(-1, module.blocks.shape[-1])
            if not rows.is_meta:
                for part in rows.split(max(1, _REGROUP_BYTES // rows.shape[1])):
                    part.copy_(quant_blocks.group_q8_0(part))
            module.qtype = "Q8_0_256"
            count += 1
    if count:
        for module in model.modules():     # a joined stack holds its members' bytes: joined again, typed anew
            if isinstance(module, SharedInputProjections) and any(
                    isinstance(stack, QuantizedStack) and stack.qtype != module.input_weights()[members[0]].qtype
                    for stack, members in module.input_runs):
                module.stack_input_weights()
    return count
