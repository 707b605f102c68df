"""The data against the model before training (no process group yet), the statistics sidecar,
and where caches go when the dataset's directory is read-only."""
from __future__ import annotations

import errno
import json
import os
import warnings

import numpy as np
import pytest
import torch

from data import cache, dataset_stats
from data.checks import check_training_data
from data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data.loader import THDLoader, open_source
from train_args import parse, validate

TINY_VOCAB = 320  # the tiny preset's vocab_size


def _dataset(path, docs, dtype=np.int32, masks=None):
    prefix = str(path / "d_text_document")
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add(np.asarray(d))
    if masks is not None:
        with IndexedDatasetWriter(str(path / "d_loss_mask_document"), np.uint8) as w:
            for m in masks:
                w.add(np.asarray(m, np.uint8))
    return prefix


def _validate(*data_path):
    args = parse(["--data-path", *data_path, "--seq-length", "64", "--global-batch-size", "1"])
    return validate(args, world=1)


def test_data_tokenised_with_a_larger_vocabulary_is_refused_before_training(tmp_path, hf_tokenizer_dir):
    """Preprocessed with a ~600-entry BPE, trained with the tiny model (320) and the default
    --tokenizer-type byte (260, which fits): the old check passed; the data's ids do not."""
    from tests.conftest import corpus
    from tools.preprocess_data import main

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(50)))
    assert main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "bpe"),
                 "--tokenizer-type", "huggingface", "--tokenizer-model", hf_tokenizer_dir]) == 0
    prefix = str(tmp_path / "bpe_text_document")
    top = int(IndexedDataset(prefix)._bin.max())
    assert top >= TINY_VOCAB  # the premise: the data holds ids the model cannot embed
    with pytest.raises(ValueError) as e:
        _validate(prefix)
    msg = str(e.value)
    assert f"--data-path {prefix}: token id {top} is outside the model's vocabulary of 320" in msg
    assert "--tokenizer-type huggingface" in msg  # what the sidecar recorded
    assert not torch.distributed.is_initialized()


def test_without_a_sidecar_the_ids_are_computed_once_and_cached(tmp_path):
    prefix = _dataset(tmp_path, [[1, 2, 3], [4, 500, 6]])
    os.remove(prefix + ".meta.json")  # as written by Megatron-LM: no sidecar
    with pytest.raises(ValueError, match="token id 500 is outside the model's vocabulary of 320"):
        check_training_data(prefix, TINY_VOCAB)
    assert json.load(open(prefix + ".meta.json"))["stats"]["max"] == 500  # cached beside it
    # rewritten in place with the same sizes: the old sidecar is stale and not trusted
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add(np.array([1, 2, 3]))
        w.add(np.array([4, 5, 6]))
    os.remove(prefix + ".meta.json")
    check_training_data(prefix, TINY_VOCAB)
    stale = json.load(open(prefix + ".meta.json"))
    stale["stats"]["max"] = 999
    stale["identity"]["bin_mtime_ns"] -= 1
    json.dump(stale, open(prefix + ".meta.json", "w"))
    assert check_training_data(prefix, TINY_VOCAB)["max_token_id"] == 6


def test_negative_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="token id -3 is outside"):
        check_training_data(_dataset(tmp_path, [[1, -3, 2]]), TINY_VOCAB)


def test_datasets_without_training_targets_are_refused_and_nearly_none_warned(tmp_path):
    one_token = _dataset(tmp_path, [[5]] * 40)
    with pytest.raises(ValueError, match=r"no training targets in 40 tokens and 40 documents: every "
                                         r"document is at most one token long"):
        _validate(one_token)
    (tmp_path / "b").mkdir()
    # 300 one-token documents and one of 3 tokens: 2 targets in 303 tokens (0.66%)
    few = _dataset(tmp_path / "b", [[5]] * 300 + [[1, 2, 3]])
    with pytest.warns(UserWarning, match=r"only 2 of 303 tokens \(0\.660%\) are training targets"):
        assert check_training_data(few, TINY_VOCAB)["targets"] == 2
    (tmp_path / "c").mkdir()
    # chat: the mask marks only documents' first tokens, which are never a target
    chat = _dataset(tmp_path / "c", [[1, 2, 3], [4, 5]], masks=[[1, 0, 0], [1, 0]])
    with pytest.raises(ValueError, match="its loss mask marks no token after a document's first"):
        check_training_data(chat, TINY_VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_training_data(_dataset(tmp_path, [[1, 2, 3]] * 5), TINY_VOCAB)["targets"] == 10


def test_blend_weights_must_be_finite_and_positive(tmp_path):
    prefix = _dataset(tmp_path, [[1, 2, 3]] * 5)
    for w in ("nan", "inf", "-1", "0"):  # nan used to pass (every comparison with it is False)
        with pytest.raises(ValueError, match=rf"--data-path: weight '{w}' for {prefix} must be a "
                                             "finite number > 0"):
            _validate(w, prefix, "1", prefix)


# --- read-only dataset directories ---------------------------------------------------------

@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A dataset directory in which creating a file fails with EROFS, as on a read-only mount.

    The tests run as root, for whom chmod does not stop writes, and mounting needs privileges
    the test machine may lack; so every ``open`` for writing that ``data/cache.py`` (the only
    code that writes caches) attempts under this directory raises ``OSError(EROFS)``. What this
    proves: the fallback logic and where files land. ``tests/e2e/test_readonly_data.py`` runs a
    real training job on a read-only bind mount where the machine allows one.
    """
    data_dir = tmp_path / "ro"
    data_dir.mkdir()
    real_open = open

    def open_(path, mode="r", *a, **kw):
        if any(c in mode for c in "wax+") and os.path.abspath(path).startswith(str(data_dir) + os.sep):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(cache, "open", open_, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return data_dir


def test_training_data_in_a_read_only_directory_uses_the_user_cache(read_only_dir, tmp_path, monkeypatch):
    prefix = _dataset(read_only_dir, [np.arange(1, 40) for _ in range(30)])
    os.remove(prefix + ".meta.json")  # statistics must be computed, and cannot be cached beside it
    before = sorted(os.listdir(read_only_dir))
    with pytest.warns(UserWarning, match="Read-only file system; cached it under .*xdg"):
        check_training_data(prefix, TINY_VOCAB)
    with pytest.warns(UserWarning, match="Read-only file system; cached it under .*xdg"):
        src = open_source(prefix, 64, "split", seed=0)
    assert sorted(os.listdir(read_only_dir)) == before  # nothing written beside the dataset
    cached = os.listdir(tmp_path / "xdg" / "step37-trainer")
    assert any(f.endswith(".meta.json") for f in cached) and any("_packplan_" in f for f in cached)
    batch = next(THDLoader([(1.0, src)], seq_length=64, micro_batch_size=1, pad_id=0))
    assert batch.tokens.shape == (64,)
    # a second run reads both from the user cache: nothing is recomputed
    monkeypatch.setattr(dataset_stats, "compute_stats", _must_not_run)
    monkeypatch.setattr("data.packing.plan_packs", _must_not_run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(prefix, TINY_VOCAB)
        assert open_source(prefix, 64, "split", seed=0).plan.num_packs == src.plan.num_packs


def test_data_cache_path_is_used_when_given(read_only_dir, tmp_path):
    prefix = _dataset(read_only_dir, [np.arange(1, 40) for _ in range(30)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit cache directory needs no fallback warning
        open_source(prefix, 64, "split", seed=0, cache_dir=str(tmp_path / "mine"))
    assert any("_packplan_" in f for f in os.listdir(tmp_path / "mine"))
    assert not (tmp_path / "xdg").exists()


def test_nothing_writable_still_trains_uncached(read_only_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(read_only_dir / "cache"))  # read-only too
    prefix = _dataset(read_only_dir, [np.arange(1, 40) for _ in range(30)])
    with pytest.warns(UserWarning, match="could not cache the pack plan .* anywhere"):
        assert open_source(prefix, 64, "split", seed=0).plan.num_packs > 0


def _must_not_run(*a, **kw):
    raise AssertionError("recomputed although cached")
