"""Our qwen4_exp against the reference (transformers' Qwen4ExpForCausalLM) on CPU in float32."""

from __future__ import annotations

import pytest
import torch

from qwen4exp.engine.generate import generate
from qwen4exp.engine.loading import load_model

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
    pieces = [model(ids[i:i + step], state, all_logits=True) for i in range(0, ids.numel(), step)]
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
    got = generate(ours, ids.tolist(), max_tokens=64).output_ids
    assert len(expected) == 64
    assert got == expected


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_prefill_equals_one_shot(ours, chunk):
    ids = _prompt(ours, 140, seed=2, eos_at=70)
    one_shot = _all_logits(ours, ids)
    chunked = _all_logits(ours, ids, chunk=chunk)
    diff = (chunked - one_shot).abs().max().item()
    assert diff < TOL, f"chunk {chunk}: max diff {diff:.3g}"


@pytest.mark.parametrize("chunk", [4, 64])
def test_greedy_answer_is_the_same_at_any_chunk(ours, chunk):
    """The engine cuts prompts on the QSA block (multiples of 4): at any such chunk, the answer of one forward."""
    ids = _prompt(ours, 140, seed=2, eos_at=70).tolist()
    assert generate(ours, ids, max_tokens=16, chunk=chunk).output_ids == generate(ours, ids, max_tokens=16).output_ids


def test_decode_rows_of_different_lengths_equal_each_alone(ours):
    """Three sequences at different positions (and an idle row) decoded together over one state batch: each row's
    logits equal that sequence's own one-token chunks, step after step."""
    prompts = [_prompt(ours, n, seed=10 + n) for n in (5, 37, 180)]
    batch = ours.new_state_batch(4, 200)
    alone = [ours.new_state(200) for _ in prompts]
    tokens = []
    for p, row, solo in zip(prompts, batch.rows, alone):
        ours(p, row)
        tokens.append(int(torch.argmax(ours(p, solo))))
    rope = ours.rope_table(200, torch.device("cpu"))
    active = torch.tensor([True, True, True, False])
    for _ in range(5):
        positions = torch.tensor([row.length for row in batch.rows])
        together = ours.decode_rows(torch.tensor(tokens + [0]), positions, active, batch, rope)
        for i, solo in enumerate(alone):
            want = ours(torch.tensor(tokens[i:i + 1]), solo)
            assert (together[i] - want).abs().max().item() < TOL
            batch.rows[i].length += 1
            tokens[i] = int(torch.argmax(want))
