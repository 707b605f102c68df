#!/usr/bin/env python3
"""A run's loss curve as a PNG beside its logs, and its validation loss against the unigram
entropy of its training data (the loss of a model that knows only how often each token occurs).

    python tools/plot_loss.py runs/quickstart/tensorboard \\
        [--data-path PREFIX [--split 95,5,0]] [--out runs/quickstart/tensorboard/loss_curve.png]

Reads LOG_DIR/metrics.jsonl (what pretrain_step37.py --log-dir writes: training rows with
"loss", evaluation rows with "valid_loss"). With --data-path the unigram entropy is counted over
the training part of the dataset (the --split the run used) and drawn as a dashed line; a
validation loss below it means the model predicts from context. Losses are in nats per token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_metrics(log_dir: str) -> tuple[list, list]:
    """([(iteration, training loss)], [(iteration, validation loss)]) from metrics.jsonl."""
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (train with --log-dir {log_dir})")
    train, valid = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("loss") is not None:
                train.append((row["iteration"], row["loss"]))
            if row.get("valid_loss") is not None:
                valid.append((row["iteration"], row["valid_loss"]))
    if not train and not valid:
        raise ValueError(f"{path}: no loss recorded yet")
    return train, valid


def baseline(data_path: str, split: str) -> tuple[float, int]:
    """The unigram entropy (nats per token) of the training part of ``data_path``, and its tokens."""
    from data.indexed_dataset import IndexedDataset
    from data.splits import split_bounds
    from data.unigram import unigram_entropy

    train_end, _ = split_bounds(len(IndexedDataset(data_path)), split)
    return unigram_entropy(data_path, 0, train_end)


def plot(out: str, train: list, valid: list, entropy: float | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="training loss", color="tab:blue")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss (held-out documents)", color="tab:orange")
    if entropy is not None:
        ax.axhline(entropy, ls="--", color="gray", label=f"unigram entropy {entropy:.3f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def summary(train: list, valid: list, entropy: float | None, tokens: int) -> list[str]:
    lines = []
    if train:
        lines.append(f"training loss {train[0][1]:.3f} at iteration {train[0][0]} -> {train[-1][1]:.3f} at "
                     f"iteration {train[-1][0]}")
    if entropy is not None:
        line = f"unigram entropy of the training data {entropy:.3f} nats/token ({tokens:,} tokens)"
        if valid:
            it, loss = valid[-1]
            verdict = "below" if loss < entropy else "NOT below"
            line = (f"validation loss {loss:.3f} nats/token at iteration {it}, {verdict} the {line}: "
                    f"{abs(entropy - loss):.3f} {'under' if loss < entropy else 'over'} it")
        lines.append(line)
    elif valid:
        lines.append(f"validation loss {valid[-1][1]:.3f} nats/token at iteration {valid[-1][0]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log_dir", help="the run's --log-dir (holds metrics.jsonl)")
    ap.add_argument("--data-path", help="the run's dataset prefix: draw and print its unigram entropy")
    ap.add_argument("--split", default="100,0,0", help="the run's --split (the entropy is of its "
                                                       "training part; default: every document)")
    ap.add_argument("--out", help="the PNG to write (default: LOG_DIR/loss_curve.png)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.log_dir, "loss_curve.png")
    try:
        train, valid = read_metrics(args.log_dir)
        entropy, tokens = baseline(args.data_path, args.split) if args.data_path else (None, 0)
        plot(out, train, valid, entropy, f"loss curve: {os.path.abspath(args.log_dir)}"[-80:])
    except ImportError:
        print("plot_loss: error: drawing needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"plot_loss: error: {e}", file=sys.stderr)
        return 1
    for line in summary(train, valid, entropy, tokens):
        print(f"plot_loss: {line}")
    print(f"plot_loss: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
