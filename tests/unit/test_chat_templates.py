"""Chat loss masks under tokenizer chat templates written here (ChatML, a Llama-3-style header
template, a Qwen3-style template with <think> reasoning, and one that upper-cases content): every
accepted row's target tokens decode to exactly its assistant turns (content, the reasoning block
where the template writes it, the end-of-turn token) and nothing else; a row whose answers cannot
be placed exactly is rejected, never mis-masked. Answers are drawn from the markup's own
characters, so a search for the answer in the rendered text would find the markup first."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from data import preprocess
from data.chat import RowError, encode_chat
from data.indexed_dataset import IndexedDataset
from data.tokenizers import build_tokenizer
from tests.conftest import corpus
from tools.preprocess_data import PreprocessConfig

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's shape: headers, trimmed content, <|eot_id|> closes every turn.
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Qwen3's rules: reasoning only for the assistant turns after the last user message (the last
# turn always gets a <think> block, empty without reasoning), stripped of newlines; the content
# after a <think> block has its leading newlines stripped; tool results go in a user turn.
QWEN3 = (
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{%- set r = m.reasoning_content or '' -%}"
    "{%- if loop.index0 > ns.last and (loop.last or r) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m.content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + m.content -}}{%- endif -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
UPPER = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen3": QWEN3, "upper": UPPER}
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "upper": "<|im_end|>"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    """A byte-level BPE with every template's markers as special tokens. Each whitespace
    character is its own pre-token, so the markup's last newline and an answer's first
    character never merge into one token (masks are token-granular: a token holding markup and
    answer both would be trained on whole)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(200), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    path = str(tmp_path_factory.mktemp("chat_tok"))
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def toks(tok_dir):
    out = {}
    for name, template in TEMPLATES.items():
        out[name] = build_tokenizer("huggingface", tok_dir)
        out[name].chat_template = template
    return out


def targets(tok, messages, **kw) -> str:
    ids, mask = encode_chat(tok, messages, **kw)
    assert len(ids) == len(mask)
    return tok.decode(ids[mask == 1].tolist())


def expected_targets(name: str, messages: list[dict], mask_history: bool, reasoning_loss: bool) -> str:
    """What each template's assistant turns are: the content and end-of-turn token; under the
    Qwen3-style template, a turn whose reasoning it writes starts at its <think> block (or after
    the reasoning, without reasoning_loss)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (mask_history and i < last_user):
            continue
        r = m.get("reasoning_content") or ""
        head = ""
        if name == "qwen3" and r and i > last_user:
            head = ("<think>\n" + r.strip("\n") if reasoning_loss else "") + "\n</think>\n\n"
        out.append(head + m["content"] + END[name])
    return "".join(out)


# Answers from the markup's own characters and words, the issue's cases among them.
MARKUP = "<|>_\n /adehimnorstu"
answer = st.one_of(st.sampled_from(["d", "a", "s", "t", "assistant", "im_end", "a b", "user", "<",
                                    "think", "</think>", "|>", "\n", "", " "]),
                   st.text(MARKUP, max_size=8))
message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, answer),
    st.builds(lambda c: {"role": "system", "content": c}, answer),
    st.builds(lambda c: {"role": "tool", "content": c}, answer),
    st.builds(lambda c: {"role": "assistant", "content": c}, answer),
    st.builds(lambda c, r: {"role": "assistant", "content": c, "reasoning_content": r}, answer,
              st.text(MARKUP, min_size=1, max_size=6)),
)
QUESTION = {"role": "user", "content": "Which option? a) cat b) dog c) sun d) eel"}


def _check(toks, name, messages, mask_history, reasoning_loss):
    tok = toks[name]
    rows_reasoning = any(m.get("reasoning_content") for m in messages)
    try:
        got = targets(tok, messages, mask_history=mask_history, reasoning_loss=reasoning_loss)
    except RowError as e:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if e.reason == "empty_text":
            assert any(not a.strip() for a in answers) and "assistant's answer is empty" in e.detail
        elif e.reason == "reasoning_unsupported":
            assert rows_reasoning and name != "qwen3"
        elif e.reason == "no_assistant_turn":
            assert mask_history or not answers
        else:
            assert e.reason == "template_error" and "assistant message" in e.detail, e
            if name == "chatml":  # ChatML writes every message verbatim: nothing to reject
                raise
            if name == "llama3":  # it trims content
                assert any(a != a.strip() for a in answers)
        return None
    assert got == expected_targets(name, messages, mask_history, reasoning_loss)
    if name == "upper":  # accepted only where upper-casing changed no answer it trains on
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        assert all(m["content"] == m["content"].upper() for i, m in enumerate(messages)
                   if m["role"] == "assistant" and (i > last_user or not mask_history))
    return got


@settings(max_examples=int(os.environ.get("CHAT_PROPERTY_EXAMPLES", 80)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(TEMPLATES)), body=st.lists(message, min_size=1, max_size=5),
       mask_history=st.booleans(), reasoning_loss=st.booleans())
@example(name="chatml", body=[{"role": "assistant", "content": "d"}], mask_history=False,
         reasoning_loss=True)
@example(name="chatml", body=[{"role": "assistant", "content": "a b"}, {"role": "user", "content": "s"},
                              {"role": "assistant", "content": "t"}], mask_history=True, reasoning_loss=True)
def test_targets_are_exactly_the_assistant_turns(toks, name, body, mask_history, reasoning_loss):
    messages = [QUESTION] + body
    if name != "qwen3":  # the others name no reasoning field: such rows are rejected, tested below
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    _check(toks, name, messages, mask_history, reasoning_loss)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["chatml", "llama3", "qwen3"]),
       turns=st.lists(st.tuples(st.sampled_from(["user", "tool"]),
                                st.text(MARKUP.replace("\n", "").replace(" ", ""), min_size=1, max_size=8)),
                      min_size=1, max_size=3))
def test_well_formed_conversations_are_accepted(toks, name, turns):
    """Alternating questions (or tool results) and non-empty answers without surrounding
    whitespace: every template here renders them verbatim, so every row is accepted."""
    messages = [QUESTION]
    for role, answer_text in turns:
        messages += [{"role": "assistant", "content": answer_text}, {"role": role, "content": "ok"}]
    messages.append({"role": "assistant", "content": turns[0][1]})
    assert _check(toks, name, messages, False, True) is not None


ISSUE_ANSWERS = [["d"], ["a"], ["s"], ["assistant"], ["im_end"], ["a b", "t"], [""], ["  \n"]]


@pytest.mark.parametrize("kind", ["huggingface", "byte"])
@pytest.mark.parametrize("mask_history", [False, True])
def test_the_issues_rows_through_preprocessing(tmp_path, hf_tokenizer_dir, mask_history, kind):
    """The issue's rows with tests/conftest.py's ChatML tokenizer (a template without a generation
    prompt) and with the built-in template: each accepted row's targets are its answers plus
    <|im_end|>, the empty answers are rejected with a reason, and accepted + rejected == rows."""
    rows = []
    for answers in ISSUE_ANSWERS:
        msgs = [QUESTION]
        for k, a in enumerate(answers):
            msgs += [{"role": "assistant", "content": a}] + ([{"role": "user", "content": "s"}]
                                                             if k < len(answers) - 1 else [])
        rows.append({"messages": msgs})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PreprocessConfig(input=[str(tmp_path / "c.jsonl")], output_prefix=str(tmp_path / "o"),
                           tokenizer_type=kind, tokenizer_model=hf_tokenizer_dir if kind != "byte" else None,
                           chat="messages", mask_history=mask_history, max_rejected_fraction=1.0)
    stats = preprocess.run(cfg, progress=False)
    assert stats.accepted + stats.num_rejected == stats.rows_read == len(rows)
    rejects = [json.loads(line) for line in open(tmp_path / "o_rejects.jsonl")]
    assert [(r["line"], r["reason"]) for r in rejects] == [(7, "empty_text"), (8, "empty_text")]
    assert "message 1: the assistant's answer is empty" in rejects[0]["detail"]
    tok = build_tokenizer(kind, hf_tokenizer_dir if kind != "byte" else None)
    text, mask = IndexedDataset(tmp_path / "o_text_document"), IndexedDataset(tmp_path / "o_loss_mask_document")
    got = [tok.decode(text[i][mask[i] == 1].tolist()) for i in range(len(text))]
    kept = ISSUE_ANSWERS[:6]
    assert got == ["".join(a + "<|im_end|>" for a in (answers[-1:] if mask_history else answers))
                   for answers in kept]


def test_a_rewriting_template_rejects_and_names_the_message(toks):
    rows = [[QUESTION, {"role": "assistant", "content": a}] for a in ("d", "assistant", "im_end", "t")]
    for row in rows:
        with pytest.raises(RowError) as e:
            encode_chat(toks["upper"], row)
        assert e.value.reason == "template_error"
        assert e.value.detail.startswith("assistant message 1: its content does not appear verbatim")
    assert targets(toks["upper"], [QUESTION, {"role": "assistant", "content": "D!"}]) == "D!<|im_end|>"


def test_a_template_that_rewrites_history_once_more_follows_is_rejected(toks):
    """Qwen3's rule gives the last turn a <think> block: an assistant turn straight after another
    one is rendered without it once the next follows, so the earlier turn's context differs from
    the text being trained on; the row is rejected naming the message."""
    row = [QUESTION, {"role": "assistant", "content": "one"}, {"role": "assistant", "content": "two"}]
    with pytest.raises(RowError) as e:
        encode_chat(toks["qwen3"], row)
    assert e.value.reason == "template_error"
    assert e.value.detail.startswith("assistant message 2: the chat template renders the messages "
                                     "before it differently once it follows them")


def test_qwen3_tool_call_turns_are_placed_with_reasoning_and_rejected_without(toks):
    """Qwen3's rule renders a tool-call turn without reasoning plainly once the tool's answer
    follows, but with an empty <think> block while it is the last message: where it ends cannot
    be told, and the row is rejected naming the message. With reasoning it is rendered the same
    both ways, and its whole turn is the target."""
    tok = toks["qwen3"]
    tok.chat_template = QWEN3.replace(
        "{{- '<|im_end|>\\n' -}}",
        "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>' + c.function.name + '</tool_call>' -}}"
        "{%- endfor -%}{{- '<|im_end|>\\n' -}}", 1)
    try:
        call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
        row = [QUESTION, call, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "d"}]
        with pytest.raises(RowError) as e:
            encode_chat(tok, row)
        assert e.value.reason == "template_error" and e.value.detail.startswith(
            "assistant message 1: it has tool calls, and the chat template renders the conversation "
            "through it differently once more messages follow")
        row[1] = {**call, "reasoning_content": "use f"}
        # the last turn's empty <think> block is markup before its content, not a target
        assert targets(tok, row) == "<think>\nuse f\n</think>\n\n<tool_call>f</tool_call><|im_end|>d<|im_end|>"
    finally:
        tok.chat_template = QWEN3


def test_a_generation_prompt_that_opens_the_thinking_block(toks):
    """The prompt ends '<think>\\n': a turn with reasoning is a target from there (the marker is
    prompt, as at inference); a turn without it, which the template writes without the block,
    begins after the previous message instead, and its header is context."""
    tok = toks["chatml"]
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
        "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    try:
        row = [QUESTION, {"role": "assistant", "content": "a"}, {"role": "user", "content": "s"},
               {"role": "assistant", "content": "d", "reasoning_content": "think"}]
        assert targets(tok, row) == "a<|im_end|>think\n</think>\n\nd<|im_end|>"
        assert targets(tok, row, reasoning_loss=False) == "a<|im_end|>\n</think>\n\nd<|im_end|>"
    finally:
        tok.chat_template = CHATML


@pytest.mark.parametrize("template, detail", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.reasoning_content %}"
     "<think>{{ m.reasoning_content }}</think>{% endif %}<|im_end|>\n{% endfor %}",
     "assistant message 1: the chat template writes its reasoning after its content"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
     "{% if messages[-1].role == 'assistant' %}(last: {{ messages[-1].content }}){% endif %}",
     "assistant message 1: the chat template writes its content or reasoning more than once"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
     "{% if messages[-1].content == 'd' %}(d again){% endif %}",
     "assistant message 1: its content does not appear verbatim in the rendered chat template (the "
     "template rewrites it, or renders the rest differently because of it)"),
])
def test_odd_templates_are_rejected_naming_the_message(toks, template, detail):
    """Reasoning after the answer, an answer written twice, a rendering that depends on the
    answer elsewhere: no exact place, so the row is rejected, never mis-masked."""
    tok = toks["chatml"]
    tok.chat_template = template
    try:
        with pytest.raises(RowError) as e:
            reasoning = {"reasoning_content": "r"} if "reasoning_content" in template else {}
            encode_chat(tok, [QUESTION, {"role": "assistant", "content": "d", **reasoning}])
        assert e.value.reason == "template_error" and e.value.detail.startswith(detail), e.value.detail
    finally:
        tok.chat_template = CHATML


def test_a_conversation_that_starts_with_an_assistant_turn_trains_as_under_the_built_in(toks):
    """transformers renders no empty conversation, so the first turn's start was a template_error
    under every tokenizer template while the built-in template trains on it: now both do."""
    from data.chat import render_builtin

    messages = [{"role": "assistant", "content": "d"}, QUESTION, {"role": "assistant", "content": "t"}]
    text, spans = render_builtin(messages)
    assert [text[a:b] for a, b, _ in spans] == ["d<|im_end|>", "t<|im_end|>"]
    for name in ("chatml", "llama3", "qwen3"):
        assert targets(toks[name], messages) == expected_targets(name, messages, False, True), name


def test_a_template_that_drops_the_system_message_is_refused(toks):
    tok = toks["chatml"]
    tok.chat_template = CHATML.replace("{% for m in messages %}",
                                       "{% for m in messages if m['role'] != 'system' %}")
    system = {"role": "system", "content": "Be brief."}
    try:
        with pytest.raises(RowError) as e:
            encode_chat(tok, [system, QUESTION, {"role": "assistant", "content": "d"}])
        assert e.value.reason == "system_unsupported" and "would be dropped" in e.value.detail
        assert targets(tok, [QUESTION, {"role": "assistant", "content": "d"}]) == "d<|im_end|>"
    finally:
        tok.chat_template = CHATML
    assert targets(tok, [system, QUESTION, {"role": "assistant", "content": "d"}]) == "d<|im_end|>"
