"""Chat rows -> token ids and an assistant-only loss mask.

A chat row holds ``messages: [{"role": ..., "content": ...}, ...]`` with roles ``system``,
``user``, ``assistant`` and ``tool``, and at least one assistant turn.

Rendering: the tokenizer's own chat template when it has one (Hugging Face tokenizers),
otherwise the built-in template, one block per message::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Loss mask (uint8, one entry per token; 1 means "this token is a training target"):

* built-in template: every token overlapping an assistant message's content or its closing
  ``<|im_end|>``;
* tokenizer template: every token overlapping an assistant message's content, plus the one
  token right after it, which is the template's end-of-turn token (``<|im_end|>``,
  ``<|eot_id|>``, ``</s>``...). Assistant content must appear verbatim in the rendered text;
  a template that rewrites it gets the row rejected (``template_error``), never mis-masked.
"""
from __future__ import annotations

import numpy as np

from data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class RowError(Exception):
    """A row that cannot be used; ``reason`` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def validate_messages(messages) -> list[dict]:
    """Check the ``messages`` value of one row; raise ``RowError`` naming what is wrong."""
    if not isinstance(messages, list):
        raise RowError("wrong_type", f"messages must be a list, got {type(messages).__name__}")
    has_assistant = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError("wrong_type", f"message {i} must be an object, got {type(m).__name__}")
        for field in ("role", "content"):
            if field not in m:
                raise RowError("wrong_type", f"message {i} has no '{field}'")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise RowError("wrong_type", f"message {i}: role and content must be strings")
        if m["role"] not in ROLES:
            raise RowError("unknown_role", f"message {i} has role {m['role']!r}; "
                                           f"expected one of {', '.join(ROLES)}")
        has_assistant |= m["role"] == "assistant"
    if not has_assistant:
        raise RowError("no_assistant_turn", "no message has role 'assistant'")
    return messages


def render_builtin(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The built-in template; returns the text and the character spans to train on."""
    parts, spans, pos = [], [], 0
    for m in messages:
        head = f"{IM_START}{m['role']}\n"
        body = f"{m['content']}{IM_END}"
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        block = head + body + "\n"
        parts.append(block)
        pos += len(block)
    return "".join(parts), spans


def render_with_template(tok: Tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The tokenizer's template; spans cover assistant content (end-of-turn added later)."""
    try:
        text = tok.apply_chat_template(messages)
    except Exception as e:  # templates raise on their own rules (e.g. role alternation)
        raise RowError("template_error", f"chat template failed: {e}") from None
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        pos = text.find(m["content"], cursor)
        if pos < 0:
            if m["role"] == "assistant":
                raise RowError("template_error", f"assistant message {i} does not appear verbatim "
                                                 "in the rendered chat template")
            continue
        end = pos + len(m["content"])
        if m["role"] == "assistant":
            spans.append((pos, end))
        cursor = end
    return text, spans


def mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int]],
                    include_next_token: bool) -> np.ndarray:
    """1 on tokens whose ``[start, end)`` overlaps a span (and, optionally, the next token)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask[(starts < b) & (ends > a)] = 1
        if include_next_token:
            nxt = int(np.searchsorted(starts, b, side="left"))
            # A token straddling b already overlaps the span; the next one starts at or after b.
            if nxt < len(mask):
                mask[nxt] = 1
    return mask


def encode_chat(tok: Tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Validate, render and tokenize one conversation: (token ids int64, loss mask uint8)."""
    validate_messages(messages)
    if tok.chat_template:
        text, spans = render_with_template(tok, messages)
        include_next = True
    else:
        text, spans = render_builtin(messages)
        include_next = False
    ids, offsets = tok.encode_with_offsets(text)
    mask = mask_from_spans(offsets, spans, include_next)
    return np.asarray(ids, dtype=np.int64), mask
