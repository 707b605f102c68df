"""Tokenizer interface and assistant-only loss masks for the byte, HF and SentencePiece kinds."""
from __future__ import annotations

import numpy as np
import pytest

from data.chat import RowError, encode_chat, render_builtin, render_with_template
from data.tokenizers import ByteTokenizer, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does the router do?"},
    {"role": "assistant", "content": "The router masks every token."},
    {"role": "tool", "content": "Déjà vu ✓"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Each expert computes the loss in fp32."},
]


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo <|im_start|>user\n数据<|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.eod_id) == 1 and tok.vocab_size == 260
    ids2, offsets = tok.encode_with_offsets(text)
    assert ids2 == ids and len(offsets) == len(ids)
    # each multi-byte character's bytes all map to that character's span
    assert offsets[1].tolist() == [1, 2] and offsets[2].tolist() == [1, 2]


def test_encode_batch_matches_encode(any_tokenizer):
    texts = ["The router masks every token.", "数据并行", "x"]
    assert any_tokenizer.encode_batch(texts) == [any_tokenizer.encode(t) for t in texts]


def test_offsets_cover_the_text(any_tokenizer):
    text = "Each expert computes the loss. Déjà vu"
    ids, offsets = any_tokenizer.encode_with_offsets(text)
    assert len(ids) == len(offsets) and ids == any_tokenizer.encode(text)
    assert np.all(offsets[:, 0] <= offsets[:, 1]) and offsets.max() <= len(text)


def _assistant_spans(tok):
    if tok.chat_template:
        text, spans = render_with_template(tok, CONVERSATION)
    else:
        text, spans = render_builtin(CONVERSATION)
    return text, spans


def test_loss_mask_covers_exactly_the_assistant_spans(any_tokenizer):
    tok = any_tokenizer
    ids, mask = encode_chat(tok, CONVERSATION)
    text, spans = _assistant_spans(tok)
    _, offsets = tok.encode_with_offsets(text)
    assert mask.dtype == np.uint8 and len(mask) == len(ids) == len(offsets)
    covered = np.zeros(len(text), bool)
    for (s, e), m in zip(offsets, mask):
        if m:
            covered[s:e] = True
    for a, b, _ in spans:  # every assistant character is trained on
        assert covered[a:b].all()
    outside = covered.copy()
    for a, b, _ in spans:
        outside[a:b] = False
    if not tok.chat_template:  # built-in: the span includes <|im_end|>; nothing else is masked
        assert not any(outside[s:e].all() for (s, e), m in zip(offsets, mask) if m and e > s)
    # Tokens that are entirely user/system/tool text are never masked.
    for m_i, msg in enumerate(CONVERSATION):
        if msg["role"] != "assistant":
            pos = text.find(msg["content"])
            inside = (offsets[:, 0] >= pos) & (offsets[:, 1] <= pos + len(msg["content"]))
            assert not mask[inside].any(), msg


@pytest.mark.parametrize("kind", ["byte", "huggingface"])
def test_masked_tokens_decode_to_assistant_turns(kind, hf_tokenizer_dir):
    tok = build_tokenizer(kind, hf_tokenizer_dir if kind == "huggingface" else None)
    ids, mask = encode_chat(tok, CONVERSATION)
    expected = "".join(m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant")
    assert tok.decode(ids[mask == 1].tolist()) == expected


@pytest.mark.parametrize("messages, reason", [
    ("hi", "wrong_type"),
    ([{"role": "user"}], "wrong_type"),
    ([{"role": "user", "content": 3}], "wrong_type"),
    (["x"], "wrong_type"),
    ([{"role": "robot", "content": "x"}], "unknown_role"),
    ([{"role": "user", "content": "x"}], "no_assistant_turn"),
])
def test_invalid_conversations_are_named(messages, reason):
    with pytest.raises(RowError) as e:
        encode_chat(ByteTokenizer(), messages)
    assert e.value.reason == reason


def test_template_that_rewrites_content_is_rejected(hf_tokenizer_dir):
    tok = build_tokenizer("huggingface", hf_tokenizer_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(RowError, match="verbatim") as e:
        encode_chat(tok, CONVERSATION)
    assert e.value.reason == "template_error"
