"""One training iteration: the step that the trainer, the distributed tests and the benchmarks
all call, so the tests check the trainer's own step and not a copy of it.

Collective over the world. The gradients of a step stay on the parameters until the next step
starts (as in Megatron), so a caller can inspect them after the update.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from core.batch_copy import DeviceBatches
from core.distributed.fsdp import reshard
from core.distributed.host_values import host_values
from core.distributed.grads import clip_gradients, grad_norm, reduce_step_metrics, sync_gradients
from core.model_api import specs_of
from core.optim.masters import masters_of
from core.parallel_state import ParallelState, local_device
from core.pipeline.executor import PipelineExecutor
from core.pipeline.schedules import build_schedule


@dataclass
class StepSettings:
    """What a step needs besides the model chunks, the optimizer and the micro-batches."""

    hidden_size: int                    # width of the pipeline's [T, hidden] transfers
    device: torch.device | str | None = None  # default: this process's GPU, else the CPU
    dtype: torch.dtype = torch.float32  # activation dtype on the pipeline wire
    mtp_depths: int = 0                 # multi-token-prediction depths of the model (every rank)
    mtp_loss_scale: float = 0.0         # weight of the MTP token losses in the objective
    aux_loss_coeff: float = 0.0         # weight of the MoE router auxiliary loss
    model_aux_experts: int = 0          # experts of a model-wide aux loss (core.moe.aux "model"): its
                                        # router statistics travel with the pipeline's messages
    clip_grad: float = 0.0              # clip the global grad norm to this (0: off)
    router_bias_rate: float = 0.0       # aux-loss-free balancing: bias step per iteration (0: off)
    flops_of: Callable | None = None    # model FLOPs of a training micro-batch (host batch -> float)


@dataclass
class StepMetrics:
    loss: float                         # main-head loss per target token, whole step, all ranks
    mtp_losses: list = field(default_factory=list)  # per MTP depth, per main-head target token
    grad_norm: float = 0.0              # before clipping
    num_targets: int = 0                # main-head target tokens of the step (global)
    num_tokens: int = 0                 # real (non-padding) tokens of the step (global)
    flops: float = 0.0                  # model FLOPs of the step, all ranks (with StepSettings.flops_of)
    moe_imbalance: float | None = None  # mean over MoE layers of max/mean tokens per expert
    skipped: bool = False               # non-finite loss or grad norm, or no targets: no update
    nonfinite_matrices: int = 0         # --optimizer-in-backward: matrices left unchanged (non-finite update)
    p2p_bytes: int = 0                  # pipeline bytes this rank sent
    p2p_trace: list = field(default_factory=list)  # the p2p batches this rank issued (NCCL replay)
    peak_held_bytes: int = 0            # most activation bytes the pipeline executor held
    held_bytes_after: int = 0           # what it still held when the step ended (0)


def train_step(chunks: list, ps: ParallelState, optimizer, batches: list, s: StepSettings) -> StepMetrics:
    """Forward and backward of ``batches`` (this DP rank's micro-batches, on the host) through
    the pipeline schedule, gradient sync, global norm, clipping, the optimizer update and the
    router-bias update; nothing is updated when the loss or the norm is not finite, or when the
    step has no target token. A step without an image on any rank of the first stage's dp x cp
    group does not run the vision tower (``_global_counts``); its parameters step on a zero
    gradient, as after the idle pass that ran before."""
    optimizer.zero_grad(set_to_none=True)
    # before the forward: FSDP's shards, not gathered copies; a frozen base (LoRA) has no
    # gradient to reduce, clip or count
    params = [(p, spec) for p, spec in specs_of(chunks) if p.requires_grad]
    targets, tokens, flops, images = _global_counts(batches, ps, s.flops_of)
    in_backward = getattr(optimizer, "in_backward", None)  # core/optim/in_backward.py
    if in_backward is not None:
        in_backward.begin(active=targets > 0)  # no targets: nothing steps (weight decay would)
        stepped = {id(p) for p in in_backward.params}
        params = [(p, spec) for p, spec in params if id(p) not in stepped]
    device = s.device or local_device()
    # on CUDA: non-blocking copies on a side stream, each waited for when first used
    on_device = DeviceBatches([_without_images(b) if ps.pp_rank != 0 else b for b in batches], device)
    executor = PipelineExecutor(chunks, ps, seq_tokens=batches[0].tokens.numel(),
                                hidden_size=s.hidden_size, dtype=s.dtype, device=device,
                                mtp_loss_scale=s.mtp_loss_scale, aux_coeff=s.aux_loss_coeff,
                                carry_numel=s.model_aux_experts + 1 if s.model_aux_experts else 0,
                                nan_on_nonfinite_loss=in_backward is not None, idle_vision=images > 0)
    schedule = build_schedule(ps.sizes.pp, ps.sizes.vpp, len(batches))
    stats = executor.run(schedule, on_device.get, targets, len(batches) * ps.sizes.dp)
    if in_backward is not None:
        if not images:  # the tower's matrices step on a zero gradient, as after an idle pass
            in_backward.step_unreached([p for c in chunks for p in _image_parameters(c) if p.requires_grad])
        in_backward.end()  # matrices held for a balanced split of Newton-Schulz step now

    sync_gradients(params, ps)
    norm = grad_norm(params, ps, in_backward.sq if in_backward is not None else None)
    loads = _reduce_expert_load(stats.expert_load, ps)  # one flat all-reduce over DP
    zero = stats.loss_sum.new_zeros(())  # on the device: no host-to-device copy before the reduce
    mtp = stats.mtp_loss_sums or [zero] * s.mtp_depths
    if len(mtp) != s.mtp_depths:
        raise ValueError(f"the model returned {len(mtp)} MTP losses, StepSettings.mtp_depths is {s.mtp_depths}")
    nonfinite = in_backward.nonfinite if in_backward is not None else zero
    loss_sum, n, imbalance_sum, moe_layers, nonfinite, *mtp_sums = reduce_step_metrics(
        [stats.loss_sum, stats.num_tokens, *_imbalance_terms(loads, zero), nonfinite, *mtp])
    n = max(n, 1.0)
    metrics = StepMetrics(loss=loss_sum / n, mtp_losses=[x / n for x in mtp_sums], grad_norm=host_values(norm.reshape(1))[0],
                          num_targets=targets, num_tokens=tokens, flops=flops,
                          moe_imbalance=imbalance_sum / moe_layers if moe_layers else None,
                          p2p_bytes=executor.p2p_bytes, p2p_trace=executor.trace,
                          peak_held_bytes=executor.peak_held_bytes, held_bytes_after=executor.held_bytes(),
                          nonfinite_matrices=int(nonfinite))
    # no targets: nothing to learn, and an update would still move the weights (weight decay,
    # momentum); non-finite: the update would spoil them
    metrics.skipped = targets == 0 or not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm))
    if not metrics.skipped:
        if s.clip_grad > 0:
            factor = clip_gradients([p for p, _ in params], s.clip_grad, norm)
            if hasattr(optimizer, "set_grad_scale"):  # ours: bf16 gradients take the factor in fp32
                optimizer.set_grad_scale(factor)
        optimizer.step()
        update_router_biases(chunks, loads, s.router_bias_rate)
    masters_of(chunks).finish()  # host masters: the workers' updates done, new bf16 weights on the device
    reshard(chunks)  # FSDP units gathered for the whole step (gather-once, bf16 copies): now stale
    return metrics


def update_router_biases(chunks: list, loads: dict, rate: float) -> int:
    """Aux-loss-free balancing: each router's correction bias steps by ``rate`` against its layer's
    expert load of this step (``loads``: chunk index -> ``[MoE layers, E]``). A router whose
    parameters do not train (a frozen part, ``--freeze-*``; a LoRA base) keeps its bias: freezing
    a part freezes its buffers' updates too. Returns the number of routers updated."""
    n = 0
    for c, load in loads.items() if rate else ():
        layers = chunks[c].moe_layers()
        assert len(layers) == load.shape[0], "moe_layers() and StageOutput.expert_load disagree"
        for layer, layer_load in zip(layers, load):
            if any(p.requires_grad for p in layer.router.parameters()):
                layer.router.update_bias(layer_load, rate)
                n += 1
    return n


def _without_images(batch):
    """The micro-batch without its images: only the first pipeline stage (on pipeline rank 0)
    reads them, so the other ranks do not copy pixels to the device."""
    if getattr(batch, "images", None) is None:
        return batch
    return dataclasses.replace(batch, images=None)


def _image_parameters(chunk) -> list:
    return chunk.image_parameters() if hasattr(chunk, "image_parameters") else []


def _global_counts(batches: list, ps: ParallelState, flops_of) -> tuple[int, int, float, int]:
    """Target and real-token counts, model FLOPs and images of the step over all DP ranks, from
    the host-side batches (one all-reduce of host values; under context parallelism each batch is
    a shard, summed over DP x CP).

    The image count decides the vision tower's idle pass. The tower runs on the first pipeline
    stage only, whose ranks are exactly this all-reduce's group there (dp x cp; EP ranks are DP
    ranks), and its FSDP units shard over that same group (``core/distributed/fsdp.py``). So all
    ranks that hold the tower, and every FSDP group of its units, see the same count: with none,
    all of them skip the tower together (no gather, no reduce-scatter anywhere); with some, a rank
    without images runs it idle. Other stages hold no images (``data.loader``'s ``with_images``)
    and no tower: their count is 0 and reads nothing."""
    local = [sum(b.num_target_tokens for b in batches),
             sum(b.packed_seq_params.host_boundaries()[0][-1] for b in batches),
             sum(flops_of(b) for b in batches) if flops_of else 0.0,
             sum(len(b.images.num_local_patches) for b in batches if getattr(b, "images", None) is not None)]
    counts = torch.tensor(local, dtype=torch.float64)
    if ps.sizes.dp * ps.sizes.cp > 1:
        dist.all_reduce(counts, group=ps.group("dp_cp"))
    # a traced step (fake tensors) assumes every DP x CP rank counts what this one does
    counts = host_values(counts, assumed=[x * ps.sizes.dp * ps.sizes.cp for x in local])
    return int(counts[0]), int(counts[1]), float(counts[2]), int(counts[3])


def _reduce_expert_load(load: dict, ps: ParallelState) -> dict:
    """Tokens per expert of every MoE layer of this rank's chunks, summed over the step's
    micro-batches (by the executor) and over the DP ranks here, in one flat all-reduce. Every
    DP rank of a stage holds the same layers, so the flat buffers line up. (Under context
    parallelism the routers already summed each pack's load over the CP group.)"""
    if not load:
        return {}
    keys = sorted(load)
    flat = torch.cat([load[k].flatten() for k in keys])
    if ps.sizes.dp > 1:
        dist.all_reduce(flat, group=ps.group("dp"))
    parts = flat.split([load[k].numel() for k in keys])
    return {k: part.view_as(load[k]) for k, part in zip(keys, parts)}


def _imbalance_terms(loads: dict, zero: torch.Tensor) -> list[torch.Tensor]:
    """(sum over this rank's MoE layers of max/mean load, number of layers). Summed over the
    world, every DP replica adds the same layers, so the ratio is the mean over all layers."""
    if not loads:
        return [zero, zero]
    load = torch.cat(list(loads.values()))
    ratio = load.max(-1).values / load.mean(-1).clamp(min=1e-9)
    return [ratio.sum(), zero + load.shape[0]]
