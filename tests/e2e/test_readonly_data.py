"""Training on a dataset whose directory is really read-only: a read-only bind mount in a
private mount namespace (``unshare -rm``), which stops root as well. Skipped where the machine
does not allow unprivileged namespaces; tests/unit/test_data_checks.py covers the same logic
with simulated EROFS errors everywhere."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from data.indexed_dataset import IndexedDatasetWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_only_mount_works(d) -> bool:
    probe = f"mount --bind -o ro {d} {d} && ! touch {d}/probe 2>/dev/null"
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_training_on_a_read_only_bind_mount(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    if not _read_only_mount_works(data):
        pytest.skip("no unprivileged mount namespaces here (unshare -rm)")
    rng = np.random.default_rng(0)
    prefix = str(data / "ro_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(40):
            w.add(rng.integers(0, 256, rng.integers(20, 90)))
    os.remove(prefix + ".meta.json")  # as from Megatron-LM: statistics must be computed too
    before = sorted(os.listdir(data))
    train = [sys.executable, "pretrain_step37.py", "--model-preset", "tiny", "--seq-length", "128",
             "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
             "--data-path", prefix, "--log-dir", str(tmp_path / "log")]
    script = f"mount --bind -o ro {data} {data} && exec {shlex.join(train)}"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Read-only file system" in out.stderr  # the fallback was taken, and said so
    rows = [json.loads(l) for l in open(tmp_path / "log" / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert sorted(os.listdir(data)) == before
    cached = os.listdir(tmp_path / "xdg" / "step37-trainer")
    assert any("_packplan_" in f for f in cached) and any(f.endswith(".meta.json") for f in cached)
