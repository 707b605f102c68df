"""End-to-end training on CPU: overfitting, bitwise resume, PP2 x EP2 == one process, and a
checkpoint saved at PP2 x EP2 that loads at PP1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--model-preset", "tiny", "--seq-length", "128", "--global-batch-size", "4",
          "--log-interval", "1", "--seed", "7", "--lr-warmup-iters", "2"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args: list[str], log_dir, world: int = 1, check: bool = True, torchrun: bool = False) -> list[dict]:
    """The run's metrics.jsonl rows. One process runs in this one (``run_in_process``) unless it
    compiles (dynamo's caches would outlive it); a compiling one and several ranks run
    ``pretrain_step37.main`` on ranks forked from the test harness's fork server with torchrun's
    variables (``run_forked``), or, ``torchrun=True``, under torchrun itself; one thread each."""
    argv = COMMON + args + ["--log-dir", str(log_dir)]
    if world == 1 and "--compile" not in args:
        rc, why = run_in_process(argv)
    elif not torchrun:
        rc, why = run_forked(argv, world, str(log_dir) + "_ranks")
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "pretrain_step37.py"] if world == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
             "--master-port", str(free_port()), "pretrain_step37.py"]
        out = subprocess.run(cmd + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        rc, why = out.returncode, out.stdout[-3000:] + out.stderr[-5000:]
    if check:
        assert rc == 0, why
    path = os.path.join(str(log_dir), "metrics.jsonl")
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []


def main_on_rank(rank: int, world: int, argv: list[str]) -> None:
    """A rank of ``run_forked``: the entry script's ``main``, as ``python pretrain_step37.py``."""
    import pretrain_step37

    os.chdir(ROOT)
    rc = pretrain_step37.main(argv)
    if rc:
        raise SystemExit(f"pretrain_step37.main returned {rc}")


def run_forked(argv: list[str], world: int, rank_dir: str) -> tuple[int, str]:
    """``pretrain_step37.main(argv)`` on ``world`` ranks forked from tests/distributed/harness.py's
    fork server, each given torchrun's variables (the trainer starts its own process group from
    them): a torchrun launch costs torchrun's imports and ~3 CPU-s of imports per rank, which on
    two cores made most of a short multi-rank run. Launching under torchrun itself is what
    ``train(..., torchrun=True)`` does (test_pp2_ep2_... and tests/e2e/test_run_control.py).
    Returns (0, "") or (1, each rank's error and log tail)."""
    from tests.distributed.harness import run_ranks

    try:
        run_ranks(world, main_on_rank, argv, tmpdir=rank_dir, timeout=600, init=False)
    except AssertionError as e:
        return 1, str(e)[-8000:]
    return 0, ""


def run_in_process(argv: list[str]) -> tuple[int, str]:
    """``pretrain_step37.main(argv)`` in this process, as a new interpreter would run it: one
    intra-op thread (what OMP_NUM_THREADS=1 gives the subprocess; --cpu-offload raises it, as
    there), no rank variables; afterwards the SIGTERM handler, the RNG, the thread count and the
    process group are put back (a new interpreter costs about 3 CPU-seconds of imports per run)."""
    import signal
    import traceback

    import torch
    import torch.distributed as dist

    import pretrain_step37

    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
             if k in os.environ}
    handler, rng, threads, cwd = signal.getsignal(signal.SIGTERM), torch.get_rng_state(), torch.get_num_threads(), \
        os.getcwd()
    torch.set_num_threads(1)
    try:
        os.chdir(ROOT)
        return int(pretrain_step37.main(argv) or 0), ""
    except SystemExit as e:  # argparse
        return (e.code if isinstance(e.code, int) else 1), str(e)
    except Exception:  # what would end the subprocess with a traceback
        return 1, traceback.format_exc()[-5000:]
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGTERM, handler)
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
        os.environ.update(saved)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_overfits_a_small_repeated_dataset(dataset, tmp_path):
    rows = train(["--data-path", dataset, "--train-iters", "80", "--optimizer", "adamw", "--lr", "5e-3"],
                 tmp_path / "tb")
    assert len(rows) == 80 and {"iteration", "loss", "lr", "grad_norm", "tokens_per_sec",
                                "skipped_steps", "tflops_per_gpu"} <= set(rows[0])
    assert rows[0]["tflops_per_gpu"] > 0 and rows[0].get("mfu") is None  # no known peak on CPU
    assert all(0 <= r["data_wait_s"] < r["step_ms"] / 1000 for r in rows)  # every step (--num-workers 2)
    assert rows[-1]["loss"] < 0.35 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


@pytest.mark.parametrize("bf16", [False, True])
def test_compile_trains_like_eager(dataset, adamw4, tmp_path, bf16):
    """--compile through the trainer (with --bf16: the compiled layers under FSDP2's mixed
    precision hooks). Backend aot_eager: dynamo + AOTAutograd without code generation runs the
    same kernels as eager. Inductor is checked in tests/unit/test_compile.py. The eager run is
    the shared one of tests/e2e/conftest.py (it also saves checkpoints, which changes no loss)."""
    from tests.e2e.conftest import ADAMW4

    eager, _ = adamw4(bf16)
    compiled = train(["--data-path", dataset, *ADAMW4] + (["--bf16"] if bf16 else []) +
                     ["--compile", "--compile-backend", "aot_eager"], tmp_path / "compiled")
    errs = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(compiled, eager)]
    assert errs[0] <= 1e-6, errs  # the first step: measured identical in fp32 and bf16
    # fp32: every step measured identical. bf16: the compiled graph rounds some bf16
    # intermediates differently (one bf16 ulp is 4e-3 relative) and AdamW turns the tiny
    # gradient differences of near-zero entries into full steps: measured 7e-6, 6e-5, 8e-5
    # relative on steps 2-4; 1e-3 as for bf16 layouts (docs/memory.md) leaves >10x
    assert max(errs) <= (1e-3 if bf16 else 1e-6), errs
    assert len(compiled) == len(eager) == 4


def test_resume_is_bitwise_identical(dataset, muon8, tmp_path):
    """The uninterrupted run: the shared Muon run of tests/e2e/conftest.py (these flags, no
    checkpoints)."""
    from tests.e2e.conftest import MUON8

    full = muon8
    args = ["--data-path", dataset, *MUON8]
    # saved by a run that builds micro-batches on the training thread, resumed with 2 workers
    train(args + ["--train-iters", "8", "--save", str(tmp_path / "ck"), "--save-interval", "4",
                  "--num-workers", "0"], tmp_path / "a")
    # interrupted at 4: drop the later checkpoint, resume from iteration 4
    shutil.rmtree(tmp_path / "ck" / "iter_0000008")
    (tmp_path / "ck" / "latest").write_text("iter_0000004")
    resumed = train(args + ["--train-iters", "8", "--load", str(tmp_path / "ck")], tmp_path / "b")
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]  # exactly
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[4:]]


def test_pp2_ep2_logs_the_losses_of_one_process_and_its_checkpoint_loads_at_pp1(dataset, tmp_path):
    args = ["--data-path", dataset, "--optimizer", "adamw", "--lr", "1e-3", "--train-iters", "6"]
    one = train(args + ["--num-workers", "0"], tmp_path / "one")  # the others: 2 workers (default)
    four = train(args + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--save", str(tmp_path / "ck"), "--save-interval", "3"], tmp_path / "four", world=4,
                 torchrun=True)  # the launch as the README runs it
    assert len(one) == len(four) == 6
    for a, b in zip(one, four):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    (tmp_path / "ck" / "latest").write_text("iter_0000003")
    resumed = train(args + ["--load", str(tmp_path / "ck")], tmp_path / "pp1")
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    for a, b in zip(one[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])


def test_flag_errors_name_the_flag(dataset, tmp_path, capfd):
    # the entry script's main in this process (run_in_process: what `python pretrain_step37.py`
    # runs; the script itself is launched by the --compile and torchrun tests): an interpreter
    # per error would cost ~3 CPU-s of imports each
    def stderr_of(*argv) -> tuple[int, str]:
        rc, _ = run_in_process(list(argv))
        return rc, capfd.readouterr().err

    rc, err = stderr_of("--data-path", dataset, "--global-batch-size", "3", "--micro-batch-size", "2")
    assert rc == 2 and "--global-batch-size 3 must be a multiple" in err
    rc, err = stderr_of("--data-path", str(tmp_path / "x"))
    assert rc == 2 and "no " in err and "preprocess_data.py" in err
    rc, err = stderr_of("--data-path", dataset, "--muon-momentum", "1.5")
    assert rc == 2 and "--muon-momentum must be in [0, 1)" in err


def test_export_to_hf_and_import_back(adamw4, tmp_path):
    """The checkpoint: the shared fp32 AdamW run's last (tests/e2e/conftest.py), read only."""
    import torch

    from core.checkpoint.sharded import load_checkpoint
    from models.step37 import Step37Config, Step37Model

    _, ck = adamw4(False)
    run = lambda *a: subprocess.run([sys.executable, "tools/convert_checkpoint.py", *map(str, a)],
                                    cwd=ROOT, capture_output=True, text=True)
    out = run("export", ck, tmp_path / "hf")
    assert out.returncode == 0 and "(iteration 4)" in out.stdout, out.stderr
    trained = Step37Model(Step37Config.preset("tiny"))
    load_checkpoint(str(ck), [trained])
    from_hf = Step37Model(Step37Config.from_hf(str(tmp_path / "hf")))
    assert from_hf.load_hf(str(tmp_path / "hf"))["missing"] == []
    for (n, a), (_, b) in zip(trained.named_parameters(), from_hf.named_parameters()):
        assert torch.equal(a, b), n
    back = run("import", tmp_path / "hf", tmp_path / "imported")
    assert back.returncode == 0, back.stderr
    again = Step37Model(Step37Config.preset("tiny"), seed=99)
    load_checkpoint(str(tmp_path / "imported"), [again])
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), again.parameters()))


def test_fsdp_with_offload_resumes_exactly_in_any_layout(dataset, tmp_path):
    """FSDP checkpoints keep layout independence: resume sharded or unsharded, same losses."""
    args = ["--data-path", dataset, "--optimizer", "muon", "--lr", "0.01", "--train-iters", "6"]
    fsdp = ["--data-parallel-sharding", "fsdp", "--cpu-offload", "all", "--recompute-granularity", "full"]
    full = train(args + fsdp + ["--save", str(tmp_path / "ck"), "--save-interval", "4"], tmp_path / "a", world=2)
    start = str(tmp_path / "ck" / "iter_0000004")
    sharded = train(args + fsdp + ["--load", start], tmp_path / "b", world=2)
    single = train(args + ["--load", start], tmp_path / "c")
    for resumed in (sharded, single):
        assert [r["iteration"] for r in resumed] == [5, 6]
        for a, b in zip(full[4:], resumed):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["loss"], b["loss"])
