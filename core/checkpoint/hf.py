"""Hugging Face safetensors checkpoints <-> a model chunk, read lazily tensor by tensor, through
the family's weight adapter (published names both ways; ``models/<family>/weights.py``).

A chunk gives ``chunk.hf_weights`` (the adapter, bound to its config), ``param_specs()`` and its
named parameters and persistent buffers (``core/model_api.py``). The adapter says, for each of our
names, which checkpoint tensors can supply it (:class:`Source`, first match wins): a tensor whole,
one half of dim 1 of a fused tensor (``gate_up_proj``), or one tensor per expert stacked on dim 0
(``...experts.{e}.gate_proj.weight``). Only tensors this chunk (or pipeline stage) owns are read,
and of those only the rows this process holds: expert stacks are sliced to the experts a rank
holds (``ParamSpec.expert_offset``), FSDP shards to their dim-0 rows. A load streams into the
model's own storage block by block (:meth:`CheckpointIndex.read_into`), so no whole tensor or
model passes through host memory.

FP8 checkpoints (DeepSeek-V3's and Kimi-K2's on the Hub): a ``float8_e4m3fn`` weight ``W`` comes
with ``W_scale_inv`` (``...weight_scale_inv``), one fp32 factor per block of
``quantization_config.weight_block_size`` (read from the checkpoint's config.json, never
assumed) rows x columns, the last blocks cut at the edges. Each block of rows read is dequantized
in fp32, ``W.float() * scale_inv`` with the factors repeated over their blocks, then converted to
the parameter's dtype, so the import streams as any other. A float8 weight without its scale, or
without a block size in config.json, is refused by name; the scales are not unexpected tensors.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from core.init import local_rows
from core.model_api import persistent_tensors

READ_BLOCK_BYTES = 32 << 20  # bytes of a checkpoint tensor read (and converted) at a time
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
READ_DTYPES = ("F32", "BF16", "F16")  # converted to the parameter's dtype on the copy
FP8_DTYPES = ("F8_E4M3",)  # block-scaled: dequantized with their scales (module docstring)
SCALE_SUFFIX = "_scale_inv"  # W -> W_scale_inv: "...weight" -> "...weight_scale_inv"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Source:
    """A checkpoint tensor that supplies one of our parameters: ``name`` whole, one ``half``
    ("gate" / "up") of its dim 1, or, when ``name`` holds ``{e}``, one tensor per expert
    (global index ``e``) stacked on dim 0."""

    name: str
    half: str | None = None

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.name

    def first(self, offset: int = 0) -> str:
        return self.name.format(e=offset) if self.per_expert else self.name


@dataclass
class Exported:
    """What an adapter's ``export`` gives to write: tensors of the main checkpoint, tensors for
    side files (name -> tensors), the ``config.json`` dict and the layout's name."""

    tensors: dict
    config_json: dict
    layout: str
    side_files: dict = field(default_factory=dict)


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read as it should; the message names the file (and the
    tensor) and what to do."""


def open_file(path: str):
    """``safe_open(path)``, a failure named with the file (truncated, not safetensors...)."""
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except Exception as e:  # safetensors' own error type, OSError
        raise CheckpointFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                                  "re-download or re-export it") from e


def _weight_map(path: str) -> dict:
    """Tensor name -> file of a single-file or sharded checkpoint; a stale or broken layout is
    an error naming the file."""
    index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFileError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from e
        files = set(weight_map.values())
        if os.path.exists(single) and SINGLE not in files:
            raise CheckpointFileError(f"{path}: holds both {INDEX} (naming {len(files)} shard files) and {SINGLE}, "
                                      "which the index does not name: one is stale from an earlier export; remove "
                                      "it, or export into an empty directory")
        absent = sorted(f for f in files if not os.path.exists(os.path.join(path, f)))
        if absent:
            raise CheckpointFileError(f"{index} names {absent[:3]}, not in {path}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.exists(single):
        with open_file(single) as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX}")


def fp8_block_size(path: str) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of an fp8 checkpoint's config.json (rows,
    columns), or None: no config.json, no fp8 quantization, no block size."""
    f = os.path.join(path, "config.json")
    try:
        with open(f, encoding="utf-8") as fh:
            q = json.load(fh).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return None  # no (readable) config: the config reader names that on its own
    block = q.get("weight_block_size")
    if q.get("quant_method", "fp8") != "fp8" or block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointFileError(f"{f}: quantization_config.weight_block_size {block!r} is not [rows, columns] "
                                  "of positive ints")
    return tuple(block)


class CheckpointIndex:
    """Tensor name -> file for a single-file or sharded safetensors checkpoint (+ side files)."""

    def __init__(self, path: str, side_files: tuple = ()):
        self.path = path
        self.fp8_block = fp8_block_size(path)
        self.file_of = _weight_map(path)
        for name in side_files:
            extra = os.path.join(path, name)
            if os.path.exists(extra):
                with open_file(extra) as f:
                    self.file_of.update({k: extra for k in f.keys()})
        self._open: dict = {}

    def handle(self, name: str):
        f = self.file_of[name]
        if f not in self._open:
            self._open[f] = open_file(f)
        return self._open[f]

    def slice(self, name: str):
        try:
            return self.handle(name).get_slice(name)
        except CheckpointFileError:
            raise
        except Exception as e:
            where = f" ({INDEX} says it does)" if os.path.basename(self.file_of[name]) != SINGLE else ""
            raise CheckpointFileError(f"{self.file_of[name]}: cannot read tensor {name}{where} "
                                      f"({type(e).__name__}: {e})") from e

    def shape(self, name: str) -> list[int]:
        return list(self.slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors' dtype name: F32, BF16, F16, F8_E4M3, I64, BOOL..."""
        return self.slice(name).get_dtype()

    def read(self, name: str, half: str | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A tensor, optionally rows ``[a, b)`` of dim 0 and one half of dim 1, read lazily."""
        return _rows(self.slice(name), half, *(rows or (0, None)))

    def read_into(self, out: torch.Tensor, name: str, half: str | None = None, first_row: int = 0) -> None:
        """Copy rows ``[first_row, first_row + len(out))`` of ``name`` (one half of dim 1 with
        ``half``) into ``out`` (any device and dtype), ``READ_BLOCK_BYTES`` of the file at a
        time, each block through a handle of its own: safetensors maps the file, and the pages a
        read touched count as this process's memory until the mapping is closed."""
        path = self.file_of[name]
        try:
            if out.dim() == 0:
                with open_file(path) as f:
                    out.copy_(f.get_tensor(name))
                return
            dtype = self.dtype(name)
            fp8 = dtype in FP8_DTYPES and self._check_fp8(name)
            row_bytes = max(1, out[0].numel()) * _DTYPE_BYTES.get(dtype, 4)
            step = max(1, READ_BLOCK_BYTES // row_bytes)
            for i in range(0, out.shape[0], step):
                j = min(out.shape[0], i + step)
                with open_file(path) as f:
                    rows = _rows(f.get_slice(name), half, first_row + i, first_row + j)
                out[i:j].copy_(self._dequantized(rows, name, half, first_row + i, first_row + j) if fp8 else rows)
        except CheckpointFileError:
            raise
        except Exception as e:
            raise CheckpointFileError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from e

    def fp8_problem(self, name: str) -> str | None:
        """Why the float8 tensor ``name`` cannot be dequantized (None: it can)."""
        scale, dtype = name + SCALE_SUFFIX, self.dtype(name)
        if scale not in self.file_of:
            return f"{name} is {dtype} without its scale {scale}: its values mean nothing without it"
        if self.fp8_block is None:
            return (f"{name} is {dtype} with scale tensors beside it ({scale}): a quantized checkpoint; dequantize it "
                    f"to bf16 first, or add to {os.path.join(self.path, 'config.json')} the "
                    "quantization_config.weight_block_size it was quantized with (the Hub's fp8 checkpoints: "
                    "[128, 128])")
        shape, (br, bc) = self.shape(name), self.fp8_block
        if len(shape) != 2:
            return f"{name} is {dtype} of shape {shape}: block scales are read for 2-D weights only"
        want = [-(-shape[0] // br), -(-shape[1] // bc)]
        if self.shape(scale) != want:
            return (f"{name} is {dtype} with scales {scale} of shape {self.shape(scale)}, not {want}: those of a "
                    f"{shape} weight in blocks of {br} x {bc} (config.json's weight_block_size)")
        return None

    def _check_fp8(self, name: str) -> bool:
        why = self.fp8_problem(name)
        if why:
            raise CheckpointFileError(f"{self.file_of[name]}: {why}")
        return True

    def _dequantized(self, rows: torch.Tensor, name: str, half: str | None, a: int, b: int) -> torch.Tensor:
        """fp32 rows ``[a, b)`` (one half of dim 1 with ``half``) of the float8 tensor ``name``:
        each value times the scale of its block (blocks cut at the edges)."""
        (br, bc), scale = self.fp8_block, name + SCALE_SUFFIX
        c0 = self.shape(name)[1] // 2 if half == "up" else 0
        r0 = a // br
        with open_file(self.file_of[scale]) as f:  # a few fp32 values per block of rows
            s = f.get_slice(scale)[r0:-(-b // br)].float()
        s = s.repeat_interleave(br, 0)[a - r0 * br:b - r0 * br]
        s = s.repeat_interleave(bc, 1)[:, c0:c0 + rows.shape[1]]
        return rows.float() * s

    def read_source(self, out: torch.Tensor, src: Source, first_row: int) -> None:
        """Rows ``[first_row, ...)`` of ``src`` into ``out``: a per-expert source reads expert
        ``first_row + i`` whole into ``out[i]``."""
        if not src.per_expert:
            self.read_into(out, src.name, src.half, first_row)
            return
        for i in range(out.shape[0]):
            self.read_into(out[i], src.name.format(e=first_row + i), src.half)


def _rows(sl, half: str | None, a: int, b: int | None) -> torch.Tensor:
    """Rows ``[a, b)`` of a safetensors slice, all of dim 1 or one half of it."""
    if half is None:
        return sl[a:b]
    mid = sl.get_shape()[1] // 2
    return sl[a:b, :mid] if half == "gate" else sl[a:b, mid:]


def _source_shape(ckpt: CheckpointIndex, src: Source, offset: int, n_rows: int) -> list[int] | None:
    """The shape ``src`` supplies (its expert stack as ``[n_rows, ...]``), or None when a tensor
    it needs is absent."""
    if not src.per_expert:
        if src.name not in ckpt.file_of:
            return None
        shape = ckpt.shape(src.name)
        if src.half is not None:
            shape[1] //= 2
        return shape
    names = [src.name.format(e=offset), src.name.format(e=offset + n_rows - 1)]
    if not all(n in ckpt.file_of for n in names):
        return None
    inner = ckpt.shape(names[0])
    if src.half is not None:
        inner[0] //= 2
    return [offset + n_rows, *inner]  # rows up to the last expert held


def plan_load(model, ckpt: CheckpointIndex) -> tuple[dict, list, list, list]:
    """(our name -> Source), our names with no source, mis-shaped tensors, and tensors of a dtype
    this reader does not convert ``(ours, theirs, dtype, scale tensors beside it)``: only
    ``READ_DTYPES`` convert without loss of meaning; an fp8 tensor with scales beside it is a
    quantized checkpoint whose values mean nothing without them, an int or bool one no weight."""
    adapter, specs = model.hf_weights, model.param_specs()
    found, missing, misshaped, wrong_dtype = {}, [], [], []
    for name, t in persistent_tensors(model):
        if name in specs and specs[name].role == "adapter":
            continue  # LoRA adapters (core/finetune/lora.py) are no part of the base's checkpoint
        offset = specs[name].expert_offset if name in specs else None
        for src in adapter.sources(name):
            shape = _source_shape(ckpt, src, offset or 0, t.shape[0] if t.dim() else 0)
            if shape is None:
                continue
            ok = len(shape) == t.dim() and shape[1:] == list(t.shape[1:]) and (
                shape[:1] == list(t.shape[:1]) if offset is None else shape[0] >= offset + t.shape[0])
            theirs = src.first(offset or 0)
            dtype = ckpt.dtype(theirs)
            if not ok:
                misshaped.append((name, theirs, shape, list(t.shape)))
            elif dtype in FP8_DTYPES and ckpt.fp8_problem(theirs) is None:
                found[name] = src
            elif dtype not in READ_DTYPES:
                scales = sorted(k for k in ckpt.file_of if k != theirs and "scale" in k
                                and k.startswith(theirs.rsplit(".", 1)[0]))
                wrong_dtype.append((name, theirs, dtype, scales))
            else:
                found[name] = src
            break
        else:
            missing.append(name)
    return found, missing, misshaped, wrong_dtype


def _used(ckpt: CheckpointIndex, found: dict) -> set:
    used = set()
    for src in found.values():
        if src.per_expert:
            used |= {k for k in ckpt.file_of if _matches(src.name, k)}
        else:
            used.add(src.name)
    # an fp8 weight's scales are read with it
    return used | {k + SCALE_SUFFIX for k in used if k + SCALE_SUFFIX in ckpt.file_of
                   and ckpt.dtype(k) in FP8_DTYPES}


def _matches(pattern: str, key: str) -> bool:
    head, _, tail = pattern.partition("{e}")
    return key.startswith(head) and key.endswith(tail) and key[len(head):len(key) - len(tail)].isdigit()


def report(model, ckpt: CheckpointIndex, found: dict, missing: list, misshaped: list,
           wrong_dtype: list = ()) -> dict:
    adapter = model.hf_weights
    kept = tuple(getattr(adapter, "kept_prefixes", ()))
    ignored = tuple(getattr(adapter, "ignored_suffixes", ()))
    used = _used(ckpt, found) | {m[1] for m in misshaped} | {w[1] for w in wrong_dtype}
    whole = getattr(model, "whole_on_meta", lambda: None)()
    if whole is not None:  # a pipeline stage: the other stages' tensors are not unexpected
        used |= _used(ckpt, plan_load(whole, ckpt)[0])
    unexpected = sorted(k for k in ckpt.file_of if k not in used and not (kept and k.startswith(kept))
                        and not (ignored and k.endswith(ignored)))
    dtypes = Counter(ckpt.dtype(src.first()) if not src.per_expert else ckpt.dtype(
        next(k for k in ckpt.file_of if _matches(src.name, k))) for src in found.values())
    return {"missing": missing, "unexpected": unexpected, "misshaped": misshaped,
            "loaded": len(found), "wrong_dtype": list(wrong_dtype), "dtypes": dict(dtypes),
            "fp8_problems": {w[1]: ckpt.fp8_problem(w[1]) for w in wrong_dtype if w[2] in FP8_DTYPES},
            "kept_aside": sum(1 for k in ckpt.file_of if kept and k.startswith(kept))}


def problems(rep: dict) -> str:
    """Why a checkpoint does not fit, in one line ("" when it does)."""
    parts = []
    if rep["missing"]:
        parts.append(f"missing {rep['missing'][:10]}{' ...' if len(rep['missing']) > 10 else ''}")
    if rep["misshaped"]:
        parts.append(f"mis-shaped {[(m[0], m[2], m[3]) for m in rep['misshaped'][:10]]}")
    for ours, theirs, dtype, scales in rep["wrong_dtype"][:5]:
        fp8 = rep.get("fp8_problems", {}).get(theirs)
        if fp8:  # why this float8 tensor cannot be dequantized
            parts.append(fp8.replace(theirs, f"{theirs} (for {ours})", 1))
            continue
        hint = (f" with scale tensors beside it ({scales[0]}...): a quantized checkpoint; dequantize it to bf16 "
                "first" if scales else ": not a weight this reader converts")
        parts.append(f"{theirs} (for {ours}) is {dtype}{hint} (it reads {', '.join(READ_DTYPES)}, and "
                     f"{', '.join(FP8_DTYPES)} with block scales)")
    if rep["unexpected"]:
        parts.append(f"unexpected tensors the model has no place for {rep['unexpected'][:5]}"
                     f"{' ...' if len(rep['unexpected']) > 5 else ''} (another model, or a quantized layout's scales?)")
    return "; ".join(parts)


def open_checkpoint(model, path: str) -> CheckpointIndex:
    return CheckpointIndex(path, tuple(getattr(model.hf_weights, "side_files", ())))


def check_checkpoint(model, path: str) -> dict:
    """Missing, unexpected and mis-shaped tensors of ``path`` for ``model``."""
    ckpt = open_checkpoint(model, path)
    return report(model, ckpt, *plan_load(model, ckpt))


@torch.no_grad()
def load_weights(model, path: str, *, strict: bool = True, progress: bool = False, masters=None) -> dict:
    """Copy the checkpoint's tensors into ``model`` (dtype converted), tensor by tensor and only
    the rows this process holds: its experts of a stacked expert tensor, its rows of an FSDP
    shard (also offloaded to host memory). Returns the check report plus ``filled``: the names
    written. With ``strict``, missing or mis-shaped tensors
    raise. ``progress``: a tqdm bar.
    ``masters``: parameters it holds are read in fp32 and stored as bf16 plus remainder, so an
    fp32 checkpoint's values survive exactly."""
    from tqdm import tqdm

    ckpt = open_checkpoint(model, path)
    found, *rest = plan_load(model, ckpt)
    out = report(model, ckpt, found, *rest)
    why = problems(out)
    if strict and why:
        raise ValueError(f"{path}: checkpoint does not fit the model: {why}")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    specs = model.param_specs()
    for name, src in tqdm(found.items(), desc=f"loading {os.path.basename(path)}", unit="tensor",
                          disable=not progress):
        local, first = local_rows(tensors[name])
        offset = specs[name].expert_offset if name in specs else None
        if not local.numel():
            continue
        if masters is not None and tensors[name] in masters:
            value = torch.empty_like(local, dtype=torch.float32)
            ckpt.read_source(value, src, first + (offset or 0))
            masters.set_master(tensors[name], value)
        else:
            ckpt.read_source(local, src, first + (offset or 0))
    out["filled"] = sorted(found)
    return out


def save_weights(model, path: str, *, source: str | None = None, max_shard_bytes: int = 5 * 2**30) -> str:
    """Write the model as a Hugging Face checkpoint (the adapter's layout); returns the layout.
    Files an earlier export of either kind left in ``path`` (``core.checkpoint.out_dir``: weights, shards,
    index, side files, a PEFT adapter's two files) are removed first, so nothing stale sits
    beside the new files (a loader would prefer an old index; transformers would load a stale
    adapter on top of merged weights); other files are left alone."""
    from safetensors.torch import save_file

    from core.checkpoint.out_dir import clear_owned, export_files

    os.makedirs(path, exist_ok=True)
    if source is not None and os.path.abspath(source) == os.path.abspath(path):
        raise ValueError(f"{path}: exporting over --source itself would destroy what it reads from")
    clear_owned(path, export_files(getattr(model.hf_weights, "side_files", ())))
    state = {n: t.detach().contiguous().cpu() for n, t in persistent_tensors(model)}
    src = open_checkpoint(model, source) if source else None
    ex = model.hf_weights.export(state, src)
    write_shards(ex.tensors, path, max_shard_bytes, save_file)
    for fname, tensors in ex.side_files.items():
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(ex.config_json, f, indent=2)
    return ex.layout


def write_shards(tensors: dict, path: str, max_bytes: int, save_file) -> None:
    shards, sizes = defaultdict(dict), defaultdict(int)
    k = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if sizes[k] and sizes[k] + n > max_bytes:
            k += 1
        shards[k][name] = tensors[name]
        sizes[k] += n
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in shards.items():
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
