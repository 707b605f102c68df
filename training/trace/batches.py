"""The micro-batches a trace runs: what the loader would hand this rank, with made-up tokens.

Each micro-batch is ``--micro-batch-size`` packs of ``--seq-length`` tokens, each pack one
document (every token but the last a target), built by the loader's own ``build_thd_batch`` (and
cut by ``data/cp_shard.shard_batch`` under context parallelism), so the host metadata a step reads
(target count, boundaries) comes as in a real run. Small host tensors: the model's ops turn them
into fake ones."""
from __future__ import annotations

import numpy as np

from data.cp_shard import shard_batch
from data.thd import build_thd_batch


class _Tokens:
    """An indexed dataset of made-up token ids (``get(doc, start, length)``)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def get(self, doc: int, start: int, length: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, length, dtype=np.int64)


def trace_batches(cfg, args, ps, num_microbatches: int) -> list:
    d = args.data
    text = _Tokens(cfg.vocab_size, args.schedule.seed)
    pack = np.array([[0, 0, d.seq_length]], dtype=np.int64)
    out = []
    for _ in range(num_microbatches):
        b = build_thd_batch([pack] * d.micro_batch_size, text, d.seq_length, pad_id=0)
        if ps.sizes.cp > 1:
            b = shard_batch(b, ps.sizes.cp, ps.cp_rank, cfg.num_mtp_layers)
        out.append(b)
    return out
