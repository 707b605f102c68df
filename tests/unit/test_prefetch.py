"""--num-workers: micro-batches built ahead by DataLoader workers (data/prefetch.py) are the
training thread's, bit for bit, in order, across a resume; a worker's error is the training
thread's error; a killed worker ends the stream with one line naming it, within the timeout.
Image + text data (tests/fixtures/step3p7_processor: tiny images) blended with text-only data."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch

from core.batch_copy import DeviceBatches, pin, tensors_of
from data.indexed_dataset import DatasetError, IndexedDataset
from data.loader import THDLoader, open_source
from data.prefetch import LoaderWorkerError, MicroBatchFeed
from models.registry import image_processor_from_settings
from tests.unit.test_vlm_data import SHAPES, draw, good_rows, preprocess, write_jsonl

SEQ = 128


@pytest.fixture(scope="module")
def image_prefix(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch")
    for name, (w, h, c, fmt) in SHAPES.items():
        (d / name).write_bytes(draw(w, h, c, fmt))
    return preprocess([write_jsonl(d / "rows.jsonl", good_rows() * 2)], d / "img" / "o")


def _loader(prefix, **kw):
    src = open_source(prefix, SEQ, "split", 0, image_processor=image_processor_from_settings)
    return THDLoader([(1.0, src)], seq_length=SEQ, micro_batch_size=2, pad_id=0, **kw)


def _flat(batch) -> list:
    """Every field of a batch's tree: tensors (dtype and values) and host values."""
    out = []
    for t in tensors_of(batch):
        out.append((t.dtype, t.shape, t.view(-1).view(torch.uint8) if t.numel() else t))
    p = batch.packed_seq_params
    out += [p.host_boundaries(), p.max_seqlen]
    if batch.images is not None:
        out.append(batch.images.num_local_patches)
    return out


def _same(a, b) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        (x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])) if isinstance(x, tuple) and len(x) == 3
        and isinstance(x[2], torch.Tensor) else x == y for x, y in zip(fa, fb))


def test_workers_give_the_training_threads_batches_in_order_and_resume_exactly(image_prefix):
    """N = 0 and N = 2 (bf16 pixels): the same micro-batches, bit for bit, images included; a
    loader state saved after 3 micro-batches, loaded into a new loader with workers, continues
    with the uninterrupted run's; starting the workers draws nothing from torch's global RNG."""
    ref = [b for _, b in zip(range(7), MicroBatchFeed(_loader(image_prefix, pixel_dtype=torch.bfloat16), 0))]
    assert sum(b.images is not None for b in ref) >= 3
    plain = _loader(image_prefix).micro_batch(1)  # bf16 pixels: the fp32 ones, cast (the tower's own cast)
    assert torch.equal(ref[1].images.pixel_values, plain.images.pixel_values.to(torch.bfloat16))
    rng = torch.get_rng_state()
    first = _loader(image_prefix, pixel_dtype=torch.bfloat16)
    feed = MicroBatchFeed(first, 2)
    got = [next(feed) for _ in range(3)]
    state = first.state_dict()
    got += [next(feed) for _ in range(4)]
    feed.close()
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(_same(a, b) for a, b in zip(ref, got)) and first.consumed == 7
    resumed = _loader(image_prefix, pixel_dtype=torch.bfloat16)
    resumed.load_state_dict(state)
    feed = MicroBatchFeed(resumed, 2)
    after = [next(feed) for _ in range(2)]
    resumed.consumed = 5  # a moved position restarts the workers there
    after += [next(feed) for _ in range(2)]
    feed.close()
    assert all(_same(a, b) for a, b in zip(ref[3:5] + ref[5:7], after))


def test_evaluation_reads_the_same_batches_through_the_workers(image_prefix):
    """training.evaluate with --num-workers 2: the validation micro-batches come through the
    workers over the evaluation's range (the feed ends there), the same ones as built here: the
    same loss bit for bit; the loader's position is left as it was."""
    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings
    from models.step37 import Step37Config, Step37Model
    from training.evaluate import evaluate

    loader = _loader(image_prefix)
    feed = MicroBatchFeed(loader, 2, end=3)
    assert len(list(feed)) == 3 and loader.consumed == 3  # a bounded feed stops at its end
    assert any(loader.micro_batch(m).images is not None for m in range(2))  # what the evaluation reads
    feed.close()
    cfg = Step37Config.preset("step37-tiny-vlm")
    model = Step37Model(cfg, seed=0)
    ps, s = ParallelState(ParallelSizes(1), 0, {}), StepSettings(hidden_size=cfg.hidden_size, mtp_depths=cfg.num_mtp_layers)
    here, workers = (evaluate([model], ps, loader, 2, 1, s, num_workers=n) for n in (0, 2))
    assert here["valid_loss"] == workers["valid_loss"] and here["valid_targets"] == workers["valid_targets"] > 0
    assert loader.consumed == 3


def test_an_error_in_a_worker_is_the_training_threads_error(image_prefix, tmp_path):
    """A damaged image read by a worker stops the stream with the error --num-workers 0 gives
    (naming the images file, the image and its document), not torch's wrapped traceback."""
    for suffix in (".bin", ".idx", ".meta.json"):  # a copy of the dataset whose image 0 is damaged
        for name in ("text", "loss_mask", "images", "image_index"):
            src = image_prefix.replace("_text_document", f"_{name}_document") + suffix
            if os.path.exists(src):
                (tmp_path / os.path.basename(src)).write_bytes(open(src, "rb").read())
    prefix = str(tmp_path / os.path.basename(image_prefix))
    images = IndexedDataset(prefix.replace("_text_", "_images_"))
    at = int(images.pointers[0]) + int(images.lengths[0]) // 2
    with open(images.prefix + ".bin", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    errors = []
    for n in (2, 0):
        with pytest.raises(DatasetError) as e:
            feed = MicroBatchFeed(_loader(prefix), n)
            for _ in range(8):
                next(feed)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "\n" not in errors[0]
    assert "_images_document" in errors[0] and "document" in errors[0], errors[0]


def test_a_killed_worker_ends_the_stream_with_one_line_naming_it(image_prefix):
    """Found at the next micro-batch asked for (or by torch's 5 s liveness check while waiting),
    within the timeout, as one line; never raised asynchronously (torch's SIGCHLD handler does
    not know the workers: the sleep gives it the chance to misbehave)."""
    loader = _loader(image_prefix)
    feed = MicroBatchFeed(loader, 2, timeout=20)
    next(feed)
    pid = feed.worker_pids()[1]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)  # the worker is gone and SIGCHLD delivered before the next micro-batch is asked for
    with pytest.raises(LoaderWorkerError) as e:
        for _ in range(1000):
            next(feed)
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "\n" not in msg and f"worker 1 (pid {pid}, killed by SIGKILL)" in msg and "--num-workers 2" in msg, msg
    assert feed.worker_pids() == []  # the others were stopped


def test_pinning_and_device_copies_on_the_cpu_are_plain_copies(image_prefix):
    """Without CUDA, pinning is a no-op (the same object) and DeviceBatches is ``.to(device)``;
    the tree walk reaches every tensor (CUDA's side-stream copies: tests/gpu)."""
    b = _loader(image_prefix).micro_batch(1)
    assert b.images is not None
    if not torch.cuda.is_available():
        assert pin(b) is b and b.pin_memory() is b
    on = DeviceBatches([b], "cpu")
    assert len(on) == 1 and _same(on.get(0), b)
    n = len(tensors_of(b))
    assert n == 3 + 2 + 3  # tokens, labels, positions; cu_seqlens x 2; pixels, crops, positions
    doubled = dataclasses.replace(b, tokens=b.tokens * 2)
    assert not _same(doubled, b) and np.array_equal(doubled.tokens.numpy(), 2 * b.tokens.numpy())


def test_a_step_that_waits_for_data_over_5_percent_warns_naming_the_loader():
    """Trainer._warn_data_wait on a logged step: over 5% of the step warns, naming the loader
    and its flag; under it, or on the run's first step (the workers start there), does not."""
    from types import SimpleNamespace

    from training.trainer import Trainer

    said = []
    for workers in (2, 0):
        t = SimpleNamespace(iteration=5, start_iteration=0, args=SimpleNamespace(data=SimpleNamespace(
            num_workers=workers)), log=SimpleNamespace(warning=said.append))
        Trainer._warn_data_wait(t, {"data_wait_s": 0.04, "step_ms": 1000.0})  # 4%: quiet
        Trainer._warn_data_wait(t, {"data_wait_s": 0.08, "step_ms": 1000.0})
        t.iteration = 1
        Trainer._warn_data_wait(t, {"data_wait_s": 0.5, "step_ms": 1000.0})  # the first step: quiet
    assert len(said) == 2, said
    assert "data loader" in said[0] and "8%" in said[0] and "--num-workers 2" in said[0]
    assert "--num-workers 0 builds micro-batches on the training thread" in said[1]
