"""Parameter grouping and the composite optimizer.

Rules (printed at start-up): with ``--optimizer muon``, ``dion`` or any registered optimizer of
matrices (``core/optim/registry.py``), every matrix (2-D) and
expert stack (3-D) goes to Muon / Dion *except* the parameters the model declares as embeddings
or output heads (``ParamSpec.role``); those, the norms and all vectors go to AdamW with its own
learning rate (``--adamw-lr``, default ``--lr``). ``--optimizer adamw`` puts
everything in AdamW. Weight decay is decoupled; norms and vectors get none. LoRA adapters (``ParamSpec.role``
``adapter``) go to AdamW too (its decayed group; the start-up summary lists them apart); frozen parameters
(``requires_grad`` False: a LoRA base, ``--freeze-*``) to none.
"""
from __future__ import annotations

import torch

from core.distributed.grads import sharded
from core.model_api import ParamSpec, iter_params
from core.optim.adamw import AdamW
from core.optim import registry
from core.optim.masters import masters_of


def classify(spec: ParamSpec, p: torch.Tensor, optimizer: str) -> str:
    """Which optimizer a parameter belongs to: 'matrix', 'adamw' or 'adamw_no_wd'."""
    if p.dim() < 2:
        return "adamw_no_wd"
    if not registry.get(optimizer).matrices or spec.role in ("embedding", "head", "adapter"):
        return "adamw"
    return "matrix"


class CompositeOptimizer:
    """Several torch optimizers stepped as one; ``param_groups`` spans them (for LR schedules)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()
        self.set_grad_scale(None)  # this step's clip factor: not the next backward's (optimizer in backward)

    def set_grad_scale(self, factor) -> None:
        """A clip factor for the gradients that were not scaled in place (bf16 gradients of
        remainder-stored parameters): each optimizer applies it in fp32 at the update."""
        for opt in self.optimizers.values():
            if hasattr(opt, "grad_scale"):
                opt.grad_scale = factor

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for opt in self.optimizers.values()
                   for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def build_optimizer(chunks, cfg) -> tuple[CompositeOptimizer, str]:
    """One optimizer over every parameter of ``chunks`` (grouped by their ``ParamSpec``).
    ``cfg`` needs: optimizer (a name in ``core/optim/registry.py``), lr, adamw_lr, weight_decay,
    adam_beta1/2, adam_eps, and what the optimizer's ``build`` reads (muon_*, dion_*). Returns the optimizer and a printable summary."""
    buckets: dict[str, list] = {"matrix": [], "adamw": [], "adamw_no_wd": []}
    names: dict[str, list] = {k: [] for k in buckets}
    frozen = adapters = n_adapters = 0
    for _, name, p, spec in iter_params(chunks):
        if not p.requires_grad:  # a frozen base (LoRA, core/finetune/lora.py; --freeze-*): no optimizer state at all
            frozen += p.numel()
            continue
        kind = classify(spec, p, cfg.optimizer)
        buckets[kind].append(p)
        if spec.role == "adapter":  # in AdamW's decayed group, summarised apart
            adapters, n_adapters = adapters + p.numel(), n_adapters + 1
        else:
            names[kind].append(name)
    adamw_lr = cfg.adamw_lr if cfg.adamw_lr is not None else cfg.lr
    masters = masters_of(chunks)  # exact fp32 masters of bf16 parameters (--store-param-remainders)
    groups = [g for g in (
        {"params": buckets["adamw"], "weight_decay": cfg.weight_decay, "lr": adamw_lr, "base_lr": adamw_lr},
        {"params": buckets["adamw_no_wd"], "weight_decay": 0.0, "lr": adamw_lr, "base_lr": adamw_lr},
    ) if g["params"]]
    opts = {}
    if groups:
        # torch's AdamW maths one tensor at a time (FSDP mixes DTensor shards and plain tensors)
        opts["adamw"] = AdamW(groups, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, masters=masters)
    if buckets["matrix"]:
        spec = registry.get(cfg.optimizer)
        # the flags' validation refused these already (core/memory_mode.py): a direct caller too
        for feature, on in (("remainders", bool(getattr(masters, "rem", None))),
                            ("fsdp", any(sharded(p) for p in buckets["matrix"]))):
            why = spec.refusal(feature, cfg) if on else None
            if why:
                raise ValueError(why)
        opts[spec.name] = spec.build([{"params": buckets["matrix"], "base_lr": cfg.lr}], cfg, masters)
    count = {k: sum(p.numel() for p in v) for k, v in buckets.items()}
    count["adamw"] -= adapters
    summary = (f"optimizer groups: {cfg.optimizer} matrices "
               f"{len(names['matrix'])} tensors / {count['matrix']:,} params (lr {cfg.lr:g}); "
               f"AdamW {len(names['adamw'])} tensors / {count['adamw']:,} params (embeddings, heads"
               f"{'' if registry.get(cfg.optimizer).matrices else ', matrices'}; lr {adamw_lr:g}); "
               + (f"LoRA adapters {n_adapters} tensors / {adapters:,} params (AdamW, lr {adamw_lr:g}); "
                  if n_adapters else "")
               + f"AdamW without decay {len(names['adamw_no_wd'])} tensors / {count['adamw_no_wd']:,} params "
               "(norms, vectors)" + (f"; frozen {frozen:,} params (no gradient or optimizer state)" if frozen else ""))
    return CompositeOptimizer(opts), summary
