"""Our qwen4_exp against the reference (transformers' Qwen4ExpForCausalLM) on CPU in float32."""

from __future__ import annotations

import pytest
import torch

from qwen4exp.engine.generate import generate
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.causal_lm import Segment

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)


def _prompt(model, length: int, seed: int, eos_at: int | None = None) -> torch.Tensor:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.eos_token_id, (length,), generator=g)
    if eos_at is not None:
        ids[eos_at] = cfg.eos_token_id   # PLE's n-grams must reset after it
    return ids


def _all_logits(model, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    state = model.new_state(ids.numel() + 8)
    step = chunk or ids.numel()
    pieces = [model([Segment(ids[i:i + step], state)], all_logits=True)[0] for i in range(0, ids.numel(), step)]
    return torch.cat(pieces)


def test_prompt_is_past_the_qsa_dense_limit(ours):
    cfg = ours.config
    assert cfg.dense_limit < 300, "the parity prompts must exercise sparse selection"
    assert any(cfg.is_qsa(i) for i in range(cfg.num_hidden_layers))
    assert any(not cfg.is_qsa(i) for i in range(cfg.num_hidden_layers))
    assert cfg.ple_layer_ids and ours.mtp is not None


def test_logits_match_reference_at_every_position(ours, reference):
    ids = _prompt(ours, 300, seed=0, eos_at=150)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = _all_logits(ours, ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < TOL, f"max |ours - reference| over 300 positions is {diff:.3g}"
    assert expected.std() > 1.0, "random weights should give well-spread logits"


def test_greedy_ids_match_reference_over_64_tokens(ours, reference):
    ids = _prompt(ours, 120, seed=1)
    with torch.no_grad():
        ref = reference.generate(ids[None], max_new_tokens=64, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, min_new_tokens=64)
    expected = ref[0, ids.numel():].tolist()
    got = generate(ours, ids.tolist(), max_tokens=64).token_ids
    assert len(expected) == 64
    assert got == expected


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_prefill_equals_one_shot(ours, chunk):
    ids = _prompt(ours, 140, seed=2, eos_at=70)
    one_shot = _all_logits(ours, ids)
    chunked = _all_logits(ours, ids, chunk=chunk)
    diff = (chunked - one_shot).abs().max().item()
    assert diff < TOL, f"chunk {chunk}: max diff {diff:.3g}"
    greedy_one = generate(ours, ids.tolist(), max_tokens=16).token_ids
    greedy_chunked = generate(ours, ids.tolist(), max_tokens=16, chunk=chunk).token_ids
    assert greedy_chunked == greedy_one


def test_batch_of_different_lengths_equals_each_alone(ours):
    prompts = [_prompt(ours, n, seed=10 + n) for n in (5, 37, 180)]
    alone = [_all_logits(ours, p) for p in prompts]
    states = [ours.new_state(200) for _ in prompts]
    together = ours([Segment(p, s) for p, s in zip(prompts, states)], all_logits=True)
    for a, t in zip(alone, together):
        assert (a - t).abs().max().item() < TOL
    # Decode a few steps together: each sequence's tokens equal its solo greedy run.
    solo = [generate(ours, p.tolist(), max_tokens=6).token_ids for p in prompts]
    tokens = [[int(torch.argmax(t[-1]))] for t in together]
    for _ in range(5):
        logits = ours([Segment(torch.tensor(tok[-1:]), s) for tok, s in zip(tokens, states)])
        for tok, lg in zip(tokens, logits):
            tok.append(int(torch.argmax(lg)))
    assert tokens == solo
