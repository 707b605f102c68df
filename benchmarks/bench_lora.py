#!/usr/bin/env python3
"""A LoRA training step on the CPU against a full SFT step (ours) and against PEFT on
transformers' model: the same Qwen3-MoE shape and weights, the same documents (one THD pack for
ours; transformers gets the documents as a batch of equal-length rows, no padding), AdamW, fp32.
Each variant runs in a process of its own; it reports tokens/s over the timed steps and the
peak resident memory its model, optimizer and steps added (``ru_maxrss`` less the resident
memory before the model was built).

    python benchmarks/bench_lora.py [--steps 3] [--rank 16] [--threads 1]

Targets: attention (q, k, v, o) and the routed experts (ours: gate, up and down per expert;
PEFT: transformers 5's fused ``gate_up_proj`` and ``down_proj`` through ``target_parameters``,
gate and up sharing one A: a close, not identical, adapter set).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
             vocab_size=4096, max_position_embeddings=1024, mlp_only_layers=[], decoder_sparse_step=1)
DOCS, DOC_LEN = 8, 256


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def _tokens():
    import torch

    return torch.randint(0, SHAPE["vocab_size"], (DOCS, DOC_LEN), generator=torch.Generator().manual_seed(0))


def _hf_config():
    import copy

    from models.qwen3_moe.config import PRESETS

    kw = copy.deepcopy(PRESETS["qwen3-moe-tiny"])
    kw.pop("model_type")
    kw.update(SHAPE)
    return kw


def run_ours(lora: bool, rank: int, steps: int) -> dict:
    import torch

    from core.init import materialize_seeded
    from core.finetune.lora import LoraSettings, apply_lora
    from core.optim.build import build_optimizer
    from core.packed_seq import PackedSeqParams
    from models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
    from types import SimpleNamespace

    base_rss = _rss_kib()
    cfg = Qwen3MoeConfig.from_hf(_hf_config())
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    if lora:
        apply_lora(model, LoraSettings(lora_rank=rank, lora_alpha=2.0 * rank, lora_targets="attention,experts"))
    materialize_seeded(model, "cpu", seed=0, std=cfg.init_std)
    opt, _ = build_optimizer([model], SimpleNamespace(optimizer="adamw", lr=1e-4, adamw_lr=None, weight_decay=0.0,
                                                      adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8))
    x = _tokens()
    tokens = x.reshape(-1)
    labels = torch.cat([torch.cat([d[1:], d.new_full((1,), -100)]) for d in x])
    pos = torch.arange(DOC_LEN).repeat(DOCS)
    cu = torch.arange(0, DOCS * DOC_LEN + 1, DOC_LEN, dtype=torch.int32)
    psp = PackedSeqParams(cu, cu.clone(), DOC_LEN)

    def step():
        opt.zero_grad()
        out = model(tokens, pos, psp, labels=labels)
        (out.loss_sum / out.num_tokens).backward()
        opt.step()
        return float(out.loss_sum / out.num_tokens)

    return _timed(step, steps, base_rss, sum(p.numel() for p in model.parameters() if p.requires_grad))


def run_peft(rank: int, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base_rss = _rss_kib()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_hf_config()))
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                          "o_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                            weight_decay=0.0, foreach=False)
    x = _tokens()

    def step():
        opt.zero_grad()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        return float(out.loss)

    return _timed(step, steps, base_rss, sum(p.numel() for p in model.parameters() if p.requires_grad))


def _timed(step, steps: int, base_rss: int, trained: int) -> dict:
    step()  # warm-up (allocations, lazy optimizer state)
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    dt = (time.perf_counter() - t0) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"tokens_per_s": DOCS * DOC_LEN / dt, "step_s": dt, "peak_mib": (peak - base_rss) / 1024,
            "trained_params": trained, "loss": losses[-1]}


VARIANTS = {"ours full SFT": ("ours", False), "ours LoRA": ("ours", True), "PEFT LoRA (transformers)": ("peft", True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.variant:  # one variant, in this process
        import torch

        torch.set_num_threads(a.threads)
        kind, lora = VARIANTS[a.variant]
        out = run_ours(lora, a.rank, a.steps) if kind == "ours" else run_peft(a.rank, a.steps)
        print(json.dumps(out))
        return 0
    print(f"Qwen3-MoE hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, {SHAPE['num_experts']} "
          f"experts top-{SHAPE['num_experts_per_tok']}; {DOCS} documents x {DOC_LEN} tokens; LoRA rank {a.rank} on "
          f"attention + experts; AdamW fp32; {a.threads} thread(s), {a.steps} timed steps")
    print(f"{'variant':<28}{'tokens/s':>10}{'step s':>9}{'peak MiB':>10}{'trained params':>16}")
    for name in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--steps", str(a.steps), "--rank",
                              str(a.rank), "--threads", str(a.threads)], capture_output=True, text=True)
        if out.returncode:
            print(f"{name:<28} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<28}{r['tokens_per_s']:>10,.0f}{r['step_s']:>9.3f}{r['peak_mib']:>10.0f}{r['trained_params']:>16,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
