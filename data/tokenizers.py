"""One small tokenizer interface over Hugging Face, SentencePiece and a built-in byte tokenizer.

Every tokenizer has ``encode``, ``encode_batch``, ``decode``, ``vocab_size``, ``eod_id`` and
``pad_id``, plus ``encode_with_offsets`` (token ids and the character span of each token in
the text), which chat loss masks are computed from. Text is encoded without the tokenizer's
automatic special tokens (BOS/EOS): documents get an end-of-document token only with
``--append-eod``, and chat templates write their own markers.

``fingerprint()`` is a hash of the vocabulary (every token and its id): what the ids of a
dataset mean. ``tools/preprocess_data.py`` records it beside the data, and training refuses a
tokenizer with another one (``data/checks.py``), wherever its files live.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Sequence

import numpy as np

TOKENIZER_TYPES = ("byte", "huggingface", "sentencepiece")


class Tokenizer:
    """The interface. Subclasses implement ``encode``, ``decode``, ``encode_with_offsets``."""

    vocab_size: int
    eod_id: int
    pad_id: int
    chat_template: str | None = None  # a Jinja template (Hugging Face tokenizers only)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """Token ids and an int64 ``[n, 2]`` array of ``[start, end)`` character offsets."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    def token_id(self, text: str) -> int | None:
        """The id of a special token written as ``text`` (None when the vocabulary lacks it)."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def vocabulary(self) -> dict[str, int]:
        """Every token (as the tokenizer writes it) and its id."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the vocabulary in id order (~50 ms for 128k tokens)."""
        pairs = sorted(((i, t) for t, i in self.vocabulary().items()))
        return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


def _char_offsets_from_byte_offsets(text: str, byte_offsets: np.ndarray) -> np.ndarray:
    """Map UTF-8 byte offsets into ``text`` to character offsets."""
    if text.isascii():
        return byte_offsets
    char_of_byte = np.repeat(np.arange(len(text) + 1),
                             [len(c.encode("utf-8")) for c in text] + [1])
    last = len(char_of_byte) - 1
    s, e = np.clip(byte_offsets[:, 0], 0, last), np.clip(byte_offsets[:, 1], 0, last)
    starts = char_of_byte[s]
    # A token ending inside a character still covers that character.
    ends = np.where(e > s, char_of_byte[np.maximum(e - 1, 0)] + 1, starts)
    return np.stack([starts, ends], axis=1)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus four special tokens; needs no files.

    Ids: bytes are themselves; ``<|endoftext|>`` 256 (end of document), ``<|pad|>`` 257,
    ``<|im_start|>`` 258 and ``<|im_end|>`` 259 (the built-in chat template's markers).
    Special-token strings in the text are encoded as those single ids.
    """

    SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
    _SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def __init__(self):
        self.vocab_size = 256 + len(self.SPECIALS)
        self._special_id = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.eod_id = self._special_id["<|endoftext|>"]
        self.pad_id = self._special_id["<|pad|>"]

    def vocabulary(self) -> dict[str, int]:
        return {**{f"<0x{b:02X}>": b for b in range(256)}, **self._special_id}

    def encode(self, text: str) -> list[int]:
        if "<|" not in text:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for part in self._SPLIT.split(text):
            if part in self._special_id:
                ids.append(self._special_id[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(self.SPECIALS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        ids: list[int] = []
        byte_spans: list[tuple[int, int]] = []
        pos = 0  # byte position in text.encode()
        for part in self._SPLIT.split(text):
            raw = part.encode("utf-8")
            if part in self._special_id:
                ids.append(self._special_id[part])
                byte_spans.append((pos, pos + len(raw)))
            else:
                ids.extend(raw)
                byte_spans.extend((pos + k, pos + k + 1) for k in range(len(raw)))
            pos += len(raw)
        offsets = np.array(byte_spans, dtype=np.int64).reshape(-1, 2)
        return ids, _char_offsets_from_byte_offsets(text, offsets)


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory or a ``tokenizer.json`` file.

    Encoding goes straight to the Rust ``tokenizers`` library when a ``tokenizer.json`` exists,
    so text preprocessing never imports transformers (a worker stays ~10x lighter). The special
    tokens and chat template come from ``tokenizer_config.json`` / ``chat_template.jinja``;
    transformers is imported only to render a chat template, or for a directory without a
    ``tokenizer.json`` (slow tokenizers).
    """

    def __init__(self, path: str):
        if os.path.isfile(path) and path.endswith(".json"):
            self._dir, tok_file = os.path.dirname(path), path
        elif os.path.isdir(path):
            self._dir, tok_file = path, os.path.join(path, "tokenizer.json")
        else:
            raise ValueError(f"--tokenizer-model {path!r}: expected a local directory with a Hugging "
                             "Face tokenizer or a tokenizer.json file")
        self._path = path
        self._hf = None  # transformers tokenizer, loaded on first need
        config = self._read_json("tokenizer_config.json")
        special = {**self._read_json("special_tokens_map.json"), **config}
        if os.path.isfile(tok_file):
            from tokenizers import Tokenizer as RustTokenizer

            self._fast = RustTokenizer.from_file(tok_file)
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            token_id = self._fast.token_to_id
        else:
            self._fast = None
            hf = self._transformers()
            self.vocab_size = len(hf)
            token_id = hf.convert_tokens_to_ids
        eos = _token_text(special.get("eos_token")) or "<|endoftext|>"
        pad = _token_text(special.get("pad_token"))
        self._token_to_id = token_id
        self.eod_id = _or(token_id(eos), -1)
        self.pad_id = _or(token_id(pad), self.eod_id) if pad else self.eod_id
        jinja = os.path.join(self._dir, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                self.chat_template = f.read()
        else:
            self.chat_template = config.get("chat_template")

    def _read_json(self, name: str) -> dict:
        p = os.path.join(self._dir, name)
        if not os.path.isfile(p):
            return {}
        with open(p, encoding="utf-8") as f:
            return json.load(f)

    def _transformers(self):
        if self._hf is None:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            if os.path.isdir(self._path):
                self._hf = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
            else:
                self._hf = PreTrainedTokenizerFast(tokenizer_file=self._path)
        return self._hf

    def token_id(self, text: str) -> int | None:
        return self._token_to_id(text)

    def vocabulary(self) -> dict[str, int]:
        if self._fast is not None:
            return self._fast.get_vocab(with_added_tokens=True)
        return self._transformers().get_vocab()

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._transformers().encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode([int(i) for i in ids], skip_special_tokens=False)
        return self._transformers().decode(list(ids))

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        if self._fast is not None:
            enc = self._fast.encode(text, add_special_tokens=False)
            return enc.ids, np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
        enc = self._transformers()(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], np.array(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._transformers().apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)


def _token_text(tok) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def _or(value, default):
    return default if value is None else value


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file."""

    def __init__(self, path: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {path!r}: no such SentencePiece model file")
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod_id

    def vocabulary(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        proto = self._sp.encode(text, out_type="proto")
        ids = [p.id for p in proto.pieces]
        offsets = np.array([(p.begin, p.end) for p in proto.pieces], dtype=np.int64).reshape(-1, 2)
        return ids, _char_offsets_from_byte_offsets(text, offsets)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type`` / ``--tokenizer-model``."""
    if tokenizer_type == "byte":
        return ByteTokenizer()
    if tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if tokenizer_type == "huggingface":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "sentencepiece":
        return SentencePieceTokenizer(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: expected one of {', '.join(TOKENIZER_TYPES)}")
