"""Exact fp32 masters in 4 bytes (core/optim/masters.py): split and join over every edge case
and random bit patterns, the compute value against torch's round-to-nearest-even, and the
optimizers updating through them. Exact comparisons: bits are moved, never summed."""
from __future__ import annotations

import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.optim.masters import RemainderMasters, join, split


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> list[int]:
    return [(b + (1 << 32)) % (1 << 32) for b in x.view(torch.int32).tolist()]


EDGES = {
    "zero": 0x00000000, "negative zero": 0x80000000, "one": 0x3F800000, "minus one": 0xBF800000,
    "tie, rounds to even down": 0x3F808000, "tie, rounds to even up": 0x3F818000,
    "just below a tie": 0x3F807FFF, "just above a tie": 0x3F808001,
    "rounds up across a power of two": 0x3FFFFFFF, "negative, rounds up across a power of two": 0xBFFFFFFF,
    "smallest subnormal": 0x00000001, "subnormal tie": 0x00008000, "largest subnormal": 0x007FFFFF,
    "smallest normal": 0x00800000, "largest finite bf16": 0x7F7F0000, "above the largest finite bf16": 0x7F7F8000,
    "largest finite fp32": 0x7F7FFFFF, "negative largest finite fp32": 0xFF7FFFFF,
    "infinity": 0x7F800000, "minus infinity": 0xFF800000, "default NaN": 0x7FC00000,
    "NaN with a low payload": 0x7FC08001, "NaN, all ones": 0xFFFFFFFF,
}


def test_every_edge_case_round_trips_bit_for_bit():
    x = _f32(list(EDGES.values()))
    hi, rem = split(x)
    assert hi.dtype == torch.bfloat16 and rem.dtype == torch.int16 and hi.shape == rem.shape == x.shape
    assert _bits(join(hi, rem)) == list(EDGES.values())


def test_the_compute_value_is_round_to_nearest():
    """Equal to torch's round-to-nearest-even but at exact ties that it rounds down (ties go away
    from zero here: a 16-bit remainder cannot make round-to-even exact); across a power of two
    the exponent carries; above the largest finite bf16 by half an ulp it is infinity, as torch's."""
    x = _f32(list(EDGES.values()))
    hi, _ = split(x)
    ref = x.to(torch.bfloat16)
    got = dict(zip(EDGES, hi.float().tolist()))
    want = dict(zip(EDGES, ref.float().tolist()))
    assert got["tie, rounds to even down"] == struct.unpack(">f", bytes.fromhex("3f810000"))[0]  # away from zero
    assert want["tie, rounds to even down"] == 1.0
    assert got["tie, rounds to even up"] == want["tie, rounds to even up"]
    assert got["rounds up across a power of two"] == want["rounds up across a power of two"] == 2.0
    assert got["negative, rounds up across a power of two"] == -2.0
    assert got["above the largest finite bf16"] == want["above the largest finite bf16"] == float("inf")
    assert got["largest finite bf16"] == want["largest finite bf16"]
    assert hi[list(EDGES).index("default NaN")].isnan() and hi[list(EDGES).index("negative zero")].view(torch.int16) == -32768
    not_ties = [k for k in EDGES if k not in ("tie, rounds to even down", "subnormal tie") and "NaN" not in k]
    assert [got[k] for k in not_ties] == [want[k] for k in not_ties]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=64))
def test_random_bit_patterns_round_trip(bits):
    x = _f32(bits)
    assert _bits(join(*split(x))) == bits


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64))
def test_random_floats_compute_as_round_to_nearest_even_but_at_ties(values):
    x = torch.tensor(values, dtype=torch.float32)
    hi, rem = split(x)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    ref = x.to(torch.bfloat16)
    same = hi.view(torch.int16) == ref.view(torch.int16)
    assert bool((same | tie).all())
    one_ulp = (hi.view(torch.int16).int() - ref.view(torch.int16).int()).abs() <= 1
    assert bool(one_ulp.all())


def test_masters_update_in_fp32_and_store_back_exactly():
    p = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    masters = RemainderMasters([p])
    value = torch.randn(3, 4) * 1e-3 + 1.0  # many fp32 values per bf16 value
    masters.set_master(p, value)
    assert torch.equal(masters.master(p), value) and p.dtype == torch.bfloat16
    with masters.fp32(p) as m:
        m.add_(1e-6)  # far below a bf16 ulp at 1.0 (7.8e-3): only the remainder moves
    assert torch.equal(masters.master(p), value + 1e-6)
    q = torch.nn.Parameter(torch.ones(2))  # fp32: its own storage is the master
    with RemainderMasters([q]).fp32(q) as m:
        assert m.data_ptr() == q.data_ptr()
