"""GLM-4.5's Hugging Face weight names, both ways: the published layout DeepSeek-V3 introduced
(``models/common/nextn_layout.py``), with GQA's ``q_proj`` / ``k_proj`` / ``v_proj`` (and their
biases), ``o_proj`` and the optional ``q_norm`` / ``k_norm`` under ``model.layers.N.self_attn.``.
The MTP layer is ``model.layers.92`` on GLM-4.5, ``model.layers.46`` on GLM-4.5-Air.
"""
from __future__ import annotations

from models.common.nextn_layout import NextNLayout


class Glm4MoeWeights(NextNLayout):
    """GLM-4.5's adapter: the shared layout as it is."""
