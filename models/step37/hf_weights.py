"""Hugging Face weights <-> Step37Model, read lazily tensor by tensor.

Names read (``P`` = ``model.layers.N.``; also accepted with ``model.language_model.`` or no
prefix, as transformers writes them from memory):

| ours (``layers.N.`` ...)            | published                         | transformers in memory              |
| ---                                | ---                               | ---                                 |
| ``self_attn.*``, norms, dense ``mlp.*`` | same under ``P``              | same                                |
| ``moe.router.weight``              | ``P moe.gate.weight``             | ``mlp.gate.weight``                 |
| ``moe.router.e_score_correction_bias`` | ``P moe.router_bias``         | ``mlp.gate.e_score_correction_bias``|
| ``moe.experts.{gate,up}_proj`` [E, I, H] | ``P moe.{gate,up}_proj.weight`` | halves of ``mlp.experts.gate_up_proj`` [E, 2I, H] |
| ``moe.experts.down_proj`` [E, H, I] | ``P moe.down_proj.weight``       | ``mlp.experts.down_proj``           |
| ``moe.shared_expert.*``            | ``P share_expert.*``              | ``mlp.shared_experts.*``            |
| ``mtp.k.{enorm,hnorm,eh_proj}``    | ``model.layers.{L+k}.{...}.weight`` | (transformers skips MTP layers)   |
| ``mtp.k.block.*``                  | ``model.layers.{L+k}.*``          |                                     |
| ``mtp.k.head_norm`` / ``mtp.k.head`` | ``model.layers.{L+k}.transformer.shared_head.{norm,output}.weight`` | |

plus ``model.embed_tokens``, ``model.norm``, ``lm_head``. Only tensors this model (or pipeline
stage) owns are read, and of those only the rows this process holds: expert stacks are sliced to
the experts a rank holds (``GroupedExperts.expert_offset``), FSDP shards to their dim-0 rows. A
load streams into the model's own storage block by block (``CheckpointIndex.read_into``).

Export (``save_hf_weights``) writes the published layout when the source checkpoint had it
(the Step-3.7 release and what ``Step3p7ForConditionalGeneration.save_pretrained`` writes; the
vision tower is copied byte for byte), else transformers' ``Step3p7TextModel`` layout, which has
no output head: the head and MTP depths then go beside it in ``step37_extra.safetensors``.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import torch

PREFIXES = ("model.layers.", "model.language_model.layers.", "layers.")
TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                               "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"),
       "lm_head.weight": ("lm_head.weight",)}
EXTRA_FILE = "step37_extra.safetensors"
VISION_PREFIXES = ("vision_model.", "vit_large_projector.", "model.vision_model.",
                   "model.multi_modal_projector.")


def _layer_candidates(rest: str) -> list[tuple[str, slice | None]]:
    """Names (within a layer) a parameter may have, with an optional slice of dim 1."""
    m = re.fullmatch(r"moe\.experts\.(gate|up|down)_proj", rest)
    if m:
        part = m.group(1)
        fused = [] if part == "down" else [("mlp.experts.gate_up_proj", part)]
        return [(f"moe.{part}_proj.weight", None)] + fused + \
            ([("mlp.experts.down_proj", None)] if part == "down" else [])
    for ours, published, memory in (("moe.router.weight", "moe.gate.weight", "mlp.gate.weight"),
                                    ("moe.router.e_score_correction_bias", "moe.router_bias",
                                     "mlp.gate.e_score_correction_bias")):
        if rest == ours:
            return [(published, None), (memory, None)]
    if rest.startswith("moe.shared_expert."):
        tail = rest[len("moe.shared_expert."):]
        return [("share_expert." + tail, None), ("mlp.shared_experts." + tail, None)]
    return [(rest, None)]


def candidates(name: str, num_layers: int) -> list[tuple[str, object]]:
    """Checkpoint names that can supply our parameter ``name`` (first match wins)."""
    if name in TOP:
        return [(c, None) for c in TOP[name]]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return [(p + m.group(1) + "." + c, s) for p in PREFIXES for c, s in _layer_candidates(m.group(2))]
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if m:
        idx, rest = str(num_layers + int(m.group(1))), m.group(2)
        if rest.startswith("block."):
            inner = _layer_candidates(rest[len("block."):])
        elif rest.startswith("head_norm."):
            inner = [("transformer.shared_head.norm.weight", None), ("shared_head.norm.weight", None)]
        elif rest.startswith("head."):
            inner = [("transformer.shared_head.output.weight", None), ("shared_head.output.weight", None),
                     ("shared_head.head.weight", None)]
        else:
            inner = [(rest, None)]
        return [(p + idx + "." + c, s) for p in PREFIXES for c, s in inner]
    raise KeyError(f"no Hugging Face name is known for parameter {name!r}")


class CheckpointIndex:
    """Tensor name -> file for a single-file or sharded safetensors checkpoint (+ extra file)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            single = os.path.join(path, "model.safetensors")
            with safe_open(single, "pt") as f:
                self.file_of = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        extra = os.path.join(path, EXTRA_FILE)
        if os.path.exists(extra):
            with safe_open(extra, "pt") as f:
                self.file_of.update({k: extra for k in f.keys()})
        self._open: dict = {}

    def handle(self, name: str):
        from safetensors import safe_open

        f = self.file_of[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "pt")
        return self._open[f]

    def shape(self, name: str) -> list[int]:
        return list(self.handle(name).get_slice(name).get_shape())

    def read(self, name: str, half: str | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A tensor, optionally rows ``[a, b)`` of dim 0 and one half of dim 1, read lazily."""
        return _rows(self.handle(name).get_slice(name), half, *(rows or (0, None)))

    def read_into(self, out: torch.Tensor, name: str, half: str | None = None, first_row: int = 0) -> None:
        """Copy rows ``[first_row, first_row + len(out))`` of ``name`` (one half of dim 1 with
        ``half``) into ``out`` (any device and dtype), ``READ_BLOCK_BYTES`` of the file at a
        time, each block through a handle of its own: safetensors maps the file, and the pages a
        read touched count as this process's memory until the mapping is closed."""
        from safetensors import safe_open

        path = self.file_of[name]
        if out.dim() == 0:
            with safe_open(path, "pt") as f:
                out.copy_(f.get_tensor(name))
            return
        with safe_open(path, "pt") as f:
            dtype = f.get_slice(name).get_dtype()
        row_bytes = max(1, out[0].numel()) * _DTYPE_BYTES.get(dtype, 4)
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        for i in range(0, out.shape[0], step):
            j = min(out.shape[0], i + step)
            with safe_open(path, "pt") as f:
                out[i:j].copy_(_rows(f.get_slice(name), half, first_row + i, first_row + j))


READ_BLOCK_BYTES = 32 << 20  # bytes of a checkpoint tensor read (and converted) at a time
_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _rows(sl, half: str | None, a: int, b: int | None) -> torch.Tensor:
    """Rows ``[a, b)`` of a safetensors slice, all of dim 1 or one half of it."""
    if half is None:
        return sl[a:b]
    mid = sl.get_shape()[1] // 2
    return sl[a:b, :mid] if half == "gate" else sl[a:b, mid:]


def _expert_offset(model, name: str) -> int | None:
    if ".moe.experts." not in name:
        return None
    return getattr(model.get_submodule(name.rsplit(".", 1)[0]), "expert_offset", 0)


def _expert_rows(model, name: str, param: torch.Tensor) -> tuple[int, int] | None:
    offset = _expert_offset(model, name)
    return None if offset is None else (offset, offset + param.shape[0])


def plan_load(model, ckpt: CheckpointIndex) -> tuple[dict, list, list]:
    """(our name -> (checkpoint name, half)), our names with no source, mis-shaped tensors."""
    L = model.config.num_layers
    found, missing, misshaped = {}, [], []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary."):
            continue
        for cand, half in candidates(name, L):
            if cand in ckpt.file_of:
                shape = ckpt.shape(cand)
                if half is not None:
                    shape[1] //= 2
                rows = _expert_rows(model, name, t)
                rows_ok = shape[:1] == list(t.shape[:1]) if rows is None else shape[0] >= rows[1]
                if len(shape) != t.dim() or shape[1:] != list(t.shape[1:]) or not rows_ok:
                    misshaped.append((name, cand, shape, list(t.shape)))
                else:
                    found[name] = (cand, half)
                break
        else:
            missing.append(name)
    return found, missing, misshaped


def _report(ckpt: CheckpointIndex, found: dict, missing: list, misshaped: list) -> dict:
    used = {c for c, _ in found.values()} | {m[1] for m in misshaped}
    unexpected = sorted(k for k in ckpt.file_of if k not in used and not k.startswith(VISION_PREFIXES)
                        and not k.endswith("rotary_emb.inv_freq"))
    vision = sum(k.startswith(VISION_PREFIXES) for k in ckpt.file_of)
    return {"missing": missing, "unexpected": unexpected, "misshaped": misshaped,
            "loaded": len(found), "vision_tensors": vision}


def check_checkpoint(model, path: str) -> dict:
    """Missing, unexpected and mis-shaped tensors of ``path`` for ``model``."""
    ckpt = CheckpointIndex(path)
    return _report(ckpt, *plan_load(model, ckpt))


@torch.no_grad()
def load_hf_weights(model, path: str, *, strict: bool = True, progress: bool = False) -> dict:
    """Copy the checkpoint's tensors into ``model`` (dtype converted), tensor by tensor and only
    the rows this process holds: its experts of a stacked expert tensor, its rows of an FSDP
    shard (also offloaded to host memory), so no whole tensor or model passes through host
    memory. Returns the check report plus ``filled``: the names written.

    With ``strict``, missing or mis-shaped tensors raise; an MTP depth without its own output
    head takes the main ``lm_head`` (checkpoints that share it). ``progress``: a tqdm bar."""
    from tqdm import tqdm

    from models.step37.materialize import local_rows

    ckpt = CheckpointIndex(path)
    found, missing, misshaped = plan_load(model, ckpt)
    report = _report(ckpt, found, missing, misshaped)
    head_fallback = [n for n in missing if re.fullmatch(r"mtp\.\d+\.head\.weight", n)
                     and "lm_head.weight" in ckpt.file_of]
    missing = [n for n in missing if n not in head_fallback]
    if strict and (missing or misshaped):
        raise ValueError(f"{path}: checkpoint does not fit the model: missing {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}; mis-shaped "
                         f"{[(m[0], m[2], m[3]) for m in misshaped[:10]]}")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    sources = {**found, **{name: ("lm_head.weight", None) for name in head_fallback}}
    for name, (cand, half) in tqdm(sources.items(), desc=f"loading {os.path.basename(path)}",
                                   unit="tensor", disable=not progress):
        local, first = local_rows(tensors[name])
        if local.numel():
            ckpt.read_into(local, cand, half, first + (_expert_offset(model, name) or 0))
    report["head_fallback"] = head_fallback
    report["filled"] = sorted(sources)
    return report


def published_name(name: str, num_layers: int) -> str:
    """Our parameter name -> the published (hub release) name."""
    if name in TOP:
        return TOP[name][0]
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if m:
        prefix, rest = f"model.layers.{num_layers + int(m.group(1))}.", m.group(2)
        if rest.startswith("head_norm."):
            return prefix + "transformer.shared_head.norm.weight"
        if rest.startswith("head."):
            return prefix + "transformer.shared_head.output.weight"
        rest = rest[len("block."):] if rest.startswith("block.") else rest
        return prefix + _layer_candidates(rest)[0][0]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return f"model.layers.{m.group(1)}." + _layer_candidates(m.group(2))[0][0]


def _transformers_text_tensors(state: dict, num_layers: int) -> tuple[dict, dict]:
    """Step3p7TextModel layout (fused gate_up) for the main layers; head and MTP kept apart
    under their published names."""
    main, extra = {}, {}
    for name, t in state.items():
        if name == "lm_head.weight" or name.startswith("mtp."):
            extra[published_name(name, num_layers)] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(gate|up|down)_proj", name)
        if m and m.group(2) == "gate":
            up = state[f"layers.{m.group(1)}.moe.experts.up_proj"]
            main[f"layers.{m.group(1)}.mlp.experts.gate_up_proj"] = torch.cat([t, up], dim=1)
        elif m and m.group(2) == "down":
            main[f"layers.{m.group(1)}.mlp.experts.down_proj"] = t
        elif not m:
            main[name if not name.startswith("layers.") else
                 name.split(".", 2)[0] + "." + name.split(".", 2)[1] + "." +
                 _layer_candidates(name.split(".", 2)[2])[-1][0]] = t
    return main, extra


def save_hf_weights(model, path: str, *, source: str | None = None,
                    max_shard_bytes: int = 5 * 2**30) -> str:
    """Write the model as a Hugging Face checkpoint; returns the layout written."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {n: t.detach().contiguous().cpu() for n, t in
             list(model.named_parameters()) + list(model.named_buffers()) if not n.startswith("rotary.")}
    L = model.config.num_layers
    src = CheckpointIndex(source) if source else None
    published = src is not None and any(".moe.gate_proj.weight" in k or ".share_expert." in k
                                        for k in src.file_of)
    if published:
        tensors = {published_name(n, L): t for n, t in state.items()}
        for k in src.file_of:  # the vision tower and projector, byte for byte
            if k.startswith(VISION_PREFIXES):
                tensors[k] = src.read(k)
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        extra = {}
    else:
        tensors, extra = _transformers_text_tensors(state, L)
        config = model.config.to_hf()
    _write_shards(tensors, path, max_shard_bytes, save_file)
    if extra:
        save_file(extra, os.path.join(path, EXTRA_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return "published" if published else "transformers-text"


def _write_shards(tensors: dict, path: str, max_bytes: int, save_file) -> None:
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
