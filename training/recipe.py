"""The flags a recipe script (``examples/*.sh``) passes to ``pretrain_step37.py``, read from the
script itself, so what plans and tests the recipe is what the recipe runs."""
from __future__ import annotations

import re
import shlex


def recipe_flags(recipe: str, values: dict | None = None) -> list[str]:
    """The arguments after ``pretrain_step37.py`` on the script's ``torchrun`` line (continuation
    lines joined); each ``"$NAME`` is replaced by ``values[NAME]`` (a path prefix, say)."""
    text = open(recipe).read().replace("\\\n", " ")
    line = next((l for l in text.splitlines() if "pretrain_step37.py" in l and l.startswith("torchrun")), None)
    if line is None:
        raise ValueError(f"{recipe}: no 'torchrun ... pretrain_step37.py' line")
    line = line.split("pretrain_step37.py", 1)[1]
    for name, value in (values or {}).items():
        line = re.sub(r'"\$' + name, '"' + value, line)
    return shlex.split(line)
