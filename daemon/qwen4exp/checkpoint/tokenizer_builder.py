"""Build the byte-level BPE tokenizer that ships with our random checkpoints.

Trained at write time on the English text in qwen4exp/assets (deterministic: same corpus, same merges), with the
ChatML special tokens placed at the exact ids the model config expects (eos, eos+1, eos+2). Ids between the
learned vocabulary and the specials belong to no token and decode to nothing.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .presets import special_token_ids

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CORPUS_FILE = ASSETS / "tokenizer_corpus.txt"
CHAT_TEMPLATE_FILE = ASSETS / "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

MAX_LEARNED = 4096  # bench/full: a few thousand real tokens are plenty for random weights
SPECIAL_MARGIN = 10  # tiny: leave a few empty ids below eos (1000 -> 990 learned tokens)


# The split rule of the Qwen tokenizers. transformers' AutoTokenizer always rebuilds a qwen4_exp tokenizer with this
# rule and NFC (whatever tokenizer.json says), so we train and ship with the same ones to make both tokenize alike.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def learned_vocab_size(eos_token_id: int) -> int:
    return max(256, min(MAX_LEARNED, eos_token_id - SPECIAL_MARGIN))


@functools.lru_cache(maxsize=8)
def _train(vocab_size: int) -> tuple[dict[str, int], list[Any]]:
    """Vocabulary and merges of a byte-level BPE trained on the shipped corpus (cached across presets)."""
    paragraphs = [p for p in CORPUS_FILE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(paragraphs, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    return dict(model["vocab"]), list(model["merges"])


def build_tokenizer(text_config: dict[str, Any]) -> Tokenizer:
    """The tokenizer for a text config: learned BPE ids from 0, ChatML specials at eos, eos+1, eos+2."""
    specials = special_token_ids(text_config)
    vocab, merges = _train(learned_vocab_size(min(specials.values())))
    if max(specials.values()) >= text_config["vocab_size"]:
        raise ValueError(f"special token ids {specials} do not fit vocab_size {text_config['vocab_size']}")
    if len(vocab) > min(specials.values()):
        raise ValueError(f"{len(vocab)} learned tokens collide with the special tokens at {specials}")
    vocab = dict(vocab)
    vocab.update(specials)
    return byte_level_bpe(vocab, merges, {tok: (i, True) for tok, i in specials.items()})


def byte_level_bpe(vocab: dict[str, int], merges: list, added: dict[str, tuple[int, bool]]) -> Tokenizer:
    """A byte-level BPE tokenizer with the Qwen split rule and NFC: `vocab` {token: id}, `merges` (pairs or
    "a b" strings), `added` {token: (id, special)} matched whole before the BPE."""
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special}
            for tok, (i, special) in sorted(added.items(), key=lambda kv: kv[1][0])
        ],
        "normalizer": json.loads(normalizers.NFC().__getstate__()),
        "pre_tokenizer": json.loads(_pre_tokenizer().__getstate__()),
        "post_processor": None,
        "decoder": json.loads(decoders.ByteLevel().__getstate__()),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return Tokenizer.from_str(json.dumps(spec))


def chat_template() -> str:
    return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")


def write_tokenizer(out_dir: str | Path, text_config: dict[str, Any]) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja for `text_config` into out_dir."""
    out = Path(out_dir)
    specials = special_token_ids(text_config)
    tokenizer = build_tokenizer(text_config)
    tokenizer.save(str(out / "tokenizer.json"))
    template = chat_template()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",  # what Qwen checkpoints name; transformers 5 picks its own class
        "model_max_length": text_config.get("max_position_embeddings", 262144),
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for tok, i in specials.items()
        },
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return [out / name for name in TOKENIZER_FILES]
