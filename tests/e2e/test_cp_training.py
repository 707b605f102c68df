"""Context parallelism through pretrain_step37.py: CP2 trains and evaluates with the losses of one
process (documents padded alike, --document-pad-multiple 4), composed with FSDP over the CP
ranks and full recompute, and its checkpoints cross CP sizes both ways. (--bf16 at CP2 x EP2:
tests/e2e/test_bf16.py; every CP layout's step: tests/distributed/test_cp_layouts.py.)"""
from __future__ import annotations

from tests.e2e.test_training import train

PAD4 = ["--document-pad-multiple", "4"]  # what CP2 pads to: one process then plans the same packs
CP2 = ["--context-parallel-size", "2"]
REL = 1e-5  # fp32: the same terms summed in another order (see the test's docstring)


def _close(a: list, b: list, rel: float = REL) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def _col(rows: list, key: str) -> list:
    return [r[key] for r in rows if key in r]


def test_cp2_trains_like_one_process_and_resumes_across_cp_sizes(dataset, tmp_path):
    """fp32, 3 steps, one evaluation at the end. CP2 (FSDP over the two CP ranks' dense
    replicas, full recompute) logs the training and validation losses of one process within
    1e-5 relative: the losses are sums of the same per-token terms, but each CP rank sums its
    shard and attention reduces over its keys in another order (a chunk against its prefix,
    ~1e-7 per step in fp32; three AdamW steps keep it far below 1e-5, while a dropped or doubled
    document moves the loss by percents). The validation data are sharded per CP rank: the
    global target count is one process's (each target counted once) and so is the loss. A CP2
    checkpoint resumes at CP1 and a CP1 one at CP2, each continuing with the uninterrupted
    run's loss."""
    args = ["--data-path", dataset, "--optimizer", "adamw", "--lr", "1e-3", "--train-iters", "3",
            "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1", "--save-interval", "2", *PAD4]
    one = train(args + ["--save", str(tmp_path / "ck1")], tmp_path / "one")
    cp2 = train(args + CP2 + ["--data-parallel-sharding", "fsdp", "--recompute-granularity", "full",
                              "--save", str(tmp_path / "ck2")], tmp_path / "cp2", world=2)
    assert _col(one, "iteration")[:3] == [1, 2, 3]
    assert _close(_col(cp2, "loss"), _col(one, "loss")), (_col(one, "loss"), _col(cp2, "loss"))
    assert _close(_col(cp2, "valid_loss"), _col(one, "valid_loss")), (_col(one, "valid_loss"),
                                                                     _col(cp2, "valid_loss"))
    assert _col(cp2, "valid_targets") == _col(one, "valid_targets") and _col(one, "valid_targets")[0] > 0
    at_cp1 = train(args + ["--load", str(tmp_path / "ck2" / "iter_0000002")], tmp_path / "cp2_to_cp1")
    at_cp2 = train(args + CP2 + ["--load", str(tmp_path / "ck1" / "iter_0000002")], tmp_path / "cp1_to_cp2",
                   world=2)
    for resumed in (at_cp1, at_cp2):
        rows = [r for r in resumed if "loss" in r]
        assert [r["iteration"] for r in rows] == [3]
        assert _close(_col(rows, "loss"), _col(one, "loss")[2:]), (_col(one, "loss"), _col(rows, "loss"))
