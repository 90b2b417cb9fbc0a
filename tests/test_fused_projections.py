"""Projections that read the same input run as one product (engine/model/shared_input.py): Gated DeltaNet's
in_proj_qkv/z/b/a, the MoE block's router, shared-expert gate/up and shared-expert gate, and a hyper-connection's
mixing down-projection and injection gates. The one product must give what the separate products give, its weight
must be the loaded parameters' own memory (no copy), and training must still reach every weight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model import moe
from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.model.gated_deltanet import GatedDeltaNet
from qwen4exp.engine.model.hyper import GatedResidual
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.engine.model.shared_input import SharedInputProjections
from qwen4exp.engine.model.step import Step
from qwen4exp.engine.model.training import training_forward

TORCH_CHUNK = SimpleNamespace(ops=TORCH_OPS, decode=False)   # what a row-wise module reads of a step
EPS = torch.finfo(torch.float32).eps
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)


def stacked_modules(model) -> list[SharedInputProjections]:
    return [m for m in model.modules() if isinstance(m, SharedInputProjections)]


def separate_products(module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each projection on its own, picked by name (a stack in the wrong order shows as a mismatch)."""
    if isinstance(module, GatedDeltaNet):
        return module.in_proj_qkv(x), module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)
    if isinstance(module, GatedResidual):
        inject = (module.block_inject_weight(x),) if module.block_inject_weight is not None else ()
        return module.input_mix_weight_down(x), *inject
    return (F.linear(x, module.gate.weight), module.shared_expert.gate_proj(x), module.shared_expert.up_proj(x),
            module.shared_expert_gate(x))


def unfused_moe(block, x: torch.Tensor) -> torch.Tensor:
    """The MoE block as it was written before the stack: router, shared expert and its gate each on x."""
    ids, weights = moe.route(F.linear(x, block.gate.weight), block.gate.top_k, block.gate.normalize)
    expert = block.shared_expert
    shared = expert.down_proj(F.silu(expert.gate_proj(x)) * expert.up_proj(x))
    routed = moe.experts_grouped(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj)
    return routed + torch.sigmoid(block.shared_expert_gate(x)) * shared


@torch.no_grad()
def test_one_product_gives_the_separate_products(model):
    gen = torch.Generator().manual_seed(0)
    worst_abs = worst_eps = 0.0
    widest = 0
    for module in stacked_modules(model):
        width = module.input_weights()[0].shape[1]
        widest = max(widest, width)
        for rows in (1, 4, 300):
            x = torch.randn(rows, width, generator=gen)
            fused = module.project_input(x, TORCH_CHUNK)
            alone = separate_products(module, x)
            for f, a, w in zip(fused, alone, module.input_weights(), strict=True):
                assert f.shape == a.shape
                # The same dot products, but MKL sums a narrow product (a few outputs) in another order than a
                # wide one, so they may differ by rounding: measured against sum |x_i w_i|, in float32 eps.
                worst_abs = max(worst_abs, (f - a).abs().max().item())
                worst_eps = max(worst_eps, ((f - a).abs() / (x.abs() @ w.abs().T)).max().item() / EPS)
    print(f"max |one product - separate products|: {worst_abs:.3g} ({worst_eps:.2f} eps of sum |x w|)")
    # A reordered K-term sum is within K eps of it in the worst case; sqrt(K) eps is the tight, typical bound.
    assert worst_eps <= widest ** 0.5, f"{worst_abs:.3g} ({worst_eps:.2f} eps)"


@torch.no_grad()
def test_blocks_match_their_unfused_forms(model, monkeypatch):
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, cfg.hidden_size, generator=gen)
    active = torch.tensor([True, False, True])
    rope = model.rope_table(64, torch.device("cpu"))

    def chunk(state):
        return Step(TORCH_OPS, torch.zeros(40, dtype=torch.long), torch.arange(40), state, *rope)

    def rows(batch):
        return Step.rows(TORCH_OPS, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), active, batch,
                         rope)

    checked_gdn = False
    for index, layer in enumerate(model.model.layers):
        assert (layer.mlp(x, TORCH_CHUNK) - unfused_moe(layer.mlp, x)).abs().max().item() < TOL
        if not hasattr(layer, "linear_attn"):
            continue
        gdn = layer.linear_attn
        fused_state, alone_state = model.new_state(64), model.new_state(64)
        fused_batch, alone_batch = model.new_state_batch(3, 8), model.new_state_batch(3, 8)
        fused = [gdn(x, chunk(fused_state), fused_state.layers[index]),
                 gdn(x[:3], rows(fused_batch), fused_batch.layers[index])]
        with monkeypatch.context() as patch:
            patch.setattr(gdn, "project_input", lambda x, step, gdn=gdn: separate_products(gdn, x))
            alone = [gdn(x, chunk(alone_state), alone_state.layers[index]),
                     gdn(x[:3], rows(alone_batch), alone_batch.layers[index])]
        for f, a in zip(fused + fused_state.carried() + fused_batch.rows[0].carried(),
                        alone + alone_state.carried() + alone_batch.rows[0].carried(), strict=True):
            assert (f - a).abs().max().item() < TOL
        checked_gdn = True
    assert checked_gdn


def _tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(preset_config("tiny", dtype="float32"))


@pytest.mark.parametrize("build", ["load_model", "random_model", "constructed, then .to(float64)"])
def test_the_stack_is_the_weights_own_memory(build, tiny_checkpoint):
    if build == "load_model":
        built = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)
    elif build == "random_model":
        built = random_model("tiny", dtype=torch.float32, device="cpu", seed=1)
    else:
        built = Qwen4ExpForCausalLM(_tiny_config()).to(torch.float64)
    modules = stacked_modules(built)
    assert modules
    for module in modules:
        stack, start = module.input_stack, 0
        assert stack.dtype == next(built.parameters()).dtype
        for w in module.input_weights():
            assert w.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
            assert w.data_ptr() == stack[start].data_ptr()
            start += w.shape[0]
        assert start == stack.shape[0] and stack.untyped_storage().nbytes() == stack.numel() * stack.element_size()
        # A load writes each weight in place; the product sees it.
        with torch.no_grad():
            module.input_weights()[-1].fill_(2.0)
            assert torch.equal(stack[-1], torch.full_like(stack[-1], 2.0))
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in built.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in built.parameters())


def test_training_reaches_every_stacked_weight(tiny_checkpoint):
    trained = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, trained.config.eos_token_id, (2, 12), generator=gen)
    out = training_forward(trained, ids, mtp=False, aux=True)
    assert out.balance_loss.item() > 0, "the router's training hook must still see its calls"
    (out.logits.square().mean() + out.balance_loss).backward()
    for module in stacked_modules(trained.model):   # the MTP head is left out (mtp=False)
        for w in module.input_weights():
            assert w.grad is not None and w.grad.abs().sum().item() > 0

    block = trained.model.layers[0].mlp
    x = torch.randn(10, trained.config.hidden_size, generator=gen)
    fused = torch.autograd.grad(block(x, TORCH_CHUNK).square().sum(), block.input_weights())
    alone = torch.autograd.grad(unfused_moe(block, x).square().sum(), block.input_weights())
    for f, a in zip(fused, alone, strict=True):
        assert (f - a).abs().max().item() < 1e-4 * max(1.0, a.abs().max().item())
