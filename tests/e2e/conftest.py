"""The corpus every e2e test trains on, and training runs that several tests compare with.

A run of the entry script costs about 3 s of CPU to start (imports) plus 0.2-0.3 s per tiny
iteration, so a run that two tests would each start is started once here and its rows and
checkpoints shared (read-only: a test that changes a checkpoint directory copies it first).
The tests that share a run are put in one xdist group (``--dist loadgroup``, the Makefile's),
so that one worker starts it."""
from __future__ import annotations

import os

import numpy as np
import pytest

from data.indexed_dataset import IndexedDatasetWriter

SHARED_RUNS = ("muon8", "adamw4")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """A small corpus: 12 documents repeated, so a tiny model can memorise it."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, rng.integers(20, 90)) for _ in range(12)]
    prefix = str(tmp_path_factory.mktemp("data") / "rep_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(20):
            for d in docs:
                w.add(d)
    return prefix


MUON8 = ["--optimizer", "muon", "--muon-momentum", "0.9", "--lr", "0.02", "--lr-decay-iters", "8"]


class Run(list):
    """A run's metrics rows, and its --log-dir (``log_dir``)."""

    log_dir = None


PROFILE = ["--profile", "--profile-step-start", "2", "--profile-step-end", "3"]


@pytest.fixture(scope="session")
def muon8(dataset, tmp_path_factory) -> Run:
    """Muon with momentum (its optimizer state matters on a resume), 8 iterations of an
    8-iteration cosine schedule, no checkpoint (so a save that changed the run would show): the
    uninterrupted run of the resume tests of test_training and test_run_control, which also
    profiles iteration 3 (test_profile.py; the resume tests, unprofiled, then also show that the
    profiler changes no number). Its rows and log directory."""
    from tests.e2e.test_training import train

    d = tmp_path_factory.mktemp("muon8")
    run = Run(train(["--data-path", dataset, *MUON8, "--train-iters", "8", *PROFILE], d / "log"))
    run.log_dir = d / "log"
    return run


ADAMW4 = ["--optimizer", "adamw", "--lr", "5e-3", "--train-iters", "4", "--save-interval", "2"]


@pytest.fixture(scope="session")
def adamw4(dataset, tmp_path_factory):
    """``adamw4(bf16)``: AdamW at lr 5e-3, 4 iterations, checkpoints at 2 and 4, in fp32 or under
    --bf16, each run once: the eager runs the --compile tests compare with and the runs and
    checkpoints of the --bf16 resume test; the fp32 run's checkpoint is the one the export test
    converts. Returns (its metrics rows, its --save directory)."""
    from tests.e2e.test_training import train

    runs = {}

    def get(bf16: bool):
        if bf16 not in runs:
            d = tmp_path_factory.mktemp("adamw4_bf16" if bf16 else "adamw4_fp32")
            rows = train(["--data-path", dataset, *ADAMW4, "--save", str(d / "ck")] + (["--bf16"] if bf16 else []),
                         d / "log")
            runs[bf16] = rows, d / "ck"
        return runs[bf16]

    return get


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in SHARED_RUNS:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(f"e2e-{name}"))


ROOT = __file__.rsplit("/tests/", 1)[0]
PROCESSOR = os.path.join(ROOT, "tests", "fixtures", "step3p7_processor")


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory) -> str:
    """Image + text chat rows (examples/data/make_shapes_vlm.py, 12 rows, one image each)
    preprocessed with the tests' tiny Step-3.7 processor (tests/fixtures/step3p7_processor)."""
    import importlib.util

    from tools.preprocess_data import main as preprocess

    spec = importlib.util.spec_from_file_location("make_shapes_vlm", os.path.join(ROOT, "examples", "data",
                                                                                 "make_shapes_vlm.py"))
    make_shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_shapes)

    d = tmp_path_factory.mktemp("shapes")
    make_shapes.make_rows(str(d), 12, seed=1)
    assert preprocess(["--input", str(d / "rows.jsonl"), "--output-prefix", str(d / "out" / "shapes"), "--chat",
                       "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR,
                       "--append-eod"]) == 0
    return str(d / "out" / "shapes_text_document")
