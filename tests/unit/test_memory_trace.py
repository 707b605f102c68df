"""The memory trace (training/trace/): its counter agrees with itself on real and fake tensors,
and it sees memory the code keeps. Tiny model, one rank, one-micro-batch steps: a few seconds."""
from __future__ import annotations

import pytest
import torch

from core.transformer import mlp
from tools.plan_memory import planned
from training.trace.counter import LiveBytes
from training.trace.runner import trace_rank

FLAGS = ["--world-size", "1", "--model-preset", "tiny", "--seq-length", "64", "--global-batch-size", "1",
         "--micro-batch-size", "1", "--bf16", "--attention-backend", "sdpa"]


def _trace(fake: bool = True, flags=FLAGS):
    _, args, _, layout = planned(flags)
    return trace_rank(args, layout, 0, fake=fake)


@pytest.fixture(scope="module")
def traced():
    return _trace()


def test_traced_peak_equals_the_real_steps_peak(traced):
    real = _trace(fake=False)
    # the same counter on real tensors: the fake ones have the real sizes, so the peaks agree
    # (2% is the bar; they agree to the byte)
    assert abs(traced.device_total - real.device_total) <= 0.02 * real.device_total, (traced, real)
    assert traced.device == real.device
    assert traced.device["parameters"] > 0 and traced.device["optimizer"] > 0 and traced.device["activations"] > 0


def test_memory_kept_alive_raises_the_traced_peak_by_its_size(traced, monkeypatch):
    held = []
    forward = mlp.SwiGLUMLP.forward

    def keep(self, x):  # a leak: the latest MLP output stays referenced
        out = forward(self, x)
        held[:] = [out]
        return out

    monkeypatch.setattr(mlp.SwiGLUMLP, "forward", keep)
    leaky = _trace()
    size = held[0].untyped_storage().nbytes()
    assert leaky.device_total - traced.device_total == size, (leaky.device_total, traced.device_total, size)


def test_counter_follows_resize_and_free():
    """FSDP allocates and frees gathered parameters by ``UntypedStorage.resize_``."""
    with LiveBytes() as c:
        t = torch.empty(256)
        assert c.device_now == 1024
        t.untyped_storage().resize_(0)
        assert c.device_now == 0
        t.untyped_storage().resize_(2048)
        assert c.device_now == 2048 and c.peak == 2048
        del t
    assert c.device_now == 0 and c.peak == 2048


def test_host_reads_of_a_traced_step_are_the_planners_assumptions():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from core.distributed.host_values import host_counts, host_values

    real = torch.tensor([[3, 1], [0, 4]])
    assert host_counts(real, 8) == [[3, 1], [0, 4]]  # a real run reads the tensor
    with FakeTensorMode():
        fake = torch.empty(2, 4, dtype=torch.int64)
        assert host_counts(fake, 10) == [[2, 2, 1, 1], [1, 1, 1, 1]]  # balanced, remainder first
        assert host_values(torch.empty(3)) == [0.0, 0.0, 0.0]
        assert host_values(torch.empty(2), assumed=[5, 6]) == [5, 6]
