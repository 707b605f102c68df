#!/usr/bin/env python3
"""Optimizer state bytes per parameter and step time: AdamW, Muon (mu 0.95), Muon (mu 0,
stateless) and Dion, on the tiny model and a mid-size MoE model, side by side. Embeddings,
heads, norms and vectors use AdamW under Muon / Dion (the grouping rules of core/optim/build.py).

    python benchmarks/bench_optim.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from core.optim.build import build_optimizer  # noqa: E402
from models.step37 import Step37Config, Step37Model  # noqa: E402

OPTIMIZERS = {
    "AdamW": dict(optimizer="adamw"),
    "Muon mu=0.95": dict(optimizer="muon", muon_momentum=0.95),
    "Muon mu=0": dict(optimizer="muon", muon_momentum=0.0),
    "Dion r=1/4": dict(optimizer="dion", dion_rank_fraction=0.25),
}


def args_for(kind: dict) -> SimpleNamespace:
    base = dict(lr=0.02, adamw_lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, muon_momentum=0.95, muon_nesterov=True, muon_ns_steps=5,
                muon_ns_method="quintic", muon_lr_adjust="rms", dion_momentum=0.95,
                dion_rank_fraction=0.25)
    return SimpleNamespace(**{**base, **kind})


def mid_config() -> Step37Config:
    c = Step37Config.preset("tiny").to_hf()
    L = 8
    c.update(hidden_size=512, intermediate_size=1024, num_hidden_layers=L, head_dim=64,
             num_attention_heads=8, num_sliding_attention_heads=8, num_key_value_heads=2,
             layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(L)],
             mlp_layer_types=["dense"] + ["sparse"] * (L - 1), n_routed_experts=32,
             num_experts_per_tok=4, moe_intermediate_size=256, share_expert_dim=256,
             swiglu_limits=[0] * L, swiglu_limits_shared=[0] * L, vocab_size=8192,
             num_nextn_predict_layers=0, mtp_layer_types=[], mtp_mlp_layer_types=[], per_layer_config={})
    return Step37Config.from_hf(c)


def measure(cfg: Step37Config, kind: dict, repeats: int) -> tuple[float, float]:
    model = Step37Model(cfg, seed=0)
    opt, _ = build_optimizer([model], args_for(kind))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()  # creates lazily allocated state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    return opt.state_bytes() / n, sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    models = {"tiny": Step37Config.preset("tiny"), "mid": mid_config()}
    counts = {k: sum(p.numel() for p in Step37Model(c).parameters()) for k, c in models.items()}
    print(f"optimizer state and step time on {os.cpu_count()} CPU cores, fp32 parameters "
          f"(tiny: {counts['tiny']:,} params; mid: {counts['mid']:,} params)")
    print(f"{'optimizer':<14}" + "".join(f"{m + ' B/param':>16}{m + ' step ms':>16}" for m in models))
    for name, kind in OPTIMIZERS.items():
        row = f"{name:<14}"
        for m, cfg in models.items():
            bpp, t = measure(cfg, kind, args.repeats)
            row += f"{bpp:>16.2f}{1000 * t:>16.1f}"
        print(row)
    print("AdamW keeps 8 B/param (two fp32 moments); Muon with mu=0 keeps state only for the AdamW "
          "group (embeddings, heads, norms).")
    print(f"reproduce: python benchmarks/bench_optim.py --repeats {args.repeats}")


if __name__ == "__main__":
    main()
