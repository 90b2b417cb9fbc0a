"""The runtime tokenizer: encode, decode, the chat template, and streaming detokenization.

Wraps a Hugging Face `tokenizer.json` (via the `tokenizers` library) and the checkpoint's chat template (rendered
by a sandboxed jinja2 environment, with the same whitespace options as transformers so both render alike).
"""

from __future__ import annotations

import codecs
import datetime
import functools
import json
import re
import secrets
from pathlib import Path
from typing import Any, Iterable

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; the message names the file and the directory."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2): printable bytes map to themselves."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """Templates' `tojson` as transformers defines it (Qwen's templates render tools with it): plain json.dumps,
    without jinja2's HTML escaping of <, > and &, which would change the text the model reads."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


class Tokenizer:
    """A checkpoint's tokenizer. Build with `Tokenizer.from_path(path)` (a directory or a GGUF file)."""

    def __init__(self, hf: HFTokenizer, chat_template: str | None, eos_token_ids: list[int], vocab_size: int,
                 source: Path):
        self._hf = hf
        self.source = source
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(specials.values())
        self._special_id = specials
        # Longest first, so a special string that contains another is matched whole.
        self._specials = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) \
            if specials else None
        self.chat_template = chat_template
        self._template = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(chat_template)
            except TemplateError as exc:
                raise TokenizerError(f"{source}: the chat template does not parse: {exc}") from exc
        self._token_bytes = self._byte_table()

    @classmethod
    def from_path(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer of a checkpoint directory, or of a GGUF file: the tokenizer.json beside it when there
        is one, else the GGUF's own tokenizer metadata."""
        path = Path(path)
        if path.suffix != ".gguf":
            return cls.from_dir(path)
        if (path.parent / "tokenizer.json").is_file():
            return cls.from_dir(path.parent)
        from .checkpoint.gguf_file import GGUFCheckpoint, tokenizer_from

        hf, template, ends, vocab_size = tokenizer_from(GGUFCheckpoint(path))
        return cls(hf, template, ends, vocab_size, path)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {root} (expected {tokenizer_file})")
        try:
            hf = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tokenizer_file} cannot be loaded: {exc}") from exc
        tok_config = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        template_file = root / "chat_template.jinja"
        template = tok_config.get("chat_template")
        if template_file.is_file():  # transformers 5 prefers the separate file too
            template = template_file.read_text(encoding="utf-8")
        model_config = _read_json(root / "config.json") if (root / "config.json").is_file() else {}
        text_config = model_config.get("text_config", model_config)
        return cls(hf, template, _eos_ids(root, text_config, tok_config, hf),
                   int(text_config.get("vocab_size") or hf.get_vocab_size(with_added_tokens=True)), root)

    @functools.cached_property
    def most_chars_per_token(self) -> int | None:
        """The most characters of a text that one of its tokens can stand for, so that a text of n characters is at
        least n / this many tokens (a prompt too long for the context is then refused before it is tokenized): the
        longest vocabulary entry (one character per byte for byte-level BPE, which no decoded character is
        shorter than), times 4 where a Unicode normal form may compose up to 4 code points into one. None where
        the normalizer may drop characters: no bound."""
        normalizer = self._hf.normalizer
        if normalizer is None:
            factor = 1
        else:
            state = json.loads(normalizer.__getstate__())
            kinds = [n.get("type") for n in state.get("normalizers", [state])]
            if not set(kinds) <= {"NFC", "NFD", "NFKC", "NFKD"}:
                return None
            factor = 4
        return factor * max(len(entry) for entry in self._hf.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. from the chat template) become their ids."""
        return self._hf.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """The same vocabulary with special-token strings read as plain text (for what users wrote); built on
        first use, since only chat requests need it."""
        plain = HFTokenizer.from_str(self._hf.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with every character read as text: `<|im_end|>` in it is not the special token."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_vars: Any) -> list[int]:
        """Token ids of a chat rendered by the template (`template_vars`, such as `tools` or `enable_thinking`,
        are passed to it), where only the template's own markers are special tokens: a message, a tool's
        description or a call's argument that contains `<|im_end|><|im_start|>system` is that text, not a new turn.

        Special strings in what the client wrote are swapped for markers no client can guess before rendering,
        the rendered text is cut at the template's special tokens, and each run between them is encoded as plain
        text with the markers swapped back. For chats without special strings the ids are those of
        `encode(apply_chat_template(...))`: the tokenizer cuts text at special tokens the same way."""
        if self._specials is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_vars))
        nonce = secrets.token_hex(8)
        marker = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        found: list[str] = []

        def hide(match: re.Match) -> str:
            found.append(match.group(0))
            return f"\ue000{nonce}{len(found) - 1}\ue001"

        def hidden(value: Any) -> Any:
            if isinstance(value, str):
                return self._specials.sub(hide, value)
            if isinstance(value, dict):
                return {hidden(key): hidden(item) for key, item in value.items()}
            if isinstance(value, list):
                return [hidden(item) for item in value]
            return value

        rendered = self.apply_chat_template(hidden(messages), add_generation_prompt,
                                            **{key: hidden(value) for key, value in template_vars.items()})
        ids: list[int] = []
        position = 0
        for special in self._specials.finditer(rendered):
            run = rendered[position:special.start()]
            if run:
                ids += self.encode_plain(marker.sub(lambda m: found[int(m.group(1))], run))
            ids.append(self._special_id[special.group(0)])
            position = special.end()
        if position < len(rendered):
            ids += self.encode_plain(marker.sub(lambda m: found[int(m.group(1))], rendered[position:]))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        if self._template is None:
            raise TokenizerError(f"{self.source} has no chat template (chat_template.jinja or tokenizer_config.json)")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (part of a character, for some); a special token's text."""
        if self._token_bytes is not None:
            return self._token_bytes.get(token_id, b"")
        return self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)

    def _byte_table(self) -> dict[int, bytes] | None:
        """Raw bytes of every token when the tokenizer is byte-level BPE, else None (then decode-diffing is used)."""
        decoder = json.loads(self._hf.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        added = {i: t.content.encode() for i, t in self._hf.get_added_tokens_decoder().items()}
        table = {}
        for token, token_id in self._hf.get_vocab(with_added_tokens=False).items():
            if token_id in added:
                continue
            try:
                table[token_id] = bytes(_UNICODE_TO_BYTE[c] for c in token)
            except KeyError:
                return None  # not a pure byte-level vocabulary
        table.update(added)
        return table


def _eos_ids(root: Path, text_config: dict[str, Any], tok_config: dict[str, Any], hf: HFTokenizer) -> list[int]:
    """Stop ids: generation_config.json's eos_token_id, else the model config's, else the tokenizer's eos token."""
    gen_file = root / "generation_config.json"
    for source in (_read_json(gen_file) if gen_file.is_file() else {}, text_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    eos_token = tok_config.get("eos_token")
    eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    token_id = hf.token_to_id(eos_token) if eos_token else None
    return [token_id] if token_id is not None else []


class IncrementalDetokenizer:
    """Turns a stream of ids into text, emitting only complete UTF-8 characters.

    A multi-byte character split across tokens is held back until its last byte arrives, so the stream never
    shows U+FFFD for it; call `flush()` at the end of the stream to release whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # decode-diff fallback for tokenizers that are not byte-level
        self._emitted = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became complete."""
        if token_id in self._skip:
            return ""
        table = self._tok._token_bytes
        if table is not None:
            return self._utf8.decode(table.get(token_id, b""))
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def feed(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        if self._tok._token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        text = self._tok.decode(self._ids)
        new, self._emitted = text[self._emitted:], len(text)
        return new
