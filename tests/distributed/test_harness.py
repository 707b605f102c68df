"""The rank harness itself: a deadlock fails within the timeout with every rank's stack, a rank
that raises is named with its error, a segfault stops the other ranks, and the happy path
passes. The rank functions are module level: spawned ranks import them from this module (tests/
is a package)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks


def _write_pid(outdir: str, rank: int) -> None:
    with open(os.path.join(outdir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))


def _pids(outdir: str, world: int) -> list[int]:
    return [int(open(os.path.join(outdir, f"pid{r}")).read()) for r in range(world)]


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie, not running
            os.kill(pid, 0)


def blocked_in_recv_from_peer(rank, world, outdir):
    _write_pid(outdir, rank)
    t = torch.zeros(1)
    dist.recv(t, src=1 - rank)  # both ranks receive, nobody sends


def rank0_raises(rank, world, outdir):
    _write_pid(outdir, rank)
    dist.barrier()  # both pids written before anything fails (spawning can be slow under load)
    if rank == 0:
        raise ValueError("boom")
    dist.barrier()  # rank 1 would wait here for rank 0 forever


def rank1_segfaults(rank, world, outdir):
    _write_pid(outdir, rank)
    dist.barrier()  # both pids written before the crash
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(600)  # rank 0 is not in a collective: only the harness can stop it


def all_reduce_sum(rank, world, outdir):
    _write_pid(outdir, rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t


def test_deadlock_times_out_with_each_rank_stack(tmp_path):
    # forked ranks reach the blocking recv within a second; their stacks are dumped 2 s before the
    # deadline (spawned ranks, which took seconds to import, needed 15)
    timeout = 8
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(2, blocked_in_recv_from_peer, str(tmp_path), tmpdir=str(tmp_path),
                  timeout=timeout)
    elapsed = time.monotonic() - start
    # the deadline, plus up to 2 s SIGTERM grace and process teardown; 20 s is generous
    assert elapsed < timeout + 20, elapsed
    msg = str(err.value)
    assert f"timed out after {timeout} s" in msg, msg
    for r in range(2):
        block = msg.split(f"--- rank {r} ---")[1].split("--- rank")[0]
        assert "blocked_in_recv_from_peer" in block, msg  # its stack, dumped before the kill
    _assert_gone(_pids(str(tmp_path), 2))


def test_rank_that_raises_is_named_and_stops_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(2, rank0_raises, str(tmp_path), tmpdir=str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    msg = str(err.value)
    block0 = msg.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    assert 'ValueError("boom")' in block0 and "ValueError: boom" in block0, msg
    assert "--- rank 1 ---" in msg, msg
    assert elapsed < 30, elapsed  # rank 1 is not left waiting in the barrier until the timeout
    _assert_gone(_pids(str(tmp_path), 2))


def test_crashed_rank_gets_the_others_terminated(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(2, rank1_segfaults, str(tmp_path), tmpdir=str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    msg = str(err.value)
    assert "rank 1 exited first (killed by SIGSEGV)" in msg, msg
    block1 = msg.split("--- rank 1 ---")[1]
    assert "Segmentation fault" in block1 and "rank1_segfaults" in block1, msg  # faulthandler
    block0 = msg.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    assert "from the harness" in block0 and "rank1_segfaults" in block0, msg  # SIGTERM dump
    assert elapsed < 30, elapsed
    _assert_gone(_pids(str(tmp_path), 2))


def test_all_reduce_passes(tmp_path):
    run_ranks(2, all_reduce_sum, str(tmp_path), tmpdir=str(tmp_path), timeout=60)
    _assert_gone(_pids(str(tmp_path), 2))


def count_spawn(rank, world, outdir, name):
    """Appends this process's pid to ``outdir/name`` (one line per rank and call)."""
    with open(os.path.join(outdir, name), "a") as f:
        f.write(f"{os.getpid()}\n")
    dist.barrier()


def rank1_raises_in_case(rank, world):
    dist.barrier()
    if rank == 1:
        raise ValueError("case two broke")
    dist.barrier()


def test_shared_ranks_run_a_world_once_and_keep_each_case_its_own_result(tmp_path):
    """Four cases of 2 ranks, the third failing: the first two pass from the one spawn, the third
    reports its own error, the third (which never ran there) runs alone on fresh ranks and
    passes; a case of another world size has its own spawn."""
    from tests.distributed.harness import SharedRanks

    out = str(tmp_path)
    cases = {"a": (2, count_spawn, (out, "a")), "a2": (2, count_spawn, (out, "a2")),
             "b": (2, rank1_raises_in_case, ()),
             "c": (2, count_spawn, (out, "c")), "d": (1, count_spawn, (out, "d"))}
    shared = SharedRanks(str(tmp_path / "runs"), cases, timeout=60)
    shared.check("a")  # runs a and a2, then b fails: c never started in that spawn
    assert not os.path.exists(tmp_path / "c")
    shared.check("a2")
    with pytest.raises(AssertionError) as err:
        shared.check("b")
    assert "ValueError: case two broke" in str(err.value) and "['a', 'a2', 'b', 'c']" in str(err.value)
    shared.check("c")  # alone
    shared.check("d")
    pids = {n: open(tmp_path / n).read().split() for n in ("a", "a2", "c", "d")}
    assert len(pids["a"]) == len(pids["c"]) == 2 and len(pids["d"]) == 1
    assert sorted(pids["a"]) == sorted(pids["a2"])  # the same two ranks ran both
    assert not set(pids["a"]) & set(pids["c"])  # c: fresh processes
    with pytest.raises(AssertionError):  # a failure is reported again, not rerun into a pass
        shared.check("b")
