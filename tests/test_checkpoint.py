"""Checkpoint presets, the random writer and the loader, checked against transformers' own loader."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from qwen4exp.checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_files,
    load_weights,
    preset_config,
    read_config,
    write_random_checkpoint,
)
from qwen4exp.checkpoint import layout  # noqa: E402
from qwen4exp.engine.loading import build_model  # noqa: E402
from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM  # noqa: E402
from qwen4exp.engine.model.config import ModelConfig  # noqa: E402
from qwen4exp.engine.model.ple import NGramEmbedding  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL_SHARDS = 1_000_000  # several shards even for the tiny preset


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request, tmp_path_factory) -> tuple[Path, torch.dtype]:
    out = tmp_path_factory.mktemp(f"tiny-{str(request.param)[6:]}")
    write_random_checkpoint(out, "tiny", dtype=request.param, shard_bytes=SMALL_SHARDS, progress=False)
    return out, request.param


def fresh(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "ck", "tiny", dtype=torch.float32, shard_bytes=SMALL_SHARDS,
                                   progress=False)


def text_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = read_config(path)
    text = {k: v for k, v in config.items() if k != "top_level"}
    return transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text)).to(dtype)


def assert_same_state(reference: torch.nn.Module, ours: torch.nn.Module) -> None:
    ref, got = reference.state_dict(), ours.state_dict()
    assert set(ref) == set(got)
    different = [k for k in ref if ref[k].dtype != got[k].dtype or not torch.equal(ref[k], got[k])]
    assert not different, different[:5]


def test_transformers_loads_it_and_we_load_the_same_tensors(tiny):
    path, dtype = tiny
    reference, info = transformers.Qwen4ExpForCausalLM.from_pretrained(path, output_loading_info=True, dtype=dtype)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    ours = text_model(path, dtype)
    report = load_weights(path, ours, dtype=dtype, progress=False)
    assert_same_state(reference, ours)
    assert report.files > 1 and report.skipped_mtp > 0 and report.skipped_visual == 0
    assert report.tensors == len(checkpoint_files(path)) - report.skipped_mtp


def test_multimodal_class_accepts_it(tiny):
    path, dtype = tiny
    _, info = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(path, output_loading_info=True,
                                                                             dtype=dtype)
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    assert not info["mismatched_keys"]


def test_mtp_tensors_on_disk(tiny):
    path, _ = tiny
    t = read_config(path)
    hidden, wide, experts = t["hidden_size"], t["hc_count"] * t["hidden_size"], t["num_experts"]
    inter = t["moe_intermediate_size"]
    shapes = {}
    for name, file in checkpoint_files(path).items():
        if name.startswith("mtp."):
            with safe_open(str(file), framework="pt") as f:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    assert shapes["mtp.fc_embedding.weight"] == (hidden, hidden)
    assert shapes["mtp.fc_hidden.weight"] == (hidden, hidden)
    assert shapes["mtp.pre_fc_norm_embedding.weight"] == (hidden,)
    assert shapes["mtp.pre_fc_norm_hidden.weight"] == (wide,)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (2 * t["num_attention_heads"] * t["head_dim"], hidden)
    assert shapes["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"] == ((t["indexer_n_heads"] + 1) * t["indexer_head_dim"], hidden)
    for e in range(experts):
        assert shapes[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] == (inter, hidden)
        assert shapes[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] == (hidden, inter)
    for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up"):
        assert f"mtp.hyper_connection_mixer.{name}.weight" in shapes
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in shapes
    assert not any(".ple." in n or "linear_attn" in n for n in shapes)


def test_mtp_loads_fused_when_the_module_has_it(tiny):
    path, _ = tiny
    module = build_model(ModelConfig.from_dict(read_config(path)), torch.float32, torch.device("cpu"))
    report = load_weights(path, module, dtype=torch.float32, progress=False)
    assert report.skipped_mtp == 0
    fused = module.get_parameter("mtp.layers.0.mlp.experts.gate_up_proj")
    files = checkpoint_files(path)
    for e in (0, 5):
        parts = []
        for proj in ("gate", "up"):
            name = f"mtp.layers.0.mlp.experts.{e}.{proj}_proj.weight"
            with safe_open(str(files[name]), framework="pt") as f:
                parts.append(f.get_tensor(name).float())
        assert torch.equal(fused[e], torch.cat(parts))


def test_single_file_text_only_layouts(tmp_path):
    path = fresh(tmp_path)
    reference = transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.save_pretrained(tmp_path / "saved")  # model.safetensors, model_type qwen4_exp_text
    config = read_config(tmp_path / "saved")
    assert config["architectures"] == ["Qwen4ExpForCausalLM"] and config["top_level"]["model_type"] == "qwen4_exp_text"
    ours = text_model(tmp_path / "saved", torch.float32)
    load_weights(tmp_path / "saved", ours, dtype=torch.float32, progress=False)
    assert_same_state(reference, ours)
    # A text-only file with the runtime prefix `model.` (no language_model) loads too.
    plain = {k.replace("model.language_model.", "model."): v
             for k, v in load_file(tmp_path / "saved" / "model.safetensors").items()}
    save_file(plain, tmp_path / "saved" / "model.safetensors")
    ours = text_model(tmp_path / "saved", torch.float32)
    load_weights(tmp_path / "saved", ours, dtype=torch.float32, progress=False)
    assert_same_state(reference, ours)


def test_writer_is_deterministic(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", "tiny", seed=3, progress=False)
    b = write_random_checkpoint(tmp_path / "b", "tiny", seed=3, progress=False)
    c = write_random_checkpoint(tmp_path / "c", "tiny", seed=4, progress=False)
    shard = "model-00001-of-00001.safetensors"
    assert (a / shard).read_bytes() == (b / shard).read_bytes() != (c / shard).read_bytes()
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == (a / shard).stat().st_size - (8 + int.from_bytes(
        (a / shard).read_bytes()[:8], "little"))


def _shard_of(path: Path, name: str) -> Path:
    return checkpoint_files(path)[name]


def test_missing_shard_names_the_file(tmp_path):
    path = fresh(tmp_path)
    victim = _shard_of(path, "lm_head.weight")
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)


@pytest.mark.parametrize("cut", ["truncated", "empty", "html"])
def test_a_shard_that_is_not_whole_safetensors_is_named(tmp_path, cut):
    path = fresh(tmp_path)
    victim = _shard_of(path, "lm_head.weight")
    whole = victim.read_bytes()
    victim.write_bytes({"truncated": whole[:len(whole) // 2], "empty": b"",
                        "html": b"<!DOCTYPE html><html><body>Not found</body></html>"}[cut])
    with pytest.raises(CheckpointError, match=f"{victim.name}: cannot be read as safetensors .*truncated download"):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    path = fresh(tmp_path)
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    shard = _shard_of(path, name)
    tensors = load_file(shard)
    tensors[name] = torch.zeros(3, 64)
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"in_proj_z.weight has shape \[3, 64\].*expects \[64, 64\]"):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)


def _rewrite(path: Path, edit) -> None:
    """Apply `edit(tensors)` to every shard and rewrite the index to match."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        edit(tensors)
        save_file(tensors, path / shard)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
        index["weight_map"].update({k: shard for k in tensors})
    index_file.write_text(json.dumps(index))


def test_missing_unexpected_and_ple_gap(tmp_path):
    path = fresh(tmp_path)
    _rewrite(path, lambda t: t.pop("model.language_model.layers.2.mlp.experts.5.up_proj.weight", None))
    with pytest.raises(CheckpointError, match=r"1 tensors the model needs.*layers.2.mlp.experts.5.up_proj"):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)

    path = fresh(tmp_path / "b")
    _rewrite(path, lambda t: t.update({"model.language_model.layers.0.bogus.weight": torch.zeros(2)}) if
             "lm_head.weight" in t else None)
    with pytest.raises(CheckpointError, match=r"match nothing.*layers.0.bogus.weight"):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)

    path = fresh(tmp_path / "c")
    prefix = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"

    def gap(tensors):
        if f"{prefix}.shard_2.weight" in tensors:
            tensors[f"{prefix}.shard_7.weight"] = tensors.pop(f"{prefix}.shard_2.weight")
    _rewrite(path, gap)
    with pytest.raises(CheckpointError, match=r"no shard_2 before .*shard_3.weight.*\[0, 1, 3, 7\]"):
        load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)


def test_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"LlamaForCausalLM.*'llama'.*Qwen4ExpForConditionalGeneration"):
        read_config(tmp_path)


def test_visual_tensors_are_skipped_with_a_log_line(tmp_path, caplog):
    path = fresh(tmp_path)
    save_file({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3)}, path / "visual.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.visual.patch_embed.proj.weight"] = "visual.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="qwen4exp.checkpoint"):
        report = load_weights(path, text_model(path, torch.float32), dtype=torch.float32, progress=False)
    assert report.skipped_visual == 1
    assert any("skipped 1 vision tensors" in r.getMessage() for r in caplog.records)
    assert any("MTP" in r.getMessage() for r in caplog.records)


def test_presets():
    with pytest.raises(ValueError, match="tiny, bench, full"):
        preset_config("huge")
    bench, full = preset_config("bench")["text_config"], preset_config("full")["text_config"]
    for t in (bench, full):
        assert (t["hidden_size"], t["vocab_size"], t["num_experts"]) == (2560, 248320, 512)
        assert (t["num_experts_per_tok"], t["moe_intermediate_size"], t["num_attention_heads"]) == (10, 640, 24)
        assert (t["linear_num_key_heads"], t["linear_num_value_heads"], t["head_dim"]) == (16, 48, 256)
        assert (t["indexer_budget"], t["eos_token_id"], t["hc_lowrank"], t["ple_layer_ids"]) == (2048, 248044, 320, [2])
    assert (bench["num_hidden_layers"], bench["ngram_vocab_size_base"], bench["split_ngram_parts"]) == (8, 200000, 8)
    assert (full["num_hidden_layers"], full["ngram_vocab_size_base"], full["split_ngram_parts"]) == (48, 20000000, 512)
    assert full["layer_types"].count("full_attention") == 12
    twelve = preset_config("bench", layers=12)["text_config"]
    assert twelve["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 3
    # Shipped size: ~121B expert + ~51B PLE + MTP parameters, ~335 GiB in bf16.
    full_specs = layout.runtime_specs(full)
    count = sum(spec.numel for spec in full_specs)
    assert 170e9 < count < 190e9 and 320 < count * 2 / 2**30 < 350
    ple = [s for s in full_specs if s.name.endswith("ngram_embedding.weight")]
    assert len(ple) == 1 and 50e9 < ple[0].numel < 52e9
    # Bench, part by part from its config: 8 layers of 512 experts, each a gate+up (2 x 640 x 2560) and a down
    # (2560 x 640) projection, 20.13B; the embedding and the LM head, 2 x 248320 x 2560 = 1.27B; the MTP layer,
    # one more layer of experts (2.52B) with its own attention; the PLE table; the rest (attention, GDN, shared
    # experts, hyper-connections, norms) under 1B.
    parts = {"experts": 0, "embed_head": 0, "mtp": 0, "ple": 0, "rest": 0}
    for spec in layout.runtime_specs(bench):
        part = "mtp" if spec.name.startswith("mtp") else "experts" if ".mlp.experts." in spec.name else \
            "ple" if "ngram" in spec.name else "embed_head" if spec.name in ("model.embed_tokens.weight",
                                                                             "lm_head.weight") else "rest"
        parts[part] += spec.numel
    assert parts["experts"] == 8 * 512 * 3 * 640 * 2560
    assert parts["embed_head"] == 2 * 248320 * 2560
    assert 512 * 3 * 640 * 2560 < parts["mtp"] < 512 * 3 * 640 * 2560 + 0.2e9
    # The PLE table: 16 n-gram heads (orders 2 and 3 of ngram_size 3, heads_per_ngram 8 each) of at least
    # ngram_vocab_size_base rows (each head's size rounded up), of ple_embed_dim / 16 = 160 values; plus two
    # 16-entry index vectors.
    assert 16 * 200000 * 160 < parts["ple"] - 32 < 16 * 200100 * 160
    assert parts["rest"] < 1e9
    assert 25.1e9 < sum(parts.values()) < 25.3e9


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_layout_holds_every_model_tensor_and_its_disk_pieces_fill_it(preset):
    text = preset_config(preset)["text_config"]
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(ModelConfig.from_dict(text))
    specs = layout.runtime_specs(text)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    constants = {f"{prefix}.{name}": tuple(values) for prefix, module in model.named_modules()
                 if isinstance(module, NGramEmbedding) for name, values in module._constants.items()}
    assert constants and {s.name: s.value for s in specs if s.init == "const"} == constants
    without_mtp = [s.name for s in layout.runtime_specs(text, with_mtp=False)]
    assert without_mtp == [s.name for s in specs if not s.name.startswith(layout.MTP_PREFIX)]
    for spec in specs:
        # Every disk piece maps back (through the loader's parsing) to the place it was written from.
        pieces = layout.disk_pieces(spec, text)
        assert sum(math.prod(p.shape) for p in pieces) == spec.numel
        rows = 0
        for piece in pieces:
            ref = layout.parse_disk_name(piece.disk)
            assert ref.target == spec.name
            if ref.kind == "expert":
                assert layout.expert_slot(ref, spec.shape) == (piece.index, piece.shape)
            elif ref.kind == "ple_shard":
                assert piece.index == (slice(rows, rows + piece.shape[0]),)
                rows += piece.shape[0]
            else:
                assert ref.kind == "whole" and piece.shape == spec.shape


def test_each_kind_of_tensor_draws_from_its_own_distribution():
    init = {s.name: s.init for s in layout.runtime_specs(preset_config("tiny")["text_config"])}
    gdn, qsa, ple = "model.layers.1.linear_attn", "model.layers.3.self_attn", "model.layers.1.ple"
    expected = {
        "model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head",
        f"{gdn}.A_log": "a_log", f"{gdn}.dt_bias": "dt_bias", f"{gdn}.conv1d.weight": "conv",
        f"{gdn}.norm.weight": "gated_norm", f"{gdn}.in_proj_qkv.weight": "fan_in",
        f"{qsa}.q_norm.weight": "norm", f"{qsa}.indexer.k_layernorm.weight": "norm",
        f"{qsa}.indexer.index_qk_proj.weight": "fan_in", "model.layers.3.mlp.gate.weight": "router",
        "model.layers.3.mlp.experts.down_proj": "fan_in", "model.layers.3.mlp.shared_expert_gate.weight": "fan_in",
        f"{ple}.ple_embedding.ngram_embedding.weight": "embedding", f"{ple}.ple_embedding.ngram_heads_offsets": "const",
        f"{ple}.conv1d.weight": "conv", f"{ple}.norm_key.weight": "norm",
        "model.hyper_connection_mixer.hc_norm.weight": "norm", "mtp.pre_fc_norm_hidden.weight": "norm",
        "mtp.fc_hidden.weight": "fan_in", "mtp.layers.0.mlp_hyper_connection.block_inject_weight.weight": "fan_in",
    }
    assert {name: init[name] for name in expected} == expected
