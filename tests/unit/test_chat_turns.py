"""Chat rows as Hugging Face chat datasets hold them: reasoning_content (or thinking) rendered by
the template and trained on or not (--no-reasoning-loss), and every assistant turn a target or only
the last (--mask-history). Tokenizers are built here (nothing is downloaded)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import RowError, encode_chat
from data.indexed_dataset import IndexedDataset
from data.tokenizers import ByteTokenizer, build_tokenizer
from tools.preprocess_data import main

# Qwen3's template in miniature: reasoning is rendered for the assistant turns after the last
# user message only (history reasoning is dropped), stripped of newlines, inside <think> ... </think>.
QWEN3_LIKE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content.strip('\\n') }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "</call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING_FIELD = QWEN3_LIKE.replace("m.reasoning_content", "m.thinking")
CALL = [{"type": "function", "function": {"name": "search", "arguments": {"q": "moe"}}}]
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "First question?"},
    {"role": "assistant", "content": "First answer.", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Second question?"},
    {"role": "assistant", "content": None, "tool_calls": CALL, "reasoning_content": "look it up"},
    {"role": "tool", "content": "found it"},
    {"role": "assistant", "content": "Second answer.", "reasoning_content": "now I know"},
]
STRIPPED = CONV[:-1] + [{**CONV[-1], "reasoning_content": "\nnow I know\n"}]


def targets(tok, messages=CONV, **kw) -> str:
    ids, mask = encode_chat(tok, messages, **kw)
    assert len(ids) == len(mask)
    return tok.decode(ids[mask == 1].tolist())


@pytest.fixture
def qwen_tok(hf_tokenizer_dir):
    tok = build_tokenizer("huggingface", hf_tokenizer_dir)
    tok.chat_template = QWEN3_LIKE
    return tok


def test_builtin_template_renders_reasoning_and_trains_on_it_by_default():
    tok = ByteTokenizer()
    ids, _ = encode_chat(tok, CONV)
    assert "<|im_start|>assistant\n<think>\nold thoughts\n</think>\n\nFirst answer.<|im_end|>" in tok.decode(ids)
    first = "<think>\nold thoughts\n</think>\n\nFirst answer.<|im_end|>"
    call = ('<think>\nlook it up\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"q": "moe"}}\n'
            '</tool_call><|im_end|>')
    last = "<think>\nnow I know\n</think>\n\nSecond answer.<|im_end|>"
    assert targets(tok) == first + call + last
    # --no-reasoning-loss: the reasoning and the marker before it are context
    assert targets(tok, reasoning_loss=False) == "".join(
        "\n</think>" + t.split("\n</think>", 1)[1] for t in (first, call, last))
    # --mask-history: only the assistant messages after the last user message
    assert targets(tok, mask_history=True) == call + last


def test_template_reasoning_is_a_target_from_the_generation_prompt_on(qwen_tok):
    """The last turn's reasoning (and its <think> marker: the model writes it) is trained on;
    the template drops the first turn's reasoning, which is then simply not there."""
    text = qwen_tok.decode(encode_chat(qwen_tok, CONV)[0].tolist())
    assert "old thoughts" not in text and "now I know" in text
    assert targets(qwen_tok, STRIPPED) == targets(qwen_tok) == ("First answer.<|im_end|>"
                                 "<think>\nlook it up\n</think>\n\n<call>search</call><|im_end|>"
                                 "<think>\nnow I know\n</think>\n\nSecond answer.<|im_end|>")
    assert targets(qwen_tok, reasoning_loss=False) == (
        "First answer.<|im_end|>\n</think>\n\n<call>search</call><|im_end|>\n</think>\n\nSecond answer.<|im_end|>")
    assert targets(qwen_tok, mask_history=True) == (
        "<think>\nlook it up\n</think>\n\n<call>search</call><|im_end|>"
        "<think>\nnow I know\n</think>\n\nSecond answer.<|im_end|>")


def test_the_row_field_is_renamed_to_the_templates_thinking_field(qwen_tok):
    """A row's reasoning_content reaches a template that reads `thinking`, and a row's
    `thinking` one that reads reasoning_content; a template that reads neither rejects the row."""
    conv = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A.", "thinking": "hm"}]
    assert targets(qwen_tok, conv) == "<think>\nhm\n</think>\n\nA.<|im_end|>"
    qwen_tok.chat_template = THINKING_FIELD
    assert targets(qwen_tok, CONV[:3] + CONV[3:4] + CONV[6:]).endswith(
        "<think>\nnow I know\n</think>\n\nSecond answer.<|im_end|>")
    qwen_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                              "<|im_end|>\n{% endfor %}")
    with pytest.raises(RowError) as e:
        encode_chat(qwen_tok, conv)
    assert e.value.reason == "reasoning_unsupported"
    assert targets(qwen_tok, [conv[0], {"role": "assistant", "content": "A."}]) == "A.<|im_end|>"


def test_mask_history_without_an_answer_to_the_last_question_is_rejected():
    conv = CONV[:3] + [{"role": "user", "content": "Unanswered?"}]
    with pytest.raises(RowError) as e:
        encode_chat(ByteTokenizer(), conv, mask_history=True)
    assert e.value.reason == "no_assistant_turn" and "--mask-history" in e.value.detail
    assert targets(ByteTokenizer(), conv).endswith("First answer.<|im_end|>")  # fine by default
    with pytest.raises(RowError) as e:
        encode_chat(ByteTokenizer(), [{"role": "assistant", "content": "x", "reasoning_content": 3}])
    assert e.value.reason == "wrong_type"


@pytest.mark.parametrize("flags, trained", [
    ([], ["<think>\nr\n</think>\n\nA1<|im_end|>", "A2<|im_end|>"]),
    (["--no-reasoning-loss"], ["\n</think>\n\nA1<|im_end|>", "A2<|im_end|>"]),
    (["--mask-history"], ["A2<|im_end|>"]),
])
def test_the_flags_reach_the_loss_mask(tmp_path, flags, trained):
    conv = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "r"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": conv}) + "\n")
    assert main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"),
                 "--chat", *flags]) == 0
    text, mask = IndexedDataset(tmp_path / "o_text_document")[0], IndexedDataset(tmp_path / "o_loss_mask_document")[0]
    tok = ByteTokenizer()
    runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask)) + 1)
    assert [tok.decode(text[r]) for r in runs if mask[r[0]]] == trained
