"""Image + text conversations -> token ids, loss mask and the image runs of one document.

A message's ``content`` may be a list of parts, as transformers' processors take them:
``{"type": "text", "text": ...}`` and image parts (``data/images.py`` lists their keys). The
conversation is rendered by the tokenizer's chat template, which writes the image token (one
``<im_patch>`` for Step-3.7) once per image part; after tokenizing, exactly those occurrences, in
order, are replaced by the processor's placeholder run for the image's size (global view, crops,
their markers), so a document's length counts its image tokens. The occurrences must number the
image parts exactly: a template that drops an image, or text that holds the image token itself,
rejects the row (``image_placement``) rather than misplace a feature.

Every token of a placeholder run has loss mask 0, so no label ever points at an image token
(a label is the next token where its mask is 1, ``data/thd.py``). Images in assistant messages
are refused (``image_in_assistant``): the model writes text, not images. An assistant message
whose content is a list of text parts is rendered as their concatenation (a string), which is how
chat templates render such a list, so its target can be located as for any text answer.

Without a chat template (the built-in one) or without an image processor, list content is joined
into text (a template not made for images may print a list's repr), and a row with an image part
is rejected (``images_unsupported``).
"""
from __future__ import annotations

import numpy as np

from data.chat import RowError, encode_chat
from data.images import ImageProcessor, column_source, decode_image, part_source, read_source


def _text_of(parts: list, i: int) -> str:
    out = []
    for j, p in enumerate(parts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            out.append(p["text"])
        else:
            raise RowError("wrong_type", f"message {i} part {j}: expected a text part "
                                         "{'type': 'text', 'text': ...}")
    return "".join(out)


def _is_image(p) -> bool:
    return isinstance(p, dict) and p.get("type") in ("image", "image_url")


def _has_images(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(_is_image, m["content"]))
        for m in messages)


def split_images(messages, images_column=None) -> tuple[list, list]:
    """(messages to render, the source of every image part in order). Image parts become
    ``{"type": "image"}`` (what a template needs); an assistant's text parts are joined."""
    if not isinstance(messages, list):
        return messages, []  # validate_messages names the error
    out, sources = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        if any(_is_image(p) for p in content):
            if m.get("role") == "assistant":
                raise RowError("image_in_assistant", f"message {i}: an assistant message holds an "
                                                     "image; images may be context only")
            parts = []
            for j, p in enumerate(content):
                if _is_image(p):
                    sources.append(part_source(p, f"message {i} part {j}"))
                    parts.append({"type": "image"})
                elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                    parts.append({"type": "text", "text": p["text"]})
                else:
                    raise RowError("wrong_type", f"message {i} part {j}: expected "
                                                 "{'type': 'text' | 'image', ...}")
            out.append({**m, "content": parts})
        else:
            out.append({**m, "content": _text_of(content, i)})
    return out, _with_column(sources, images_column)


def _with_column(sources: list, column) -> list:
    """Image parts without a source of their own take the row's ``images`` list, in order."""
    if column is None:
        column = []
    if not isinstance(column, list):
        raise RowError("wrong_type", f"images must be a list, got {type(column).__name__}")
    need = sum(kind == "column" for kind, _ in sources)
    if need != len(column):
        raise RowError("image_placement", f"the conversation has {need} image part(s) without a "
                                          f"source and the row's images list holds {len(column)}")
    it = iter(column)
    return [column_source(next(it), f"images[{k}]") if kind == "column" else (kind, v)
            for k, (kind, v) in enumerate(sources)]


def load_images(sources: list, base_dir: str, max_pixels: int) -> list[tuple[bytes, int, int]]:
    """(bytes, width, height) of each image, decoded whole once to check it."""
    out = []
    for k, (kind, value) in enumerate(sources):
        data, name = read_source(kind, value, base_dir, f"image {k}")
        img = decode_image(data, max_pixels, name)
        out.append((data, *img.size))
    return out


def expand_images(ids: np.ndarray, mask: np.ndarray, runs: list[list[int]],
                  image_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replace the k-th occurrence of ``image_token_id`` in ``ids`` by ``runs[k]``.

    Returns (ids, mask with 0 over every run, int64 ``[k, 2]`` (start, length) of each run in the
    new ids). ``RowError`` when the occurrences do not number the runs."""
    at = np.flatnonzero(ids == image_token_id)
    if len(at) != len(runs):
        raise RowError("image_placement", f"the rendered conversation holds the image token "
                                          f"{len(at)} time(s) for {len(runs)} image part(s) (a "
                                          "template that drops images, or the image token typed "
                                          "in text)")
    if not runs:
        return ids, mask, np.zeros((0, 2), np.int64)
    pieces_ids, pieces_mask, spans, prev, shift = [], [], [], 0, 0
    for a, run in zip(at.tolist(), runs):
        run = np.asarray(run, dtype=np.int64)
        pieces_ids += [ids[prev:a], run]
        pieces_mask += [mask[prev:a], np.zeros(len(run), np.uint8)]
        spans.append((a + shift, len(run)))
        shift += len(run) - 1
        prev = a + 1
    pieces_ids.append(ids[prev:])
    pieces_mask.append(mask[prev:])
    return (np.concatenate(pieces_ids), np.concatenate(pieces_mask),
            np.asarray(spans, dtype=np.int64).reshape(-1, 2))


def encode_image_chat(tok, proc: ImageProcessor | None, messages, images_column, base_dir: str,
                      max_pixels: int, **chat_kwargs):
    """One conversation with images: (ids int64, mask uint8, images [(bytes, w, h)], runs
    int64 [k, 2]). Without images it is :func:`data.chat.encode_chat`'s result (and no run)."""
    if (proc is None or not tok.chat_template) and _has_images(messages):
        why = "no image processor" if proc is None else "no chat template"
        raise RowError("images_unsupported", f"the row has image parts but the tokenizer ({why}) "
                                             "cannot place them: give --tokenizer-model a "
                                             "processor folder")
    # a text-only run ignores an images column (it has no image part to give it to)
    messages, sources = split_images(messages, images_column if proc is not None else None)
    if (proc is None or not tok.chat_template) and isinstance(messages, list):
        # a template not made for images may not render a list either (it would print its repr)
        messages = [{**m, "content": _text_of(m["content"], i)} if isinstance(m, dict)
                    and isinstance(m.get("content"), list) else m for i, m in enumerate(messages)]
    images = load_images(sources, base_dir, max_pixels)
    ids, mask = encode_chat(tok, messages, **chat_kwargs)
    if proc is None:
        return ids, mask, images, np.zeros((0, 2), np.int64)
    runs = [proc.placeholder_ids(w, h) for _, w, h in images]
    ids, mask, spans = expand_images(ids, mask, runs, proc.image_token_id)
    return ids, mask, images, spans
