"""The chunked linear + cross-entropy (core/loss.py) against ``F.cross_entropy`` on full fp32
logits: loss, target count and both gradients, over random shapes, tiles and ignored labels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from core.loss import chunked_backward, chunked_forward, linear_cross_entropy, tile_shape
from core.costs.saved_bytes import SavedTensorBytes
from tests.host_reads import HostReads
from tests.unit.numerics import assert_close_rel


def _inputs(T, H, V, ignored, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)  # logits of a few units
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = -100
    return h, w, labels


def _reference(h, w, labels):
    """Today's loss on fp32 logits ([T, V] held), and its gradients in fp32."""
    h, w = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = F.cross_entropy(F.linear(h, w), labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _chunked(h, w, labels, rows, cols):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss, n = linear_cross_entropy(h, w, labels, rows=rows, cols=cols)
    (loss * 1.5).backward()  # a non-unit upstream gradient reaches both results
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    return loss.detach(), n, h.grad.float() / 1.5, w.grad.float() / 1.5


SHAPES = dict(T=st.integers(1, 40), H=st.integers(1, 24), V=st.integers(2, 70), rows=st.integers(1, 45),
              cols=st.integers(1, 75), ignored=st.sampled_from([0.0, 0.3, 0.7, 1.0]), seed=st.integers(0, 2 ** 16))


@settings(max_examples=60, deadline=None)
@given(**SHAPES)
@example(T=37, H=8, V=50, rows=5, cols=7, ignored=0.3, seed=1)    # both dimensions split unevenly
@example(T=12, H=4, V=9, rows=4, cols=9, ignored=1.0, seed=2)     # every label ignored
def test_fp32_equals_full_logits(T, H, V, rows, cols, ignored, seed):
    h, w, labels = _inputs(T, H, V, ignored, seed)
    if ignored == 0.3 and T >= 8:
        labels[:4] = -100  # a token block (rows <= 4) with no target at all
    ref_loss, ref_dh, ref_dw = _reference(h, w, labels)
    loss, n, dh, dw = _chunked(h, w, labels, rows, cols)
    assert n.dtype == torch.int64 and int(n) == int((labels != -100).sum())
    assert loss.dtype == torch.float32
    # fp32 throughout; tiles reorder the GEMM and logsumexp sums (online max, rescaled sums).
    # The loss relative to its size (targets x log V): measured <= 3.6e-7 over 2,000 examples;
    # 1e-5 leaves ~28x
    assert abs(loss - ref_loss) <= 1e-5 * _loss_scale(n, V)
    # gradients relative to the scale of what they sum: softmax - onehot of a confident target
    # is 1 - (1 - small), whose fp32 error is ~1e-7 absolute however small the entry (both
    # paths have it, rounded differently), so dh errs by ~1e-7 x |W| and dW by ~1e-7 x |h| even
    # where the gradient itself is tiny: measured <= 8.9e-7 of max(|ref|, |W| or |h|) over
    # 2,000 examples; 1e-5 leaves ~11x
    _close_or_zero(dh, ref_dh, 1e-5, w)
    _close_or_zero(dw, ref_dw, 1e-5, h)


def _loss_scale(n, V):
    return max(float(n), 1.0) * max(1.0, float(torch.log(torch.tensor(float(V)))))


def _close_or_zero(got, ref, rel, factor):
    """``max |got - ref| <= rel * max(max |ref|, max |factor|)`` (``factor``: the other operand
    of the gradient's sum); exactly zero where the reference is (no target)."""
    if ref.abs().max() > 0:
        scale = max(ref.abs().max().item(), factor.float().abs().max().item())
        diff = (got.float() - ref).abs().max().item()
        assert diff <= rel * scale, f"max |a - b| = {diff:.3g} > {rel:g} * {scale:.3g}"
    else:
        assert torch.count_nonzero(got) == 0


@settings(max_examples=30, deadline=None)
@given(**SHAPES)
def test_bf16_inputs_match_the_fp32_upcast_reference(T, H, V, rows, cols, ignored, seed):
    h, w, labels = _inputs(T, H, V, ignored, seed, torch.bfloat16)
    ref_loss, ref_dh, ref_dw = _reference(h, w, labels)  # the same bf16 values, upcast
    loss, n, dh, dw = _chunked(h, w, labels, rows, cols)
    assert loss.dtype == torch.float32
    # the logits are exact products of bf16 values summed in fp32, as the reference's: the loss
    # is fp32-close (tolerance as above; measured <= 3.1e-7)
    assert abs(loss - ref_loss) <= 1e-5 * _loss_scale(n, V)
    # gradients come back in bf16: rounding to 8 significant bits moves an entry by at most the
    # unit roundoff 2^-8 of itself, plus the fp32 error above (scaled as above): measured <=
    # 3.8e-3 over 500 examples; 2^-7 (twice the roundoff) leaves ~2x
    _close_or_zero(dh, ref_dh, 2 ** -7, w)
    _close_or_zero(dw, ref_dw, 2 ** -7, h)


def test_no_grad_gives_the_loss_without_a_graph():
    h, w, labels = _inputs(20, 8, 30, 0.3, 3)
    with torch.no_grad():
        loss, n = linear_cross_entropy(h.requires_grad_(), w, labels, rows=6, cols=11)
    assert not loss.requires_grad
    ref = F.cross_entropy(h.detach() @ w.t(), labels, ignore_index=-100, reduction="sum")
    assert abs(loss - ref) <= 1e-5 * _loss_scale(n, 30)  # fp32, tiles reorder the sums (as above)


def test_under_activation_checkpoint_gradients_equal_eager():
    """Non-reentrant checkpoint (what --recompute-granularity uses): the loss is rerun in the
    backward, with the same tiles, so the gradients are bitwise those of the eager run."""
    h, w, labels = _inputs(33, 8, 40, 0.3, 4)
    x = h.clone().requires_grad_()
    grads = []
    for wrap in (lambda f, *a: f(*a), lambda f, *a: checkpoint(f, *a, use_reentrant=False)):
        x.grad, wp = None, w.clone().requires_grad_()
        loss = wrap(lambda a, b: linear_cross_entropy(torch.tanh(a), b, labels, rows=7, cols=9)[0], x, wp)
        loss.backward()
        grads.append((x.grad, wp.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_backward_keeps_h_labels_and_logsumexp_only():
    """What autograd saves: the (non-leaf) hidden state, the labels and an fp32 [T] logsumexp;
    the weight is a parameter (left out); nothing of vocabulary size."""
    T, H, V = 64, 8, 96
    h, w, labels = _inputs(T, H, V, 0.3, 5)
    x = h.clone().requires_grad_()
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data.copy_(w)
    hidden = x * 1.0  # an activation, as the final norm's output is
    with SavedTensorBytes(head) as saved:
        linear_cross_entropy(hidden, head.weight, labels, rows=16, cols=32)
    assert saved.bytes == T * H * 4 + T * 8 + T * 4


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_of_tokens_by_vocabulary_is_made():
    """Every tensor the forward and backward make (their ops seen one by one) is at most one
    tile, dh, or dW: with T x V = 6144 here and the largest of those 768, a [T, V] would show."""
    T, H, V, rows, cols = 64, 8, 96, 16, 32
    h, w, labels = _inputs(T, H, V, 0.3, 6)
    with _Largest() as seen:
        loss, lse = chunked_forward(h, w, labels, rows, cols)
        chunked_backward(torch.tensor(1.0), h, w, labels, lse, rows, cols)
    assert seen.numel == max(rows * cols, T * H, V * H) == 768 < T * V


def test_no_host_reads_in_forward_or_backward():
    """The loops' bounds come from shapes; no value is read back (a device sync on a GPU). The
    passes are called directly: inside the custom op a dispatch mode would not see them."""
    h, w, labels = _inputs(30, 8, 40, 0.3, 7)
    with HostReads() as reads:
        loss, lse = chunked_forward(h, w, labels, 7, 9)
        chunked_backward(torch.tensor(1.0), h, w, labels, lse, 7, 9)
    assert reads.reads == []


def test_tile_shape_for_step37_flash():
    # H 4096: fp32 [cols, 4096] <= 128 MiB gives cols 8192; fp32 [rows, 8192] <= 128 MiB gives
    # rows 4096 (T = 32768: 8 token blocks, 16 vocabulary blocks of 128,896)
    assert tile_shape(32768, 128896, 4096) == (4096, 8192)
    # Qwen3-30B-A3B (H 2048, vocab 151,936): 16384 columns, 2048 rows
    assert tile_shape(32768, 151936, 2048) == (2048, 16384)
    # a tiny model: one tile covers everything
    assert tile_shape(256, 320, 64) == (256, 320)
