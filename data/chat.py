"""Chat rows -> token ids and an assistant-only loss mask.

A chat row holds ``messages: [{"role": ..., "content": ...}, ...]`` with roles ``system``,
``user``, ``assistant`` and ``tool``, and at least one assistant turn. A non-assistant message's
content may be a list of text and image parts (``data/image_chat.py`` prepares them), which only
a tokenizer's chat template renders. An assistant message may
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
Likewise a row with a system message whose template does not write it (some templates keep only
a default system prompt of their own, or none) is rejected (``system_unsupported``): the
conversation is rendered once more with each system message's content replaced by a placeholder,
which must appear once per system message.

A conversation may start with an assistant turn (a greeting): the built-in template and a
tokenizer's template both train on it. Under a tokenizer's template such a first turn starts
where the rendering starts (there is no earlier conversation to render, so no generation prompt
to end at): its content and end-of-turn token are the target; with tool calls, whose span needs
that generation prompt, it is rejected (``template_error``).

Loss mask (uint8, one entry per token; 1 means "this token is a training target"):

* built-in template: every token overlapping an assistant message's content, tool calls or its
  closing ``<|im_end|>``;
* tokenizer template: every token overlapping an assistant message's content, plus the one
  token right after it, which is the template's end-of-turn token (``<|im_end|>``,
  ``<|eot_id|>``, ``</s>``...). The content is never searched for (an answer such as "a" or
  "assistant" also occurs in the markup): the conversation is rendered again with the message's
  content (and reasoning) replaced by placeholders, and putting the message's own text back in
  their places must give the rendered text exactly; the placeholders' places are then where the
  template wrote it. The turn must also begin where the rendering of the messages before it
  ends, with the generation prompt where the template has one (a template without one, or whose
  generation prompt opens a thinking block the turn lacks, writes the turn's header there, which
  is context). A template that rewrites the content (upper-cases it, strips it), writes it
  twice, or renders the earlier messages differently once the turn follows them (Qwen3's gives
  the last turn an empty ``<think>`` block, so an assistant turn straight after another one is
  rendered both ways) gets the row rejected (``template_error``, naming the message), never
  mis-masked. An assistant turn with tool calls spans from the end of the generation prompt to
  the end of the rendering of the conversation through it, end-of-turn token included; a
  template whose renderings are not prefixes of one another cannot be located this way, and the
  row is rejected (``template_error``).

Masks are token-granular: where the tokenizer merges the markup's last characters and the
content's first into one token, that token is a target.

An assistant message without tool calls whose content is empty or whitespace only is rejected
(``empty_text``): there is nothing to train on but a bare end-of-turn token.

Reasoning: an assistant message may carry ``reasoning_content`` (or ``thinking``), the text the
model thinks before it answers. The built-in template writes it before the content as
``<think>\\n{reasoning}\\n</think>\\n\\n``; a tokenizer template renders it under the field its
source names (``reasoning_content``, else ``thinking``: the row's field is renamed to it), where
it chooses to (Qwen3's drops the reasoning of turns before the last user message: that is not an
error). A row with reasoning and a template that names neither field is rejected
(``reasoning_unsupported``). With ``reasoning_loss`` (the default) a turn's target starts where
the model starts generating (the end of the generation prompt, where the template has one) and
covers the reasoning; without it, the reasoning and what comes before it are context and the
target starts after the reasoning text (the template's closing marker, the answer and the
end-of-turn token).

Turns: every assistant message is a target by default. With ``mask_history`` only the last turn
is: the assistant messages after the last user message (its tool calls and its answer); a
conversation with no assistant message after its last user message is then rejected
(``no_assistant_turn``).

Text holding a lone surrogate (a JSON ``\\ud800`` escape without its pair), which no UTF-8
tokenizer can encode, is rejected (``invalid_unicode``).
"""
from __future__ import annotations

import json
import re

import numpy as np

from data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "thinking")  # what rows call it; the first wins
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"  # the built-in template's markers
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
        content_ok = isinstance(m.get("content"), str) or (calls and m.get("content") is None) \
            or (isinstance(m.get("content"), list) and m.get("role") != "assistant")  # parts
        if not isinstance(m["role"], str) or not content_ok:
            raise RowError("wrong_type", f"message {i}: role and content must be strings (or, "
                                         "for a non-assistant message, a list of parts)")
        if m["role"] not in ROLES:
            raise RowError("unknown_role", f"message {i} has role {m['role']!r}; "
                                           f"expected one of {', '.join(ROLES)}")
        if calls is not None:
            _check_tool_calls(i, m["role"], calls)
        for key in REASONING_KEYS:
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RowError("wrong_type", f"message {i}: {key} must be a string, got "
                                             f"{type(m[key]).__name__}")
        if m["role"] == "assistant" and not calls and not m["content"].strip():
            raise RowError("empty_text", f"message {i}: the assistant's answer is empty after "
                                         "stripping whitespace (nothing to train on but the "
                                         "end-of-turn token)")
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


def reasoning_of(m: dict) -> str:
    """An assistant message's reasoning text ('' when it has none)."""
    if m.get("role") != "assistant":
        return ""
    return next((m[k] for k in REASONING_KEYS if m.get(k)), "")


def target_turns(messages: list[dict], mask_history: bool) -> list[bool]:
    """Per message: whether it is a training target (an assistant message; with
    ``mask_history`` only those after the last user message)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    targets = [m["role"] == "assistant" and (not mask_history or i > last_user)
               for i, m in enumerate(messages)]
    if not any(targets):
        raise RowError("no_assistant_turn", "no assistant message after the last user message "
                                            "(--mask-history trains on the last turn only)")
    return targets


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


def render_builtin(messages: list[dict], reasoning_loss: bool = True,
                   mask_history: bool = False) -> tuple[str, list[tuple[int, int, bool]]]:
    """The built-in template; returns the text and the spans to train on, each
    ``(start, end, next_token)`` in characters (``next_token``: the token after ``end`` too)."""
    parts, spans, pos = [], [], 0
    for i, (m, target) in enumerate(zip(messages, target_turns(messages, mask_history))):
        head = f"{IM_START}{m['role']}\n"
        reasoning = reasoning_of(m)
        think = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}" if reasoning else ""
        body = f"{think}{_builtin_body(i, m)}{IM_END}"
        if target:
            skip = 0 if reasoning_loss or not reasoning else len(THINK_OPEN) + len(reasoning)
            spans.append((pos + len(head) + skip, pos + len(head) + len(body), False))
        block = head + body + "\n"
        parts.append(block)
        pos += len(block)
    return "".join(parts), spans


def supports_tool_calls(template: str) -> bool:
    """Whether a Jinja chat template renders ``tool_calls`` at all (it must name them)."""
    return "tool_calls" in template


_THINKING_FIELD = re.compile(r"\.thinking\b|\[\s*['\"]thinking['\"]\s*\]")


def template_reasoning_key(template: str) -> str | None:
    """The message field a Jinja chat template renders reasoning from, if any."""
    if "reasoning_content" in template:
        return "reasoning_content"
    return "thinking" if _THINKING_FIELD.search(template) else None


def _for_template(tok: Tokenizer, messages: list[dict]) -> list[dict]:
    """The messages with their reasoning under the template's field name."""
    if not any(reasoning_of(m) for m in messages):
        return messages
    key = template_reasoning_key(tok.chat_template)
    if key is None:
        raise RowError("reasoning_unsupported", "the row has reasoning_content (or thinking) but "
                                                "the tokenizer's chat template names neither, so "
                                                "it would be dropped")
    out = []
    for m in messages:
        r = reasoning_of(m)
        m = {k: v for k, v in m.items() if k not in REASONING_KEYS or m["role"] != "assistant"}
        out.append({**m, key: r} if r else m)
    return out


def _render(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # templates raise on their own rules (e.g. role alternation)
        raise RowError("template_error", f"chat template failed: {e}") from None


# Placeholders for a message's own text: private-use characters only, which no template writes and
# no case or whitespace filter changes.
CONTENT_MARK, REASONING_MARK = "\ue000\ue001\ue002\ue003", "\ue000\ue002\ue001\ue003"
SYSTEM_MARK = "\ue000\ue003\ue002\ue001"


def _check_system_written(tok: Tokenizer, messages: list[dict]) -> None:
    """Every system message is written by the template (``RowError`` otherwise)."""
    n = sum(m["role"] == "system" for m in messages)
    if not n:
        return
    out = _render(tok, [{**m, "content": SYSTEM_MARK} if m["role"] == "system" else m
                        for m in messages])
    if out.count(SYSTEM_MARK) < n:
        raise RowError("system_unsupported", "the row has a system message but the tokenizer's chat "
                                             "template does not write it, so it would be dropped")


def _template_error(i: int, what: str) -> RowError:
    return RowError("template_error", f"assistant message {i}: {what}; the row is left out rather "
                                      "than mis-masked")


def _turn_start(tok: Tokenizer, messages: list[dict], i: int, text: str,
                prompt: bool) -> tuple[int, bool]:
    """Where assistant turn ``i`` begins in ``text``: the end of the rendering of the messages
    before it with the generation prompt (``True``: the model generates from there; ``prompt``
    says the template writes one), else (no generation prompt, or one the turn does not begin
    with, e.g. one that opens a thinking block the turn lacks) the end of their rendering without
    it (``False``). A template that renders the earlier messages differently once turn ``i``
    follows has no such point. A first turn begins at 0 (transformers renders no empty
    conversation, so there is no generation prompt to find)."""
    if i == 0:
        return 0, False
    if prompt:
        prompted = _render(tok, messages[:i], add_generation_prompt=True)
        if text.startswith(prompted):
            return len(prompted), True
    plain = _render(tok, messages[:i])
    if text.startswith(plain):
        return len(plain), False
    raise _template_error(i, "the chat template renders the messages before it differently once "
                             "it follows them")


def _fill(out: str, fills: dict[str, str]) -> tuple[str, dict[str, int]]:
    """``out`` with each placeholder replaced by its text, and where each text starts there."""
    if not fills:
        return out, {}
    parts = re.split("(" + "|".join(map(re.escape, fills)) + ")", out)
    filled, at, n = [], {}, 0
    for p in parts:
        if p in fills:
            at[p], p = n, fills[p]
        filled.append(p)
        n += len(p)
    return "".join(filled), at


def _locate(tok: Tokenizer, messages: list[dict], i: int, text: str,
            with_content: bool) -> tuple[int, int, int]:
    """(reasoning start, reasoning end, content start) of message ``i`` in ``text``; -1 for the
    reasoning where the template does not render it (Qwen3's drops that of earlier turns), and
    for the content without ``with_content``.

    The conversation is rendered again with the message's content (``with_content``) and its
    reasoning replaced by placeholders. Putting the message's own text back in their places must
    give ``text`` exactly: then the template writes that text verbatim, once, there, and nothing
    else it writes depends on it, and the positions follow without any search. A template that
    rewrites the text (upper-cases it, strips it) fails this. Reasoning may be written stripped
    of surrounding newlines or whitespace, as templates do: at most one form gives ``text``."""
    m = messages[i]
    key = next((k for k in REASONING_KEYS if m.get(k)), None)
    if not (with_content or key):
        return -1, -1, -1
    marked = dict(m)
    if with_content:
        marked["content"] = CONTENT_MARK
    if key:
        marked[key] = REASONING_MARK
    out = _render(tok, messages[:i] + [marked] + messages[i + 1:])
    unfound = _template_error(i, "its content" + (" or reasoning" if key else "") + " does not "
                                 "appear verbatim in the rendered chat template (the template "
                                 "rewrites it, or renders the rest differently because of it)")
    if with_content and out.count(CONTENT_MARK) != 1 or out.count(REASONING_MARK) > 1:
        if with_content and not out.count(CONTENT_MARK):
            raise unfound
        raise _template_error(i, "the chat template writes its content or reasoning more than once")
    fills = {CONTENT_MARK: m["content"]} if with_content else {}
    forms = dict.fromkeys([m[key], m[key].strip("\n"), m[key].strip()]) if key else {}
    for form in forms if REASONING_MARK in out else [None]:
        filled, at = _fill(out, {**fills, **({REASONING_MARK: form} if form is not None else {})})
        if filled == text:
            r = at.get(REASONING_MARK, -1)
            return r, (r + len(form) if r >= 0 else -1), at.get(CONTENT_MARK, -1)
    raise unfound


def _turn_span(tok: Tokenizer, messages: list[dict], i: int, text: str, reasoning_loss: bool,
               prompt: bool) -> tuple[int, int, bool]:
    """The span to train on of assistant turn ``i``: its content and the token after it (the
    end-of-turn token); with reasoning rendered, from the generation prompt's end (or the
    reasoning's start) with ``reasoning_loss``, else from the reasoning's end. A turn with tool
    calls: everything from there to the end of the rendering through it (end-of-turn included)."""
    m = messages[i]
    calls = bool(m.get("tool_calls"))
    begin, prompted = _turn_start(tok, messages, i, text, prompt)
    rstart, rend, cstart = _locate(tok, messages, i, text, with_content=not calls)
    if min(x for x in (rstart, cstart, begin) if x >= 0) < begin:
        raise _template_error(i, "the chat template writes its text before the messages that "
                                 "precede it")
    if 0 <= cstart < rstart:
        raise _template_error(i, "the chat template writes its reasoning after its content")
    if rstart >= 0:
        start = (begin if prompted else rstart) if reasoning_loss else rend
    elif calls and not prompted:
        raise _template_error(i, "it has tool calls, and without a generation prompt that it "
                                 "begins with, where its turn starts is unknown")
    else:
        start = begin if calls else cstart
    if not calls:
        return start, cstart + len(m["content"]), True
    through = _render(tok, messages[:i + 1])
    if not text.startswith(through):
        raise _template_error(i, "it has tool calls, and the chat template renders the "
                                 "conversation through it differently once more messages follow, "
                                 "so where its turn ends is unknown")
    return start, len(through.rstrip()), False


def render_with_template(tok: Tokenizer, messages: list[dict], reasoning_loss: bool = True,
                         mask_history: bool = False) -> tuple[str, list[tuple[int, int, bool]]]:
    """The tokenizer's template; spans as in :func:`render_builtin`. A content span adds the
    end-of-turn token after it; a tool-call turn's span already ends with it."""
    if any(m.get("tool_calls") for m in messages) and not supports_tool_calls(tok.chat_template):
        raise RowError("tool_calls_unsupported", "the row has tool_calls but the tokenizer's chat "
                                                 "template never mentions tool_calls, so they would "
                                                 "be dropped")
    targets = target_turns(messages, mask_history)
    messages = _for_template(tok, messages)
    _check_system_written(tok, messages)
    text = _render(tok, messages)
    # Whether the template writes a generation prompt (not just names the variable).
    prompt = ("add_generation_prompt" in tok.chat_template
              and _render(tok, messages, add_generation_prompt=True) != text)
    spans = [_turn_span(tok, messages, i, text, reasoning_loss, prompt)
             for i, target in enumerate(targets) if target]
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


def encode_chat(tok: Tokenizer, messages: list[dict], reasoning_loss: bool = True,
                mask_history: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Validate, render and tokenize one conversation: (token ids int64, loss mask uint8).
    ``reasoning_loss``: reasoning is a target; ``mask_history``: only the last turn is."""
    validate_messages(messages)
    render = render_with_template if tok.chat_template else render_builtin
    text, spans = (render(tok, messages, reasoning_loss, mask_history) if tok.chat_template
                   else render(messages, reasoning_loss, mask_history))
    bad = SURROGATE.search(text)
    if bad:
        raise RowError("invalid_unicode", f"the conversation holds a lone surrogate {bad.group()!r} "
                                          "(a \\ud800-\\udfff escape without its pair)")
    ids, offsets = tok.encode_with_offsets(text)
    return np.asarray(ids, dtype=np.int64), mask_from_spans(offsets, spans)
