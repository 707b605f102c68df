"""LoRA through the command line (``pretrain_step37.py --load-hf BASE --lora-rank ...``): the
first step's loss is the base model's exactly (B starts at zero); its checkpoints hold the
adapters, their optimizer state and the base's identity only (a small fraction of a full
checkpoint); a resume continues bitwise; a base that is not the one the adapters were trained on
is refused, naming both."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from models.step37 import Step37Config, Step37Model
from tests.e2e.test_training import COMMON, run_in_process, train

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "attention,mlp,shared_expert,experts"]


def _tensors(path) -> dict:
    """Key -> bytes of the tensors a checkpoint holds (from DCP's metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: math.prod(m.size) * m.properties.dtype.itemsize for k, m in md.items() if hasattr(m, "size")}


@pytest.fixture(scope="module")
def lora_runs(dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf = tmp / "hf"
    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(hf))
    common = ["--data-path", dataset, "--load-hf", str(hf), "--optimizer", "adamw", "--lr", "1e-2",
              "--train-iters", "4"]
    lora = train(common + LORA + ["--save", str(tmp / "ck"), "--save-interval", "2"], tmp / "a")
    full = train(common + ["--train-iters", "2", "--save", str(tmp / "full")], tmp / "full_log")
    return tmp, hf, common, lora, full


def test_lora_run_starts_at_the_base_loss_and_trains(lora_runs):
    tmp, hf, common, lora, full = lora_runs
    assert lora[0]["loss"] == full[0]["loss"]  # exactly: B = 0 at step 0
    assert lora[-1]["loss"] < lora[0]["loss"]


def test_lora_checkpoint_holds_the_adapters_and_the_base_identity(lora_runs):
    tmp, hf, *_ = lora_runs
    meta = json.load(open(tmp / "ck" / "iter_0000004" / "meta.json"))
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["load_hf"] == str(hf)
    assert len(meta["lora"]["base"]["weights_fingerprint"]) == 16
    lora, full = _tensors(tmp / "ck" / "iter_0000004"), _tensors(tmp / "full" / "iter_0000002")
    model_keys = [k for k in lora if k.startswith("model/")]
    # the adapters and the buffers (the routers' balancing biases), nothing of the frozen base
    assert model_keys and all(".lora_" in k or "e_score_correction_bias" in k for k in model_keys), model_keys
    assert all(".lora_" in k for k in lora if k.startswith("optim/"))
    # rank 4 on the tiny model (hidden 64): 12% of a full checkpoint's tensor bytes (DCP's
    # per-key metadata, one key per expert, weighs more than that at this size)
    assert sum(lora.values()) < 0.15 * sum(full.values()), (sum(lora.values()), sum(full.values()))


def test_lora_resume_is_bitwise_and_refuses_another_base(lora_runs, tmp_path, capfd):
    tmp, hf, common, lora, _ = lora_runs
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "ck", ck)
    shutil.rmtree(ck / "iter_0000004")
    (ck / "latest").write_text("iter_0000002")
    resumed = train(common + LORA + ["--load", str(ck)], tmp_path / "b")
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in lora[2:]]  # exactly
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in lora[2:]]

    other = tmp_path / "other_hf"
    Step37Model(Step37Config.preset("tiny"), seed=6).save_hf(str(other))
    argv = [a if a != str(hf) else str(other) for a in common]
    rc, why = run_in_process(COMMON + argv + LORA + ["--load", str(ck), "--log-dir", str(tmp_path / "c")])
    why += capfd.readouterr().err
    assert rc != 0
    assert f"--load {ck / 'iter_0000002'}: its adapters were trained on another base: the weights differ" in why
    assert str(hf) in why and str(other) in why


def test_generate_samples_with_the_adapters_over_the_recorded_base(lora_runs, tmp_path, capsys):
    """tools/generate.py on a LoRA checkpoint: the model it builds is the recorded base with the
    trained adapters (its logits are the merged weights' to fp32 rounding, 1e-5 of the largest
    logit, and differ from the base's); it samples from it; another base is refused naming it."""
    import torch

    from core.finetune.lora_export import merge_lora
    from core.packed_seq import PackedSeqParams
    from tools.generate import load_model, main

    tmp, hf, *_ = lora_runs
    model, meta, path = load_model(str(tmp / "ck"))
    assert meta["lora"] and path.endswith("iter_0000004")
    n = 9
    args = (torch.arange(3, 3 + n), torch.arange(n), PackedSeqParams(torch.tensor([0, n], dtype=torch.int32),
                                                                      torch.tensor([0, n], dtype=torch.int32), n))
    base = Step37Model(Step37Config.preset("tiny"))
    base.load_hf(str(hf))
    with torch.no_grad():
        got = model(*args)
        merge_lora(model)
        merged = model(*args)
    assert (got - merged).abs().max() <= 1e-5 * merged.abs().max()
    with torch.no_grad():
        assert (base.eval()(*args) - got).abs().max() > 1e-3 * got.abs().max()  # the adapters matter
    assert main(["--load", str(tmp / "ck"), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert "[greedy] 'ab' -> " in capsys.readouterr().out
    other = tmp_path / "other_hf"
    Step37Model(Step37Config.preset("tiny"), seed=6).save_hf(str(other))
    assert main(["--load", str(tmp / "ck"), "--base", str(other), "--prompt", "ab"]) == 1
    assert "its adapters were trained on another base" in capsys.readouterr().err


def test_bf16_lora_keeps_the_frozen_base_in_bf16(dataset, tmp_path, capfd):
    """Under --bf16 the frozen base is stored in bf16, its only copy (its compute weight: the
    fp32 value rounded once, as FSDP's mixed precision rounds a full run's masters), the routers
    in fp32, the adapters fp32 masters: the first step's loss equals a full --bf16 run's exactly,
    and the weights the rank holds (start-up summary) are a little over half the full run's (2
    bytes per base parameter instead of 4, plus the fp32 adapters and routers)."""
    hf = tmp_path / "hf"
    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(hf))
    common = ["--data-path", dataset, "--load-hf", str(hf), "--optimizer", "adamw", "--lr", "1e-2", "--bf16",
              "--train-iters", "3"]
    capfd.readouterr()
    lora = train(common + LORA, tmp_path / "lora")
    lora_held = _held_mib(capfd.readouterr())
    full = train(common + ["--train-iters", "2"], tmp_path / "full")
    full_held = _held_mib(capfd.readouterr())
    assert lora[0]["loss"] == full[0]["loss"]
    assert all(math.isfinite(r["loss"]) for r in lora)
    assert 0.5 * full_held < lora_held < 0.65 * full_held, (lora_held, full_held)


def _held_mib(captured) -> float:
    """The bytes of the weights the rank holds, from the trainer's start-up summary (MiB; on the
    CPU the "device" is host memory)."""
    import re

    m = re.search(r"parameters on this rank \([\d.]+ MiB on the device, ([\d.]+) MiB in host memory",
                  captured.out + captured.err)
    assert m, captured.err[-2000:]
    return float(m.group(1))


def test_bf16_lora_under_fsdp_and_ep_on_two_ranks_resumes_on_one(dataset, tmp_path):
    """--bf16 --data-parallel-sharding fsdp --expert-model-parallel-size 2 on two ranks (a frozen
    bf16 base sharded with fp32 adapters in the same FSDP units): the losses are one process's
    within 1e-4 relative (bf16 compute; the ranks sum the same terms in another order), with
    --cpu-offload experts exactly the same, and its
    checkpoint (adapters only, the base's fingerprint taken over both ranks' shards) resumes in one
    process onto the same base."""
    hf = tmp_path / "hf"
    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(hf))
    common = ["--data-path", dataset, "--load-hf", str(hf), "--optimizer", "adamw", "--lr", "1e-2", "--bf16",
              "--train-iters", "3", *LORA]
    one = train(common, tmp_path / "one")
    two = train(common + ["--data-parallel-sharding", "fsdp", "--expert-model-parallel-size", "2",
                          "--save", str(tmp_path / "ck"), "--save-interval", "2"], tmp_path / "two", world=2)
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["loss"], b["loss"])
    # the frozen experts' shards (and their adapters') in host memory: the same step, bit for bit
    # (on the CPU this proves the bookkeeping, not the host-to-device copies)
    offloaded = train(common + ["--data-parallel-sharding", "fsdp", "--expert-model-parallel-size", "2",
                                "--cpu-offload", "experts"], tmp_path / "offloaded", world=2)
    assert [r["loss"] for r in offloaded] == [r["loss"] for r in two]
    (tmp_path / "ck" / "latest").write_text("iter_0000002")
    resumed = train(common + ["--load", str(tmp_path / "ck")], tmp_path / "resumed")
    assert [r["iteration"] for r in resumed] == [3]
