"""The embedded default model (qwen4exp/assets/tiny_model): it loads, answers in readable English, deterministically."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import qwen4exp
from qwen4exp.checkpoint.loader import read_config
from qwen4exp.engine.generate import generate
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.training import training_forward, training_logits
from qwen4exp.tokenizer import Tokenizer

ASSET = Path(qwen4exp.__file__).resolve().parent / "assets" / "tiny_model"
WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
VERSE = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: "
         "and God divided the light from the darkness.")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model is too small to gain from two threads, and on a busy 2-core machine two OpenMP threads stall at
    every barrier (seen: one 24-token generate taking 13 s instead of 0.1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(one_thread):
    return load_model(str(ASSET), dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(ASSET)


@pytest.fixture(scope="module")
def known_words() -> frozenset[str]:
    return frozenset((ASSET / "words.txt").read_text().split())


def readability(text: str, known: frozenset[str]) -> tuple[int, float, int]:
    """(words, share of them that are corpus words, distinct words)."""
    words = WORD.findall(text.lower())
    share = sum(w in known for w in words) / max(1, len(words))
    return len(words), share, len(set(words))


def assert_readable(text: str, known: frozenset[str]) -> None:
    count, share, distinct = readability(text, known)
    assert count >= 10, f"too few words: {text!r}"
    assert share >= 0.8, f"only {share:.0%} of the words are English words of the corpus: {text!r}"
    assert distinct >= 6, f"degenerate repetition ({distinct} distinct words): {text!r}"


def test_the_asset_is_a_complete_small_checkpoint(model, tok):
    names = {p.name for p in ASSET.iterdir()}
    for required in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "words.txt", "README.md"):
        assert required in names
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 20 * 1024 * 1024
    readme = (ASSET / "README.md").read_text()
    assert "public domain" in readme and "scripts/train_tiny_model.py" in readme
    cfg = model.config
    assert [cfg.is_qsa(i) for i in range(cfg.num_hidden_layers)] == [False, False, False, True] * (
        cfg.num_hidden_layers // 4)
    assert cfg.ple_layer_ids == (2,) and cfg.num_experts >= 8 and cfg.num_experts_per_tok == 2
    assert cfg.hc_count == 4 and model.mtp is not None
    eos = cfg.eos_token_id
    assert [tok.encode(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [[eos], [eos + 1], [eos + 2]]
    assert json.loads((ASSET / "generation_config.json").read_text())["eos_token_id"] == [eos, eos + 2]


def test_greedy_completion_is_readable_english(model, tok, known_words):
    result = generate(model, tok.encode("And God said unto Noah,"), max_tokens=40)
    assert_readable(tok.decode(result.output_ids), known_words)


def test_chat_answer_is_readable_and_ends(model, tok, known_words):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Who made the heaven and the earth?"}])
    result = generate(model, tok.encode(prompt), max_tokens=80, stop_ids=tuple(tok.eos_token_ids))
    assert_readable(tok.decode(result.output_ids, skip_special_tokens=True), known_words)
    assert result.finish_reason == "stop", "the answer should end with <|im_end|>"


def test_greedy_is_deterministic(model, tok):
    ids = tok.encode("Blessed are the poor in spirit: for theirs is the kingdom of heaven.")
    assert len(ids) > 8, "the chunked run must cut the prompt into several forwards"
    first = generate(model, ids, max_tokens=24).output_ids
    assert generate(model, ids, max_tokens=24).output_ids == first
    assert generate(model, ids, max_tokens=24, chunk=4).output_ids == first


def test_training_forward_is_the_serving_forward(model, tok):
    ids = torch.tensor(tok.encode(VERSE))
    assert ids.numel() > model.config.dense_limit, "the check must reach sparse QSA selection"
    served = model(ids, model.new_state(ids.numel()), all_logits=True)
    with torch.no_grad():
        trained = training_logits(model, ids[None])[0]
    assert (trained - served).abs().max().item() < 1e-4


def test_mtp_head_is_trained(model, tok):
    """The MTP head predicts token t+2 far better than chance (ln V), and not better than the main model's t+1."""
    ids = torch.tensor(tok.encode(VERSE))[None]
    with torch.no_grad():
        out = training_forward(model, ids, mtp=True, aux=False)
    vocab = out.logits.shape[-1]
    main = F.cross_entropy(out.logits[0, :-1], ids[0, 1:]).item()
    mtp = F.cross_entropy(out.mtp_logits[0, :-1], ids[0, 2:]).item()
    assert mtp < 0.6 * torch.log(torch.tensor(float(vocab))).item()
    assert main < mtp


def test_transformers_loads_it_with_the_same_logits(model, tok):
    transformers = pytest.importorskip("transformers")
    reference, info = transformers.Qwen4ExpForCausalLM.from_pretrained(ASSET, output_loading_info=True,
                                                                       dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    ids = torch.tensor(tok.encode(VERSE))
    with torch.no_grad():
        expected = reference.eval()(ids[None]).logits[0]
    got = model(ids, model.new_state(ids.numel()), all_logits=True)
    assert (got - expected).abs().max().item() < 1e-4
    assert read_config(ASSET)["vocab_size"] == expected.shape[-1]
