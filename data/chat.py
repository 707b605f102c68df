"""Chat rows -> token ids and an assistant-only loss mask.

A chat row holds ``messages: [{"role": ..., "content": ...}, ...]`` with roles ``system``,
``user``, ``assistant`` and ``tool``, and at least one assistant turn. An assistant message may
carry OpenAI-style ``tool_calls`` (``[{"type": "function", "function": {"name": ...,
"arguments": {...} or "..."}}]``, or the flat ``{"name", "arguments"}``); its ``content`` may
then be null.

Rendering: the tokenizer's own chat template when it has one (Hugging Face tokenizers),
otherwise the built-in template, one block per message::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

where an assistant's tool calls follow its content, one block each (the Hermes / Qwen form)::

    <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>

A tokenizer template renders tool calls only if its source mentions ``tool_calls``; a row with
tool calls and a template that would silently drop them is rejected (``tool_calls_unsupported``).

Loss mask (uint8, one entry per token; 1 means "this token is a training target"):

* built-in template: every token overlapping an assistant message's content, tool calls or its
  closing ``<|im_end|>``;
* tokenizer template: every token overlapping an assistant message's content, plus the one
  token right after it, which is the template's end-of-turn token (``<|im_end|>``,
  ``<|eot_id|>``, ``</s>``...). Assistant content must appear verbatim in the rendered text;
  a template that rewrites it gets the row rejected (``template_error``), never mis-masked.
  An assistant turn with tool calls is located by rendering the conversation before it (with
  the generation prompt) and through it: the mask covers everything between the two, up to
  and including the end-of-turn token. A template whose renderings are not prefixes of one
  another cannot be located this way, and the row is rejected (``template_error``).

Text holding a lone surrogate (a JSON ``\\ud800`` escape without its pair), which no UTF-8
tokenizer can encode, is rejected (``invalid_unicode``).
"""
from __future__ import annotations

import json
import re

import numpy as np

from data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SURROGATE = re.compile("[\ud800-\udfff]")


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
        calls = m.get("tool_calls")
        for field in ("role", "content"):
            if field not in m and not (field == "content" and calls):
                raise RowError("wrong_type", f"message {i} has no '{field}'")
        content_ok = isinstance(m.get("content"), str) or (calls and m.get("content") is None)
        if not isinstance(m["role"], str) or not content_ok:
            raise RowError("wrong_type", f"message {i}: role and content must be strings")
        if m["role"] not in ROLES:
            raise RowError("unknown_role", f"message {i} has role {m['role']!r}; "
                                           f"expected one of {', '.join(ROLES)}")
        if calls is not None:
            _check_tool_calls(i, m["role"], calls)
        has_assistant |= m["role"] == "assistant"
    if not has_assistant:
        raise RowError("no_assistant_turn", "no message has role 'assistant'")
    return messages


def _check_tool_calls(i: int, role: str, calls) -> None:
    if not isinstance(calls, list):
        raise RowError("invalid_tool_call", f"message {i}: tool_calls must be a list, got "
                                            f"{type(calls).__name__}")
    if calls and role != "assistant":
        raise RowError("invalid_tool_call", f"message {i} has role {role!r}; only assistant "
                                            "messages carry tool_calls")
    for j in range(len(calls)):
        tool_call_parts(calls, i, j)


def tool_call_parts(calls: list, i: int, j: int) -> tuple[str, object]:
    """(name, arguments) of tool call ``j`` of message ``i``, in the OpenAI or the flat form."""
    call = calls[j]
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowError("invalid_tool_call", f"message {i} tool call {j}: expected "
                                            "{'function': {'name': ..., 'arguments': ...}}")
    args = fn.get("arguments", {})
    if not isinstance(args, (str, dict)):
        raise RowError("invalid_tool_call", f"message {i} tool call {j}: arguments must be an "
                                            f"object or a JSON string, got {type(args).__name__}")
    return fn["name"], args


def _builtin_body(i: int, m: dict) -> str:
    text = m.get("content") or ""
    calls = m.get("tool_calls") or []
    for j in range(len(calls)):
        name, args = tool_call_parts(calls, i, j)
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        block = (f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
                 f'"arguments": {args_text}}}\n</tool_call>')
        text = f"{text}\n{block}" if text else block
    return text


def render_builtin(messages: list[dict]) -> tuple[str, list[tuple[int, int, bool]]]:
    """The built-in template; returns the text and the spans to train on, each
    ``(start, end, next_token)`` in characters (``next_token``: the token after ``end`` too)."""
    parts, spans, pos = [], [], 0
    for i, m in enumerate(messages):
        head = f"{IM_START}{m['role']}\n"
        body = f"{_builtin_body(i, m)}{IM_END}"
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body), False))
        block = head + body + "\n"
        parts.append(block)
        pos += len(block)
    return "".join(parts), spans


def supports_tool_calls(template: str) -> bool:
    """Whether a Jinja chat template renders ``tool_calls`` at all (it must name them)."""
    return "tool_calls" in template


def _render(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # templates raise on their own rules (e.g. role alternation)
        raise RowError("template_error", f"chat template failed: {e}") from None


def _tool_call_turn(tok: Tokenizer, messages: list[dict], i: int, text: str) -> tuple[int, int]:
    """Characters of assistant turn ``i`` (with tool calls) in ``text``: between the rendering
    of the conversation before it, generation prompt included, and the rendering through it."""
    before = _render(tok, messages[:i], add_generation_prompt=True)
    through = _render(tok, messages[:i + 1])
    if not (through.startswith(before) and text.startswith(through)):
        raise RowError("template_error", f"assistant message {i} has tool_calls, and the chat "
                                         "template does not render the conversation as a growing "
                                         "prefix, so its turn cannot be located")
    return len(before), len(through.rstrip())


def render_with_template(tok: Tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int, bool]]]:
    """The tokenizer's template; spans as in :func:`render_builtin`. A content span adds the
    end-of-turn token after it; a tool-call turn's span already ends with it."""
    if any(m.get("tool_calls") for m in messages) and not supports_tool_calls(tok.chat_template):
        raise RowError("tool_calls_unsupported", "the row has tool_calls but the tokenizer's chat "
                                                 "template never mentions tool_calls, so they would "
                                                 "be dropped")
    text = _render(tok, messages)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            start, cursor = _tool_call_turn(tok, messages, i, text)
            spans.append((start, cursor, False))
            continue
        content = m.get("content") or ""
        pos = text.find(content, cursor)
        if pos < 0:
            if m["role"] == "assistant":
                raise RowError("template_error", f"assistant message {i} does not appear verbatim "
                                                 "in the rendered chat template")
            continue
        end = pos + len(content)
        if m["role"] == "assistant":
            spans.append((pos, end, True))
        cursor = end
    return text, spans


def mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int, bool]]) -> np.ndarray:
    """1 on tokens whose ``[start, end)`` overlaps a span (and on the next token where asked)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b, next_token in spans:
        mask[(starts < b) & (ends > a)] = 1
        if next_token:
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
    else:
        text, spans = render_builtin(messages)
    bad = SURROGATE.search(text)
    if bad:
        raise RowError("invalid_unicode", f"the conversation holds a lone surrogate {bad.group()!r} "
                                          "(a \\ud800-\\udfff escape without its pair)")
    ids, offsets = tok.encode_with_offsets(text)
    return np.asarray(ids, dtype=np.int64), mask_from_spans(offsets, spans)
