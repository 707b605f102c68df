"""Muon: momentum, then orthogonalise the update with Newton-Schulz, for matrix parameters.

Differences from ``torch.optim.Muon`` (which it equals on 2-D parameters when configured alike):

* ``momentum = 0`` is stateless: no momentum buffer is ever allocated (the update is the
  gradient itself), so the optimizer holds zero bytes for these parameters;
* 3-D stacked expert weights ``[E, out, in]`` are a batch of E matrices, orthogonalised in one
  batched Newton-Schulz (same result as looping over experts);
* under FSDP, a row-sharded matrix is orthogonalised by one owner rank, not by every rank of its
  mesh (``core/optim/muon_split.py``: two all-to-alls, 1/D of the Newton-Schulz work per rank,
  the same bits); stacks of whole experts on a rank are orthogonalised where they are;
* ``ns_method="polar_express"``: per-iteration coefficients (Amsel et al. 2025) instead of the
  fixed quintic;
* offloaded parameters (``--cpu-offload``: masters and gradients in host memory): each matrix's
  gradient goes to the GPU, is gathered and orthogonalised there one matrix at a time, and
  only the update comes back to the host master.

Update: ``buf = mu * buf + (1 - mu) * g``; ``u = nesterov ? lerp(g, buf, mu) : buf``;
``p *= 1 - lr * wd``; ``p -= lr * adjust(shape) * NS(u)`` with ``adjust`` ``spectral``
``sqrt(max(1, out/in))`` or ``rms`` ``0.2 * sqrt(max(out, in))`` (carries AdamW's lr over).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from core.optim.masters import NO_MASTERS
from core.optim.muon_split import local_experts, split_orthogonalise, splittable
from core.parallel_state import local_device

QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (degree-5) coefficients per iteration, the last repeated if more steps are asked.
POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def newton_schulz(g: torch.Tensor, steps: int = 5, method: str = "quintic", eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate ``U V^T`` of each matrix in the last two dims (batched for 3-D input)."""
    x = g.to(dtype)
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.mT
    if x.dim() == 2:
        x = x.div(x.norm().clamp(min=eps))
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for i in range(steps):
        a, b, c = QUINTIC if method == "quintic" else POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)]
        if x.dim() == 2:  # the exact op sequence of torch.optim.Muon
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def _local_rows(full: torch.Tensor, p: "DTensor") -> torch.Tensor:
    """The rows of ``full`` that FSDP's dim-0 shard of ``p`` holds on this rank."""
    mesh = p.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def _on_compute_device(g: "DTensor") -> "DTensor":
    """``g`` with its local shard on the compute device (an offloaded shard lives on the host,
    where NCCL cannot gather it)."""
    device = local_device()
    if g.to_local().device == device:
        return g
    return DTensor.from_local(g.to_local().to(device), g.device_mesh, g.placements,
                              shape=g.shape, stride=g.stride())


def lr_adjustment(shape: torch.Size, rule: str) -> float:
    out_dim, in_dim = shape[-2], shape[-1]
    if rule == "spectral":
        return math.sqrt(max(1.0, out_dim / in_dim))
    if rule == "rms":
        return 0.2 * math.sqrt(max(out_dim, in_dim))
    if rule == "none":
        return 1.0
    raise ValueError(f"--muon-lr-adjust {rule!r}: expected spectral, rms or none")


class Muon(Optimizer):
    """``masters``: exact fp32 masters of bf16 parameters (``core/optim/masters.py``); each
    matrix is updated in fp32 and split back. ``grad_scale``: a clip factor the gradients did not
    receive (bf16 gradients), applied in fp32 (momentum 0 makes it a no-op but for rounding)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, ns_steps: int = 5, ns_method: str = "quintic",
                 lr_adjust: str = "spectral", eps: float = 1e-7, ns_dtype=torch.bfloat16, masters=None,
                 split: bool = True):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {momentum}")
        if ns_method not in ("quintic", "polar_express"):
            raise ValueError(f"--muon-ns-method {ns_method!r}: expected quintic or polar_express")
        lr_adjustment(torch.Size([1, 1]), lr_adjust)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      weight_decay=weight_decay, ns_steps=ns_steps,
                                      ns_method=ns_method, lr_adjust=lr_adjust, eps=eps,
                                      ns_dtype=ns_dtype))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    raise ValueError(f"Muon takes matrices (2-D) or expert stacks (3-D); got a "
                                     f"{p.dim()}-D parameter of shape {tuple(p.shape)}")
        self.masters = masters or NO_MASTERS
        self.grad_scale = None
        self.split = split  # Newton-Schulz of row-sharded matrices by one owner each (else on every rank)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            self.update_many([p for p in group["params"] if p.grad is not None], group)
        return loss

    def _gradient(self, p, group) -> torch.Tensor:
        """The (momentum) gradient in fp32, as a DTensor when the parameter is sharded."""
        g = p.grad
        if g.dtype != torch.float32:  # bf16 (remainder masters): fp32, with the clip factor
            g = g.float() if self.grad_scale is None else g.float() * self.grad_scale
        mu = group["momentum"]
        if mu > 0:  # momentum = 0 keeps no state at all
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            g = g.lerp(buf, mu) if group["nesterov"] else buf
        return g

    def _ns(self, group):
        return lambda g: newton_schulz(g, group["ns_steps"], group["ns_method"], group["eps"], group["ns_dtype"])

    def orthogonalised(self, p, group) -> torch.Tensor:
        """Newton-Schulz of the whole matrix's update, this rank's rows (on the compute device)."""
        g = self._gradient(p, group)
        if local_experts(g):  # whole experts on this rank: no other rank's rows needed
            return self._ns(group)(_on_compute_device(g).to_local())
        sharded = isinstance(g, DTensor)
        if sharded:  # FSDP: orthogonalise the whole matrix, keep this rank's rows
            g = _on_compute_device(g).full_tensor()
        # offloaded (host) gradients: Newton-Schulz on the GPU, one matrix at a time
        update = self._ns(group)(g.to(local_device()))
        return _local_rows(update, p) if sharded else update

    @torch.no_grad()
    def update_many(self, params: list, group, guard: bool = False) -> list:
        """``update`` of each of ``params`` (every rank of their meshes passes the same list, in
        the same order): matrices sharded by rows over several ranks are orthogonalised once, by
        an owner each (``core/optim/muon_split.py``), the rest where they are."""
        kept = {}
        by_mesh: dict = {}
        for p in params:
            if self.split and splittable(p):
                by_mesh.setdefault(id(p.device_mesh.get_group()), []).append(p)
            else:
                kept[p] = self.update(p, group, guard)
        for batch in by_mesh.values():
            grads = [_on_compute_device(self._gradient(p, group)) for p in batch]
            for p, u in zip(batch, split_orthogonalise(grads, self._ns(group), group["ns_dtype"])):
                kept[p] = self._apply(p, group, u, guard)
        return [kept[p] for p in params]

    @torch.no_grad()
    def update(self, p, group, guard: bool = False):
        """Update ``p``. ``guard``: keep its value when the update is not finite, without a host
        read (returns the device bool "updated")."""
        return self._apply(p, group, self.orthogonalised(p, group), guard)

    def _apply(self, p, group, update: torch.Tensor, guard: bool):
        """``p *= 1 - lr wd; p -= lr adjust update`` through the master storage."""
        decay = 1 - group["lr"] * group["weight_decay"]
        alpha = -group["lr"] * lr_adjustment(p.shape, group["lr_adjust"])
        keep = torch.isfinite(update).all() if guard else None

        def apply(m, u, *on):
            u = u.to(m.dtype)
            if not on:
                m.mul_(decay)
                m.add_(u, alpha=alpha)
            else:  # a NaN or inf anywhere in the gradient spreads to every row of the update
                m.mul_(torch.where(on[0], decay, 1.0))
                m.add_(torch.where(on[0], u, 0.0), alpha=alpha)
        self.masters.update(p, apply, update, *(() if keep is None else (keep,)))
        return keep
