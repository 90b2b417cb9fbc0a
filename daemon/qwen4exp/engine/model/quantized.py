"""Weights kept as GGML blocks, as a quantized GGUF stores them: the expert stacks (95% of the model's bytes), the
embedding tables (the PLE table is its largest tensor), the projections and the LM head stay quantized. An FP8
checkpoint's expert stacks and PLE table stay float8 the same way, as our FP8 block types (checkpoint/fp8.py).

A `QuantizedStack` stands where the model keeps a dense tensor: `Experts`' [E, rows, cols] stacks, the [rows,
dim] embedding tables (the module itself), and the [out, in] weights a layer multiplies through the ops
backend's `linear`. `blocks` is uint8 [..., row bytes] of one block type; indexing it (an int or a tensor of ids,
as the torch forms index the dense tensors), or calling it as an embedding, gives those entries dequantized
(quant_blocks.py, bit for bit llama.cpp's values) in the model's dtype, and `dequantize()` the whole tensor. The
torch forms therefore run on its dense twin; the Triton backend's kernels read the blocks themselves and
dequantize in registers (kernels/moe_blocks.py, block_products.py, quant_tiles.gather_rows).
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant_blocks


_STACKS = (".experts.gate_up_proj", ".experts.down_proj")
_LINEAR = ("lm_head.weight", ".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
           ".in_proj_qkv.weight", ".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight", ".out_proj.weight",
           ".input_mix_weight_down.weight", ".block_inject_weight.weight", ".shared_expert.gate_proj.weight",
           ".shared_expert.up_proj.weight", ".shared_expert.down_proj.weight", ".key_proj.weight",
           ".value_proj.weight")
_TABLES = (".ple_embedding.ngram_embedding.weight", "model.embed_tokens.weight")


def kept_name(target: str) -> str | None:
    """The QuantizedStack a runtime tensor becomes where a checkpoint keeps it as blocks (a GGUF's, an FP8
    checkpoint's): the expert stacks, the projections and the LM head themselves, the embedding modules of the
    tables; None where the model takes no stack."""
    if target.endswith(_STACKS + _LINEAR):
        return target
    return target.removesuffix(".weight") if target.endswith(_TABLES) else None


class QuantizedStack(nn.Module):
    """A tensor of `shape` kept as `qtype` blocks, read by entries of its first axis (see the module's text)."""

    def __init__(self, qtype: str, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        values, size = quant_blocks.LAYOUTS[qtype]
        if shape[-1] % values:
            raise ValueError(f"{qtype} rows hold whole blocks of {values} values; these rows have {shape[-1]}")
        self.qtype, self.shape, self.dtype = qtype, tuple(shape), dtype
        self.host = False
        self.register_buffer("blocks", torch.empty(*shape[:-1], shape[-1] // values * size, dtype=torch.uint8))

    def __getitem__(self, index) -> torch.Tensor:
        """The entries `index` selects along the first axis, dequantized (an expert's [rows, cols] for an int), on
        the index's device (a tensor index) or the blocks' (else)."""
        device = index.device if isinstance(index, torch.Tensor) else self.blocks.device
        if isinstance(index, torch.Tensor):
            index = index.to(self.blocks.device)
        return quant_blocks.dequantize(self.blocks[index], self.qtype).to(device=device, dtype=self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """As an embedding table: the rows of `ids` (any shape) -> [*ids.shape, dim]."""
        return self[ids]

    def dequantize(self) -> torch.Tensor:
        return self[:]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def keep_on_host(self) -> None:
        """Keep the blocks in host memory, pinned where a GPU is present (a GPU reads the rows it looks up there in
        place: kernels/quant_tiles.gather_rows), whatever device the model is moved to."""
        if self.blocks.is_meta:      # not allocated yet (a model being built): the host's copy is the first
            blocks = torch.empty(self.blocks.shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        else:
            blocks = self.blocks.to("cpu")
            blocks = blocks.pin_memory() if torch.cuda.is_available() else blocks
        self.blocks = blocks
        self.host = True

    def _apply(self, fn, recurse=True):
        # A cast of the model (.to(dtype), .half()) changes the dtype the experts are dequantized to; the blocks
        # stay uint8 and only move (unless kept on the host).
        blocks = self.blocks
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=blocks.device)).dtype
        if self.host:
            self.blocks = blocks
        return self

    def extra_repr(self) -> str:
        return f"{self.qtype}, shape={self.shape}, dtype={self.dtype}" + (", on the host" if self.host else "")


def keep_quantized(model: nn.Module, stacks: dict[str, tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> None:
    """Put a QuantizedStack of (type, shape) in place of each named dense tensor or embedding module of `model`
    (built on meta, before its memory is allocated, so the dense ones never are)."""
    for name, (qtype, shape) in stacks.items():
        owner_name, attr = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        delattr(owner, attr)
        setattr(owner, attr, QuantizedStack(qtype, shape, dtype))


# Rows regrouped at a time: bounds the temporary a regroup allocates (the full model's LM head is 675 MB of blocks).
_REGROUP_BYTES = 64 << 20


@torch.no_grad()
def regroup_q8_0(model: nn.Module) -> int:
    """Every Q8_0 projection (a Linear's weight: the decode products' operand) whose rows are a multiple of 256 values
    becomes Q8_0_R in place (quant_tiles.LAYOUTS: the same bytes and values, each row's quants 16-byte aligned), after
    its weights are loaded; embeddings and experts stay Q8_0. The decode products then load the quants in 16-byte
    vectors and give the same results bit for bit (docs/PERFORMANCE.md). Returns how many were regrouped."""
    count = 0
    for owner in model.modules():
        stack = getattr(owner, "weight", None) if isinstance(owner, nn.Linear) else None
        if isinstance(stack, QuantizedStack) and stack.qtype == "Q8_0" and stack.shape[-1] % 256 == 0:
            rows = stack.blocks.view(-1, stack.blocks.shape[-1])
            if not rows.is_meta:
                for part in rows.split(max(1, _REGROUP_BYTES // rows.shape[1])):
                    part.copy_(quant_blocks.split_q8_0(part))
            stack.qtype = "Q8_0_R"
            count += 1
    # A joined stack (shared_input.py's input_runs, read here by name: that module imports this one) holds its
    # members' bytes, which were regrouped in place through their views: it takes their type; a run whose members
    # now differ in type is joined again by type.
    for module in model.modules() if count else ():
        for stack, members in getattr(module, "input_runs", ()):
            kinds = {module.input_weights()[i].qtype for i in members} if isinstance(stack, QuantizedStack) else set()
            if len(kinds) == 1:
                stack.qtype = kinds.pop()
            elif kinds:
                module.stack_input_weights()
                break
    return count
