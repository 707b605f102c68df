"""DeepSeek-V3's Hugging Face weight names, both ways: the published layout in
``models/common/nextn_layout.py`` (DeepSeek-V3 introduced it; GLM-4.5 keeps it), with MLA's
projections (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``) under
``model.layers.N.self_attn.`` as ours are. The MTP layer is ``model.layers.61`` on the release.
FP8 weights (``float8_e4m3fn`` + ``weight_scale_inv``) are dequantized by the reader
(``core/checkpoint/hf.py``). Export writes the published layout, which transformers loads as is.
"""
from __future__ import annotations

from models.common.nextn_layout import NextNLayout


class DeepseekV3Weights(NextNLayout):
    """DeepSeek-V3's adapter: the shared layout as it is."""
