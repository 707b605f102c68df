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


def test_counter_reports_frees_it_never_saw_allocated():
    """A storage grown behind the counter's back (here: while it is not entered) and freed under
    it is reported as overfreed, not counted below nothing (the Step-3.7-Flash 8 x H200 recipe
    with --overlap-moe-expert-parallel-comm once traced 12.2 GB this way, its gathered layers at
    -93 GB); the summary line says the traced peak is then no bound."""
    from training.trace.report import summary
    from training.trace.runner import TraceResult

    c = LiveBytes()
    with c:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(1024)  # not counted
    with c:
        t.untyped_storage().resize_(0)
        assert c.device_now == 0 and c.overfreed == 1024 and min(c.live.values(), default=0) >= 0
    del t

    class Row:
        pp_rank = ep_rank = 0
        device_total = 2048

    class Layout:
        class sizes:
            @staticmethod
            def coords(rank):
                return {"pp": 0, "ep": 0}

    lines = summary([Row()], {0: TraceResult(0, 1024, overfreed=c.overfreed)}, Layout())
    assert "NOT A BOUND" in lines[-1]


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


def test_planner_books_one_micro_batch_as_the_trace_finds_it():
    """One micro-batch (LoRA): the backward frees the kept activations as it makes the gradients,
    and a frozen base has no unit gradient (nor, with one stage, its gathered root beside the
    backward's recompute working set); the plan booked them whole (+16% over the trace on
    Step-3.7-Flash's 8 x H200 LoRA recipe, more here), now within 10%."""
    from training.planner.memory import plan
    from training.planner.run import plan_inputs

    flags = ["--world-size", "1", "--model-preset", "tiny", "--seq-length", "128", "--global-batch-size", "1",
             "--micro-batch-size", "1", "--bf16", "--recompute-granularity", "full", "--lora-rank", "4"]
    _, args, _, layout = planned(flags)
    planned_total = plan(layout.config, plan_inputs(args, layout))[0].device_total
    traced_total = trace_rank(args, layout, 0).device_total
    assert abs(planned_total - traced_total) <= 0.10 * traced_total, (planned_total, traced_total)


def test_inputs_kept_in_host_memory_are_not_device_bytes():
    """--offload-recompute-inputs: the kept inputs wait in host memory; on the CPU that stands in
    for the GPU the trace counts them as host (core/transformer/chunked.py reports them)."""
    base = ["--world-size", "1", "--model-preset", "tiny", "--seq-length", "64", "--global-batch-size", "2",
            "--micro-batch-size", "2", "--bf16", "--attention-backend", "sdpa", "--recompute-granularity", "full",
            "--recompute-chunks", "2"]
    offloaded = _trace(flags=base + ["--offload-recompute-inputs"])
    # no other host memory in this layout: the host held every layer's kept input (the 2 packs'
    # [T, hidden] in bf16) at once, and the device none of them
    layers, T, hidden = 4, 128, 64
    assert offloaded.host_peak >= layers * T * hidden * 2, offloaded


def test_plan_memory_trace_json_and_refusals(capsys):
    import json

    from tools.plan_memory import main

    assert main([*FLAGS, "--trace", "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert rank["traced_device_total"] > 0 and rank["traced_host_total"] == 0
    assert set(rank["traced_device"]) <= set(rank["device"])  # the planner's column names
    assert main([*FLAGS, "--trace", "--trace-ranks", "3"]) == 2
    assert "--trace-ranks 3: rank 3 is not in a world of 1" in capsys.readouterr().err
    assert main([*FLAGS, "--trace", "--search"]) == 2
    assert "--trace traces one layout" in capsys.readouterr().err
    assert main([*[f for f in FLAGS if f != "--bf16"], "--trace"]) == 2
    assert "--trace needs --bf16" in capsys.readouterr().err


def test_the_overlap_under_fsdp_and_recompute_keeps_the_backwards_gathered_units():
    """A chunked recompute's rerun inside the backward must not reshard the MoE layer's inner FSDP units
    that the backward holds gathered (core/distributed/fsdp_internals.gathered_through_forward):
    resharding them there made FSDP gather them again, unseen by the counter (239 GB freed
    unseen over Step-3.7-Flash's 8 x H200 recipe step). Traced, nothing is freed unseen."""
    flags = ["--world-size", "2", "--model-preset", "tiny", "--seq-length", "64", "--global-batch-size", "4",
             "--micro-batch-size", "2", "--bf16", "--expert-model-parallel-size", "2",
             "--data-parallel-sharding", "fsdp", "--recompute-granularity", "full", "--recompute-chunks", "2",
             "--overlap-moe-expert-parallel-comm"]
    t = _trace(flags=flags)
    assert t.overfreed == 0, t


def test_the_overlaps_trace_cuts_each_pack_into_the_halves_the_planner_assumes():
    """Under --overlap-moe-expert-parallel-comm each traced pack is two documents of half a pack
    (training/trace/batches.py): with one document a pack, a block run a pack at a time
    (--recompute-chunks) would cut no second chunk, and the trace would never run the overlap's
    halves nor its joined weight gradients (training/planner/overlap.py books both)."""
    from types import SimpleNamespace

    from training.trace.batches import trace_batches

    flags = ["--world-size", "2", "--model-preset", "tiny", "--seq-length", "64", "--global-batch-size", "4",
             "--micro-batch-size", "2", "--bf16", "--expert-model-parallel-size", "2"]
    ps = SimpleNamespace(sizes=SimpleNamespace(cp=1))
    for extra, starts in (([], [0, 64, 128]), (["--overlap-moe-expert-parallel-comm"], [0, 32, 64, 96, 128])):
        _, args, _, layout = planned(flags + extra)
        batch = trace_batches(layout.config, args, ps, 1)[0]
        assert batch.packed_seq_params.cu_seqlens_padded.tolist() == starts


def test_an_async_all_to_all_keeps_its_send_buffer_until_wait_as_nccl_does():
    """ProcessGroupNCCL's Work keeps an async collective's input and output until ``wait()``; the
    fake group's keeps nothing, so the MoE dispatch's send buffer (dropped when ``dispatch_start``
    returns, sent while the shared expert runs) was counted freed at the start."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from core.distributed.collectives import AllToAllInFlight, all_to_all_start, all_to_all_wait
    from training.trace.works import held_until_wait

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    original = dist.all_to_all_single
    try:
        with held_until_wait(), LiveBytes() as c:
            flight = AllToAllInFlight([2, 2], [2, 2], dist.group.WORLD)
            rows = all_to_all_start(torch.ones(4, 8), flight)  # the send buffer: dropped by the caller
            assert c.device_now == 2 * 4 * 8 * 4  # sent and received, both in flight
            rows = all_to_all_wait(rows, flight)
            assert c.device_now == 4 * 8 * 4  # the send buffer freed at the wait
        assert dist.all_to_all_single is original  # restored
    finally:
        dist.destroy_process_group()


def test_the_dispatch_keeps_no_expert_output_for_the_backward():
    """Undoing the experts' row order by ``index_copy`` kept its source, the experts' whole output
    ``[T x top-k, hidden]`` (2.1 GB a layer at Step-3.7-Flash's 4 packs), for the backward; the
    gather by the inverse order keeps only the indices."""
    from core.moe.dispatch import unsort_rows

    y = torch.randn(6, 4, requires_grad=True)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = unsort_rows(y * 1, order)
    assert torch.equal(out, torch.empty(6, 4).index_copy(0, order, y.detach()))
    assert all(t.dtype == torch.int64 for t in saved), [t.shape for t in saved]


def test_the_dispatch_holds_no_buffer_past_its_use():
    """While the experts run, the received rows in source order are gone (only the regrouped copy
    stays), and the experts' output is gone before the combine's receive buffer is made: the
    phased dispatcher held each of them (``[T x top-k, hidden]``, 2.1 GB at Step-3.7-Flash's 4
    packs) one step longer, through its Python locals. In units of such a buffer, on a fake
    group of two (send buffers held until their wait, as NCCL's Work holds them)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from core.moe.dispatch import AllToAllDispatcher
    from training.trace.works import held_until_wait

    T, K, H, E = 64, 2, 256, 4
    unit = T * K * H * 2
    seen = []

    class Experts(torch.nn.Module):
        num_experts = E // 2

        def forward(self, x, counts):
            seen.append(c.device_now)
            return x * 2

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = torch.randn(T, H, dtype=torch.bfloat16)
        chosen = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        disp = AllToAllDispatcher(dist.group.WORLD, 2, E)
        with held_until_wait(), LiveBytes() as c:
            base = c.device_now
            d = disp.dispatch_start(x, torch.rand(T, K), chosen)
            rows = disp.dispatch_wait(d)
            before = c.device_now
            c.reset_peak()
            disp.combine_start(d, Experts(), rows)
            assert (seen[0] - base) / unit < 1.5  # the regrouped rows only (and int indices)
            assert (c.peak - before) / unit < 2.5  # the output's reordered copy in flight, and the receive
    finally:
        dist.destroy_process_group()
