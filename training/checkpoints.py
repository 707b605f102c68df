"""The trainer's side of checkpoints: what a save records, resuming or fine-tuning from one
(``--load``, ``--finetune``, ``--no-load-optim``, ``--no-load-rng``), and the ``--async-save`` in
flight. The files themselves are ``core/checkpoint/sharded.py``'s business."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass

import torch.distributed as dist

from core.checkpoint.sharded import (RUNTIME_FIELDS, CheckpointError, _short, begin_save, compare_model_config,
                                finish_save, load_checkpoint, read_meta, resolve)
from core.finetune.freeze import PARTS
from core.finetune.lora import base_fingerprint
from models import registry


@dataclass(frozen=True)
class MustMatch:
    """A run setting that a load from a checkpoint must match: the flag(s) that set it, where
    ``meta.json`` records it, when it applies (``always``: every load, the tensors would not fit;
    ``resume``: not under ``--finetune``, a new run from the weights, which is warned instead;
    ``optimizer``: only when the optimizer state is restored) and what to do."""

    flag: str
    path: tuple
    scope: str
    fix: str


_LORA_FIX = "resume with the checkpoint's LoRA flags"
# The one list of what a resume compares (resume_mismatches reads it; the tests are generated from it).
# Not here: the model family (what the rest means), a LoRA base's identity (check_lora_base: not a
# flag's value but the weights it loaded), the data (the loader's fingerprint, data/loader.py) and the
# LR schedule (may change on a resume, e.g. a longer run: warned, RunCheckpoints._check_schedule).
RESUME_MUST_MATCH = (
    MustMatch("--model-preset / --hf-config", ("model",), "resume",
              "resume with the checkpoint's model flags, or start a new run from its weights with --finetune"),
    MustMatch("--lora-rank", ("lora", "rank"), "always", _LORA_FIX),
    MustMatch("--lora-targets", ("lora", "targets"), "always", _LORA_FIX),
    MustMatch("--lora-alpha", ("lora", "alpha"), "resume", _LORA_FIX + ", or start a new run from them with --finetune"),
    MustMatch("--lora-dropout", ("lora", "dropout"), "resume", _LORA_FIX + ", or start a new run from them with --finetune"),
    *(MustMatch(f"--freeze-{part}", ("freeze", part), "optimizer",
                "the optimizer state is the trained parameters': resume with the checkpoint's --freeze-* flags, or "
                "pass --no-load-optim to start the optimizer afresh") for part in PARTS),
    MustMatch("--optimizer", ("optimizer",), "optimizer", "pass --no-load-optim to start the optimizer afresh"),
)
_ABSENT = object()


def _at(meta: dict, path: tuple):
    for key in path:
        if not isinstance(meta, dict) or key not in meta or meta[key] is None:
            return _ABSENT
        meta = meta[key]
    return meta


def _differs(saved, run) -> str:
    """"checkpoint X, this run Y" ("" when equal); model configs field by field."""
    if isinstance(saved, dict) and isinstance(run, dict):
        return "; ".join(compare_model_config(saved, run))
    return "" if saved == run else f"checkpoint {_short(saved)}, this run {_short(run)}"


def resume_mismatches(saved: dict, run: dict, *, finetune: bool, load_optim: bool) -> tuple[list[str], list[str]]:
    """``(refused, warned)``: ``"FLAG: checkpoint X, this run Y (what to do)"`` for every entry of
    ``RESUME_MUST_MATCH`` on which the checkpoint's ``meta.json`` (``saved``) and this run's
    (``run``) differ; an entry absent on either side (an older checkpoint, a run without LoRA) is
    not compared. Under ``--finetune`` a ``resume`` entry is warned about, an ``optimizer`` one
    (also under ``--no-load-optim``) not compared."""
    refused, warned = [], []
    for m in RESUME_MUST_MATCH:
        a, b = _at(saved, m.path), _at(run, m.path)
        diff = "" if a is _ABSENT or b is _ABSENT else _differs(a, b)
        if not diff:
            continue
        if m.scope == "always" or (m.scope == "resume" and not finetune) or \
                (m.scope == "optimizer" and load_optim and not finetune):
            refused.append(f"{m.flag}: {diff} ({m.fix})")
        elif m.scope == "resume":
            warned.append(f"{m.flag}: {diff}")
    return refused, warned


def run_flags_record(args) -> dict:
    """What ``meta.json`` records of the run's flags for ``RESUME_MUST_MATCH`` beside the model
    config and the LoRA record: the optimizer and the frozen parts."""
    frozen = set(getattr(args.model, "frozen_parts", ()))
    return {"optimizer": args.optim.optimizer, "freeze": {part: part in frozen for part in PARTS}}


def schedule_record(args) -> dict:
    """The learning-rate schedule as resolved for this run (stored in ``meta.json``)."""
    s, o = args.schedule, args.optim
    return {"lr": o.lr, "min_lr": o.min_lr, "adamw_lr": o.adamw_lr, "lr_decay_style": s.lr_decay_style,
            "lr_decay_iters": s.decay_iters, "lr_warmup_iters": s.warmup_iters,
            "lr_wsd_decay_iters": s.lr_wsd_decay_iters}


def checkpoint_family(meta: dict) -> str:
    """The model family a checkpoint holds (``registry.LEGACY_FAMILY`` for checkpoints written
    before families were recorded)."""
    return meta.get("family") or registry.LEGACY_FAMILY


def checkpoint_model(path: str, meta: dict):
    """``(family spec, model config)`` the checkpoint at ``path`` (its ``meta``) was saved with;
    a ``CheckpointError`` naming its meta.json when the config does not build."""
    spec = registry.spec(checkpoint_family(meta))
    try:
        return spec, spec.config_class(**meta["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, 'meta.json')}: no usable {spec.family} model config "
                              f"({type(e).__name__}: {e})") from e


def lora_record(args, cfg, chunks, pstate) -> dict | None:
    """What a LoRA run's checkpoints record of it (``meta.json``'s ``lora``): the adapters'
    settings and the identity of the frozen base (``--load-hf`` path or the seed, a fingerprint
    of its model config and one of its weights, ``core.finetune.lora.base_fingerprint``); None without
    LoRA. Collective (the weights' fingerprint)."""
    lora = getattr(args, "lora", None)
    if lora is None or not lora.enabled:
        return None
    return lora_meta(lora, cfg, chunks, pstate, args.model.load_hf, args.schedule.seed)


def lora_meta(lora, cfg, chunks, pstate, load_hf: str | None, seed: int) -> dict:
    """``meta.json``'s ``lora`` for ``LoraSettings`` ``lora`` on the base ``load_hf`` (or seeded
    from ``seed``) that ``chunks`` hold."""
    model = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_FIELDS}
    return {"rank": lora.lora_rank, "alpha": lora.alpha, "dropout": lora.lora_dropout, "targets": list(lora.targets),
            "base": {"load_hf": load_hf, "seed": None if load_hf else seed,
                     "config_sha256": hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16],
                     "weights_fingerprint": base_fingerprint(chunks, pstate)}}


def check_lora_base(path: str, saved: dict | None, run: dict | None) -> None:
    """A LoRA checkpoint resumes only as a LoRA run, onto its own base (its flags: ``RESUME_MUST_MATCH``)."""
    if saved is None and run is None:
        return
    if saved is None:
        raise CheckpointError(f"--load {path}: not a LoRA checkpoint (it holds every weight); this run trains "
                              "adapters (--lora-rank): drop --lora-rank to resume it")
    if run is None:
        raise CheckpointError(f"--load {path}: a LoRA checkpoint (adapters of rank {saved['rank']} only, on the "
                              f"base {saved['base']['load_hf'] or 'seeded'}); resume it with --lora-rank "
                              f"{saved['rank']} --lora-alpha {saved['alpha']:g} --lora-targets "
                              f"{','.join(saved['targets'])} and --load-hf of that base")
    sb, rb = saved["base"], run["base"]
    for key, what in (("config_sha256", "model config"), ("weights_fingerprint", "weights")):
        if sb[key] != rb[key]:
            raise CheckpointError(
                f"--load {path}: its adapters were trained on another base: the {what} differ (checkpoint "
                f"{sb[key]} from {sb['load_hf'] or 'seed ' + str(sb['seed'])}, this run {rb[key]} from "
                f"{rb['load_hf'] or 'seed ' + str(rb['seed'])}); pass --load-hf of the base it was trained on")


@dataclass
class Resumed:
    path: str
    iteration: int
    extra: dict  # this rank's loader position, RNG, skipped steps (empty when fine-tuning)
    note: str = ""  # "resumed from ...": logged by the caller once it accepts the data position


class RunCheckpoints:
    """Collective methods: every rank calls them in the same order."""

    def __init__(self, args, log):
        self.args, self.log = args, log
        self.pending = None          # an --async-save still being written
        self.saved_iteration = None  # the last iteration saved by this run
        self.async_group = None
        ck = args.checkpoint
        if ck.save and ck.async_save and dist.is_initialized():
            # DCP's background thread runs its own collectives: a group of their own, on gloo,
            # so they never interleave with the training's on the same communicator
            minutes = args.parallel.distributed_timeout_minutes
            self.async_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))

    # ------------------------------------------------------------------ saving
    def save(self, iteration: int, chunks, optimizer, extra: dict, meta: dict) -> None:
        ck = self.args.checkpoint
        self.wait()  # one save in flight at a time
        pending = begin_save(ck.save, iteration, chunks, optimizer, extra, meta, ck.keep_last,
                             async_group=self.async_group)
        self.saved_iteration = iteration
        if self.async_group is None:
            self._finish(pending)
        else:
            self.pending = pending
            self.log.info(f"checkpoint of iteration {iteration}: writing in the background")

    def busy(self) -> bool:
        """This rank's part of the asynchronous save is still being written."""
        return self.pending is not None and not self.pending.done()

    def poll(self, any_rank_busy: bool) -> None:
        """Publish the asynchronous save once no rank is writing (``any_rank_busy``: reduced)."""
        if self.pending is not None and not any_rank_busy:
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and publish it."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(pending)

    def _finish(self, pending) -> None:
        self.log.info(f"saved checkpoint {finish_save(pending)}")

    # ------------------------------------------------------------------ loading
    def resume(self, run: dict, chunks, optimizer) -> Resumed | None:
        """Fill ``chunks`` (and the optimizer, unless told not to) from ``--load``; None when
        there is nothing to load yet. ``run``: what this run's checkpoints record (``meta.json``:
        its family, model config, flags and ``lora_record``), compared with the checkpoint's
        (``RESUME_MUST_MATCH``; a LoRA checkpoint resumes only onto the base it was trained on)."""
        ck = self.args.checkpoint
        if not ck.load:
            return None
        try:
            path = resolve(ck.load)
        except CheckpointError as e:
            if ck.finetune or os.path.exists(os.path.join(ck.load, "latest")):
                raise
            self.log.info(f"no checkpoint in {ck.load} yet: starting from scratch ({e})")
            return None
        meta = read_meta(path)
        if not isinstance(meta.get("model"), dict):
            raise CheckpointError(f"{os.path.join(path, 'meta.json')}: no model config (\"model\")")
        saved_family, family = checkpoint_family(meta), run["family"]
        if saved_family != family:
            raise CheckpointError(f"--load {path}: a {saved_family} checkpoint; this run trains a {family} "
                                  "model (--model-preset / --hf-config). A checkpoint loads only into its own "
                                  "model family")
        check_lora_base(path, meta.get("lora"), run.get("lora"))
        restore_optim = ck.load_optim and not ck.finetune
        refused, warned = resume_mismatches(meta, run, finetune=ck.finetune, load_optim=ck.load_optim)
        if refused:
            raise CheckpointError(f"--load {path}: saved with other flags than this run's: {'; '.join(refused)}")
        for diff in warned:
            self.log.warning(f"--finetune: this run differs from the checkpoint: {diff}")
        _, extra = load_checkpoint(path, chunks, optimizer if restore_optim else None)
        if ck.finetune:
            self.log.info(f"--finetune: weights of {path} (iteration {meta['iteration']}); starting at "
                          "iteration 0 with a fresh optimizer, data position and RNG")
            return Resumed(path, 0, {})
        self._check_schedule(meta.get("schedule"))
        if not ck.load_rng:
            extra.pop("rng", None)
        kept = [what for what, on in (("optimizer", restore_optim), ("RNG", ck.load_rng)) if not on]
        return Resumed(path, meta["iteration"], extra, f"resumed from {path} at iteration {meta['iteration']}"
                       + (f" (fresh {' and '.join(kept)})" if kept else ""))

    def _check_schedule(self, saved: dict | None) -> None:
        """Warn when the resumed run's LR schedule is not the one the checkpoint followed."""
        if not saved:
            return
        now = schedule_record(self.args)
        diffs = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
        if not diffs:
            return
        hint = ""
        if "lr_decay_iters" in (d.split()[0] for d in diffs) and self.args.schedule.lr_decay_iters is None:
            hint = (f" (--lr-decay-iters defaults to --train-iters: pass --lr-decay-iters "
                    f"{saved['lr_decay_iters']} to keep the checkpoint's schedule)")
        self.log.warning(f"the learning-rate schedule differs from the checkpoint's: "
                         f"{', '.join(diffs)}{hint}")


def lora_model(spec, cfg, lora: dict, base: str | None, path: str):
    """The model of a LoRA checkpoint: its base (``base``, else the --load-hf it trained on, else
    the seeded weights), checked against the recorded fingerprint, with empty adapters for the
    checkpoint to fill."""
    from core.finetune.lora import LoraSettings, apply_lora

    recorded = lora["base"]
    if base and not os.path.isdir(base):
        raise ValueError(f"--base {base}: no such directory (the Hugging Face checkpoint {path}'s adapters were "
                         "trained on)")
    if not base and recorded["load_hf"] and not os.path.isdir(recorded["load_hf"]):
        raise ValueError(f"{path}: its recorded LoRA base {recorded['load_hf']} (the --load-hf it trained on, in "
                         "meta.json) no longer exists: pass --base DIR with that base's Hugging Face checkpoint")
    base = base or recorded["load_hf"]
    model = spec.build(cfg, seed=recorded["seed"] or 0) if not base else spec.build(cfg)
    apply_lora(model, LoraSettings(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                   lora_targets=",".join(lora["targets"])))
    if base:
        model.load_hf(base)
    fingerprint = base_fingerprint([model])
    if fingerprint != recorded["weights_fingerprint"]:
        raise ValueError(f"{path}: its adapters were trained on another base (weights fingerprint "
                         f"{recorded['weights_fingerprint']}, {base or 'the seeded weights'}: {fingerprint}); "
                         "pass --base with the base it was trained on")
    return model
