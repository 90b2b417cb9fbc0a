"""Qwen's FP8 checkpoint layout (checkpoint/fp8.py) on the CPU: an FP8 checkpoint gives exactly the logits and tokens
of its dequantized float32 twin, with float32 or bfloat16 scales and blocks that do not divide the weights; what
the layout gets wrong is named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen4exp.checkpoint.errors import CheckpointError
from qwen4exp.checkpoint.writer import write_random_checkpoint
from qwen4exp.engine.generate import generate
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.engine.state import SequenceState

PROMPT = [5, 77, 300, 12, 9, 41, 600, 2, 18, 250, 7, 3, 999, 64, 33, 1, 90, 800, 45, 46, 47, 48, 49, 50, 51, 52,
          53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66]     # past QSA's dense limit of 35


def _twin(fp8_dir, out):
    """The float32 checkpoint of an FP8 one's dequantized values, computed here block by block in numpy (not by the
    loader's code): value x the scale of its block, or x the table's one scale (`<table>.weight_scale`)."""
    config = json.loads((fp8_dir / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    tensors = {}
    for file in sorted(fp8_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    twin = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale_inv", ".weight_scale")):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            twin[name] = tensor
            continue
        values = tensor.to(torch.float32).numpy()
        scale = tensors.get(name + "_scale_inv")
        if scale is None:                                          # a PLE shard: the table's one scale
            scale = tensors[name.rsplit(".shard_", 1)[0] + ".weight_scale"]
        scale = scale.to(torch.float32).numpy()
        out_values = np.empty_like(values)
        if scale.size == 1:
            out_values[:] = values * scale.reshape(())
        else:
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                    out_values[rows, cols] = values[rows, cols] * scale[i, j]
        twin[name] = torch.from_numpy(out_values)
    out.mkdir()
    save_file(twin, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (fp8_dir / extra).exists():
            shutil.copy(fp8_dir / extra, out / extra)
    return out


@pytest.mark.parametrize("block, scales", [((128, 128), torch.float32), ((24, 40), torch.bfloat16)],
                         ids=["128x128-float32-scales", "24x40-bfloat16-scales"])
def test_an_fp8_checkpoint_gives_the_logits_of_its_dequantized_float32_twin(tmp_path, block, scales):
    # Small shards: the PLE shards lie in other files than the table's one scale.
    fp8_dir = write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=4, dtype=torch.float32, progress=False,
                                      fp8_block=block, scale_dtype=scales, shard_bytes=200_000)
    with safe_open(str(next(fp8_dir.glob("*.safetensors"))), framework="pt") as f:
        kinds = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert "F8_E4M3" in kinds
    quantized = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False)
    twin = load_model(str(_twin(fp8_dir, tmp_path / "twin")), dtype="float32", device="cpu", progress=False)
    kept = {name: m for name, m in quantized.named_modules() if isinstance(m, QuantizedStack)}
    # Every float8 weight stays float8 where the block's columns allow it (128-value runs for the 128-wide inputs of
    # the tiny preset's o_proj, 32 for the rest), else it is dequantized at load.
    if block == (128, 128):
        assert {m.qtype for m in kept.values()} == {"FP8_B128", "FP8_B32"}
        assert {name.rsplit(".", 2)[-2] if name.endswith("weight") else name.rsplit(".", 1)[-1] for name in kept} \
            == {"gate_up_proj", "down_proj", "gate_proj", "up_proj", "q_proj", "k_proj", "v_proj", "o_proj"}
    else:
        assert not kept
    held = quantized.state_dict()
    for name, tensor in twin.state_dict().items():
        stack = kept.get(name)
        assert torch.equal(stack.dequantize() if stack is not None else held[name], tensor), name
    states = [SequenceState(m.config, 128, "cpu", torch.float32) for m in (quantized, twin)]
    logits = [m(torch.tensor(PROMPT), s, all_logits=True) for m, s in zip((quantized, twin), states)]
    assert torch.equal(logits[0], logits[1])
    assert generate(quantized, PROMPT, 12).output_ids == generate(twin, PROMPT, 12).output_ids


def _rewrite(directory, change):
    """Apply change(tensors) to the checkpoint's one shard, rewritten as a single model.safetensors."""
    tensors = {}
    files = sorted(directory.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
        file.unlink()
    (directory / "model.safetensors.index.json").unlink()
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.fixture
def fp8_dir(tmp_path):
    return write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=4, dtype=torch.float32, progress=False,
                                   fp8_block=(24, 40))


EXPERT = "model.language_model.layers.0.mlp.experts.3.down_proj.weight"
TABLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.weight"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(EXPERT + "_scale_inv"), f"float8 tensor {EXPERT} has no {EXPERT}_scale_inv"),
    (lambda t: t.__setitem__(EXPERT + "_scale_inv", torch.ones(1, 1)),
     rf"{EXPERT}_scale_inv has shape \[1, 1\]; {EXPERT} \[64, 32\] in blocks of \[24, 40\] needs \[3, 1\]"),
    (lambda t: t.__setitem__("model.language_model.layers.0.linear_attn.out_proj.weight_scale_inv", torch.ones(1)),
     r"linear_attn\.out_proj\.weight_scale_inv \(model\.safetensors: scales no float8 weight\)"),
    (lambda t: t.__setitem__(EXPERT + "_scale", torch.ones(1)),        # only the PLE table's scale is a weight_scale
     rf"{EXPERT}_scale \(model\.safetensors: scales no float8 weight\)"),
    (lambda t: t.pop(TABLE + "_scale"), rf"float8 tensor .*shard_\d\.weight has no {TABLE}_scale"),
    (lambda t: t.__setitem__(TABLE + "_scale", torch.ones(2)),
     rf"model\.safetensors: {TABLE}_scale has shape \[2\]; the PLE table's float8 shards take one global scale"),
], ids=["no-scale", "scale-of-the-wrong-shape", "a-scale-without-a-float8-weight", "a-weight-scale-not-the-tables",
        "no-table-scale", "a-table-scale-of-two"])
def test_what_the_layout_gets_wrong_is_named(fp8_dir, change, message):
    _rewrite(fp8_dir, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_method="gptq"), "quant_method is 'gptq'; this engine reads Qwen's block-scaled 'fp8'"),
    (lambda q: q.update(fmt="e5m2"), "fmt is 'e5m2'; this engine reads e4m3"),
    (lambda q: q.update(weight_block_size=[128]), r"weight_block_size must be \[rows, cols\]"),
    (lambda q: q.clear(), "float8 weights or their scales, but the config has no quantization_config"),
], ids=["another-method", "another-format", "a-bad-block", "no-quantization-config"])
def test_a_quantization_config_it_does_not_read_is_named_by_key(fp8_dir, edit, message):
    config = json.loads((fp8_dir / "config.json").read_text())
    edit(config["quantization_config"])
    if not config["quantization_config"]:
        del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("beside_each_shard", [False, True], ids=["inv-beside-the-table", "inv-beside-each-shard"])
def test_a_ple_scale_inv_reads_as_the_tables_one(fp8_dir, beside_each_shard):
    """Where the file keeps the table's one scale as a `weight_scale_inv` (beside the table's name or beside every
    shard) instead of the published `<table>.weight_scale`."""
    before = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False).state_dict()

    def move(tensors):
        scale = tensors.pop(TABLE + "_scale")
        shards = [n for n in tensors if n.startswith(TABLE.removesuffix("weight") + "shard_")]
        for name in shards if beside_each_shard else [TABLE]:
            tensors[name + "_scale_inv"] = scale.clone()

    _rewrite(fp8_dir, move)
    after = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False).state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_transformers_reads_our_fp8_checkpoint_as_we_do(tmp_path):
    """transformers' FP8 quantizer (on the CPU it dequantizes, with accelerate) reads the published layout: the PLE
    table stays a float8 embedding, as modules_to_convert asks, scaled by `<table>.weight_scale` into our table; the
    logits agree within tests/test_model_parity.py's tolerance (its float32 checkpoints differ as much: the two
    models' sums are ordered differently), and the greedy tokens are the same."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_model_parity import TOL

    fp8_dir = write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=4, dtype=torch.float32, progress=False,
                                      fp8_block=(128, 128))
    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    ours = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False)
    table, our_table = (m.model.layers[1].ple.ple_embedding.ngram_embedding for m in (reference, ours))
    assert table.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(table.weight.float() * table.weight_scale, our_table.weight)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        greedy = reference.generate(ids[None], max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    got = ours(ids, SequenceState(ours.config, 64, "cpu", torch.float32), all_logits=True)
    assert (got - expected).abs().max().item() < TOL
    assert generate(ours, PROMPT, 8).output_ids == greedy[0, len(PROMPT):].tolist()


def test_transformers_fp8_path_swaps_in_fp8_modules_for_exactly_the_float8_weights(tmp_path, monkeypatch):
    """On a GPU transformers serves the checkpoint through its own FP8 modules (bench/fp8_peer.py), swapped in for
    every projection that modules_to_not_convert does not name: each must be one the checkpoint stores in float8
    with its scales, or the module runs on a scale it never loaded. The swap and the load are checked here on the
    CPU, where the quantizer's device check would have it dequantize instead."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
    fp8_dir = write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=4, dtype=torch.bfloat16, progress=False,
                                      fp8_block=(128, 128))
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    config = transformers.FineGrainedFP8Config(modules_to_not_convert=quant["modules_to_not_convert"])
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=torch.bfloat16, quantization_config=config, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    swapped = {name for name, module in model.named_modules() if type(module).__name__ in ("FP8Linear", "FP8Experts")}
    with safe_open(next(fp8_dir.glob("*.safetensors")), "pt") as f:
        scaled = {key.removesuffix(".weight_scale_inv").replace("model.language_model.", "model.")
                  for key in f.keys() if key.endswith(".weight_scale_inv") and not key.startswith("mtp.")}
    scaled = {name.rsplit(".", 2)[0] if ".experts." in name else name for name in scaled}    # experts.E.gate_proj
    assert swapped == scaled


def test_a_float8_vision_weight_is_skipped_with_its_scales(fp8_dir):
    """The vision tower is not served: a float8 weight of it and its block scales are passed over together, not
    named as scales of nothing."""
    before = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False).state_dict()
    visual = "model.visual.blocks.0.attn.qkv.weight"

    def add_vision(tensors):
        tensors[visual] = torch.zeros(48, 40).to(torch.float8_e4m3fn)
        tensors[visual + "_scale_inv"] = torch.ones(2, 1)

    _rewrite(fp8_dir, add_vision)
    after = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False).state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_a_config_without_the_mtp_layer_skips_its_float8_weights_and_their_scales(fp8_dir):
    """The MTP head's float8 experts and their scales in the file, a config that builds no head: both passed over."""
    config = json.loads((fp8_dir / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 0
    (fp8_dir / "config.json").write_text(json.dumps(config))
    model = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False)
    assert model.mtp is None


def test_init_checkpoint_writes_fp8_and_generate_serves_it(tmp_path, capsys):
    from qwen4exp.cli import main

    out = tmp_path / "fp8"
    assert main(["init-checkpoint", "--preset", "tiny", "--format", "fp8", "--dtype", "float32", "--out",
                 str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "6",
                 "--ignore-eos", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    model = load_model(str(out), dtype="float32", device="cpu", progress=False)
    assert answer["token_ids"] == generate(model, PROMPT, 6).output_ids


def test_a_float8_ple_table_stays_float8_on_the_host_and_gives_its_twins_logits(tmp_path, monkeypatch):
    """A PLE table whose rows take a block type (the tiny preset with 32-value rows: ple_embed_dim 512 over its 16
    n-gram heads) stays float8 as FP8_B32 with its one scale, in host memory with ple_on_host, and the model gives
    its float32 twin's logits."""
    from qwen4exp.checkpoint import writer
    from qwen4exp.engine.loading import quantized_ple_tables

    real = writer.preset_config

    def wide_ple(*args, **kwargs):
        config = real(*args, **kwargs)
        config["text_config"]["ple_embed_dim"] = 512
        return config

    monkeypatch.setattr(writer, "preset_config", wide_ple)
    fp8_dir = write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=6, dtype=torch.float32, progress=False,
                                      fp8_block=(128, 128))
    quantized = load_model(str(fp8_dir), dtype="float32", device="cpu", progress=False, ple_on_host=True)
    [table] = quantized_ple_tables(quantized)
    assert table.qtype == "FP8_B32" and table.host and table.shape[-1] == 32
    twin = load_model(str(_twin(fp8_dir, tmp_path / "twin")), dtype="float32", device="cpu", progress=False)
    assert torch.equal(table.dequantize(), twin.model.layers[1].ple.ple_embedding.ngram_embedding.weight)
    states = [SequenceState(m.config, 128, "cpu", torch.float32) for m in (quantized, twin)]
    logits = [m(torch.tensor(PROMPT), s, all_logits=True) for m, s in zip((quantized, twin), states)]
    assert torch.equal(logits[0], logits[1])


def test_a_random_fp8_model_is_built_in_place_with_its_mtp_head():
    """random_model(quant="fp8"), what a benchmark of the full FP8 model builds on a device without its 173 GiB: the
    float8 weights an FP8 checkpoint keeps as random FP8 blocks (no NaN byte, the dense draw's spread), the MTP head
    kept, finite logits with a spread."""
    from qwen4exp.checkpoint.fp8_stacks import planned_fp8_stacks
    from qwen4exp.checkpoint.random_weights import random_model

    model = random_model("tiny", dtype="float32", device="cpu", quant="fp8")
    kept = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedStack)}
    assert {name: (m.qtype, m.shape) for name, m in kept.items()} == planned_fp8_stacks(model.config)
    assert model.mtp is not None and any(name.startswith("mtp.") for name in kept)
    experts = kept["model.layers.0.mlp.experts.gate_up_proj"].dequantize()
    assert not experts.isnan().any() and 0.5 < float(experts.std()) * 64 ** 0.5 < 2
    logits = model(torch.tensor(PROMPT), SequenceState(model.config, 64, "cpu", torch.float32))
    assert torch.isfinite(logits).all() and float(logits.std()) > 0.1


def test_random_fp8_blocks_masked_a_slice_at_a_time_are_the_whole_tensors(monkeypatch):
    """The random FP8 fill masks NaN bytes a slice of rows at a time (the full model's table in host memory is too
    large for whole-tensor temporaries): slices of 3 rows, the last one short, give the one-pass fill's bytes, and no
    byte is NaN."""
    from qwen4exp.checkpoint import fp8

    whole = torch.empty(10, 4 * 36, dtype=torch.uint8)
    fp8.fill_random_blocks(whole, "FP8_B32", 0.02, seed=5)
    monkeypatch.setattr(fp8, "FILL_BYTES_AT_ONCE", 3 * 36)
    sliced = torch.empty(10, 4 * 36, dtype=torch.uint8)
    fp8.fill_random_blocks(sliced, "FP8_B32", 0.02, seed=5)
    assert torch.equal(sliced, whole)
    values = sliced.view(-1, 36)[:, 4:]
    assert not ((values & 0x7F) == 0x7F).any()
