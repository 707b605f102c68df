"""What a model tells core: the contract between model code and the model-agnostic machinery.

core never matches a model's parameter names or reaches into its attributes. Each pipeline
chunk of a model implements:

- ``param_specs() -> dict[str, ParamSpec]``: for every named parameter, its role for the
  optimizer, where its replicas live, whether a copy of it sits on another pipeline stage, and
  whether dim 0 stacks experts (checkpoints store one key per expert);
- ``fsdp_units() -> list[FSDPUnit]``: submodules to wrap as FSDP units, innermost first, each
  with the replication group of its parameters (``"dp"`` or ``"expert_dp"``) and whether it
  must compute in fp32 under bf16 mixed precision (e.g. a router); the chunk itself is the root;
- ``moe_layers() -> list[MoELayer]``: its MoE layers in the order of ``StageOutput.expert_load``;
- ``blocks() -> list[tuple[int, nn.Module]]``: its blocks in forward order, each with its global
  id: decoder layer ``i`` is ``i``, an extra block after the last layer (a multi-token-prediction
  depth) ``k`` is ``-1 - k``; recompute, ``--compile`` and the planner work block by block;
- ``forward(tokens, position_ids, packed_seq_params, *, hidden=None, labels=None)``: with
  ``labels`` (the training path) it returns a :class:`StageOutput`. Every stage receives the
  whole micro-batch and uses what its role needs. The first stage also gets ``images=``
  (``core.packed_seq.ImageInputs``) when the micro-batch has images, an idle one
  (``ImageInputs.idle()``: run a vision tower's collectives, write nothing) when it has none but
  another rank of its data-parallel group has, and nothing when no rank of the group has;
- ``image_parameters() -> list``: (optional) the parameters only images reach, in the order a
  backward makes their gradients final: a step in which the tower does not run steps them on a
  zero gradient under ``--optimizer-in-backward``, as after an idle pass (``core/train_step.py``).

The last stage's heads (final norm, head, extra blocks) read of the trunk only the output of its
last decoder layer (the first element of that block's output): core hooks its gradient, whole
once the heads' backward is done, after which none of the root's weights is read (FSDP frees
them then with one stage per rank: ``core/distributed/fsdp.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

ROLES = ("weight", "embedding", "head", "adapter")
REPLICATION = ("dp", "expert_dp")


@dataclass(frozen=True)
class ParamSpec:
    role: str = "weight"            # "embedding" / "head": AdamW even under Muon or Dion; "adapter":
                                    # a LoRA adapter (core/finetune/lora.py): AdamW, not in the base's checkpoints
    replicated_over: str = "dp"     # "dp": dense; "expert_dp": an expert-parallel shard
    tied: bool = False              # copies on the first and the last pipeline stage (MTP's embedding)
    expert_offset: int | None = None  # dim 0 stacks experts; global index of the first one

    def __post_init__(self):
        if self.role not in ROLES or self.replicated_over not in REPLICATION:
            raise ValueError(f"ParamSpec: role {self.role!r} must be one of {ROLES}, "
                             f"replicated_over {self.replicated_over!r} one of {REPLICATION}")


@dataclass(frozen=True)
class FSDPUnit:
    module: nn.Module
    replicated_over: str = "dp"
    fp32: bool = False  # under --bf16: compute with the fp32 parameters (a unit of its own)


@dataclass
class StageOutput:
    """What one chunk's training forward returns.

    Non-last stages fill ``hidden`` (sent to the next stage). The last stage fills the loss
    sums: main head and each multi-token-prediction depth, summed over tokens (fp32), with their
    target counts; the caller normalises once per step by the global target count. Every stage
    returns its MoE layers' auxiliary loss (summed) and routing load (tokens per expert, padding
    excluded, ``[num_moe_layers, num_experts]`` fp32), for the step-level statistics."""

    hidden: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    mtp_loss_sums: list = field(default_factory=list)
    mtp_num_tokens: list = field(default_factory=list)
    aux_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    # a model-wide aux loss (core.moe.aux scope "model"): this chunk's router statistics, summed
    # over its MoE layers; the executor combines the stages' (aux_loss is then the chunk's alone)
    router_counts: torch.Tensor | None = None   # [E] routed slots over valid tokens (no gradient)
    router_probs: torch.Tensor | None = None    # [E] scores summed over valid tokens (differentiable)
    router_layers: int = 0
    router_tokens: torch.Tensor | None = None   # valid tokens of the micro-batch


def iter_params(chunks) -> Iterator[tuple[nn.Module, str, nn.Parameter, ParamSpec]]:
    """``(chunk, name, parameter, spec)`` for every parameter of ``chunks``; a parameter the
    model gives no spec for is an error (core would otherwise guess).

    Call it between steps: FSDP registers the unsharded parameters on the modules while they are
    gathered (e.g. from a forward until ``reshard()``), and the optimizer holds the shards."""
    for chunk in chunks:
        specs = chunk.param_specs()
        for name, p in chunk.named_parameters():
            if name not in specs:
                raise KeyError(f"{type(chunk).__name__}.param_specs() has no entry for {name!r}")
            yield chunk, name, p, specs[name]


def specs_of(chunks) -> list[tuple[nn.Parameter, ParamSpec]]:
    """``(parameter, spec)`` pairs of ``chunks``, captured once (see ``iter_params``)."""
    return [(p, spec) for _, _, p, spec in iter_params(chunks)]


def persistent_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Named parameters and persistent buffers (what a checkpoint holds), as ``.data``."""
    for name, p in module.named_parameters():
        yield name, p.data
    for prefix, m in module.named_modules():
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield (f"{prefix}.{bname}" if prefix else bname), b
