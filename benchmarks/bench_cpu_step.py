#!/usr/bin/env python3
"""A training step on the CPU: our THD model against transformers on padded rows, same model,
weights and documents, on a quiet machine and with a second training job on the same cores.

* ours: the family's whole model (``Step37Model``, ``Qwen3MoeModel``) on one THD micro-batch of
  ``--packs`` packs of ``--seq-length`` (S) tokens (documents with log-normal lengths, median
  min(300, S/8), packed by our planner: ``benchmarks/model_slice.py``), the ``sdpa`` attention
  backend (``core/transformer/sdpa_blocks.py``), loss over next-token targets inside each
  document (the MoE auxiliary loss is not part of it, on either side).
* transformers: its text model (``Step3p7TextModel``, ``Qwen3MoeModel``) + the same output head
  and loss on the same documents,
  one document per row, sorted by length and cut into batches of at most S padded tokens
  (rows of similar length: the least padding, transformers' best case), right-padded with an
  attention mask; gradients accumulate over the batches of one step.

Timed: forward + backward of the whole model (embedding, decoder layers, head, cross-entropy;
no optimizer), fp32, ``--iters`` steps after ``--warmup``, the two sides alternating step by
step so both see the same machine; median seconds, tokens/s counts real tokens. Before timing,
both sides run once with non-trivial weights: the loss and every gradient must agree within
CHECK_REL (``model_slice.py``) or nothing is timed. Under ``--load``, a second process runs
our training step of the same config in a loop, with as many threads, for the whole
measurement. Each row reports the 1-minute load average (``os.getloadavg``) before and after:
other users of the cores show up there.

    python benchmarks/bench_cpu_step.py [--configs tiny hidden256 qwen3-moe-tiny] [--load quiet loaded]

Measured on the shared 2-core development machine (2 threads, 2026-12-01; the cores were never
quiet: "quiet" means no second job of ours, and the load average column shows the other
developers' work; ``docs/performance.md`` has the commands):

    config          machine    load avg   ours tok/s  transformers  ours / tf
    tiny            quiet      7.90-7.43      28,685        14,665      1.96x   (iters 7)
    tiny            quiet     10.18-9.33       1,345           569      2.36x   (iters 7)
    tiny            loaded    9.33-12.17         222            69      3.22x   (iters 7)
    hidden256       quiet     13.35-8.06       2,398           307      7.81x   (iters 3)
    hidden256       loaded     6.73-5.57         153            93      1.63x   (iters 3)
    qwen3-moe-tiny  quiet      1.79-2.75       6,471         5,135      1.26x   (iters 5)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.model_slice import (CHECK_REL, CHECK_SEQ, _half, init_weights, match_tensors, packed_batch,  # noqa: E402
                                    relative_error)

SEQ = {"tiny": 1024, "hidden256": 4096, "qwen3-moe-tiny": 1024}
NO_MTP = dict(num_mtp_layers=0, mtp_layer_types=[], mtp_mlp_layer_types=[], mtp_swiglu_limits=[],
              mtp_swiglu_limits_shared=[])  # transformers' Step3p7 has no MTP


def model_config(name: str):
    """``tiny``: Step-3.7's preset (hidden 64, window 8) without MTP. ``hidden256``: Step-3.7
    with hidden 256, 4 layers (full, then 3 sliding, window 512), 8 query / 2 KV heads of 32,
    16 experts top-4. ``qwen3-moe-tiny``: that preset (hidden 64, full attention, 4 layers)."""
    from models.qwen3_moe import Qwen3MoeConfig
    from models.step37 import Step37Config

    if name == "qwen3-moe-tiny":
        return dataclasses.replace(Qwen3MoeConfig.preset(name), attention_backend="sdpa")
    cfg = Step37Config.preset("tiny")
    if name == "hidden256":
        hf = cfg.to_hf()
        hf.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=4096,
                  layer_types=["full_attention"] + ["sliding_attention"] * 3,
                  mlp_layer_types=["dense"] + ["sparse"] * 3, swiglu_limits=[0] * 4,
                  swiglu_limits_shared=[0] * 4, n_routed_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=128, share_expert_dim=128, num_nextn_predict_layers=0,
                  mtp_layer_types=[], mtp_mlp_layer_types=[], head_dim=32, num_attention_heads=8,
                  num_sliding_attention_heads=8, num_key_value_heads=2, sliding_window=512,
                  per_layer_config={})
        cfg = Step37Config.from_hf(hf)
    return dataclasses.replace(cfg, attention_backend="sdpa", **NO_MTP)


def _hf_text_model(cfg):
    """transformers' text model of the config's family, ``sdpa`` attention."""
    import transformers

    from models import registry

    family = registry.spec_of(cfg).family
    names = {"step37": ("Step3p7TextConfig", "Step3p7TextModel"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeModel")}
    config_class, model_class = (getattr(transformers, n) for n in names[family])
    config = config_class(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    return model_class(config)


class HFCausal(nn.Module):
    """transformers' text model with our output head: what its ``*ForCausalLM`` does for text
    (Step3p7ForConditionalGeneration without its vision tower). Names as published (``model.``,
    ``lm_head``)."""

    def __init__(self, cfg):
        super().__init__()
        self.model = _hf_text_model(cfg)
        self.model.embed_tokens.padding_idx = None  # else the pad id's row gets no gradient; ours has none
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def loss_sum(self, ids, mask, labels):
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), labels.flatten(), reduction="sum")


def padded_rows(batch, lengths: list, budget: int) -> list:
    """The pack's documents as right-padded rows sorted by length, cut into batches of at most
    ``budget`` padded tokens: ``(input_ids, attention_mask, labels)`` per batch."""
    starts = batch.packed_seq_params.host_boundaries()[1][:-1]
    docs = sorted(zip(lengths, starts))
    out, i = [], 0
    while i < len(docs):
        j = i + 1
        while j < len(docs) and (j + 1 - i) * docs[j][0] <= budget:
            j += 1
        L = docs[j - 1][0]
        ids = torch.zeros(j - i, L, dtype=torch.long)
        mask = torch.zeros(j - i, L, dtype=torch.long)
        labels = torch.full((j - i, L), -100, dtype=torch.long)
        for r, (n, s) in enumerate(docs[i:j]):
            ids[r, :n], mask[r, :n], labels[r, :n] = batch.tokens[s:s + n], 1, batch.labels[s:s + n]
        out.append((ids, mask, labels))
        i = j
    return out


def steps_on(ours, hf, batch, lengths: list, budget: int) -> dict:
    """One training step of each side on these documents (gradients set, loss sum returned)."""
    targets = int((batch.labels != -100).sum())
    rows = padded_rows(batch, lengths, budget)
    p = batch.packed_seq_params

    def ours_step():
        ours.zero_grad(set_to_none=True)
        out = ours(batch.tokens, batch.position_ids, p, labels=batch.labels)
        (out.loss_sum / targets).backward()
        return out.loss_sum.detach()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for ids, mask, labels in rows:
            loss = hf.loss_sum(ids, mask, labels)
            (loss / targets).backward()
            total += loss.detach()
        return total

    return dict(steps={"ours": ours_step, "hf": hf_step}, tokens=sum(lengths), docs=len(lengths),
                longest=max(lengths), batches=len(rows), padded=sum(ids.numel() for ids, _, _ in rows))


def build(name: str, seq_length: int, packs: int, seed: int) -> dict:
    """Both models (weights to be set), the matched tensors, and the timed steps."""
    from models import registry

    cfg = model_config(name)
    ours, hf = registry.spec_of(cfg).build(cfg), HFCausal(cfg)
    mine = [(n, t) for n, t in list(ours.named_parameters()) + list(ours.named_buffers()) if "rotary" not in n]
    theirs = {n: t for n, t in hf.state_dict(keep_vars=True).items() if "rotary_emb" not in n}
    pairs = match_tensors(mine, theirs, ours.hf_weights)
    batch, lengths = packed_batch(seq_length, seed, vocab=cfg.vocab_size, packs=packs)
    return dict(cfg=cfg, ours=ours, hf=hf, pairs=pairs, **steps_on(ours, hf, batch, lengths, seq_length))


@torch.no_grad()
def _copy(pairs):
    for _, ours_t, hf_t, half in pairs:
        _half(hf_t, half).copy_(ours_t)


def check(b: dict, seed: int) -> float:
    """Largest relative difference of the loss and every gradient, with non-trivial weights, on
    the CHECK_SEQ-token pack with the most documents (as ``model_slice.check_equivalence``:
    the timed batch's thousands of tokens would meet a near-tie expert choice that fp32
    rounding can flip between the two implementations)."""
    init_weights(b["ours"], seed, std=0.3, norm_std=0.2, bias_std=0.5)  # zero norms and bias hide bugs
    _copy(b["pairs"])
    batch, lengths = packed_batch(CHECK_SEQ, seed, most_documents=True, vocab=b["cfg"].vocab_size)
    steps = steps_on(b["ours"], b["hf"], batch, lengths, CHECK_SEQ)["steps"]
    worst = relative_error(steps["ours"]()[None], steps["hf"]()[None])
    for _, a, h, half in b["pairs"]:
        if a.requires_grad:
            worst = max(worst, relative_error(a.grad, _half(h.grad, half)))
    return worst


def measure(b: dict, warmup: int, iters: int) -> dict:
    """Median seconds per step of each side, alternating, after ``warmup`` steps of each."""
    seconds = {k: [] for k in b["steps"]}
    for i in range(warmup + iters):
        for name, step in b["steps"].items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                seconds[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in seconds.items()}


def load_job(name: str, seq_length: int, packs: int, seed: int) -> None:
    """The second training job: our step on the same config, forever (killed by the parent)."""
    b = build(name, seq_length, packs, seed + 1)
    init_weights(b["ours"], seed, std=b["cfg"].init_std)
    b["steps"]["ours"]()
    print("ready", flush=True)
    while True:
        b["steps"]["ours"]()


def _start_load(args, name: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--_load", name, "--seq-length", str(args.seq_length or SEQ[name]),
           "--packs", str(args.packs), "--seed", str(args.seed), "--threads", str(args.threads)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    if job.stdout.readline().strip() != "ready":
        raise SystemExit("bench_cpu_step: the load job did not start")
    return job


def run(args, name: str) -> list[dict]:
    S = args.seq_length or SEQ[name]
    b = build(name, S, args.packs, args.seed)
    err = check(b, args.seed)
    if err > CHECK_REL:
        raise SystemExit(f"bench_cpu_step: {name}: ours and transformers differ by {err:.1e} > {CHECK_REL:.0e}")
    init_weights(b["ours"], args.seed, std=b["cfg"].init_std)
    _copy(b["pairs"])
    rows = []
    for mode in args.load:
        job = _start_load(args, name) if mode == "loaded" else None
        try:
            before = os.getloadavg()[0]
            t = measure(b, args.warmup, args.iters)
            after = os.getloadavg()[0]
        finally:
            if job is not None:
                job.kill()
                job.wait()
        rows.append(dict(config=name, mode=mode, load=(before, after), ours=b["tokens"] / t["ours"],
                         hf=b["tokens"] / t["hf"], check=err, **{k: b[k] for k in
                                                               ("tokens", "docs", "longest", "batches", "padded")},
                         seq=S))
    return rows


def report(args, rows: list[dict]) -> None:
    print(f"training step (forward + backward, fp32) on CPU, {args.threads} threads, median of "
          f"{args.iters} alternating steps after {args.warmup} warm-up")
    for r in rows[::len(args.load)]:
        print(f"  {r['config']}: {args.packs} packs of {r['seq']} tokens, {r['docs']} documents (longest {r['longest']}, "
              f"{r['tokens']} real); transformers: {r['batches']} batches, {r['padded']} padded tokens; "
              f"check: largest difference {r['check']:.1e} (tolerance {CHECK_REL:.0e})")
    print(f"{'config':<15}{'machine':<9}{'load avg':>12}{'ours tok/s':>12}{'transformers':>14}{'ours / tf':>11}")
    for r in rows:
        load = f"{r['load'][0]:.2f}-{r['load'][1]:.2f}"
        print(f"{r['config']:<15}{r['mode']:<9}{load:>12}{r['ours']:>12,.0f}{r['hf']:>14,.0f}{r['ours'] / r['hf']:>10.2f}x")
    print("loaded: a second process trains our model of the same config on the same cores")
    print("reproduce: python benchmarks/bench_cpu_step.py --configs " + " ".join(args.configs) + " --load "
          + " ".join(args.load) + f" --packs {args.packs} --iters {args.iters} --warmup {args.warmup} "
          f"--threads {args.threads}"
          + (f" --seq-length {args.seq_length}" if args.seq_length else ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(SEQ), default=["tiny", "hidden256"])
    ap.add_argument("--load", nargs="+", choices=["quiet", "loaded"], default=["quiet", "loaded"])
    ap.add_argument("--seq-length", type=int, help="tokens in the pack (default: tiny 1024, hidden256 4096)")
    ap.add_argument("--packs", type=int, default=4, help="packs per micro-batch (default 4)")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--_load", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args._load:
        return load_job(args._load, args.seq_length or SEQ[args._load], args.packs, args.seed)
    report(args, [r for name in args.configs for r in run(args, name)])


if __name__ == "__main__":
    main()
