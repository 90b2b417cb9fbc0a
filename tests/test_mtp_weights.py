"""A GGUF model's MTP head from a safetensors release of the same model (`mtp_weights`, checkpoint/mtp_weights.py):
the GGUF drafts with the trained head and answers as without it; only the shards holding the head are needed; a
head of another model, or none, is refused with the file and key that say why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qwen4exp.checkpoint.errors import CheckpointError
from qwen4exp.checkpoint.gguf_writer import write_gguf
from qwen4exp.checkpoint.loader import INDEX_FILE, read_config
from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.checkpoint.tokenizer_builder import build_tokenizer, chat_template
from qwen4exp.checkpoint.writer import write_random_checkpoint
from qwen4exp.config import ConfigError, check_profile
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.model_dir import EMBEDDED_MODEL
from qwen4exp.tokenizer import Tokenizer

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "The LORD is my shepherd;"]


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory) -> Path:
    """The embedded model as llama.cpp's converter would write it: no MTP head."""
    model = load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False)
    tokenizer = json.loads((EMBEDDED_MODEL / "tokenizer.json").read_text())
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, read_config(EMBEDDED_MODEL), tokenizer,
                      chat_template(), mix="f32")


def _answers(model, slots: int, **engine) -> tuple[Engine, list[Request]]:
    """Greedy and seeded answers to PROMPTS (the embedded model's words; fixed ids for a random model's vocabulary)."""
    if model.config.vocab_size == Tokenizer.from_path(EMBEDDED_MODEL).vocab_size:
        prompts = [Tokenizer.from_path(EMBEDDED_MODEL).encode(p) for p in PROMPTS]
    else:
        prompts = [[(7 * i + 3 * j) % model.config.vocab_size for j in range(5 + i)] for i in range(len(PROMPTS))]
    engine = Engine(model, slots=slots, context=256, chunk=64, **engine)
    requests = [engine.submit(Request(prompt_ids=p, max_tokens=32, sampling=SamplingParams(
        temperature=0.8, seed=i) if i % 2 else SamplingParams())) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    return engine, requests


def test_a_gguf_drafts_with_the_head_of_its_safetensors_release_and_answers_as_without(embedded_gguf):
    headless = load_model(str(embedded_gguf), dtype="float32", device="cpu", progress=False)
    assert headless.mtp is None
    model = load_model(str(embedded_gguf), dtype="float32", device="cpu", progress=False,
                       mtp_weights=str(EMBEDDED_MODEL))
    whole = load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False)
    ours, theirs = model.state_dict(), whole.state_dict()
    head = [name for name in theirs if name.startswith("mtp.")]
    assert head and all(torch.equal(ours[name], theirs[name]) for name in head)
    for slots in (1, 4):
        _, plain = _answers(headless, slots)
        engine, drafted = _answers(model, slots, mtp=3)
        assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
        # The float32 GGUF holds the safetensors model's values: its head drafts and is taken exactly as there.
        reference, _ = _answers(whole, slots, mtp=3)
        assert vars(engine.drafter.counters) == vars(reference.drafter.counters)
        assert engine.drafter.counters.accepted_at[0] * 3 > engine.drafter.counters.verify_steps


def test_the_engine_config_and_generate_take_the_head(embedded_gguf, capsys):
    from qwen4exp.cli import main

    config = EngineConfig(model=str(embedded_gguf), device="cpu", dtype="float32", mtp=2,
                          mtp_weights=str(EMBEDDED_MODEL))
    _, model = config.load_model()
    assert model.mtp is not None
    prompt = ["--model", str(embedded_gguf), "--prompt", PROMPTS[0], "--max-tokens", "24", "--json"]
    assert main(["generate", *prompt, "--mtp", "3", "--mtp-weights", str(EMBEDDED_MODEL)]) == 0
    drafting = json.loads(capsys.readouterr().out)
    assert main(["generate", *prompt, "--mtp", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert drafting["token_ids"] == plain["token_ids"]
    assert drafting["mtp"]["accepted"] > 0 and plain["mtp"]["drafted"] == 0


def _fp8_release(root: Path) -> Path:
    """A random tiny model in Qwen's FP8 layout, many shards."""
    return write_random_checkpoint(root, preset="tiny", seed=4, dtype=torch.float32, progress=False,
                                   fp8_block=(128, 128), shard_bytes=200_000)


def test_only_the_shards_holding_the_head_are_read_and_float8_experts_stay_float8(tmp_path):
    release = _fp8_release(tmp_path / "fp8")
    model = random_model("tiny", dtype="float32", device="cpu", seed=4)
    text = read_config(release)
    gguf = write_gguf(tmp_path / "tiny.gguf", model, text, json.loads(build_tokenizer(text).to_str()), chat_template(),
                      mix="f32")
    weight_map = json.loads((release / INDEX_FILE).read_text())["weight_map"]
    head_shards = {file for name, file in weight_map.items() if name.startswith("mtp.")}
    others = set(weight_map.values()) - head_shards
    assert others
    for file in others:                     # what a user who fetched only the head's shards has
        (release / file).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(str(release), dtype="float32", device="cpu", progress=False)
    ours = load_model(str(gguf), dtype="float32", device="cpu", progress=False, mtp_weights=str(release))
    stacks = {name: m for name, m in ours.named_modules() if isinstance(m, QuantizedStack)}
    assert any(name.startswith("mtp.") and m.qtype.startswith("FP8") for name, m in stacks.items())
    full = _fp8_release(tmp_path / "again")
    theirs = load_model(str(full), dtype="float32", device="cpu", progress=False).state_dict()
    mine = ours.state_dict()
    head = [name for name in theirs if name.startswith("mtp.")]
    assert head and all(torch.equal(mine[name], theirs[name]) for name in head)
    _, plain = _answers(load_model(str(gguf), dtype="float32", device="cpu", progress=False), 2)
    _, drafted = _answers(ours, 2, mtp=2)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]


def _edited_release(tmp_path: Path, change) -> Path:
    release = tmp_path / "release"
    shutil.copytree(EMBEDDED_MODEL, release)
    config = json.loads((release / "config.json").read_text())
    change(config.get("text_config", config))
    (release / "config.json").write_text(json.dumps(config))
    return release


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(num_experts=t["num_experts"] * 2), r"config.json: not the model of .*tiny.gguf.*"
                                                           r"text_config.num_experts is \d+, .* has \d+"),
    (lambda t: t.update(hidden_size=t["hidden_size"] + 64), r"text_config.hidden_size is"),
    (lambda t: t.update(mtp_num_hidden_layers=0), r"mtp_num_hidden_layers is 0: this checkpoint has no MTP head"),
])
def test_a_head_that_does_not_fit_the_gguf_is_refused_by_its_key(embedded_gguf, tmp_path, change, message):
    release = _edited_release(tmp_path, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(embedded_gguf), dtype="float32", device="cpu", progress=False, mtp_weights=str(release))
    with pytest.raises(ConfigError, match=message):
        check_profile(overrides={"model": str(embedded_gguf), "mtp_weights": str(release)})


def test_where_a_head_cannot_come_from_is_said(embedded_gguf, tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_model(str(embedded_gguf), dtype="float32", device="cpu", progress=False, mtp_weights=str(tmp_path / "x"))
    with pytest.raises(ConfigError, match=r"command line: mtp_weights: gives a GGUF model its MTP head; model = "
                                          r"'tiny' is a safetensors checkpoint"):
        check_profile(overrides={"model": "tiny", "mtp_weights": str(EMBEDDED_MODEL)})
    with pytest.raises(CheckpointError, match="is a safetensors checkpoint, which brings its own"):
        load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False,
                   mtp_weights=str(EMBEDDED_MODEL))
    release = _edited_release(tmp_path, lambda t: None)
    from safetensors.torch import load_file, save_file
    index = json.loads((release / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (release / INDEX_FILE).write_text(json.dumps(index))
    for shard in set(index["weight_map"].values()):
        save_file({k: v for k, v in load_file(release / shard).items() if not k.startswith("mtp.")}, release / shard)
    with pytest.raises(CheckpointError, match=r"no tensor is named mtp\.\*"):
        load_model(str(embedded_gguf), dtype="float32", device="cpu", progress=False, mtp_weights=str(release))


def test_a_random_gguf_mix_keeps_a_dense_head_when_asked():
    """What bench/mtp_speed.py --quant builds: the mix's quantized weights as random blocks and, beside them, the head
    dense (as `mtp_weights` gives a GGUF one from Qwen's bfloat16 release); without the flag a GGUF's has none."""
    assert random_model("tiny", dtype="float32", device="cpu", quant="ud-q4_k_xl").mtp is None
    model = random_model("tiny", dtype="float32", device="cpu", quant="ud-q4_k_xl", mtp_head=True)
    stacks = {name for name, m in model.named_modules() if isinstance(m, QuantizedStack)}
    assert model.mtp is not None and stacks and not any(name.startswith("mtp.") for name in stacks)
    _, plain = _answers(random_model("tiny", dtype="float32", device="cpu", quant="ud-q4_k_xl"), 2)
    _, drafted = _answers(model, 2, mtp=2)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]


def test_a_profile_names_the_head_beside_itself_and_plan_counts_it(embedded_gguf, tmp_path):
    """A relative mtp_weights is relative to the profile (as model is), so a daemon started from / finds it; `check`
    reads the head's config; `plan --estimate` counts the head's weights and its cache; a profile that pairs a head
    with a safetensors model is refused at load, naming the key."""
    from qwen4exp.config import load_settings
    from qwen4exp.engine.fit_estimate import EstimateError, model_facts

    shutil.copytree(EMBEDDED_MODEL, tmp_path / "release")
    shutil.copy(embedded_gguf, tmp_path / "tiny.gguf")
    profile = tmp_path / "p.toml"
    profile.write_text('model = "tiny.gguf"\nmtp_weights = "release"\n')
    settings = check_profile(profile)
    assert settings.mtp_weights == str(tmp_path / "release")
    assert EngineConfig.from_settings(settings).mtp_weights == str(tmp_path / "release")
    with_head = model_facts(str(embedded_gguf), None, "float32", mtp_weights=str(tmp_path / "release"))
    without = model_facts(str(embedded_gguf), None, "float32")
    head = sum(t.numel() for name, t in load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu",
                                                   progress=False).state_dict().items() if name.startswith("mtp."))
    assert with_head.weights - without.weights == head * 4
    assert with_head.per_position > without.per_position          # the head's attention cache
    with pytest.raises(EstimateError, match="gives a GGUF model its MTP head; --model tiny is not one"):
        model_facts("tiny", None, "float32", mtp_weights=str(tmp_path / "release"))
    profile.write_text('model = "release"\nmtp_weights = "release"\n')
    with pytest.raises(ConfigError, match=r"mtp_weights.*is a safetensors checkpoint, which brings its own head"):
        load_settings(profile)
