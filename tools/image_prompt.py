"""``tools/generate.py --image``: a prompt with images, as one user turn, and the images as the
model takes them (``core.packed_seq.ImageInputs``).

The prompt is built the way ``tools/preprocess_data.py --chat`` builds a training document
(``data/image_chat.py``): the conversation ``[{"role": "user", "content": [image parts...,
{"type": "text", "text": prompt}]}]`` is rendered by the tokenizer's chat template, here with
its generation prompt, tokenized, and each image token the template wrote is replaced by the
image processor's placeholder run for that image's size. The pixels are the processor's, and
``feature_positions`` are the positions of the image token in the prompt (what the loader takes:
``data/image_store.py``), so the model writes the features where training wrote them.

The processor is the one the tokenizer folder holds (``models.registry.load_image_processor``):
the folder the run recorded, or ``--tokenizer-model``. A checkpoint does not record the
dataset's processor settings; the tokenizer folder is where preprocessing read them from, and
training refuses a folder whose vocabulary or image processor differs from the dataset's
(``data/checks.check_made_with``), so the recorded folder is the data's.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from core.packed_seq import ImageInputs

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _tokenizer_folder(args, meta: dict) -> str | None:
    if args.tokenizer_type:
        return args.tokenizer_model if args.tokenizer_type == "huggingface" else None
    recorded = meta.get("tokenizer") or {}
    return recorded.get("model") if recorded.get("type") == "huggingface" else None


def end_of_turn(tok) -> set[int]:
    """The token the chat template writes right after an assistant's answer (``<|im_end|>``),
    found by rendering one; empty when the template writes nothing or only white space there."""
    user = {"role": "user", "content": "a"}
    prompt = tok.apply_chat_template([user], add_generation_prompt=True)
    full = tok.apply_chat_template([user, {"role": "assistant", "content": "b"}])
    if not full.startswith(prompt + "b"):
        return set()
    rest = tok.encode(full[len(prompt) + 1:])
    return {rest[0]} if rest and tok.decode(rest[:1]).strip() else set()


class ImagePrompts:
    """The images of ``--image``, decoded and preprocessed once, for every ``--prompt``.

    ``ValueError`` (one line): the model has no vision tower (naming the flag), the tokenizer
    folder holds no image processor or chat template, or an image cannot be read (naming it)."""

    def __init__(self, model, tok, meta: dict, args):
        from data.chat import RowError
        from data.images import decode_image
        from models import registry

        files = list(args.image)
        if getattr(model.config, "vision", None) is None:
            raise ValueError(f"--image: the model has no vision tower ({meta.get('family')}, "
                             "text only); drop --image or load a vision-language checkpoint")
        folder = _tokenizer_folder(args, meta)
        if not folder or not os.path.isdir(folder) or \
                not any(os.path.isfile(os.path.join(folder, f)) for f in _PROCESSOR_FILES):
            raise ValueError(f"--image needs a tokenizer folder that holds the image processor "
                             f"({' or '.join(_PROCESSOR_FILES)}); the tokenizer is {folder or 'not a folder'}"
                             ": pass --tokenizer-type huggingface --tokenizer-model PROCESSOR_DIR")
        if not tok.chat_template:
            raise ValueError(f"--image: the tokenizer in {folder} has no chat template to place the images")
        self.tok, self.proc = tok, registry.load_image_processor(folder, tok.token_id)
        self.pictures = []
        for f in files:
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
                self.pictures.append(decode_image(data, name=f))
            except OSError as e:
                raise ValueError(f"--image {f}: cannot read it ({e.strerror or e})") from None
            except RowError as e:  # empty, too large, not an image, truncated
                raise ValueError(f"--image {f}: {e}") from None
        self.sizes = [p.size for p in self.pictures]
        pixels = [self.proc.pixels(p) for p in self.pictures]
        self.globals = torch.stack([torch.as_tensor(g, dtype=torch.float32) for g, _ in pixels])
        crops = [torch.as_tensor(c, dtype=torch.float32) for _, c in pixels]
        self.counts = tuple(int(c.shape[0]) for c in crops)
        self.crops = torch.cat(crops) if sum(self.counts) else None
        self.stops = end_of_turn(tok)

    def ids(self, prompt: str) -> list[int]:
        """The prompt's tokens: one user turn (images, then the text), the generation prompt,
        each image token expanded into its placeholder run."""
        parts = [{"type": "image"} for _ in self.pictures] + ([{"type": "text", "text": prompt}] if prompt else [])
        text = self.tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        return self.proc.expand_ids(self.tok.encode(text), self.sizes)

    def prompt_ids(self, prompt: str, context: int, max_new: int) -> tuple[list[int], int]:
        """(the prompt's ids, the new tokens it gets), as ``generate.prompt_ids``."""
        import sys

        ids = self.ids(prompt)
        if len(ids) >= context:
            raise SystemExit(f"generate: error: --prompt {prompt[:40]!r} with its {len(self.pictures)} "
                             f"image(s) is {len(ids)} tokens, and the model's context is {context} "
                             "(max_position_embeddings)")
        room = context - len(ids)
        if max_new > room:
            print(f"generate: --max-new-tokens {max_new} is capped at {room} for --prompt {prompt[:40]!r}",
                  file=sys.stderr)
        return ids, min(max_new, room)

    def images(self, ids: list[int]) -> ImageInputs:
        """The model's images for a prompt's ``ids``: the placeholders' positions in it."""
        positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == self.proc.image_token_id)
        return ImageInputs(self.globals, self.crops, self.counts, torch.from_numpy(positions))
