"""Building on meta and materialising (core/init.py, training/startup.py) and streaming a checkpoint
tensor into preallocated storage (core/hf_checkpoint.CheckpointIndex.read_into). Exact comparisons
throughout: values are drawn or copied, never summed."""
from __future__ import annotations

import resource

import pytest
import torch

from core.transformer.rotary import inverse_frequencies
from models.step37 import Step37Config, Step37Model
from core.checkpoint import hf as hf_weights
from core import init as mat
from training.startup import materialize
from core.checkpoint.hf import CheckpointIndex
from tests.distributed.startup_cases import reset_rss_peak


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 split (torch.chunk): ceil(n / world) rows per rank, the last ones short."""
    step = -(-n // world)
    return [(min(n, r * step), min(n, (r + 1) * step)) for r in range(world)]


def test_rows_of_any_split_equal_the_whole_tensor(monkeypatch):
    """A tensor of several seeded blocks: every shard drawn on its own equals its rows of the whole,
    for any number of shards (block edges and shard edges fall anywhere, shards may be empty)."""
    monkeypatch.setattr(mat, "INIT_BLOCK_NUMEL", 12)  # 2 rows of 5 per block: 12 blocks for 23 rows
    shape = (23, 5)
    whole = torch.empty(shape)
    mat.fill_seeded(whole, "w", shape, 0, 0.02, 7)
    assert not torch.equal(whole[0:2], whole[2:4])  # blocks draw from different generators
    for world in range(1, 7):
        for a, b in _chunks(23, world):
            part = torch.empty(b - a, 5)
            mat.fill_seeded(part, "w", shape, a, 0.02, 7)
            assert torch.equal(part, whole[a:b]), (world, a, b)


def test_expert_rows_are_keyed_by_the_global_expert():
    """Experts 4..7 held by EP rank 1 (offset 4), and expert 6 alone as an FSDP shard of them."""
    shape = (4, 3, 2)
    all_experts = torch.empty(8, 3, 2)
    mat.fill_seeded(all_experts, "layers.1.moe.experts.up_proj", (8, 3, 2), 0, 0.02, 0, expert_offset=0)
    mine = torch.empty(shape)
    mat.fill_seeded(mine, "layers.1.moe.experts.up_proj", shape, 0, 0.02, 0, expert_offset=4)
    one = torch.empty(1, 3, 2)
    mat.fill_seeded(one, "layers.1.moe.experts.up_proj", shape, 2, 0.02, 0, expert_offset=4)
    assert torch.equal(mine, all_experts[4:]) and torch.equal(one, all_experts[6:7])


def test_seed_gives_the_same_weights_as_before():
    """The seed -> weights contract (unchanged since the first release: one generator per tensor,
    or per expert, keyed by its global name); values printed from the CPU generator."""
    model = Step37Model(Step37Config.preset("tiny"), seed=0)
    q = model.layers["0"].self_attn.q_proj.weight[0, :3].tolist()
    up = model.layers["1"].moe.experts.up_proj[5, 0, :3].tolist()
    assert q == [0.009232273325324059, 0.05322129651904106, -0.0026338400784879923]
    assert up == [-0.02810286544263363, 0.00608527846634388, 0.010295240208506584]


def test_meta_build_then_materialize_is_the_direct_build():
    cfg = Step37Config.preset("tiny")
    direct = Step37Model(cfg, seed=3)
    with torch.device("meta"):
        model = Step37Model(cfg, seed=3)
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    materialize(model, "cpu", seed=3)
    for (n, a), (_, b) in zip(direct.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    for name, b in model.named_buffers():
        assert b.dtype == torch.float32, name
        if name.endswith("inv_freq"):  # recomputed after to_empty, fp32
            layer_type = name.split(".")[1]
            assert torch.equal(b, inverse_frequencies(cfg.head_dim, cfg.rope_parameters[layer_type]))
        else:
            assert name.endswith("e_score_correction_bias") and not b.any(), name
    norms = [p for n, p in model.named_parameters() if n in mat.constant_values(model)]
    assert norms and not any(p.any() for p in norms)  # RMSNorm scales by 1 + weight


def test_materialize_without_init_leaves_parameters_to_a_checkpoint():
    """``init=False`` (resuming): storage allocated, buffers set, no values drawn."""
    cfg = Step37Config.preset("tiny")
    with torch.device("meta"):
        model = Step37Model(cfg)
    calls = []
    orig = mat.fill_seeded
    try:
        mat.fill_seeded = lambda *a, **k: calls.append(a[1])
        materialize(model, "cpu", init=False)
    finally:
        mat.fill_seeded = orig
    assert calls == [] and not any(t.is_meta for t in model.parameters())
    assert torch.equal(model.rotary["full_attention"].inv_freq,
                       inverse_frequencies(cfg.head_dim, cfg.rope_parameters["full_attention"]))


def test_an_unknown_buffer_is_an_error():
    cfg = Step37Config.preset("tiny")
    with torch.device("meta"):
        model = Step37Model(cfg)
        model.layers["0"].register_buffer("scale", torch.ones(2))
    with pytest.raises(ValueError, match=r"buffer 'layers\.0\.scale': no initial value is known for it; "
                                         r"give DecoderBlock a reset_buffers\(device\) method"):
        materialize(model, "cpu")


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return CheckpointIndex(str(path))


def test_read_into_streams_rows_and_halves_in_blocks(tmp_path, monkeypatch):
    """Rows [a, b) of a bf16 tensor and one half of dim 1 of a fused [E, 2I, H] stack, read a few
    rows at a time (24-byte blocks) into fp32 storage."""
    monkeypatch.setattr(hf_weights, "READ_BLOCK_BYTES", 24)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(37, 3, generator=g).bfloat16()
    fused = torch.randn(6, 8, 4, generator=g).bfloat16()
    ckpt = _save(tmp_path, {"flat": flat, "fused": fused})
    out = torch.empty(20, 3)
    ckpt.read_into(out, "flat", None, 11)
    assert torch.equal(out, flat[11:31].float())
    for half, cols in (("gate", slice(0, 4)), ("up", slice(4, 8))):
        experts = torch.empty(3, 4, 4)
        ckpt.read_into(experts, "fused", half, 2)
        assert torch.equal(experts, fused[2:5, cols].float()), half


def test_read_into_holds_one_block_of_the_file_at_a_time(tmp_path):
    """Reading a 128 MiB bf16 tensor into fp32 storage raises the peak RSS by at most about one
    block: safetensors maps the file, and a single handle kept open for the whole tensor would add
    its 128 MiB of touched pages (the old whole-tensor read added those plus an fp32 copy)."""
    if not reset_rss_peak():
        pytest.skip("/proc/self/clear_refs is not writable here: the peak cannot be reset")
    rows, cols = 16384, 4096  # 64 Mi elements: 128 MiB in bf16, 256 MiB in fp32
    ckpt = _save(tmp_path, {"w": torch.ones(rows, cols, dtype=torch.bfloat16)})
    out = torch.zeros(rows, cols)  # the shard, allocated and touched before measuring
    ckpt.shape("w")
    with open("/proc/self/status") as f:
        base = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    reset_rss_peak()
    ckpt.read_into(out, "w")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert bool(out.eq(1).all())
    # one block of mapped pages (32 MiB) and one in flight; 16 MiB for the allocator and Python
    assert peak - base <= 2 * hf_weights.READ_BLOCK_BYTES + 16 * 2**20, (peak - base) / 2**20
