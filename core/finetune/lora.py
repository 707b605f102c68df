"""LoRA: low-rank adapters on a frozen base, for any model built from core's blocks.

An adapted linear computes ``W x + (alpha / r) B A dropout(x)`` with ``A [r, in]`` and
``B [out, r]``; ``B`` starts at zero, so before the first update the model is the base model
exactly. Routed experts get grouped adapters ``A [E, r, in]``, ``B [E, out, r]`` per projection,
run with the grouped GEMM of the base experts (``core/moe/experts.expert_linear``) over the same
token segments. They live in the expert module, so expert parallelism holds them for its own
experts only (the same slice as the base weights), and the model's ``param_specs`` marks them
expert shards stacked on dim 0 like the base experts.

:func:`apply_lora` adapts a model chunk in place, on the ``meta`` device before FSDP
(``training/parallelize.py``), choosing modules by core's block types (no family is named):

- ``attention``: the projections each attention module declares (``lora_projections``, the
  protocol of ``core/transformer/attention.py``): GQA's q, k, v, o and a head gate; MLA's
  ``q_proj`` or ``q_a_proj`` + ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``;
- ``mlp``: a dense :class:`~core.transformer.mlp.SwiGLUMLP` (gate, up, down);
- ``shared_expert``: an MoE layer's shared expert (gate, up, down);
- ``experts``: the routed experts (gate, up, down, grouped).

Routers, embeddings, heads, norms and other projections (an MTP depth's ``eh_proj``) are never
adapted. Every parameter of the chunk that is not an adapter is frozen (``requires_grad``
False): it gets no gradient, no optimizer state and no gradient reduction. Adapters keep the
base weights' parameter names (``q_proj.weight`` stays), adding ``q_proj.lora_A`` /
``q_proj.lora_B`` and, on experts, ``experts.lora_A.gate_proj`` / ``experts.lora_B.gate_proj``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.cli import option
from core.distributed.host_values import host_counts
from core.moe.experts import GroupedExperts, _grouped_mm_ok, expert_linear
from core.moe.layer import MoELayer
from core.transformer.attention import attention_modules
from core.transformer.mlp import SwiGLUMLP

TARGETS = ("attention", "mlp", "shared_expert", "experts")
NEVER = ("router", "embeddings", "embedding", "head", "norm")
DEFAULT_TARGETS = ",".join(TARGETS)


@dataclass
class LoraSettings:
    """LoRA: train low-rank adapters on a frozen base (core/finetune/lora.py)."""

    lora_rank: int = option(0, "LoRA rank r: train adapters W + (alpha / r) B A on the chosen projections, "
                               "every other parameter frozen (no gradient, optimizer state or reduction; "
                               "0: off, full training)")
    lora_alpha: float = option(None, "LoRA alpha: the adapters' scale is alpha / r (default: r, scale 1)")
    lora_dropout: float = option(0.0, "dropout on the adapters' input (the base path sees the undropped input)")
    lora_targets: str = option(DEFAULT_TARGETS, "comma-separated modules to adapt: attention (q, k, v, o and a "
                                                "head gate; MLA's q or q_a + q_b, kv_a, kv_b, o), mlp (dense "
                                                "SwiGLU), shared_expert, experts (grouped adapters per routed "
                                                "expert, sharded with them under EP); routers, embeddings and "
                                                "heads never")

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        if self.lora_alpha is not None and not (self.lora_alpha > 0 and self.lora_alpha != float("inf")):
            raise ValueError(f"--lora-alpha must be a finite number > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        names = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        for t in names:
            if t in NEVER:
                raise ValueError(f"--lora-targets {t}: the router, embeddings, heads and norms are never adapted "
                                 f"(expected some of {', '.join(TARGETS)})")
            if t not in TARGETS:
                raise ValueError(f"--lora-targets {t!r}: expected a comma-separated list of {', '.join(TARGETS)}")
        if not names:
            raise ValueError(f"--lora-targets is empty: expected some of {', '.join(TARGETS)}")
        if not self.lora_rank:
            for flag, set_ in (("--lora-alpha", self.lora_alpha is not None), ("--lora-dropout", self.lora_dropout),
                               ("--lora-targets", self.lora_targets != DEFAULT_TARGETS)):
                if set_:
                    raise ValueError(f"{flag} needs --lora-rank > 0 (LoRA is off)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def targets(self) -> tuple:
        return tuple(t for t in TARGETS if t in {s.strip() for s in self.lora_targets.split(",")})

    @property
    def scale(self) -> float:
        return (self.lora_alpha if self.lora_alpha is not None else self.lora_rank) / self.lora_rank

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else float(self.lora_rank)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p and training else x


class LoRALinear(nn.Linear):
    """``nn.Linear`` with an adapter: the wrapped linear's own ``weight`` and ``bias`` parameters
    (same names, same objects) plus ``lora_A [r, in]`` and ``lora_B [out, r]`` (fp32)."""

    lora_target = ""  # the --lora-targets entry that chose it (apply_lora)

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, device=dev, dtype=torch.float32))
        self.rank, self.alpha, self.scale, self.dropout = rank, alpha, alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        a = _dropout(x, self.dropout, self.training)
        return y + self.adapter(self.lora_B, self.adapter(self.lora_A, a)) * self.scale

    def adapter(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One of the adapter's linears (``lora_A`` or ``lora_B``), in the input's dtype (the
        MoE overlap joins its gradient over two chunks here, core/moe/joined_grads.py)."""
        return F.linear(x, w.to(x.dtype))

    def constant_init(self) -> dict:
        """``B`` starts at zero: the adapted model is the base model until the first update."""
        return {"lora_B": 0.0}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.rank}, lora_alpha={self.alpha:g}"


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with grouped adapters per projection: ``lora_A[name] [E, r, in]`` and
    ``lora_B[name] [E, out, r]``, run over the same expert-sorted token segments."""

    def __init__(self, base: GroupedExperts, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.num_experts, self.limit, self.expert_offset = base.num_experts, base.limit, base.expert_offset
        self.use_grouped_mm = base.use_grouped_mm
        for n in self.PROJECTIONS:
            setattr(self, n, getattr(base, n))
        E, dev = base.num_experts, base.gate_proj.device
        shapes = {n: getattr(base, n).shape[1:] for n in self.PROJECTIONS}  # (out, in)
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(E, rank, i, device=dev, dtype=torch.float32))
                                        for n, (o, i) in shapes.items()})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.empty(E, o, rank, device=dev, dtype=torch.float32))
                                        for n, (o, i) in shapes.items()})
        self.rank, self.alpha, self.scale, self.dropout = rank, alpha, alpha / rank, dropout

    def _segments(self, x_NH, counts_E):
        grouped, sizes = super()._segments(x_NH, counts_E)
        # the adapters' GEMMs are grouped too when their rank is aligned (else the loop, which
        # reads the segment sizes on the host once per layer, as the base loop does)
        lora_grouped = grouped and _grouped_mm_ok(x_NH, self.rank)
        if sizes is None and not lora_grouped and not torch.compiler.is_compiling():
            sizes = host_counts(counts_E, x_NH.shape[0])
        return grouped, lora_grouped, sizes

    def project(self, name, x_NI, counts_E, segments):
        grouped, lora_grouped, sizes = segments
        y = expert_linear(x_NI, getattr(self, name), counts_E, grouped, sizes)
        a = _dropout(x_NI, self.dropout, self.training)
        low = self.adapter(self.lora_A[name], a, counts_E, lora_grouped, sizes)
        return y + self.adapter(self.lora_B[name], low, counts_E, lora_grouped, sizes) * self.scale

    def adapter(self, w: torch.Tensor, x_NI: torch.Tensor, counts_E: torch.Tensor, grouped: bool, sizes):
        """One adapter projection of every expert's rows, in the rows' dtype (the MoE overlap
        joins its gradient over two chunks here, core/moe/joined_grads.py)."""
        return expert_linear(x_NI, w.to(x_NI.dtype), counts_E, grouped, sizes)

    def constant_init(self) -> dict:
        return {f"lora_B.{n}": 0.0 for n in self.PROJECTIONS}


def adapter_params(module: nn.Module) -> set[int]:
    """Ids of the adapter parameters inside ``module``."""
    out = set()
    for m in module.modules():
        if isinstance(m, LoRALinear):
            out |= {id(m.lora_A), id(m.lora_B)}
        elif isinstance(m, LoRAGroupedExperts):
            out |= {id(p) for p in (*m.lora_A.values(), *m.lora_B.values())}
    return out


def target_modules(chunk: nn.Module, targets) -> list[tuple[nn.Module, str, str]]:
    """``(parent, attribute, target)`` of every module ``targets`` chooses in ``chunk``."""
    shared = {id(m.shared_expert) for m in chunk.modules() if isinstance(m, MoELayer) and m.shared_expert is not None}
    attention = {id(m) for m in attention_modules(chunk)} if "attention" in targets else set()
    out = []
    for m in chunk.modules():
        if id(m) in attention:
            out += [(m, n, "attention") for n in m.lora_projections if isinstance(getattr(m, n, None), nn.Linear)]
        elif isinstance(m, SwiGLUMLP):
            t = "shared_expert" if id(m) in shared else "mlp"
            if t in targets:
                out += [(m, n, t) for n in ("gate_proj", "up_proj", "down_proj")]
        elif isinstance(m, MoELayer) and "experts" in targets:
            out.append((m, "experts", "experts"))
    return out


def rank_limit(chunk: nn.Module, targets) -> tuple[int, str] | None:
    """The largest useful rank over the modules ``targets`` chooses: the smallest ``min(in, out)``
    of an adapted projection (a rank above it adds parameters and no expressiveness), and that
    projection's name; None when nothing is chosen. Shapes only: works on ``meta``."""
    names = {id(m): n for n, m in chunk.named_modules()}
    best = None
    for parent, attr, _ in target_modules(chunk, targets):
        base = getattr(parent, attr)
        prefix = f"{names[id(parent)]}.{attr}".lstrip(".")
        if isinstance(base, GroupedExperts):
            shapes = [(f"{prefix}.{n}", getattr(base, n).shape[1:]) for n in base.PROJECTIONS]
        else:
            shapes = [(prefix, base.weight.shape)]
        for name, (out_f, in_f) in shapes:
            if best is None or min(out_f, in_f) < best[0]:
                best = (min(out_f, in_f), f"{name}: out {out_f}, in {in_f}")
    return best


def check_rank(chunk: nn.Module, settings: LoraSettings) -> None:
    """``ValueError`` naming ``--lora-rank`` and the limit when the rank exceeds ``rank_limit``:
    before any adapter is allocated (an absurd rank would otherwise allocate ``r x (in + out)``
    per module first)."""
    limit = rank_limit(chunk, settings.targets) if settings.enabled else None
    if limit is not None and settings.lora_rank > limit[0]:
        raise ValueError(f"--lora-rank {settings.lora_rank} exceeds {limit[0]}, the smallest min(in, out) of an "
                         f"adapted projection ({limit[1]}): choose a rank of at most {limit[0]}")


def apply_lora(chunk: nn.Module, settings: LoraSettings) -> int:
    """Adapt ``chunk`` in place as ``settings`` say and freeze every other parameter; returns
    the number of adapted modules (0 when LoRA is off: nothing changes). Built on any device
    (``meta`` before FSDP); the adapters' values are written at materialisation (``A`` seeded
    like any weight, ``B`` zero by ``constant_init``)."""
    if not settings.enabled:
        return 0
    check_rank(chunk, settings)
    r, alpha, p = settings.lora_rank, settings.alpha, settings.lora_dropout
    found = target_modules(chunk, settings.targets)
    for parent, name, target in found:
        base = getattr(parent, name)
        if isinstance(base, (LoRALinear, LoRAGroupedExperts)):
            continue
        wrap = LoRAGroupedExperts if isinstance(base, GroupedExperts) else LoRALinear
        setattr(parent, name, wrap(base, r, alpha, p))
        getattr(parent, name).lora_target = target
    adapters = adapter_params(chunk)
    for q in chunk.parameters():
        q.requires_grad_(id(q) in adapters)
    return len(found)


def frozen_to_bf16(chunk: nn.Module) -> int:
    """Under ``--bf16``, on the meta device before FSDP: every frozen parameter that computes in
    bf16 (not those of units the model keeps in fp32, the routers) is stored in bf16, its only
    copy: no fp32 master, as it is never updated (2 bytes per parameter instead of 4). Returns
    how many."""
    keep = {id(p) for u in chunk.fsdp_units() if u.fp32 for p in u.module.parameters()}
    n = 0
    for p in chunk.parameters():
        if not p.requires_grad and p.dtype == torch.float32 and id(p) not in keep:
            p.data = p.data.to(torch.bfloat16)
            n += 1
    return n


def count_targets(chunk: nn.Module, targets) -> dict:
    """Modules each target chooses in ``chunk`` (what validation checks the model against)."""
    out = {t: 0 for t in targets}
    for _, _, t in target_modules(chunk, targets):
        out[t] += 1
    return out


_FINGERPRINT_BLOCK = 1 << 24  # elements converted at a time (64 MiB of fp32)


def base_fingerprint(chunks, pstate=None) -> str:
    """A fingerprint of the frozen base's values, the same in every layout (collective over the
    world with ``pstate``, this rank's chunks being one share of the model; without it
    ``chunks`` are the whole model): per row of every frozen parameter, the sum of the fp32 bit
    patterns of its values rounded to bf16 (so a base stored in bf16 under ``--bf16`` and the same
    base in fp32 agree; HF checkpoints are bf16) (int64, wrapping: exact and independent of the order of summation), weighted by a hash of the
    parameter's name plus the row's global index (expert rows by their global expert), summed
    over the rows each distinct tensor has once (``core.distributed.grads.owns``) and over the
    ranks. Changing, swapping or moving any row changes it (short of a 2^-64 collision)."""
    import zlib

    import torch.distributed as dist

    from core.distributed.grads import owns
    from core.init import local_rows
    from core.model_api import iter_params
    from core.parallel_state import local_device

    device = local_device()
    total = torch.zeros((), dtype=torch.int64, device=device)
    for _, name, p, spec in iter_params(chunks):
        if p.requires_grad or (pstate is not None and not owns(p, spec, pstate)):
            continue
        local, first = local_rows(p)
        if not local.numel():
            continue
        rows = local.detach().reshape(local.shape[0] if local.dim() else 1, -1)
        step = max(1, _FINGERPRINT_BLOCK // rows.shape[1])  # bounded temporaries: a block of rows at a time
        # the bf16 value (as bf16 storage under --bf16 holds it): one fingerprint in either precision
        sums = torch.cat([b.to(device, torch.bfloat16).float().view(torch.int32).sum(1, dtype=torch.int64)
                          for b in rows.split(step)])
        index = torch.arange(sums.numel(), device=device, dtype=torch.int64) + first + (spec.expert_offset or 0)
        total += (sums * (index + (zlib.crc32(name.encode()) << 20))).sum()
    if pstate is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return f"{int(total) & (2**64 - 1):016x}"
