"""Shared fixtures: tokenizers trained here on synthetic text (nothing is downloaded)."""
from __future__ import annotations

import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One intra-op thread per test process, and for what it starts (`make test` runs two workers on
# two cores): with torch's default of one thread per core, every op waits at OpenMP's barrier
# for a core the other worker holds (a [512, 64] x [64, 256] matmul takes 6 ms so, 0.1 ms with
# one thread; four unit files ran in 69 s so, 41 s with one). Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # the variable is read when torch starts
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "examples", "data"))
    from make_sample_data import paragraph

    rng = random.Random(seed)
    return [paragraph(rng, rng.randint(1, 8)) for _ in range(n)]


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE (vocab ~600) with a ChatML template, saved as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    path = str(tmp_path_factory.mktemp("hf_tok"))
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sp_model_path(tmp_path_factory) -> str:
    """A small SentencePiece BPE model trained on synthetic text."""
    import sentencepiece as spm

    prefix = os.path.join(str(tmp_path_factory.mktemp("sp")), "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=prefix,
                                   vocab_size=300, model_type="bpe", character_coverage=1.0,
                                   minloglevel=2)
    return prefix + ".model"


@pytest.fixture(params=["byte", "huggingface", "sentencepiece"])
def any_tokenizer(request, hf_tokenizer_dir, sp_model_path):
    from data.tokenizers import build_tokenizer

    model = {"byte": None, "huggingface": hf_tokenizer_dir, "sentencepiece": sp_model_path}
    return build_tokenizer(request.param, model[request.param])


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (the Makefile's): pytest-xdist tells its scheduler an item's
    ``xdist_group`` by a suffix on the node id that it writes to ``item._nodeid``, which pytest 9.2
    no longer reads (node ids are ``item._id``, a ``NodeId``): the groups are silently ignored
    (pytest-xdist issue #1386, fix pending in #1388). Until then, put the suffix where pytest reads
    it; a no-op where xdist's own write took effect."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        suffixed = item.__dict__.get("_nodeid")
        if isinstance(suffixed, str) and suffixed != item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(suffixed)
