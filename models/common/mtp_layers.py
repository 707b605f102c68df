"""How many multi-token-prediction layers a published checkpoint folder really holds.

DeepSeek-V3 and GLM-4.5 publish their MTP layers after the last decoder layer
(``model.layers.{num_hidden_layers + k}.*``) and say how many in ``num_nextn_predict_layers``.
transformers builds none, and its ``save_pretrained`` keeps the count but writes no such tensor,
so most re-saved checkpoints declare a layer they do not hold. A family reading such a folder
builds only the layers its weights hold: a depth started from seeded weights would send its
untrained loss into the trunk's gradients without a word."""
from __future__ import annotations

import os
import re


def mtp_layers_held(folder: str, num_layers: int, declared: int) -> int:
    """How many of the ``declared`` MTP layers (``model.layers.{num_layers + k}.*``, k from 0) the
    weights in ``folder`` hold; ``declared`` when the folder has no weights (a config alone)."""
    from core.checkpoint.hf import INDEX, SINGLE, CheckpointIndex

    if not declared or not any(os.path.exists(os.path.join(folder, f)) for f in (INDEX, SINGLE)):
        return declared
    layers = {int(m.group(1)) for m in (re.match(r"(?:model\.)?layers\.(\d+)\.", k)
                                        for k in CheckpointIndex(folder).file_of) if m}
    held = 0
    while held < declared and num_layers + held in layers:
        held += 1
    return held
