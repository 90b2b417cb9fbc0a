"""GGUF files in llama.cpp's layout (checkpoint/gguf_*.py): a file llama.cpp's converter wrote (tests/data) gives
the model, the logits and the tokens of the checkpoint it was converted from; what the file cannot say, or says
wrong, is refused with the key or tensor named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen4exp.checkpoint.errors import CheckpointError
from qwen4exp.checkpoint.gguf_file import GGUFCheckpoint
from qwen4exp.checkpoint.gguf_loader import quantized_stacks
from qwen4exp.checkpoint.gguf_metadata import config_from_metadata
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.engine.state import SequenceState
from qwen4exp.tokenizer import Tokenizer

LLAMACPP_F32 = Path(__file__).parent / "data" / "tiny_llamacpp_f32.gguf"


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory):
    """The checkpoint the llama.cpp file was converted from (tests/data/README.md)."""
    from qwen4exp.checkpoint.writer import write_random_checkpoint

    out = tmp_path_factory.mktemp("gguf_source") / "ckpt"
    write_random_checkpoint(out, preset="tiny", seed=0, dtype=torch.float32, progress=False)
    return out


def all_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, SequenceState(model.config, 512, "cpu", torch.float32), all_logits=True)


def test_a_file_llamacpp_wrote_gives_the_logits_of_its_source_bit_for_bit(source_checkpoint):
    ours = load_model(str(LLAMACPP_F32), dtype="float32", device="cpu", progress=False)
    reference = load_model(str(source_checkpoint), dtype="float32", device="cpu", progress=False)
    assert ours.config.layer_types == reference.config.layer_types
    assert ours.config.indexer_compress_ratio == reference.config.indexer_compress_ratio == 4
    assert ours.mtp is None                                   # llama.cpp's converter drops the MTP head
    ids = torch.randint(0, ours.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(all_logits(ours, ids), all_logits(reference, ids))   # dense and ranked QSA, PLE, experts


def test_its_tokenizer_and_chat_template_come_from_the_file(source_checkpoint, tmp_path):
    copy = tmp_path / "model.gguf"                            # no tokenizer.json beside it
    copy.write_bytes(LLAMACPP_F32.read_bytes())
    ours, reference = Tokenizer.from_path(copy), Tokenizer.from_path(source_checkpoint)
    text = "The quick brown fox, 12 apples and naïve café!\n\nDone."
    assert ours.encode(text) == reference.encode(text)
    chat = [{"role": "user", "content": "Hello there"}]
    assert ours.encode_chat(chat) == reference.encode_chat(chat)
    assert ours.eos_token_ids == reference.eos_token_ids           # end of text and <|im_end|>: chats stop
    assert ours.vocab_size == reference.vocab_size
    assert ours.decode(ours.encode(text)) == text


def test_generate_on_the_gguf_answers_as_on_its_source(source_checkpoint):
    def generate(model: str) -> list[int]:
        out = subprocess.run([sys.executable, "-m", "qwen4exp.cli", "generate", "--model", model, "--prompt",
                              "Once upon a time", "--max-tokens", "12", "--greedy", "--json", "--ignore-eos"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["token_ids"]

    assert generate(str(LLAMACPP_F32)) == generate(str(source_checkpoint))


def metadata(overrides: dict):
    checkpoint = GGUFCheckpoint(LLAMACPP_F32)

    def value(key: str):
        if key in overrides:
            if overrides[key] is KeyError:
                raise KeyError(key)
            return overrides[key]
        return checkpoint.value(key)

    return value, checkpoint.shape


def test_the_converter_bug_that_zeroes_the_qsa_compress_ratio_is_named():
    value, shape = metadata({"qwen4exp.attention.compress_ratios": [0] * 8})
    with pytest.raises(CheckpointError, match=r"compress_ratios is 0 on the QSA layers \[3, 7\].*indexed_attention"):
        config_from_metadata(value, shape, "x.gguf")


@pytest.mark.parametrize("overrides, message", [
    ({"general.architecture": "qwen35moe"}, "general.architecture is 'qwen35moe'"),
    ({"qwen4exp.hyper_connection.count": KeyError}, "metadata key qwen4exp.hyper_connection.count is missing"),
    ({"qwen4exp.attention.compress_ratios": [0, 0, 0, 4, 0, 0, 0, 2]}, "different compress ratios"),
    # Numbers the shapes are built from: zero, not a number, lists a layer too short, counts that disagree.
    ({"qwen4exp.attention.key_length": 0}, "qwen4exp.attention.key_length is 0; it must be at least 1"),
    ({"qwen4exp.ssm.time_step_rank": 0}, "qwen4exp.ssm.time_step_rank is 0; it must be at least 1"),
    ({"qwen4exp.block_count": "eight"}, "qwen4exp.block_count is 'eight', not a number"),
    ({"qwen4exp.block_count": 12}, r"recurrent_layers has 8 entries for the 12 layers of qwen4exp.block_count"),
    ({"qwen4exp.attention.compress_ratios": [0, 0, 0, 4]}, "compress_ratios has 4 entries for the 8 layers"),
    ({"qwen4exp.expert_used_count": 9}, r"expert_used_count \(9\) is more than qwen4exp.expert_count \(8\)"),
    ({"tokenizer.ggml.eos_token_id": KeyError}, "metadata key tokenizer.ggml.eos_token_id is missing"),
    ({"tokenizer.ggml.eos_token_id": 99999}, "eos_token_id is 99999, outside the 1024 tokens of token_embd"),
])
def test_metadata_it_cannot_serve_is_refused_by_key(overrides, message):
    value, shape = metadata(overrides)
    with pytest.raises(CheckpointError, match=message):
        config_from_metadata(value, shape, "x.gguf")


def test_a_tensor_type_it_does_not_read_is_refused_by_name(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "qwen4exp")
    writer.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((8, 32, 84), dtype=np.uint8),   # 84 bytes: 256 values
                      raw_dtype=GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down_exps\.weight \(Q2_K\).*reads F32, F16, BF16"):
        GGUFCheckpoint(path).check_types()


def test_a_split_set_reads_as_the_one_file(tmp_path):
    first = write_tiny(tmp_path / "set.gguf", "f32", split_max_tensors=100)
    assert first.name == "set-00001-of-00003.gguf"
    split = GGUFCheckpoint(first)
    whole = GGUFCheckpoint(LLAMACPP_F32)
    assert len(split.shards) == 3 and set(split.tensors) == set(whole.tensors)
    ids = torch.arange(40) * 7 % 1000
    assert torch.equal(all_logits(load_model(str(first), device="cpu", progress=False), ids),
                       all_logits(load_model(str(LLAMACPP_F32), device="cpu", progress=False), ids))


def test_a_split_set_is_named_by_its_first_shard(tmp_path):
    for no in (1, 2):
        (tmp_path / f"m-0000{no}-of-00003.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="lacks m-00003-of-00003.gguf"):
        GGUFCheckpoint(tmp_path / "m-00001-of-00003.gguf")
    (tmp_path / "m-00003-of-00003.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="name the first shard"):
        GGUFCheckpoint(tmp_path / "m-00002-of-00003.gguf")


def test_the_daemon_reads_a_gguf_tokenizer_without_importing_torch():
    code = ("import sys\n"
            "from qwen4exp.tokenizer import Tokenizer\n"
            f"tokenizer = Tokenizer.from_path({str(LLAMACPP_F32)!r})\n"
            "assert tokenizer.encode('hello world')\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def write_tiny(path: Path, mix: str, model=None, split_max_tensors: int = 0, text: dict | None = None) -> Path:
    from qwen4exp.checkpoint.gguf_writer import write_gguf
    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.checkpoint.random_weights import random_model
    from qwen4exp.checkpoint.tokenizer_builder import build_tokenizer, chat_template

    text = text or preset_config("tiny", dtype="float32")["text_config"]
    model = model if model is not None else random_model("tiny", dtype="float32", device="cpu", seed=0)
    return write_gguf(path, model, text, json.loads(build_tokenizer(text).to_str()), chat_template(), mix=mix,
                      split_max_tensors=split_max_tensors)


def test_our_writer_writes_what_llamacpps_converter_writes(tmp_path):
    from gguf import GGUFReader

    ours, theirs = GGUFReader(str(write_tiny(tmp_path / "ours.gguf", "f32"))), GGUFReader(str(LLAMACPP_F32))
    ours_tensors, their_tensors = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(ours_tensors) == set(their_tensors)
    for name, tensor in ours_tensors.items():
        assert tensor.tensor_type == their_tensors[name].tensor_type, name
        assert np.array_equal(np.asarray(tensor.data), np.asarray(their_tensors[name].data)), name
    # what the converter adds from files we do not write (the model card's name, the vision config's image token)
    optional = {"general.name", "general.size_label", "qwen4exp.ple.image_token_id", "GGUF.kv_count"}
    ours_keys = {k: f.contents() for k, f in ours.fields.items() if k not in optional}
    their_keys = {k: f.contents() for k, f in theirs.fields.items() if k not in optional}
    assert ours_keys == their_keys


@pytest.mark.parametrize("mix", ["llama.cpp's f32", "BF16", "IQ4_XS", "ud-q4_k_xl"])
def test_the_header_reader_reads_what_gguf_py_reads(tmp_path, mix):
    """gguf_header.read_gguf, which the engine opens files with (gguf-py's reader took 6.7 s for Qwen's 248K-token
    vocabulary): every metadata value and every tensor's type, shape, size and data as gguf-py gives them."""
    from gguf import GGUFReader

    from qwen4exp.checkpoint.gguf_header import read_gguf

    path = LLAMACPP_F32 if mix == "llama.cpp's f32" else write_tiny(tmp_path / "m.gguf", mix)
    fields, tensors = read_gguf(path)
    reference = GGUFReader(str(path))
    assert fields == {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert [t.name for t in tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.n_bytes == theirs.n_bytes, ours.name
        assert np.array_equal(ours.shape, theirs.shape) and ours.data.dtype == theirs.data.dtype, ours.name
        assert ours.data.shape == theirs.data.shape and np.array_equal(ours.data, theirs.data), ours.name


def test_a_split_part_renamed_or_mixed_up_is_named_by_what_it_records(tmp_path):
    """llama.cpp's split.no and split.count in each part, against its place by name."""
    first = write_tiny(tmp_path / "set.gguf", "f32", split_max_tensors=100)
    parts = sorted(tmp_path.glob("set-*.gguf"))
    second, third = parts[1].read_bytes(), parts[2].read_bytes()
    parts[1].write_bytes(third)
    parts[2].write_bytes(second)
    with pytest.raises(CheckpointError, match=r"set-00002-of-00003.gguf: records itself as part 3 of 3, where its "
                                              r"name makes it part 2 of 3"):
        GGUFCheckpoint(first)
    alone = tmp_path / "model.gguf"
    first.rename(alone)
    with pytest.raises(CheckpointError, match=r"model.gguf: part 1 of a split GGUF of 3 parts, named as a whole "
                                              r"file; give the first part under its split name"):
        GGUFCheckpoint(alone)


def test_a_merged_file_that_records_split_count_0_reads_as_a_whole_file():
    """llama-gguf-split --merge keeps split.no and writes split.count 0 into the file it merges into."""
    from qwen4exp.checkpoint.gguf_file import _check_part

    _check_part(Path("merged.gguf"), {"split.no": 0, "split.count": 0, "split.tensors.count": 214}, 0, 1)
    with pytest.raises(CheckpointError, match="part 2 of a split GGUF of 3 parts, named as a whole file"):
        _check_part(Path("model.gguf"), {"split.no": 1, "split.count": 3}, 0, 1)


@pytest.mark.parametrize("alignment", [0, 7])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, alignment):
    from gguf import GGUFWriter

    path = tmp_path / "aligned.gguf"
    writer = GGUFWriter(str(path), "qwen4exp")
    writer.add_uint32("general.alignment", alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=f"general.alignment is {alignment}, not a power of two"):
        GGUFCheckpoint(path)


def test_a_truncated_or_foreign_file_is_named_with_what_is_wrong(tmp_path):
    whole = LLAMACPP_F32.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:len(whole) - 1000])
    with pytest.raises(CheckpointError, match=r"cut.gguf: not a readable GGUF file .*tensor .* runs past the end "
                                              r"of the file .*truncated download"):
        GGUFCheckpoint(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(whole[:5000])
    with pytest.raises(CheckpointError, match="header.gguf: not a readable GGUF file .*runs past the end|ends early"):
        GGUFCheckpoint(header)
    foreign = tmp_path / "weights.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="weights.gguf: not a readable GGUF file .*no GGUF magic"):
        GGUFCheckpoint(foreign)


def greedy(model, n: int = 10) -> list[int]:
    state = SequenceState(model.config, 64, "cpu", torch.float32)
    logits = model(torch.tensor([5, 77, 300, 12, 9]), state)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([out[-1]]), state)
    return out


@pytest.mark.parametrize("mix", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                                 "IQ4_NL", "IQ4_XS", "ud-q4_k_xl"])
def test_a_quantized_gguf_gives_the_tokens_of_the_float32_gguf_of_its_dequantized_weights(tmp_path, mix):
    quantized_file = write_tiny(tmp_path / "q.gguf", mix)
    types = {tensor.tensor_type.name for tensor in GGUFCheckpoint(quantized_file).tensors.values()}
    if mix != "ud-q4_k_xl":
        assert mix in types                                    # the tiny shapes take every type somewhere
    quantized = load_model(str(quantized_file), dtype="float32", device="cpu", progress=False)
    twin = load_model(str(write_tiny(tmp_path / "f.gguf", "f32", model=quantized)), dtype="float32", device="cpu",
                      progress=False)
    kept = {name for name, module in quantized.named_modules() if isinstance(module, QuantizedStack)}
    if mix in ("F16", "BF16"):
        assert not kept
    else:      # the experts, the LM head and every projection the file quantized kept as blocks, dequantized in use
        assert kept == set(quantized_stacks(GGUFCheckpoint(quantized_file), quantized.config))
        layers = quantized.config.num_hidden_layers
        assert sum(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in kept) == 2 * layers
        assert {"lm_head.weight", "model.embed_tokens"} <= kept
        assert sum(name.endswith(".linear_attn.in_proj_qkv.weight") for name in kept) > 0    # reordered by rows
        assert model_bytes(quantized) < model_bytes(twin)
    assert greedy(quantized) == greedy(twin)


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                   "IQ4_XS"])
def test_random_blocks_reach_every_byte_and_keep_the_spread_asked(qtype):
    from gguf import GGMLQuantizationType, quants

    from qwen4exp.checkpoint.gguf_blocks import random_blocks

    blocks = random_blocks(qtype, (32, 1024), 0.02, seed=3)
    values = quants.dequantize(blocks, GGMLQuantizationType[qtype])
    assert np.isfinite(values).all() and values.shape == (32, 1024)
    assert abs(values.std() - 0.02) < 0.003 and abs(values.mean()) < 0.004
    assert len(np.unique(blocks)) == 256


@pytest.mark.parametrize("qtype", ["FP8_B32", "IQ4_NL"])
def test_a_host_table_drawn_a_slice_at_a_time_is_whole_and_the_same_each_time(monkeypatch, qtype):
    """random_weights.fill_through, how a PLE table in host memory is drawn beside a model on a GPU (here the CPU
    stands in for the GPU): slices of 5 rows, the last one short, fill every row (no NaN byte, every block's scale
    set), and the same seed draws the same table."""
    from qwen4exp.checkpoint import random_weights
    from qwen4exp.engine.model.quant_blocks import dequantize

    row_bytes = 4 * 36 if qtype == "FP8_B32" else 4 * 18
    monkeypatch.setattr(random_weights, "HOST_SLICE_BYTES", 5 * row_bytes)
    tables = []
    for _ in range(2):
        table = torch.zeros(23, row_bytes, dtype=torch.uint8)
        random_weights.fill_through(table, qtype, 1.0, seed=4, device=torch.device("cpu"))
        tables.append(table)
    assert torch.equal(tables[0], tables[1])
    values = dequantize(tables[0], qtype)
    assert torch.isfinite(values).all() and (values != 0).any(dim=1).all()       # every row drawn, its last too
    assert 0.5 < float(values.std()) < 2
    random_weights.fill_through(torch.zeros(0, row_bytes, dtype=torch.uint8), qtype, 1.0, seed=4,
                                device=torch.device("cpu"))       # an empty table: nothing to draw, no error


@pytest.mark.parametrize("name, shape, message", [
    ("blk.0.ffn_gate_exps.weight", (6, 32, 64), r"expects \[8, 32, 64\]"),        # a kept expert stack
    ("output.weight", (1000, 64), r"expects \[1024, 64\]"),                       # the LM head, Q8_0
])
def test_a_weight_kept_quantized_of_the_wrong_shape_is_refused_not_built_to_it(tmp_path, monkeypatch, name, shape,
                                                                                 message):
    """The shape a kept stack is built with comes from the config, not from the file it is read from."""
    checkpoint = GGUFCheckpoint(write_tiny(tmp_path / "q.gguf", "q8_0"))
    real_shape = checkpoint.shape
    monkeypatch.setattr(checkpoint, "shape", lambda tensor: shape if tensor == name else real_shape(tensor))
    with pytest.raises(CheckpointError, match=f"{name} has shape {list(shape)}".replace("[", r"\[") + ".*" + message):
        quantized_stacks(checkpoint, checkpoint.model_config())


def test_a_tensor_of_the_wrong_shape_is_named_before_anything_is_copied(monkeypatch):
    from qwen4exp.checkpoint.gguf_loader import load_gguf_weights
    from qwen4exp.engine.loading import build_model

    checkpoint = GGUFCheckpoint(LLAMACPP_F32)
    config = checkpoint.model_config()
    model = build_model(config, torch.float32, torch.device("cpu"))
    for tensor in model.state_dict().values():
        tensor.zero_()
    real_shape = checkpoint.shape
    monkeypatch.setattr(checkpoint, "shape", lambda name: (7, 7) if name == "blk.6.ssm_out.weight" else
                        real_shape(name))
    with pytest.raises(CheckpointError, match=r"blk\.6\.ssm_out\.weight has shape \[7, 7\].*expects \[64, 64\]"):
        load_gguf_weights(checkpoint, model, config)
    assert all(not tensor.any() for tensor in model.state_dict().values())


def test_the_ple_table_stays_quantized_and_answers_as_its_float32_twin(tmp_path):
    """The tiny preset's table rows (4 values) take no block type: here 32 values a head, in IQ4_NL and Q8_0."""
    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.checkpoint.random_weights import fill_random
    from qwen4exp.engine.loading import build_model
    from qwen4exp.engine.model.config import ModelConfig

    text = dict(preset_config("tiny", dtype="float32")["text_config"], ple_embed_dim=512)
    model = build_model(ModelConfig.from_dict(text), torch.float32, torch.device("cpu"))
    fill_random(model, text, seed=0, dtype=torch.float32)
    for mix in ("IQ4_NL", "Q8_0"):
        quantized = load_model(str(write_tiny(tmp_path / f"{mix}.gguf", mix, model=model, text=text)),
                               dtype="float32", device="cpu", progress=False)
        table = quantized.model.layers[1].ple.ple_embedding.ngram_embedding
        assert isinstance(table, QuantizedStack) and table.qtype == mix
        twin = load_model(str(write_tiny(tmp_path / f"{mix}_f32.gguf", "f32", model=quantized, text=text)),
                          dtype="float32", device="cpu", progress=False)
        assert greedy(quantized) == greedy(twin)
        state = SequenceState(quantized.config, 64, "cpu", torch.float32)
        ids = torch.arange(30) * 11 % 1000
        assert torch.equal(quantized(ids, state, all_logits=True),
                           twin(ids, SequenceState(twin.config, 64, "cpu", torch.float32), all_logits=True))


def test_a_quantized_ple_table_can_be_kept_in_host_memory(tmp_path, tiny_checkpoint):
    """ple = 'host': the table's blocks stay on the host through the model's casts and moves (the GPU suite reads
    them from there); a table that is not quantized is refused, by what it is."""
    from test_engine_config import quantized_table_model

    path, on_host = quantized_table_model(tmp_path, ple_on_host=True)
    table = on_host.model.layers[1].ple.ple_embedding.ngram_embedding
    assert table.host and "on the host" in repr(table)
    on_host.to(torch.bfloat16)
    assert table.blocks.device.type == "cpu" and table.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="this model's table is not quantized"):
        load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False, ple_on_host=True)


def test_weights_kept_quantized_are_written_as_the_blocks_they_are(tmp_path):
    """`init-checkpoint --format gguf` draws the weights a mix keeps quantized as random blocks (no dense copy of
    the experts) and writes those blocks unchanged (reordered into llama.cpp's layout and back): read back, every
    weight kept as blocks holds the same bytes."""
    from qwen4exp.checkpoint.random_weights import random_model
    from qwen4exp.cli import main

    model = random_model("tiny", dtype="float32", device="cpu", seed=3, quant="ud-q4_k_xl")
    back = load_model(str(write_tiny(tmp_path / "blocks.gguf", "ud-q4_k_xl", model=model)), dtype="float32",
                      device="cpu", progress=False)
    ours = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedStack)}
    theirs = {name: m for name, m in back.named_modules() if isinstance(m, QuantizedStack)}
    assert ours.keys() == theirs.keys()
    assert sum(name.endswith(".experts.down_proj") for name in ours) == model.config.num_hidden_layers
    assert all(torch.equal(ours[name].blocks, theirs[name].blocks) for name in ours)
    out = tmp_path / "cli.gguf"
    assert main(["init-checkpoint", "--preset", "tiny", "--format", "gguf", "--quant", "ud-q4_k_xl", "--seed", "3",
                 "--out", str(out)]) == 0
    written = load_model(str(out), dtype="float32", device="cpu", progress=False)
    assert all(torch.equal(ours[name].blocks, module.blocks) for name, module in written.named_modules()
               if isinstance(module, QuantizedStack))


def test_blocks_reordered_into_our_layout_hold_the_values_reordered():
    """The Gated DeltaNet's value heads are ordered otherwise in llama.cpp's files: a quantized tensor is reordered
    by whole rows (the input projections) or whole blocks along the rows (the output projection, where a head's
    width holds whole blocks) and keeps the values the float reorder gives; where a head would split a block the
    piece says so (it is then read dense)."""
    from qwen4exp.checkpoint import gguf_layout
    from qwen4exp.checkpoint.gguf_blocks import random_blocks
    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM
    from qwen4exp.engine.model.config import ModelConfig
    from qwen4exp.engine.model.quant_blocks import LAYOUTS, dequantize

    text = preset_config("tiny", dtype="float32")["text_config"]
    cfg = ModelConfig.from_dict(dict(text, linear_value_head_dim=64))
    pieces = [p for p in gguf_layout.layer_pieces(cfg, 0) if p.blocks is not None]
    assert {p.gguf.split(".", 2)[2] for p in pieces} == {"attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                                                         "ssm_alpha.weight", "ssm_out.weight"}
    with torch.device("meta"):
        targets = Qwen4ExpForCausalLM(cfg).state_dict()
    for piece in pieces:
        shape = tuple(piece.to_gguf(targets[piece.target]).shape)
        for qtype in ("Q8_0", "Q6_K") if shape[1] % 256 == 0 else ("Q8_0",):
            raw = torch.from_numpy(random_blocks(qtype, shape, 0.1, 1))
            ours = piece.reorder_blocks(raw, LAYOUTS[qtype])
            if piece.gguf.endswith("ssm_out.weight") and qtype == "Q6_K":     # a 64-wide head splits its blocks
                assert ours is None
                continue
            assert torch.equal(dequantize(ours, qtype), piece.from_gguf(dequantize(raw, qtype))), (piece.gguf, qtype)
            assert torch.equal(piece.reorder_blocks(ours, LAYOUTS[qtype], to_gguf=True), raw)


def test_a_gguf_with_holes_loads_with_zero_experts_and_every_other_weight_as_written(tmp_path):
    """`init-checkpoint --format gguf --holes` (the full model's benchmarks on a disk smaller than its 104 GiB)
    leaves the routed experts and the PLE table unwritten: the file has the full size and the same bytes
    elsewhere, takes less disk, and loads, those weights zero and every other one as in the whole file."""
    import os

    from qwen4exp.checkpoint.gguf_writer import is_hole
    from qwen4exp.checkpoint.random_weights import random_model
    from qwen4exp.cli import main

    model = random_model("tiny", dtype="float32", device="cpu", seed=5, quant="ud-q4_k_xl")
    whole = tmp_path / "whole.gguf"
    sparse = tmp_path / "sparse.gguf"
    assert main(["init-checkpoint", "--preset", "tiny", "--format", "gguf", "--quant", "ud-q4_k_xl", "--seed", "5",
                 "--dtype", "float32", "--holes", "--out", str(sparse)]) == 0
    write_tiny(whole, "ud-q4_k_xl", model=model)
    assert sparse.stat().st_size == whole.stat().st_size
    from gguf import GGUFReader

    theirs = {t.name: t for t in GGUFReader(str(whole)).tensors}
    holes = 0
    for tensor in GGUFReader(str(sparse)).tensors:
        data = np.asarray(tensor.data)
        if is_hole(tensor.name):
            holes += data.nbytes
            assert not data.any(), tensor.name
        else:
            assert np.array_equal(data, np.asarray(theirs[tensor.name].data)), tensor.name
    assert holes > whole.stat().st_size // 4
    assert os.stat(sparse).st_blocks * 512 < whole.stat().st_size - holes // 2     # the disk it takes

    loaded = load_model(str(sparse), dtype="float32", device="cpu", progress=False)
    reference = load_model(str(whole), dtype="float32", device="cpu", progress=False).state_dict()
    zeroed = 0
    for name, value in loaded.state_dict().items():
        if ".experts." in name or "ngram_embedding" in name:
            assert not value.any(), name
            zeroed += 1
        else:
            assert torch.equal(value, reference[name]), name
    assert zeroed >= loaded.config.num_hidden_layers
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.isfinite(all_logits(loaded, ids)).all()


def test_holes_are_refused_outside_a_gguf(tmp_path):
    from qwen4exp.cli import main

    with pytest.raises(SystemExit, match="--holes .* --format gguf"):
        main(["init-checkpoint", "--preset", "tiny", "--holes", "--out", str(tmp_path / "ckpt")])


@pytest.mark.parametrize("mix", ["F16", "BF16", "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_tensors_are_read_as_stored_and_give_the_float32_reads_values(tmp_path, mix, dtype):
    """A 16-bit tensor goes to the device as stored and is rearranged there (no float32 copy on the host): every
    weight equals what reading it through float32 gives."""
    from qwen4exp.checkpoint import gguf_layout

    path = write_tiny(tmp_path / "w.gguf", mix)
    checkpoint = GGUFCheckpoint(path)
    model = load_model(str(path), dtype=dtype, device="cpu", progress=False)
    targets = model.state_dict()
    stored = 0
    for piece in gguf_layout.pieces(model.config):
        via_float32 = piece.from_gguf(torch.from_numpy(checkpoint.array(piece.gguf))).to(targets[piece.target].dtype)
        assert torch.equal(piece.part_of(targets[piece.target]), via_float32), piece.gguf
        stored += checkpoint.type_name(piece.gguf) in ("F16", "BF16")
    assert stored > 10


def test_q8_0_projections_are_regrouped_once_and_written_back_as_q8_0(tmp_path, monkeypatch):
    """At a hidden size of 256 (the tiny preset's rows are too short to regroup) every Q8_0 projection whose rows are
    a multiple of 256 values is Q8_0_R after the build (quantized.regroup_q8_0), experts and embeddings stay Q8_0, the
    joined shared-input stacks stay views of their members' bytes with the members' type, a second regroup finds
    nothing, and the GGUF written from the model holds Q8_0 again, which loads back to the same blocks and types."""
    from qwen4exp.checkpoint import random_weights
    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.engine.model.quantized import regroup_q8_0

    def wide(name, layers=None, dtype="bfloat16"):
        config = preset_config("tiny", layers, dtype)
        config["text_config"]["hidden_size"] = 256
        return config

    monkeypatch.setattr(random_weights, "preset_config", wide)
    model = random_weights.random_model("tiny", dtype="float32", device="cpu", quant="Q8_0")
    stacks = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedStack)}
    regrouped = {name for name, m in stacks.items() if m.qtype == "Q8_0_R"}
    assert regrouped and all(m.shape[-1] % 256 == 0 for name, m in stacks.items() if name in regrouped)
    assert all(stacks[name].qtype == "Q8_0" for name in stacks if ".experts." in name or "embed" in name)
    for module in model.modules():
        for stack, members in getattr(module, "input_runs", ()):
            if isinstance(stack, QuantizedStack):
                weights = [module.input_weights()[i] for i in members]
                assert {w.qtype for w in weights} == {stack.qtype}
                assert all(w.blocks.untyped_storage().data_ptr() == stack.blocks.untyped_storage().data_ptr()
                           for w in weights)
    assert regroup_q8_0(model) == 0
    text = wide("tiny")["text_config"]
    path = write_tiny(tmp_path / "wide.gguf", "Q8_0", model=model, text=text)
    checkpoint = GGUFCheckpoint(str(path))
    assert "Q8_0_R" not in {checkpoint.type_name(name) for name in checkpoint.tensors}
    loaded = load_model(str(path), dtype="float32", device="cpu", progress=False)
    again = {name: m for name, m in loaded.named_modules() if isinstance(m, QuantizedStack)}
    assert {n: m.qtype for n, m in again.items()} == {n: m.qtype for n, m in stacks.items()}
    assert all(torch.equal(again[n].blocks, stacks[n].blocks) for n in stacks)
