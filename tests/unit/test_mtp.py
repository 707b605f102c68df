"""Multi-token prediction as a building block (core/transformer/mtp.py): a family other than
Step-3.7 (here Qwen3-MoE, given two depths in this test only, no edit outside tests/) gets MTP
depths as extra blocks, their heads as heads, and losses equal to a by-hand computation of
depth k: the inputs and labels shifted by k inside each document, fed with depth k-1's hidden
state (the main model's last hidden state for k = 1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from core.transformer.attention_backends import DocLayout
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
from models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
from models.qwen3_moe.model import decoder_layer
from tests.unit.hf_reference import randomize
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for

LENGTHS = [5, 1, 7, 3]
DEPTHS = 2


class Qwen3WithMTP(Qwen3MoeModel):
    """The family's wiring only: which decoder block each depth runs (its last layer's kind)."""

    @property
    def embedding_on_last(self) -> bool:
        return True

    def build_extra(self, experts):
        cfg = self.config
        self.mtp = MultiTokenPrediction([
            MTPDepth(cfg.hidden_size, cfg.vocab_size, decoder_layer(cfg, cfg.num_layers - 1, experts), self.make_norm)
            for _ in range(DEPTHS)])


def _shift(t, fill):
    """``t`` moved one position left inside each document, ``fill`` at each document's end."""
    out, s = torch.full_like(t, fill), 0
    for n in LENGTHS:
        out[s:s + n - 1] = t[s + 1:s + n]
        s += n
    return out


def test_a_family_gets_mtp_from_core_with_losses_as_by_hand():
    cfg = Qwen3MoeConfig.from_hf(Qwen3MoeConfig.preset("qwen3-moe-tiny").to_hf())
    model = Qwen3WithMTP(cfg)
    randomize(model, 0)
    names = [n for n, _ in model.named_parameters() if n.startswith("mtp.")]
    assert {n.split(".")[2] for n in names} == {"enorm", "hnorm", "eh_proj", "block", "head_norm", "head"}
    assert [i for i, _ in model.blocks()][-DEPTHS:] == [-1, -2]
    assert {n for n, s in model.param_specs().items() if s.role == "head"} == \
        {"lm_head.weight", "mtp.0.head.weight", "mtp.1.head.weight"}

    tokens, pos, psp = thd(LENGTHS, vocab=cfg.vocab_size, seed=1)
    labels = labels_for(tokens, LENGTHS)
    last = {}
    model.layers[str(cfg.num_layers - 1)].register_forward_hook(lambda m, a, out: last.update(h=out[0]))
    with torch.no_grad():
        out = model(tokens, pos, psp, labels=labels)
        h, toks, labs, want, counts = last["h"], tokens, labels, [], []
        ropes = {k: r(pos, h.dtype) for k, r in model.rotary.items()}
        layout = DocLayout.from_params(psp)
        valid = layout.valid_mask(pos.device)
        for depth in model.mtp.values():
            toks, labs = _shift(toks, 0), _shift(labs, -100)
            x = depth.eh_proj(torch.cat([depth.enorm(model.embed_tokens(toks)), depth.hnorm(h)], dim=-1))
            h, _ = depth.block(x, ropes, layout, valid)
            logits = depth.head(depth.head_norm(h)).float()
            want.append(F.cross_entropy(logits, labs, ignore_index=-100, reduction="sum"))
            counts.append(int((labs != -100).sum()))
    # depth k's targets: k fewer per document (a document of n tokens has n - 1 - k)
    assert counts == [sum(max(n - 1 - k, 0) for n in LENGTHS) for k in range(1, DEPTHS + 1)]
    assert [int(n) for n in out.mtp_num_tokens] == counts
    # fp32, the same GEMMs: measured equal; 1e-5 relative leaves room for the loss's vocabulary
    # tiles (core/loss.py), which reorder the logsumexp's sums at larger shapes
    for got, ref in zip(out.mtp_loss_sums, want):
        assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref)), (got, ref)
