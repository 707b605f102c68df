"""Part (d): the last stage's head with its multi-token-prediction depths (Step-3.7-Flash: the
final norm and head, and 3 MTP depths, each a full MoE layer with all 288 experts and a head of
its own over the 128,896-token vocabulary) on one 8192-token pack in bf16: peak memory of a
forward + backward (allocated and reserved), without recompute and with ``--recompute-granularity full``.

What the peak holds beyond the weights and their gradients (all bf16 here) is the activations
and the loss's working set; next to it the planner's prediction for the same stage and mode
(``training/planner/memory.py``'s activations and recompute working set, from
``core/costs/activations.py``), so a wrong activation model shows here first."""
from __future__ import annotations

import sys
from types import SimpleNamespace

from benchmarks.gpu_parts import common

import torch  # noqa: E402


def predicted_bytes(cfg, T: int, recompute: str) -> int:
    """The planner's activations (no pipeline: one micro-batch in flight) and recompute working
    set for a last stage that holds no decoder layer."""
    from core.memory_mode import MemoryMode
    from training.planner.inputs import PlanInputs
    from training.planner.memory import _chunk_activations, _recompute_working_set

    chunk = SimpleNamespace(layers=(), first=False, last=True)
    inp = PlanInputs(mode=MemoryMode(bf16=True, recompute_granularity=recompute), seq_length=T, micro_batch_size=1)
    return _chunk_activations(cfg, chunk, T, 2, inp) + _recompute_working_set(cfg, chunk, T, 2, inp)


def run(preset: str, device, seq: int, recompute: str, seed: int = 0) -> dict:
    from benchmarks.model_slice import allocate_chunk, init_weights, packed_batch
    from core.loss import IGNORE_INDEX
    from core.transformer.block import apply_recompute
    from models import registry

    cfg = registry.resolve(preset)[1]
    with torch.device("meta"):
        chunk = registry.spec_of(cfg).build(cfg, layers=[], first=False, last=True)
    allocate_chunk(chunk, device, common.compute_dtype(device))
    init_weights(chunk, seed, std=cfg.init_std)
    apply_recompute(chunk, recompute)
    batch, lengths = packed_batch(seq, seed)
    batch = batch.to(device)
    g = torch.Generator(device).manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (seq,), device=device, generator=g)
    labels = torch.where(batch.labels != IGNORE_INDEX, torch.roll(tokens, -1), batch.labels)
    x = torch.randn(seq, cfg.hidden_size, device=device, generator=g, dtype=common.compute_dtype(device)).requires_grad_()
    params = sum(p.numel() * p.element_size() for p in chunk.parameters())

    def step():
        chunk.zero_grad(set_to_none=True)
        x.grad = None
        out = chunk(tokens, batch.position_ids, batch.packed_seq_params, hidden=x, labels=labels)
        (out.loss_sum + 0.3 * sum(out.mtp_loss_sums)).backward()

    step()
    common.free()
    common.reset_peak(device)
    ms = common.median_ms(step, device, warmup=0, iters=1)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in chunk.parameters() if p.grad is not None)
    mem = common.peak_memory(device)
    peak = mem["peak_allocated_gib"]
    measured = peak * common.GiB - params - grads if peak is not None else None
    predicted = predicted_bytes(cfg, seq, recompute) / common.GiB
    planned_peak = predicted + (params + grads) / common.GiB
    return {"recompute": recompute, "mtp_depths": cfg.num_mtp_layers, "tokens": sum(lengths), "ms": ms,
            "params_gib": params / common.GiB, "grads_gib": grads / common.GiB, "peak_gib": peak, **mem,
            "activations_gib": measured / common.GiB if measured is not None else None,
            "predicted_gib": predicted, "planned_peak_gib": planned_peak,
            "compare": common.memory_compare(f"head + MTP, recompute {recompute}", mem, planned_peak)}


def main(argv=None) -> int:
    args = common.parse(__doc__.split("\n\n")[0], argv)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    seq, rows = (128 if args.tiny else 8192), []
    print(f"{'recompute':<10}{'weights':>9}{'grads':>9}{'peak':>9}{'reserved':>9}{'planned':>9}{'beyond':>9}"
          f"{'planned':>9}{'ms':>9}   (GiB; beyond: the peak less weights and grads)")
    for mode in ("none", "full"):
        r = run(common.preset_of(args), device, seq, mode, args.seed)
        rows.append(r)
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{mode:<10}{f(r['params_gib']):>9}{f(r['grads_gib']):>9}{f(r['peak_gib']):>9}"
              f"{f(r['peak_reserved_gib']):>9}{f(r['planned_peak_gib']):>9}"
              f"{f(r['activations_gib']):>9}{f(r['predicted_gib']):>9}{r['ms']:>9.0f}")
        common.free()
    last = rows[-1]
    headline = (f"head + {last['mtp_depths']} MTP depths at T {seq}: peak {rows[0]['peak_gib'] or 0:.1f} GiB "
                f"(no recompute), {last['peak_gib'] or 0:.1f} GiB (full); beyond weights and grads "
                f"{rows[0]['activations_gib'] or 0:.1f} / {last['activations_gib'] or 0:.1f} GiB, planned "
                f"{rows[0]['predicted_gib']:.1f} / {last['predicted_gib']:.1f}")
    headline += (f"; reserved {rows[0]['peak_reserved_gib'] or 0:.1f} / {last['peak_reserved_gib'] or 0:.1f} GiB vs "
                 f"planned peak {rows[0]['planned_peak_gib']:.1f} / {last['planned_peak_gib']:.1f}")
    return common.finish(args, {"part": "d", "passed": True, "rows": rows, "headline": headline,
                                "compare": [c for r in rows for c in r["compare"]]})


if __name__ == "__main__":
    sys.exit(main())
