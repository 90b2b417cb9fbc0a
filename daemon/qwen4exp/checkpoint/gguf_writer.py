"""Write a model as a GGUF in llama.cpp's qwen4exp layout, at a quantization mix: what `init-checkpoint --format
gguf` writes, so tests and benches need no download.

The metadata, the tensor names and transforms are the converter's (gguf_metadata.py, gguf_layout.py): at the
f32 mix the file equals, tensor for tensor and bit for bit, what llama.cpp's converter writes from the same
checkpoint (tests/test_gguf.py). Float types and the simple quants (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) encode the
model's values; the K-quants and IQ4 types, which the `gguf` package cannot quantize, are random blocks with
the tensor's spread (gguf_blocks.py): the file's model is then its own random model, read back by dequantizing.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..engine.model.quantized import QuantizedStack
from . import gguf_blocks, gguf_layout
from .gguf_loader import StackPart, kept_name
from .gguf_metadata import ARCH, metadata_for

# unsloth's UD-Q4_K_XL of Qwen3.8-Flash-Next, as published (docs/PRODUCT.md): experts' gate/up Q4_K, down Q5_1
# (Q8_0 on layers 2, 4, 30, 46, 47), the indexer BF16, the PLE table IQ4_NL, every other matrix Q8_0. (The
# publication names one layer whose gate/up are Q5_K without saying which; all are Q4_K here.)
_UD_DOWN_Q8_LAYERS = (2, 4, 30, 46, 47)
MIXES = ("f32", "bf16", "q8_0", "ud-q4_k_xl")
_FILE_TYPES = {"f32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "ud-q4_k_xl": "MOSTLY_Q4_K_M",
               "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}   # general.file_type: what llama.cpp's tools name
# Besides the mixes, one type for every matrix (the per-type tests): "Q4_K", "IQ4_NL", ...
ONE_TYPE = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def _block(qtype: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]


def tensor_type(piece: gguf_layout.Piece, shape: tuple[int, ...], mix: str) -> str:
    """The GGML type of `piece`'s tensor (`shape` in torch order) at `mix` (one of MIXES or ONE_TYPE): F32 for
    1-D tensors and those llama.cpp keeps in F32 (norms, routers, the Gated DeltaNet's conv, A and dt bias). A
    type whose blocks do not divide the rows falls back to Q8_0, then F16, as llama.cpp's tools do."""
    name = piece.gguf
    if mix == "f32" or len(shape) == 1 or piece.float32:
        return "F32"
    wanted = mix if mix in ONE_TYPE else {"bf16": "BF16", "q8_0": "Q8_0"}.get(mix) or _ud_q4_k_xl(name)
    for qtype in (wanted, "Q8_0", "F16"):
        if shape[-1] % _block(qtype) == 0:
            return qtype
    return "F16"


def _ud_q4_k_xl(name: str) -> str:
    layer = re.match(r"blk\.(\d+)\.", name)
    if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
        return "Q4_K"
    if name.endswith("ffn_down_exps.weight"):
        return "Q8_0" if layer and int(layer[1]) in _UD_DOWN_Q8_LAYERS else "Q5_1"
    if ".indexer." in name:
        return "BF16"
    if name == "per_layer_token_embd.weight":
        return "IQ4_NL"
    if name.endswith(("ssm_alpha.weight", "ssm_beta.weight")):
        return "F32"
    return "Q8_0"


class PlannedFile:
    """The tensors `write_gguf` writes for a model of `config` at `mix`, by name: their types and shapes (torch order),
    found on the meta device without weights. It answers as a GGUFCheckpoint does (`tensors`, `type_name`,
    `shape`), so what is kept quantized can be planned for a file not written (the kernels' compile check)."""

    def __init__(self, config, mix: str):
        from ..engine.model.causal_lm import Qwen4ExpForCausalLM

        with torch.device("meta"):
            targets = Qwen4ExpForCausalLM(config).state_dict()
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for piece in gguf_layout.pieces(config):
            shape = tuple(piece.to_gguf(piece.part_of(targets[piece.target])).shape)
            self.tensors[piece.gguf] = (tensor_type(piece, shape, mix), shape)

    def type_name(self, name: str) -> str:
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]


def encode(values: torch.Tensor, qtype: str, seed: int) -> np.ndarray:
    """The bytes (or float array) of `values` (float32, torch order) as `qtype`."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "BF16":
        # torch rounds to nearest even as gguf.quants does, on the values' device (the numpy form is minutes
        # for the bench preset's experts)
        bits = values.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
        return bits.view(np.uint8)
    array = values.detach().to(torch.float32).cpu().numpy()
    if qtype == "F32":
        return array
    if qtype == "F16":
        return array.astype(np.float16)
    if qtype in gguf_blocks.QUANTIZED_TYPES and qtype not in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        spread = float(array.std()) if array.size > 1 else 0.0
        return gguf_blocks.random_blocks(qtype, array.shape, spread or 1e-3, seed)
    return quants.quantize(array, GGMLQuantizationType[qtype])


def tokenizer_metadata(tokenizer_json: dict, vocab_size: int, chat_template: str | None,
                       eos_token_id: int) -> list[tuple[str, object, str]]:
    """tokenizer.* as the converter writes them for a Qwen byte-level BPE (tokens padded to vocab_size)."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size                                   # unused, until a token claims the id
    for token, index in tokenizer_json["model"]["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = token, 1
    for added in tokenizer_json.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    rows = [("tokenizer.ggml.model", "gpt2", "STRING"), ("tokenizer.ggml.pre", "qwen35", "STRING"),
            ("tokenizer.ggml.tokens", tokens, "ARRAY:STRING"), ("tokenizer.ggml.token_type", types, "ARRAY:INT32"),
            ("tokenizer.ggml.merges", merges, "ARRAY:STRING"),
            ("tokenizer.ggml.eos_token_id", eos_token_id, "UINT32"),
            ("tokenizer.ggml.padding_token_id", eos_token_id, "UINT32"),
            ("tokenizer.ggml.add_bos_token", False, "BOOL")]
    if chat_template:
        rows.append(("tokenizer.chat_template", chat_template, "STRING"))
    return rows


# What `holes` leaves unwritten: the routed experts and the PLE n-gram table, 98 of the full model's 104 GiB at
# UD-Q4_K_XL. A hole reads as zero bytes, which every block type decodes to zero.
_HOLE_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "per_layer_token_embd.weight")


def is_hole(name: str) -> bool:
    return name.endswith(_HOLE_SUFFIXES)


def _array_layout(shape: tuple[int, ...], qtype: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of the array `encode` returns for a tensor of `shape` at `qtype` (known before it
    is made, so the tensor infos can be written first and each tensor's data made only when it is written)."""
    from gguf import GGMLQuantizationType, quant_shape_to_byte_shape

    if qtype == "F32":
        return shape, np.dtype(np.float32)
    if qtype == "F16":
        return shape, np.dtype(np.float16)
    return tuple(quant_shape_to_byte_shape(shape, GGMLQuantizationType[qtype])), np.dtype(np.uint8)


@torch.no_grad()
def write_gguf(path: str | Path, model: torch.nn.Module, text_config: dict, tokenizer_json: dict,
               chat_template: str | None, mix: str = "bf16", seed: int = 0, split_max_tensors: int = 0,
               holes: bool = False) -> Path:
    """`model` (built from `text_config`, the config dict it came from) as a GGUF at `mix` (one of MIXES); with
    `split_max_tensors`, a split set of that many tensors a shard (llama.cpp's names: returns the first shard).

    Each tensor's data is made when it is written, so host memory holds one tensor at a time. With `holes`, the
    routed experts' and the PLE table's data are left unwritten: a sparse file whose holes read as zero blocks,
    so the full model at UD-Q4_K_XL takes ~5 GiB of disk instead of 104 (a benchmark of its speed and memory on
    a machine whose disk is smaller than the model; those weights are then zero, not random)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

    if mix not in MIXES + ONE_TYPE:
        raise ValueError(f"unknown GGUF mix {mix!r}; choose one of {', '.join(MIXES + ONE_TYPE)}")
    if holes and split_max_tensors:
        raise ValueError("a sparse GGUF (holes) is written as one file, not a split set")
    cfg = model.config
    path = Path(path)
    writer = GGUFWriter(str(path), ARCH, split_max_tensors=split_max_tensors)
    sections = (text_config.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10]
    rows = metadata_for(cfg, sections, gguf_layout.ple_constants_from(model),
                        int(LlamaFileType[_FILE_TYPES.get(mix, f"MOSTLY_{mix}")]), path.stem)
    rows += tokenizer_metadata(tokenizer_json, cfg.vocab_size, chat_template, cfg.eos_token_id)
    for key, value, kind in rows:
        if key == "general.architecture":
            continue                                         # the writer's own first key
        element = kind.split(":")[1] if kind.startswith("ARRAY:") else None
        writer.add_key_value(key, value, GGUFValueType["ARRAY" if element else kind],
                             sub_type=GGUFValueType[element] if element else None)
    makers = {}
    for name, shape, dtype, qtype, make in _planned_tensors(model, mix, seed):
        raw = None if qtype in ("F32", "F16") else GGMLQuantizationType[qtype]
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, raw)
        makers[name] = None if holes and is_hole(name) else make
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for out, tensors in zip(writer.fout, writer.tensors):
        writer.write_padding(out, out.tell())
        for name, info in tensors.items():
            make = makers[name]
            if make is None:
                out.seek(info.nbytes, 1)
            else:
                data = make()
                if data.nbytes != info.nbytes:
                    raise AssertionError(f"{name}: {data.nbytes} bytes made, {info.nbytes} planned")
                data.tofile(out)
            writer.write_padding(out, info.nbytes)
        out.truncate(out.tell())          # a hole at the end still counts in the file's size
    shards = len(writer.tensors)
    writer.close()
    return path if shards <= 1 else path.with_name(f"{path.stem}-00001-of-{shards:05d}.gguf")


def _planned_tensors(model: torch.nn.Module, mix: str, seed: int):
    """(GGUF name, array shape, array dtype, GGML type, a function that makes the array) for each tensor of the
    file, in its order: a quantized stack whose type the mix keeps is written as the blocks it holds, any other
    tensor is encoded from its values."""
    targets = model.state_dict()
    stacks = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedStack)}
    for index, piece in enumerate(gguf_layout.pieces(model.config)):
        stack = stacks.get(kept_name(piece.target))
        part = StackPart(stack, piece) if stack is not None else None
        if part is not None and tensor_type(piece, part.shape, mix) == part.file_qtype:   # the blocks as they are
            yield (piece.gguf, tuple(part.blocks().shape), np.dtype(np.uint8), part.file_qtype,
                   lambda part=part, piece=piece: part.file_blocks(piece).cpu().numpy())
            continue
        full = stack.shape if stack is not None else targets[piece.target].shape
        shape = tuple(piece.to_gguf(piece.part_of(torch.empty(full, device="meta"))).shape)
        qtype = tensor_type(piece, shape, mix)

        def make(stack=stack, piece=piece, qtype=qtype, index=index):
            # a stack the mix writes in another type than its own is written from its dequantized values
            target = stack.dequantize().float() if stack is not None else targets[piece.target].float()
            return encode(piece.to_gguf(piece.part_of(target).contiguous()), qtype, seed * 100003 + index)

        yield (piece.gguf, *_array_layout(shape, qtype), qtype, make)
