"""Checkpoint defects found by fault probes, each a test: keep-last after a rollback, a kill at
any point of a re-save, crafted and corrupted files, a disk that fills during a save. One
process, the tiny model, no process group (the save and load code paths are the trainer's)."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from core.checkpoint.sharded import CheckpointError, load_checkpoint, resolve, save_checkpoint
from models.step37 import Step37Config, Step37Model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def model(seed: int = 0) -> Step37Model:
    return Step37Model(Step37Config.preset("tiny"), seed=seed)


def save(d, iteration: int, m=None, keep_last: int = 0) -> str:
    return save_checkpoint(str(d), iteration, [m or model()], None, {"at": iteration},
                           {"model": Step37Config.preset("tiny").to_dict()}, keep_last)


def loaded_seed(d) -> int:
    """Which of the test's models (seed 1 or 2) the checkpoint that ``d`` resolves to holds."""
    m = model(seed=99)
    load_checkpoint(str(d), [m])
    for seed in (1, 2):
        if all(torch.equal(a, b) for a, b in zip(m.parameters(), model(seed).parameters())):
            return seed
    raise AssertionError("the checkpoint holds neither the old nor the new weights")


# ---------------------------------------------------------------- --keep-last
def test_keep_last_after_a_rollback_keeps_the_checkpoint_just_written(tmp_path):
    """An older run left iter 100 and 90; this run saves iter 4 with --keep-last 1. Before: the
    directories were sorted by name and iter_0000004 (just written, named by 'latest') was
    deleted, so the next resume failed."""
    save(tmp_path, 90)
    save(tmp_path, 100)
    with pytest.warns(UserWarning, match="later iterations"):
        save(tmp_path, 4, keep_last=1)
    assert resolve(str(tmp_path)).endswith("iter_0000004")
    assert load_checkpoint(str(tmp_path), [model()])[1] == {"at": 4}
    with pytest.warns(UserWarning):
        save(tmp_path, 8, keep_last=1)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("iter_")) == ["iter_0000008", "iter_0000100"]


def test_keep_last_counts_iterations_not_names(tmp_path):
    """iter_10000000 sorts before iter_9999999 by name; it is the newer one."""
    for it in (9_999_998, 9_999_999):
        os.makedirs(tmp_path / f"iter_{it:07d}")
        (tmp_path / f"iter_{it:07d}" / "meta.json").write_text('{"iteration": %d}' % it)
    save(tmp_path, 10_000_000, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_10000000", "iter_9999999", "latest"]


# ---------------------------------------------------------------- re-saving an iteration
class Killed(BaseException):
    """A kill -9 at this point: nothing after it runs, no cleanup."""


def _kill_at(monkeypatch, k: int) -> list:
    """From the ``k``-th file-system mutation (rename, rmtree, unlink) of the process on, every
    one raises ``Killed`` instead of happening: the process is dead (DCP turns the first into
    its own exception; whatever cleanup follows is not done either). Returns the call log."""
    calls = []
    for mod, name in ((os, "replace"), (os, "rename"), (os, "remove"), (os, "unlink"), (shutil, "rmtree")):
        real = getattr(mod, name)

        def fake(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            if len(calls) >= k:
                raise Killed(f"killed before {_name}{a[:1]}")
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, fake)
    return calls


def test_a_kill_at_any_point_of_a_resave_leaves_latest_on_a_complete_checkpoint(tmp_path, monkeypatch):
    """Re-saving iteration 2 (SIGTERM on a save-interval iteration, a relaunched finished run),
    killed before each file-system mutation in turn: 'latest' always resolves to a complete
    checkpoint holding the old or the new weights, and the next save repairs the directory.
    Before: the old iter_0000002 was removed, then the new one renamed in: a kill in between
    left 'latest' naming nothing."""
    old, new = model(1), model(2)
    k = 0
    while True:
        k += 1
        d = tmp_path / f"k{k}"
        save(d, 2, old)
        with monkeypatch.context() as mp:
            calls = _kill_at(mp, k)
            try:
                save(d, 2, new)
                finished = True
            except BaseException:  # Killed, or what a wrapper made of it: the process is gone
                finished = False
        assert loaded_seed(d) in ((1, 2) if not finished else (2,)), f"kill before mutation {k}"
        save(d, 2, new)  # the relaunch saves again: repairs whatever the kill left
        assert loaded_seed(d) == 2
        assert sorted(os.listdir(d)) == ["iter_0000002", "latest"], (k, os.listdir(d))
        if finished:
            break
    assert k > 3, calls  # the re-save went through several steps, each one killed once


# ---------------------------------------------------------------- reading untrusted files
def test_a_crafted_metadata_file_is_refused_not_run(tmp_path):
    """DCP's .metadata is a pickle; FileSystemReader unpickles it with pickle.load, so a crafted
    one ran its code on --load and convert_checkpoint.py export (it created this file)."""
    path = save(tmp_path / "ck", 2)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Exploit(), f)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused .*posix\.system"):
        load_checkpoint(str(tmp_path / "ck"), [model()])
    out = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", str(tmp_path / "ck"),
                          str(tmp_path / "hf"), "--tokenizer-type", "byte"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 1 and ".metadata: refused" in out.stderr, out.stderr
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated_distcp", "garbage_distcp", "garbage_extra",
                                    "garbage_meta", "meta_without_iteration", "missing_distcp"])
def test_a_damaged_file_is_a_checkpoint_error_naming_it(tmp_path, damage):
    """Before: EOFError, IndexError, JSONDecodeError, KeyError or DCP's CheckpointException (a
    BaseException that `except Exception` misses) with no file named."""
    path = save(tmp_path, 2)
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
    target = {"truncated_distcp": data, "garbage_distcp": data, "missing_distcp": data,
              "garbage_extra": os.path.join(path, "extra_rank0.pt"),
              "garbage_meta": os.path.join(path, "meta.json"),
              "meta_without_iteration": os.path.join(path, "meta.json")}[damage]
    if damage == "truncated_distcp":
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    elif damage == "missing_distcp":
        os.remove(target)
    elif damage == "meta_without_iteration":
        with open(target, "w") as f:
            f.write('{"model": {}}')
    else:  # same size, other bytes
        size = os.path.getsize(target)
        with open(target, "wb") as f:
            f.write(bytes((i * 7 + 3) % 251 for i in range(size)))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path), [model()])
    assert target in str(e.value), str(e.value)


def test_a_disk_that_fills_during_a_save_leaves_no_partial_checkpoint(tmp_path):
    """Writes past 200 kB fail with EFBIG (RLIMIT_FSIZE; SIGXFSZ ignored), as a full disk fails
    them with ENOSPC: the save raises CheckpointError naming the cause, its .tmp is removed and
    'latest' still names the previous checkpoint. Before: DCP's CheckpointException escaped
    and iter_N.tmp stayed behind."""
    save(tmp_path, 2)
    script = textwrap.dedent(f"""
        import resource, signal, warnings
        warnings.simplefilter("ignore")
        from core.checkpoint.sharded import CheckpointError, save_checkpoint
        from models.step37 import Step37Config, Step37Model
        m = Step37Model(Step37Config.preset("tiny"))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        try:
            save_checkpoint({str(tmp_path)!r}, 4, [m], None, {{}}, {{"model": {{}}}})
        except CheckpointError as e:
            print("CheckpointError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "CheckpointError:" in out.stdout and "iter_0000004.tmp" in out.stdout, out.stdout
    assert "File too large" in out.stdout, out.stdout
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]
    assert resolve(str(tmp_path)).endswith("iter_0000002")
