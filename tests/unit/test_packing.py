"""Pack planner: properties over random inputs, byte-identity with the Python reference."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data.packing import cached_plan, permutation, plan_packs
from data.packing_reference import SplitMix64, first_fit_decreasing, plan_packs_reference

lengths_and_S = st.integers(1, 64).flatmap(
    lambda S: st.tuples(st.lists(st.integers(0, 3 * S + 1), max_size=60), st.just(S)))


def _covered(plan):
    """(doc, token) pairs present in the plan, as a sorted array."""
    out = [np.stack([np.full(n, d), np.arange(s, s + n)], 1) for d, s, n in plan.segments.tolist()]
    return np.concatenate(out) if out else np.zeros((0, 2), np.int64)


@settings(max_examples=300, deadline=None)
@given(lengths_and_S, st.sampled_from(["split", "truncate", "drop"]), st.integers(0, 2**64 - 1))
def test_properties(ls, policy, seed):
    lengths, S = ls
    plan = plan_packs(np.array(lengths, dtype=np.int64), S, long_docs=policy, seed=seed)
    tokens = plan.pack_tokens()
    assert (tokens <= S).all() and (tokens > 0).all()
    cov = _covered(plan)
    assert len(np.unique(cov, axis=0)) == len(cov)  # no token twice
    total = sum(lengths)
    if policy == "split":
        assert len(cov) == total
    else:
        assert len(cov) + plan.dropped_tokens + plan.truncated_tokens == total
        assert plan.truncated_tokens == sum(L - S for L in lengths if L > S and policy == "truncate")
        assert plan.dropped_tokens == sum(L for L in lengths if L > S and policy == "drop")
        assert all(s == 0 for s in plan.segments[:, 1])  # kept documents start at token 0
    assert plan.empty_docs == lengths.count(0)
    # deterministic, and the same as the slow reference, byte for byte
    again = plan_packs(np.array(lengths, dtype=np.int64), S, long_docs=policy, seed=seed)
    ref_offsets, ref_segments = plan_packs_reference(lengths, S, policy, seed)
    for a, b in ((plan.pack_offsets, again.pack_offsets), (plan.segments, again.segments),
                 (plan.pack_offsets, ref_offsets), (plan.segments, ref_segments)):
        assert a.tobytes() == b.tobytes()


@settings(max_examples=300, deadline=None)
@given(lengths_and_S)
def test_never_more_packs_than_first_fit_decreasing(ls):
    lengths, S = ls
    fitting = [L for L in lengths if 0 < L <= S]
    assert plan_packs(np.array(fitting, dtype=np.int64), S).num_packs <= first_fit_decreasing(fitting, S)


def test_hand_worked_example():
    # S = 10, lengths 6 5 4 3 2: sorted 6,5,4,3,2 -> 6 opens A (4 left), 5 opens B (5 left),
    # 4 fits A exactly (best fit: 4 <= 5), 3 goes to B (2 left), 2 fills B. Two full packs.
    plan = plan_packs(np.array([6, 5, 4, 3, 2]), 10, seed=0)
    packs = sorted(sorted(plan.pack(p)[:, 0].tolist()) for p in range(plan.num_packs))
    assert packs == [[0, 2], [1, 3, 4]] and plan.fill == 1.0


def test_powers_of_two_plus_one_and_exact_fits():
    for S in (2, 3, 1025, 4097):
        plan = plan_packs(np.array([S, 1, S - 1, S + 1, 2 * S - 1]), S)
        assert plan.num_packs == 5 and (plan.pack_tokens() == S).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="long_docs must be one of split, truncate, drop"):
        plan_packs(np.array([1]), 8, long_docs="cut")
    with pytest.raises(ValueError, match="seq_length must be >= 1"):
        plan_packs(np.array([1]), 0)
    with pytest.raises(ValueError, match="negative length"):
        plan_packs(np.array([1, -2]), 8)
    with pytest.raises(ValueError, match="1-D integer array"):
        plan_packs(np.array([1.5]), 8)


def test_shuffle_is_seeded_and_not_length_sorted():
    lengths = np.arange(1, 2001)
    a, b = plan_packs(lengths, 512, seed=1), plan_packs(lengths, 512, seed=2)
    assert a.num_packs == b.num_packs and a.segments.tobytes() != b.segments.tobytes()
    first = [int(a.pack(p)[0, 2]) for p in range(a.num_packs)]
    assert first != sorted(first, reverse=True)


def test_permutation_matches_reference():
    rng = SplitMix64(42)
    ref = list(range(50))
    for i in range(49, 0, -1):
        j = rng.bounded(i + 1)
        ref[i], ref[j] = ref[j], ref[i]
    assert permutation(50, 42).tolist() == ref


def test_cached_plan_builds_once_then_maps(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 300, 1000)
    first = cached_plan(lengths, 256, str(tmp_path / "ds"), seed=3)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 and all(".tmp-" not in f for f in files)
    second = cached_plan(lengths, 256, str(tmp_path / "ds"), seed=3)
    assert isinstance(second.segments, np.memmap)
    assert second.segments.tobytes() == first.segments.tobytes()
    cached_plan(lengths, 256, str(tmp_path / "ds"), seed=4)  # other seed: other files
    assert len(list(tmp_path.iterdir())) == 6


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-40])


def _zero(path):
    path.write_bytes(bytes(path.stat().st_size))


@pytest.mark.parametrize("suffix, damage, message", [
    ("segments.npy", _truncate, "bytes, its meta file records"),
    ("segments.npy", _zero, "CRC-32 differs"),
    ("offsets.npy", _zero, "CRC-32 differs"),
    ("meta.json", lambda p: p.write_text(""), "unreadable \\(JSONDecodeError"),
])
def test_a_damaged_cache_entry_is_named_and_rebuilt(tmp_path, suffix, damage, message):
    """A truncated or zeroed array file, or an empty meta file, crashed with 'mmap length is
    greater than file size' or a JSONDecodeError naming no file. Now the damaged file is named
    in a warning, the plan rebuilt (the same bytes as planning afresh) and the entry rewritten."""
    lengths = np.random.default_rng(1).integers(1, 300, 500)
    cached_plan(lengths, 256, str(tmp_path / "ds"), seed=3)
    (path,) = tmp_path.glob(f"ds_packplan_*_{suffix}")
    damage(path)
    with pytest.warns(UserWarning, match=f"damaged pack-plan cache entry: {path}.*{message}.*rebuilding"):
        plan = cached_plan(lengths, 256, str(tmp_path / "ds"), seed=3)
    fresh = plan_packs(lengths, 256, seed=3)
    assert plan.segments.tobytes() == fresh.segments.tobytes()
    assert plan.pack_offsets.tobytes() == fresh.pack_offsets.tobytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: the next read is clean
        again = cached_plan(lengths, 256, str(tmp_path / "ds"), seed=3)
    assert isinstance(again.segments, np.memmap) and again.segments.tobytes() == fresh.segments.tobytes()
