"""Start-up of a rank's chunks: storage for its own shards (``core/init.py``), then each tensor
written once: streamed from a Hugging Face checkpoint through the family's weight adapter
(``core/checkpoint/hf.py``; tensors it lacks are seeded), else seeded; or left for a training
checkpoint to fill. See ``core/init.py`` for the seeding contract (the same weights in any
layout) and the choice of generator."""
from __future__ import annotations

import torch

from core.checkpoint.hf import load_weights
from core.init import allocate, init_buffers, init_parameters
from core.optim.masters import RemainderMasters, attach


def materialize(model, device, *, seed: int = 0, hf_path: str | None = None, init: bool = True,
                generator_device=None, progress: bool = False, masters=None) -> dict | None:
    """Allocate ``model`` (built on meta, possibly FSDP-wrapped) on ``device`` and write its
    weights once: from the Hugging Face checkpoint ``hf_path`` (streamed into this process's
    rows; tensors it lacks are seeded), else from ``seed``; ``init=False`` leaves the parameters
    undefined (a training checkpoint fills them next). Buffers are always set. Parameters the
    model holds in bf16 (``--store-param-remainders``: ``core.optim.masters.to_bf16_storage``)
    get an fp32 master each in ``masters`` (the rank's storage: remainders by default, or host
    masters), and their values are written as exact fp32 masters. Returns the checkpoint report
    of the load, if any; ``progress``: a bar over the checkpoint's tensors."""
    allocate(model, device)
    init_buffers(model, device)
    # bf16 parameters that train get fp32 masters; a frozen bf16 base (LoRA) is its own only copy
    trained_bf16 = [p for p in model.parameters() if p.dtype == torch.bfloat16 and p.requires_grad]
    if trained_bf16:
        masters = masters if masters is not None else RemainderMasters()
        masters.add(trained_bf16)
        attach(model, masters)
    report, filled = None, set()
    if hf_path is not None:
        report = load_weights(model, hf_path, progress=progress, masters=masters)
        filled = set(report["filled"])
    if init:
        init_parameters(model, seed, model.config.init_std, generator_device=generator_device or device,
                        skip=filled, masters=masters)
    return report
