#!/usr/bin/env python3
"""Move a registered model family's weights between Hugging Face checkpoints and this project
(the family from the checkpoint's config.json model_type, or from --model-preset).

Verbs:
  check   DIR [--model-preset NAME | --hf-config PATH]
          Compare a Hugging Face checkpoint directory with a model config and list missing,
          unexpected and mis-shaped tensors (nothing is loaded; the model is built on the meta
          device, so this works for the full 196B model on a laptop). Exit 1 if it does not fit.

  export  CKPT OUT [--source HF_DIR] [--base HF_DIR] [--merge-lora] [--overwrite]
          Training checkpoint (any layout; the 'latest' one of a --save directory, or an iter_*
          directory) -> Hugging Face safetensors. With --source (the checkpoint it was imported
          from), the published layout is written and the vision tower copied byte for byte;
          otherwise the family's own layout (Step-3.7: transformers' Step3p7TextModel layout,
          head and MTP beside it; Qwen3-MoE: the hub's per-expert layout). The
          config gets pad_token_id from --tokenizer-type/--tokenizer-model, else from --source's
          config, else from the tokenizer the training run recorded.

          A LoRA run's checkpoint (adapters only) is loaded onto its base (the --load-hf it trained
          on, recorded in meta.json, or --base; its fingerprint must match) and written as a PEFT
          adapter folder (adapter_config.json + adapter_model.safetensors, transformers' module
          names; peft.PeftModel.from_pretrained loads it onto the base), or with --merge-lora as
          the merged full Hugging Face weights. Routed experts' adapters export merged only.

          OUT (core/checkpoint/out_dir.py): every file an export of ours writes that OUT holds (weights, shards,
          index, config.json, side files, a PEFT adapter's two files) is replaced, of either kind, so
          no stale adapter sits beside merged weights nor weights beside an adapter; an OUT holding
          any other file is refused unless --overwrite (which keeps those files); OUT may not be the
          --source or LoRA base it reads.

  import  HF_DIR OUT [--model-preset NAME | --hf-config PATH] [--peft ADAPTER_DIR]
          Hugging Face checkpoint -> a training checkpoint at iteration 0 (weights only), for
          `pretrain_step37.py --load OUT`. With --peft, a PEFT LoRA adapter trained on HF_DIR
          (as export writes one) -> a LoRA checkpoint of its adapters on that base, for
          `pretrain_step37.py --load-hf HF_DIR --lora-rank R ... --load OUT` (the flags printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from core.checkpoint.hf import check_checkpoint, problems  # noqa: E402
from data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from models import registry  # noqa: E402
from models.common.decoder import count_parameters  # noqa: E402


def spec_and_config(args, directory: str):
    """The family and config: ``--hf-config``, else ``--model-preset``, else DIRECTORY's own
    config.json; a preset of another family than the checkpoint's is refused by name."""
    registry.import_model_module(getattr(args, "model_module", None))
    if args.model_preset:
        spec, cfg = registry.resolve(args.model_preset)
        own = os.path.join(directory, "config.json")
        if os.path.exists(own):
            theirs = registry.spec_for_hf(own)
            if theirs.family != spec.family:
                raise ValueError(f"{directory} holds a {theirs.family} checkpoint; --model-preset "
                                 f"{args.model_preset} is a {spec.family} model")
        return spec, cfg
    return registry.resolve(hf_config=args.hf_config or directory)


def cmd_check(args) -> int:
    spec, cfg = spec_and_config(args, args.directory)
    with torch.device("meta"):
        model = spec.build(cfg)
    report = check_checkpoint(model, args.directory)
    counts = count_parameters(model)
    print(f"model     {spec.family}: {counts['total']:,} parameters ({counts['total_without_mtp']:,} without "
          f"MTP, {cfg.num_layers} layers, {cfg.num_mtp_layers} MTP depths)")
    dtypes = ", ".join(f"{n:,} {d}" for d, n in sorted(report["dtypes"].items()))
    print(f"matched   {report['loaded']:,} tensors ({dtypes or 'none'}); tensors kept aside (not the text "
          f"decoder's, e.g. a vision tower): {report['kept_aside']:,}")
    for key, title in (("missing", "missing"), ("unexpected", "unexpected"), ("misshaped", "mis-shaped"),
                       ("wrong_dtype", "dtype")):
        items = report[key]
        print(f"{title:<10}{len(items):,}")
        for item in items[:args.show]:
            if key == "misshaped":
                ours, theirs, shape, want = item
                print(f"    {theirs}: checkpoint {shape}, model {want} ({ours})")
            elif key == "wrong_dtype":
                ours, theirs, dtype, scales = item
                why = report["fp8_problems"].get(theirs)  # a float8 weight that cannot be dequantized
                quantized = f", quantized: scales beside it ({', '.join(scales[:2])})" if scales else ""
                print(f"    {why} ({ours})" if why else
                      f"    {theirs}: {dtype}, this tool reads F32 / BF16 / F16 and block-scaled F8_E4M3 "
                      f"({ours}{quantized}); dequantize or convert it to bf16 first")
            elif key == "missing":
                print(f"    {model.hf_weights.published(item)} ({item})")
            else:
                print(f"    {item}")
        if len(items) > args.show:
            print(f"    ... and {len(items) - args.show} more (--show N to list more)")
    ok = not problems(report)  # an unexpected tensor is a problem too: another model, or scales
    print(f"convert_checkpoint check: {'OK' if ok else 'DOES NOT FIT'}: {report['loaded']:,} matched, "
          f"{len(report['missing']):,} missing, {len(report['unexpected']):,} unexpected, "
          f"{len(report['misshaped']):,} mis-shaped, {len(report['wrong_dtype']):,} of an unread dtype")
    return 0 if ok else 1


def check_out_folder(out: str, what: str) -> None:
    """OUT names a folder to write into: refuse, in one line, a path where a file stands (itself or
    the nearest part of it that exists), which would otherwise fail mid-run with a raw errno."""
    from core.checkpoint.out_dir import check_out_dir

    check_out_dir(out, (), flag="OUT", tool=what, overwrite=True)


def _same_folder(a: str | None, b: str) -> bool:
    return bool(a) and os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def cmd_export(args) -> int:
    from core.checkpoint.sharded import load_checkpoint, read_meta, resolve
    from core.checkpoint.out_dir import check_out_dir, clear_owned, export_files, split_files

    from training.checkpoints import checkpoint_model, lora_model

    check_out_folder(args.out, "export")  # before any work; what it holds is checked once the family is known
    registry.import_model_module(args.model_module)
    path = resolve(args.checkpoint, "CKPT")
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    lora = meta.get("lora")
    if args.merge_lora and not lora:
        raise ValueError(f"--merge-lora: {path} is not a LoRA run's checkpoint (it holds every weight)")
    if args.base and not lora:
        raise ValueError(f"--base {args.base}: {path} is not a LoRA run's checkpoint (it holds every weight): drop "
                         "--base (--source keeps a published layout)")
    owned = export_files(getattr(spec.model_class.weight_adapter, "side_files", ()))
    held = check_out_dir(args.out, owned, flag="OUT", tool="export", overwrite=args.overwrite)
    for flag, folder in (("--source", args.source), ("--base", args.base),
                         ("the recorded LoRA base", (lora or {}).get("base", {}).get("load_hf"))):
        if _same_folder(folder, args.out):
            raise ValueError(f"OUT {args.out} is {flag} ({folder}): exporting into it would replace the weights it "
                             "reads; choose another OUT")
    if args.source and os.path.exists(os.path.join(args.source, "config.json")):
        theirs = registry.spec_for_hf(args.source)
        if theirs.family != spec.family:
            raise ValueError(f"--source {args.source} is a {theirs.family} checkpoint; {path} holds a "
                             f"{spec.family} model")
    pad_id, pad_from = pad_token_id(args, meta)
    model = lora_model(spec, cfg, lora, args.base, path) if lora else spec.build(cfg)
    load_checkpoint(path, [model])
    clear_owned(args.out, owned)  # an earlier export's files, of either kind (core/checkpoint/out_dir.py)
    others = split_files(args.out, owned)[1]
    replaced = (f"; removed {len(held)} file(s) of an earlier export first: {', '.join(held)}" if held else "") + \
        (f"; kept {len(others)} other file(s) (--overwrite): {', '.join(others[:5])}" if others else "")
    if lora and not args.merge_lora:
        from core.finetune.lora_export import write_peft

        config = write_peft(model, args.out, rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
                            base=args.base or lora["base"]["load_hf"])
        print(f"convert_checkpoint export: {path} (iteration {meta['iteration']}) -> {args.out} (PEFT LoRA "
              f"adapter, rank {lora['rank']}, alpha {lora['alpha']:g}, {len(config['target_modules'])} modules"
              f"{replaced})")
        return 0
    if lora:
        from core.finetune.lora_export import merge_lora

        merge_lora(model)
    layout = model.save_hf(args.out, source=args.source)
    set_pad_token_id(os.path.join(args.out, "config.json"), pad_id)
    print(f"convert_checkpoint export: {path} (iteration {meta['iteration']}) -> {args.out} "
          f"({spec.family}, {layout} layout, {count_parameters(model)['total']:,} parameters; pad_token_id "
          f"{pad_id} from {pad_from}{replaced})")
    return 0


def _config_pad(config_dir: str | None) -> int | None:
    if not config_dir or not os.path.exists(os.path.join(config_dir, "config.json")):
        return None
    with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    for d in (c, c.get("text_config") or {}):
        if isinstance(d.get("pad_token_id"), int):
            return d["pad_token_id"]
    return None


def pad_token_id(args, meta: dict) -> tuple[int, str]:
    """The padding id to publish (transformers assumes 1 when it is missing, which makes token 1
    a padding row): the tokenizer given, else --source's config, else the tokenizer the run
    trained with (recorded in meta.json), else the config of the checkpoint it was imported from."""
    if args.tokenizer_type:
        from data.tokenizers import build_tokenizer

        return build_tokenizer(args.tokenizer_type, args.tokenizer_model).pad_id, \
            f"--tokenizer-type {args.tokenizer_type}"
    if (pad := _config_pad(args.source)) is not None:
        return pad, f"{args.source}/config.json"
    tok = meta.get("tokenizer") or {}
    if isinstance(tok.get("pad_id"), int):
        return tok["pad_id"], f"the training run's tokenizer ({tok.get('type')})"
    if (pad := _config_pad(meta.get("source"))) is not None:
        return pad, f"{meta['source']}/config.json"
    raise ValueError("cannot tell the padding token id (the checkpoint does not record its "
                     "tokenizer): pass --tokenizer-type and --tokenizer-model as for training")


def set_pad_token_id(config_path: str, pad_id: int) -> None:
    """Write ``pad_token_id`` at the top level and in ``text_config`` when there is one."""
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["pad_token_id"] = pad_id
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["pad_token_id"] = pad_id
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def cmd_import(args) -> int:
    from core.checkpoint.directory import read_pointer
    from core.checkpoint.sharded import save_checkpoint
    from training.checkpoints import lora_meta

    check_out_folder(args.out, "import")
    latest = read_pointer(args.out) if os.path.isdir(args.out) else None
    if latest is not None:
        raise ValueError(f"OUT {args.out} already holds a run's checkpoints ('latest' is {latest}): importing "
                         "would point 'latest' back to iteration 0; import into an empty directory")
    spec, cfg = spec_and_config(args, args.directory)
    model = spec.build(cfg)
    report = model.load_hf(args.directory)
    meta = {"family": spec.family, "model": cfg.to_dict(), "source": args.directory}
    if args.peft:
        lora, n = import_peft(model, args.peft, args.directory)
        meta["lora"] = lora_meta(lora, cfg, [model], None, args.directory, 0)
    path = save_checkpoint(args.out, 0, [model], None, {}, meta)
    resume = f"--load-hf {args.directory} {lora_flags(meta['lora'])} --load {args.out}" if args.peft else \
        f"--load {args.out}"
    print(f"convert_checkpoint import: {args.directory}{' + ' + args.peft if args.peft else ''} -> {path} "
          f"({spec.family}, {report['loaded']} tensors{f', {n} adapter tensors' if args.peft else ''}; resume with "
          f"pretrain_step37.py {resume})")
    return 0


def lora_flags(lora: dict) -> str:
    return (f"--lora-rank {lora['rank']} --lora-alpha {lora['alpha']:g} --lora-targets {','.join(lora['targets'])}"
            + (f" --lora-dropout {lora['dropout']:g}" if lora["dropout"] else ""))


def import_peft(model, folder: str, base: str):
    """Adapt ``model`` (its base loaded from ``base``, whose tensor names are the module names
    the adapter uses) as the PEFT folder says and read its adapters; returns the settings and the
    number of tensors read."""
    from core.finetune.lora import TARGETS, LoraSettings, apply_lora
    from core.finetune.lora_export import adapted_targets, base_keys, read_peft, read_peft_config

    config = read_peft_config(folder)
    trained_on = config.get("base_model_name_or_path")
    if trained_on and not _same_folder(trained_on, base):
        print(f"convert_checkpoint import: warning: --peft {folder} was trained on {trained_on} (its "
              f"base_model_name_or_path), imported onto {base}: check that they hold the same weights", file=sys.stderr)
    keys = base_keys(base, model)
    probe = LoraSettings(lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"]))
    with torch.device("meta"):  # which of our targets the folder covers
        every = type(model)(model.config)
    apply_lora(every, probe)
    targets = adapted_targets(every, folder, keys)
    if not targets:
        raise ValueError(f"--peft {folder}: none of its tensors adapts a module of this model ({', '.join(TARGETS)})")
    lora = LoraSettings(lora_rank=probe.lora_rank, lora_alpha=probe.lora_alpha,
                        lora_dropout=float(config.get("lora_dropout") or 0.0), lora_targets=",".join(targets))
    apply_lora(model, lora)
    return lora, read_peft(model, folder, keys)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="verb", required=True)
    check = sub.add_parser("check", help="compare a HF checkpoint with a model config")
    check.add_argument("directory", help="Hugging Face checkpoint directory (safetensors)")
    src = check.add_mutually_exclusive_group()
    src.add_argument("--model-preset", help=f"check against a preset ({', '.join(registry.preset_names())})")
    src.add_argument("--hf-config", help="check against this config.json (default: DIRECTORY's own)")
    check.add_argument("--show", type=int, default=20, help="list at most N names per category")
    check.set_defaults(func=cmd_check)
    exp = sub.add_parser("export", help="training checkpoint -> Hugging Face")
    exp.add_argument("checkpoint", help="--save directory (uses 'latest') or an iter_* directory")
    exp.add_argument("out", help="output Hugging Face directory")
    exp.add_argument("--source", help="the HF checkpoint it came from (keeps its layout and vision tower)")
    exp.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                     help="the tokenizer the data was made with, for pad_token_id (default: --source's "
                          "config, else the tokenizer the training run recorded)")
    exp.add_argument("--tokenizer-model", help="its model file or directory")
    exp.add_argument("--base", help="a LoRA checkpoint's base HF directory (default: the --load-hf it trained on)")
    exp.add_argument("--merge-lora", action="store_true",
                     help="a LoRA checkpoint: write the merged full weights instead of a PEFT adapter folder")
    exp.add_argument("--overwrite", action="store_true",
                     help="export into an OUT that holds files an export did not write (they are kept; an earlier "
                          "export's files are always replaced, of either kind)")
    exp.set_defaults(func=cmd_export)
    imp = sub.add_parser("import", help="Hugging Face -> training checkpoint")
    imp.add_argument("directory", help="Hugging Face checkpoint directory")
    imp.add_argument("out", help="training checkpoint directory (like --save)")
    src2 = imp.add_mutually_exclusive_group()
    src2.add_argument("--model-preset", help=f"a preset ({', '.join(registry.preset_names())})")
    src2.add_argument("--hf-config")
    imp.add_argument("--peft", help="a PEFT LoRA adapter folder trained on HF_DIR: import it too, for a LoRA run to "
                                    "continue (--load-hf HF_DIR --lora-rank ... --load OUT)")
    imp.set_defaults(func=cmd_import)
    for p in (check, exp, imp):
        p.add_argument("--model-module", help="import this module first (it registers another model family)")
    return ap


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process on purpose
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
