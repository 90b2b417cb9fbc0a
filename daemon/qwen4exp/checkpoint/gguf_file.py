"""A qwen4_exp GGUF (one file or a `-00001-of-0000N.gguf` set) in llama.cpp's layout: its metadata, config,
tensors and tokenizer (no torch here: the daemon reads the tokenizer too).

The headers are read when it is opened (gguf_header.py); a tensor's data only when asked for, dequantized by the
`gguf` package's `gguf.quants.dequantize` (the reference for every type) to float32. gguf_loader.py puts the tensors
into a model.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .gguf_header import TensorInfo, read_gguf
from .gguf_metadata import config_from_metadata

log = logging.getLogger("qwen4exp.checkpoint")

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                   "IQ4_NL", "IQ4_XS")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def shard_paths(path: str | Path) -> list[Path]:
    """The files of a GGUF: the one named, or every shard of a split set when the first shard is named."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["no"]) != 1:
        raise CheckpointError(f"{path}: name the first shard of a split GGUF ({match['stem']}-00001-of-{count:05d}"
                              f".gguf), not shard {int(match['no'])}")
    shards = [path.with_name(f"{match['stem']}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]
    missing = [str(s.name) for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{path}: the split GGUF set lacks {', '.join(missing)}")
    return shards


def _check_part(shard: Path, fields: dict, number: int, parts: int) -> None:
    """A shard's own record of its place in the set (llama.cpp's split.no, from 0, and split.count) against its
    place by name: a renamed or mixed-up file is named, not read as the wrong part."""
    if "split.count" not in fields:
        if parts > 1:
            raise CheckpointError(f"{shard}: named as part {number + 1} of {parts} of a split GGUF, but it records no "
                                  f"split (no split.count): a whole file renamed?")
        return
    count, no = int(fields["split.count"]), int(fields.get("split.no", 0))
    if parts == 1 and count <= 1:
        return                        # llama-gguf-split --merge writes split.count 0 into the whole file
    if parts == 1:
        raise CheckpointError(f"{shard}: part {no + 1} of a split GGUF of {count} parts, named as a whole file; "
                              f"give the first part under its split name (<name>-00001-of-{count:05d}.gguf), "
                              f"the others beside it")
    if (no, count) != (number, parts):
        raise CheckpointError(f"{shard}: records itself as part {no + 1} of {count}, where its name makes it part "
                              f"{number + 1} of {parts}")


class GGUFCheckpoint:
    """The metadata and tensors of a GGUF (all its shards), headers only until a tensor is asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.shards = shard_paths(path)
        headers = []
        for shard in self.shards:
            try:
                headers.append(read_gguf(shard))
            except (ValueError, OSError) as err:
                raise CheckpointError(f"{shard}: not a readable GGUF file ({err})") from None
        self._fields = headers[0][0]
        for number, (shard, (fields, _)) in enumerate(zip(self.shards, headers)):
            _check_part(shard, fields, number, len(self.shards))
        self.tensors: dict[str, TensorInfo] = {}
        for shard, (_, tensors) in zip(self.shards, headers):
            for tensor in tensors:
                if tensor.name in self.tensors:
                    raise CheckpointError(f"{shard}: tensor {tensor.name} is also in another shard")
                self.tensors[tensor.name] = tensor
        if len(self.shards) > 1:
            expected = self.value("split.tensors.count")
            if expected != len(self.tensors):
                raise CheckpointError(f"{self.path}: the split set holds {len(self.tensors)} tensors, its "
                                      f"split.tensors.count says {expected}")

    def value(self, key: str):
        """A metadata value: a number, a string, or a list of them (KeyError when absent)."""
        return self._fields[key]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape in torch's axis order (GGUF lists the fastest axis first)."""
        tensor = self.tensors.get(name)
        return None if tensor is None else tuple(int(n) for n in reversed(tensor.shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def config_dict(self) -> tuple[dict, list[str]]:
        return config_from_metadata(self.value, self.shape, str(self.path))

    def model_config(self):
        from ..engine.model.config import ModelConfig

        raw, notes = self.config_dict()
        for note in notes:
            log.info("%s: %s", self.path.name, note)
        return ModelConfig.from_dict(raw, source=f"{self.path} (metadata)")

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in torch's axis order (a new, writable array)."""
        from gguf import quants

        tensor = self.tensors[name]
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(self.shape(name))

    def stored_floats(self, name: str):
        """A tensor of a float type (F32, F16, BF16) as the torch tensor of its stored values, in torch's axis order
        (a new one, in host memory); None for a block type. A 16-bit tensor stays 16-bit, where `array` would
        make a float32 copy of it on the host."""
        import torch

        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(self.type_name(name))
        if dtype is None:
            return None
        stored = np.array(self.tensors[name].data).view(np.uint8)
        return torch.from_numpy(stored).view(dtype).reshape(self.shape(name))

    def raw(self, name: str) -> np.ndarray:
        """A quantized tensor's blocks as stored: uint8 [..., row bytes] in torch's axis order."""
        return np.array(self.tensors[name].data, dtype=np.uint8)

    def check_types(self) -> None:
        unsupported = [f"{name} ({self.type_name(name)})" for name in self.tensors
                       if self.type_name(name) not in SUPPORTED_TYPES]
        if unsupported:
            raise CheckpointError(f"{self.path}: tensor types this engine does not read: {', '.join(unsupported[:5])}"
                                  f"{' and more' if len(unsupported) > 5 else ''}; it reads "
                                  f"{', '.join(SUPPORTED_TYPES)}")


_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5   # llama.cpp's token types


# Qwen's end-of-turn and end-of-text tokens: llama.cpp ends generation at them too (by their text), beside the
# ids tokenizer.ggml.eos_token_id and eot_token_id name.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def tokenizer_from(checkpoint: GGUFCheckpoint):
    """(tokenizers.Tokenizer, chat template or None, the ids that end generation, vocabulary size) from the GGUF's
    tokenizer.* metadata: the byte-level BPE of llama.cpp's "gpt2" model with the Qwen split rule ("qwen35" /
    "qwen2" pre-tokenizers)."""
    from .tokenizer_builder import byte_level_bpe

    where = checkpoint.path
    try:
        model, pre = checkpoint.value("tokenizer.ggml.model"), checkpoint.value("tokenizer.ggml.pre")
        tokens = checkpoint.value("tokenizer.ggml.tokens")
        merges = checkpoint.value("tokenizer.ggml.merges")
        eos = int(checkpoint.value("tokenizer.ggml.eos_token_id"))
    except KeyError as err:
        raise CheckpointError(f"{where}: no tokenizer.json beside it and no {err.args[0]} in its metadata") from None
    if model != "gpt2" or pre not in ("qwen35", "qwen2"):
        raise CheckpointError(f"{where}: tokenizer.ggml.model {model!r} with pre-tokenizer {pre!r}: this engine "
                              f"reads Qwen's byte-level BPE (gpt2 with qwen35 or qwen2); put the model's "
                              f"tokenizer.json beside the file")
    try:
        types = checkpoint.value("tokenizer.ggml.token_type")
    except KeyError:
        types = [1] * len(tokens)
    vocab, added = {}, {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _UNUSED:
            continue
        vocab[token] = index
        if kind in (_CONTROL, _USER_DEFINED):
            added[token] = (index, kind == _CONTROL)
    try:
        template = checkpoint.value("tokenizer.chat_template")
    except KeyError:
        template = None
    ends = [eos]
    try:
        ends.append(int(checkpoint.value("tokenizer.ggml.eot_token_id")))
    except KeyError:
        pass
    ends += sorted(added[token][0] for token in _END_TOKENS if token in added)
    return byte_level_bpe(vocab, list(merges), added), template, list(dict.fromkeys(ends)), len(tokens)
