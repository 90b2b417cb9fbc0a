"""Which ops backend a model runs (engine/model/backend.py): the kernels only where guard.serves the weights' device
and dtype, chosen when the model is built and again whenever it is moved or cast."""

from __future__ import annotations

import torch

from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.engine.model.triton_ops import TRITON_OPS
from qwen4exp.kernels import guard


def test_the_kernels_serve_16_bit_models_on_gpus_only():
    gpu = torch.device("meta")                                     # stands for the H200 under compiling_for
    with guard.compiling_for(guard.CHECKED_TARGETS["sm_90"]):
        assert guard.serves(gpu, torch.bfloat16) == (guard.triton is not None)
        assert guard.serves(gpu, torch.float16) == (guard.triton is not None)
        assert not guard.serves(gpu, torch.float32)               # the reference setup keeps the torch forms
    assert not guard.serves(torch.device("cpu"), torch.bfloat16)


def test_the_backend_follows_the_model_when_it_is_cast_or_moved(monkeypatch):
    config = ModelConfig.from_dict(preset_config("tiny", dtype="float32"))
    monkeypatch.setattr(guard, "why_not", lambda device, dtype: None if dtype == torch.bfloat16 else "f32")  # a GPU
    model = Qwen4ExpForCausalLM(config)
    assert model.ops is TORCH_OPS
    assert model.to(torch.bfloat16).ops is TRITON_OPS
    assert model.float().ops is TORCH_OPS
    monkeypatch.setattr(guard, "why_not", lambda device, dtype: None if device.type == "meta" else "cpu")
    with torch.device("meta"):
        built = Qwen4ExpForCausalLM(config)
    assert built.ops is TRITON_OPS                                 # chosen when the model is built
    assert built.to_empty(device="cpu").ops is TORCH_OPS           # and again where a load puts it


def test_a_torch_form_of_the_experts_also_keeps_batched_chunks_apart():
    """On a GPU whose grouped expert kernels do not build, the experts run their torch form, whose sums may follow
    the row count: several prompt chunks then run the MoE chunk by chunk, not in one launch."""
    from qwen4exp.engine.model.ops import TorchOps
    from qwen4exp.engine.model.triton_ops import TritonOps, with_torch_forms

    backend = with_torch_forms(frozenset({"experts"}))
    assert backend.chunks_experts.__func__ is TorchOps.chunks_experts
    assert with_torch_forms(frozenset({"rotate"})).chunks_experts.__func__ is TritonOps.chunks_experts


def test_prompt_chunks_share_the_experts_launch_in_the_form_each_takes_alone(monkeypatch):
    """Quantized experts: short chunks whose sum would run full row blocks (or dequantize the stacks whole) still
    share one launch, in the small row blocks each runs alone; chunks of different forms run one by one."""
    from types import SimpleNamespace

    from qwen4exp.engine.model.quantized import QuantizedStack
    from qwen4exp.kernels import moe

    experts, top_k, hidden = 8, 2, 32
    stacks = SimpleNamespace(gate_up_proj=QuantizedStack("Q8_0", (experts, 64, hidden), torch.bfloat16),
                             down_proj=QuantizedStack("Q8_0", (experts, hidden, 32), torch.bfloat16))
    launches = []

    def grouped(x, ids, weights, gate_up, down, form=None, shared=None):
        launches.append((x.shape[0], form or moe.grouped_form(gate_up, down, ids.numel())))
        assert shared is not None and shared[0].shape == x.shape    # each chunk's shared term, joined as its rows
        return torch.zeros_like(x)

    def route(x, step):
        rows = x.shape[0]
        return x, torch.zeros(rows, top_k, dtype=torch.long), torch.ones(rows, top_k), (x, torch.zeros(rows, 1))

    monkeypatch.setattr(moe, "moe_grouped", grouped)
    block = SimpleNamespace(route=route, experts=stacks)
    step = SimpleNamespace(decode=False)
    small = moe.GroupedForm(moe.SMALL_BLOCK_M, False, False)
    short = [torch.zeros(60, hidden)] * 6        # 15 pairs an expert each; 90 together (past DENSE_FROM's 64)
    assert [out.shape[0] for out in TRITON_OPS.chunks_experts(block, short, [step] * 6)] == [60] * 6
    assert launches == [(360, small)]
    launches.clear()
    TRITON_OPS.chunks_experts(block, [torch.zeros(60, hidden), torch.zeros(100, hidden)], [step] * 2)
    assert launches == [(60, small), (100, moe.GroupedForm(moe.GROUPED_BLOCK_M, False, False))]
