"""What the expert-parallel all-to-alls leave exposed, per MoE block, with and without
``--overlap-moe-expert-parallel-comm`` (the step-time model's all-to-all; ``timing.py``).

Notation, per block and one micro-batch of the rank's ``T`` tokens, in seconds at the assumed
efficiency and the EP group's bandwidth: ``x`` one dispatch (a combine moves as many bytes,
``T x top_k x hidden x (ep - 1) / ep`` elements); ``a`` the block's attention (projections and
scores), ``e`` its router and routed experts, ``s`` its shared expert, forward; ``w`` the weight
gradient's multiple of the forward in the backward (1; 0 under LoRA, whose frozen base has none),
the input gradient's being 1.

Plain: the shared expert's forward runs while its dispatch is in flight; nothing else overlaps.
A forward (and a recompute's rerun) waits ``2x - min(s, x)``, a backward ``x`` for the combine's
backward and ``x`` for the dispatch's.

Overlapped (``core/moe/overlap.py``, within each MoE block): the micro-batch runs as two chunks
of whole documents, A and B (halves: every per-token cost, attention's included, splits in two,
since no document is cut), and every all-to-all of one chunk flies while compute of the block
runs. Each of the four all-to-alls of a pass hides behind the compute the block's schedule puts
beside it and exposes ``max(0, x - hiding) / 2``; each piece of compute is credited to one
all-to-all only:

====================  ===========================  =======================================
pass                  all-to-all (x / 2 each)      hidden by (halves)
====================  ===========================  =======================================
forward               dispatch(A)                  attention(B) + shared(A): ``a + s``
                      dispatch(B)                  experts(A): ``e``
                      combine(A)                   experts(B): ``e``
                      combine(B)                   shared(B): ``s`` (0 without one)
backward              combine(B)'s backward        shared(B)'s: ``s``
                      combine(A)'s backward        experts(B)'s: ``e``
                      dispatch(B)'s backward       experts(A)'s: ``(1 + 2w) e``
                      dispatch(A)'s backward       attention(B)'s + shared(A)'s: ``a + (1 + 2w) s``
====================  ===========================  =======================================

In the backward a chunk's compute is its input gradients, and the later chunk's (A's) also
makes the weight gradients of both (``core/moe/joined_grads.py``: one GEMM over both chunks'
tokens, the plain schedule's arithmetic), so B's pieces count ``1x`` their forward and A's
``1 + 2w``. Attention(B)'s ``a`` undercounts its scores' backward (twice their forward, no
weight): conservative.

A recompute's rerun forward runs like the forward. Per all-to-all and not summed over a pass, so
slack beside one never hides another (conservative). Assumed: the halves' GEMMs run at the same
efficiency as whole ones (the planner has one efficiency for every matmul; each half still
multiplies thousands of rows per expert at Step-3.7-Flash's 4 packs of 8,192 tokens), and NCCL's
kernels slow the compute beside them by nothing (as for Newton-Schulz's stream). At equal
predicted speed the search ranks the plain schedule first, for what this does not time.

Memory (``memory.py``): a layer's transient all-to-all buffers are two of its row buffers,
``2 Tc x top_k x hidden`` elements (``Tc``: the tokens a block runs at once, ``--recompute-chunks``'
chunk: the rows in flight and the rows received, each freed at its wait or regrouping); the
overlap's two halves in flight together hold as many. Kept activations are per token: the same
in two halves.

The joined weight gradients (``core/moe/joined_grads.py``, :func:`joined_grads_bytes`: the
``joined grads`` column) keep, in a block's backward, B's output gradient of each joined op
(B's backward runs first; its input is a kept activation, already booked) until A's arrives,
and A's backward concatenates both chunks' operands for the one weight-gradient GEMM. B's FFN
(shared expert, then routed experts) runs its backward before A's routed experts (the table's
order), so at A's first routed projection (down) every B output gradient of the FFN is kept
beside that projection's concatenation (booked: beside the FFN's largest concatenation, the
down projection's wherever ``2 hidden > size``); the attention's ops and norms are joined after
it, when the FFN's are released. The column is the larger of the two moments, for the rank's
largest MoE block (one block's backward at a time), with ``m = Tc / 2`` tokens a chunk (``m x top_k`` rows
for a routed projection) and ``b`` the compute dtype's bytes:

- kept: ``m x out x b`` per joined op (``out``: its output features);
- a linear's concatenation: ``2m (in + out) b``; a routed projection's, put in the plain
  order by ``index_select`` (each operand concatenated, then reordered, the concatenation freed):
  ``max(4m in, 2m in + 4m out) b``; an RMSNorm's (``n`` features): ``2m n (3 x 4 + b)`` (its fp32
  normalised input, the gradient and its fp32 copy, their product; the ``w x y`` form's bf16
  copies hold less).

Under LoRA only the adapters are joined: each adapted ``in -> out`` projection is two ops,
``in -> r`` and ``r -> out``; the frozen norms are not.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.costs.flops import attention_flops
from core.costs.shapes import F32
from models.registry import shapes_of

FLAG = "--overlap-moe-expert-parallel-comm"


@dataclass(frozen=True)
class Waits:
    """Seconds the compute stream waits for one MoE block's all-to-alls in one micro-batch."""

    forward: float       # dispatch and combine of the forward
    rerun: float         # ... of the recompute's rerun forward (0 when not recomputed)
    combine_bwd: float   # the combine's backward (before the experts' gradients are made)
    dispatch_bwd: float  # the dispatch's backward (after them)


def overlap_choices(cfg, inp) -> tuple:
    """The flag's values the search lists: both where the overlapped schedule serves the layout
    (``core.moe.overlap.check_overlap``, the trainer's own rule) on an MoE model, else only off."""
    from core.moe.overlap import check_overlap

    try:
        check_overlap(inp.ep, inp.cp, inp.moe_dispatcher, inp.mode.recompute_granularity, inp.compile)
    except ValueError:
        return (False,)
    return (False, True) if cfg.num_experts else (False,)


def shared_flops(cfg, chunk) -> float:
    """Forward FLOPs per token of a shared expert (SwiGLU: gate, up, down) of the chunk's MoE
    layers (the largest, if they differ; 0 without one)."""
    shapes = shapes_of(cfg)
    blocks = [shapes.blocks[i] for i in chunk.layers] + (list(shapes.extra) if chunk.last else [])
    return max((6.0 * shapes.hidden * b.ffn.shared for b in blocks if b.ffn.moe), default=0.0)


def block_waits(cfg, chunk, inp, moe: set, redone: set, T: int, eff: float, x: float) -> dict:
    """``Waits`` per MoE block of the chunk (``moe``; ``redone``: those recomputed) for ``T``
    tokens at ``eff`` FLOP/s and ``x`` seconds per dispatch."""
    if not inp.overlap_moe_expert_parallel_comm:
        hidden = min(shared_flops(cfg, chunk) * T / eff, x) if inp.moe_dispatcher == "alltoall" else 0.0
        return {i: Waits(2 * x - hidden, 2 * x - hidden if i in redone else 0.0, x, x) for i in moe}
    shapes, H = shapes_of(cfg), cfg.hidden_size
    order = list(chunk.layers) + ([-1 - k for k in range(len(shapes.extra))] if chunk.last else [])
    attn = [attention_flops(H, shapes.block(i).attention, inp.seq_length) * T / eff for i in order]
    # backward: the input gradient (1x the forward) and the weight gradient (1x; none under LoRA,
    # whose frozen base makes none). A weight both chunks use gets its gradient once, in the
    # later chunk's backward (core/moe/joined_grads.py): B's compute (the earlier) has 1x, A's
    # 1 + 2w
    w = 0.0 if inp.lora_rank else 1.0
    out = {}
    for n, i in enumerate(order):
        if i not in moe:
            continue
        f = shapes.block(i).ffn
        a = attn[n]
        e = 2.0 * H * (f.experts + 3 * f.top_k * f.size) * T / eff
        s = 6.0 * H * f.shared * T / eff
        exposed = lambda *hiding: sum(max(0.0, x - h) for h in hiding) / 2
        forward = exposed(a + s, e, e, s)
        later = 1.0 + 2.0 * w
        out[i] = Waits(forward, forward if i in redone else 0.0, exposed(s, e), exposed(later * e, a + later * s))
    return out


def _linear(m: int, i: int, o: int, b: int, routed: bool) -> tuple[int, int]:
    """``(kept, concatenation)`` bytes of one joined ``i -> o`` linear, ``m`` rows a chunk."""
    joined = max(4 * m * i, 2 * m * i + 4 * m * o) if routed else 2 * m * (i + o)
    return m * o * b, joined * b


def _adapted(i: int, o: int, rank: int, adapted: bool) -> list:
    """The joined linears of an ``i -> o`` projection: itself, or under LoRA its adapters
    (none when it is not adapted: a frozen base makes no weight gradient)."""
    if not rank:
        return [(i, o)]
    return [(i, rank), (rank, o)] if adapted else []


def _moment(costs: list) -> int:
    """Every op's kept output gradient and the largest concatenation."""
    return sum(k for k, _ in costs) + max((c for _, c in costs), default=0)


def joined_grads_bytes(cfg, chunk, inp) -> int:
    """Device bytes the joined weight gradients hold at their largest moment in the backward of
    the chunk's largest MoE block (the module docstring; 0 without the flag)."""
    if not inp.overlap_moe_expert_parallel_comm or not cfg.num_experts:
        return 0
    shapes, H, b = shapes_of(cfg), cfg.hidden_size, inp.act_bytes
    m, rank = inp.chunk_tokens // 2, inp.lora_rank
    targets = {t.strip() for t in inp.lora_targets.split(",")} if rank else set()
    blocks = [shapes.blocks[i] for i in chunk.layers] + (list(shapes.extra) if chunk.last else [])
    best = 0
    for s in (s for s in blocks if s.ffn.moe):
        f, K = s.ffn, s.ffn.top_k
        ffn = [_linear(m * K, i, o, b, True) for p, q in ((H, f.size), (H, f.size), (f.size, H))
               for i, o in _adapted(p, q, rank, "experts" in targets)]
        if f.shared:
            ffn += [_linear(m, i, o, b, False) for p, q in ((H, f.shared), (H, f.shared), (f.shared, H))
                    for i, o in _adapted(p, q, rank, "shared_expert" in targets)]
        projections, norms = s.attention.joined_ops(H)
        attention = [_linear(m, i, o, b, False) for p, q in projections
                     for i, o in _adapted(p, q, rank, "attention" in targets)]
        if not rank:  # the block's two norms and the attention's (a frozen base's are not joined)
            attention += [(m * n * b, 2 * m * n * (3 * F32 + b)) for n in (H, H, *norms)]
        best = max(best, _moment(ffn), _moment(attention))
    return best
