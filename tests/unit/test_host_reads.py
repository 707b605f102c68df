"""No host reads of tensor values (device syncs on a GPU) in a forward + backward of the model
with the local dispatcher; the counter itself catches each kind of read."""
from __future__ import annotations

import torch

from core.transformer.attention_backends import DocLayout
from models.step37 import Step37Model
from tests.distributed.parallel_cases import micro_batches, tiny_config
from tests.host_reads import HostReads, HostToDevice


def test_forward_and_backward_read_nothing_back_with_the_local_dispatcher():
    cfg = tiny_config()
    model = Step37Model(cfg)
    b = micro_batches(1, 1, cfg.vocab_size)[0][0]  # several documents, MTP, dense and MoE layers
    with HostReads() as h:
        out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
        (out.loss_sum + 0.3 * sum(out.mtp_loss_sums) + 0.01 * out.aux_loss).backward()
    assert h.reads == [], h.reads


def test_forward_and_backward_copy_nothing_host_to_device():
    """Once a micro-batch is on the device, nothing mid-forward comes from the host (the
    validity mask and the MTP shifts are derived on the device from its boundaries): model and
    batch on ``meta``, which stands in for the GPU here (bf16: grouped_mm's meta rule)."""
    cfg = tiny_config()
    with torch.device("meta"):
        model = Step37Model(cfg).bfloat16()
    b = micro_batches(1, 1, cfg.vocab_size)[0][0].to("meta")
    with HostToDevice() as h:
        out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
        (out.loss_sum + 0.3 * sum(out.mtp_loss_sums) + 0.01 * out.aux_loss).backward()
    assert h.copies == [], h.copies
    with HostToDevice() as h:  # the counter: boundaries left on the host are copied per use
        DocLayout.from_params(micro_batches(1, 1, cfg.vocab_size)[0][0].packed_seq_params).valid_mask("meta")
    assert h.copies and all("_to_copy" in op for op, _ in h.copies), h.copies


def test_the_counter_sees_every_kind_of_read():
    t = torch.arange(6.0, requires_grad=True)
    with HostReads() as h:
        t.sum().item(), int(t[0]), float(t[1]), bool(t[2] > 0), t.detach().tolist()
        t[t > 2].sum().backward()
        torch.nonzero(t), torch.bincount(t.long()), torch.repeat_interleave(t, torch.ones(6, dtype=torch.long))
        torch.repeat_interleave(t, torch.ones(6, dtype=torch.long), output_size=6)  # not a read
    kinds = [what for what, _ in h.reads]
    assert kinds.count("aten._local_scalar_dense.default") == 4
    assert "tolist" in kinds and "boolean mask indexing" in kinds and "aten.nonzero.default" in kinds
    assert "aten.bincount.default" in kinds and kinds.count("repeat_interleave without output_size") == 1
