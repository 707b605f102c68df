"""DeepSeek-V3 (transformers' ``deepseek_v3``: DeepSeek-V3/R1, Kimi-K2, Moonlight): config,
single-device model, Hugging Face weights (bf16, fp32 or the hub's block-scaled FP8), shapes."""
from models.deepseek_v3.config import MODEL_TYPES, PRESETS, DeepseekV3Config
from models.deepseek_v3.costs import model_shapes
from models.deepseek_v3.model import DeepseekV3Model
from models.registry import ModelSpec

SPEC = ModelSpec(family="deepseek_v3", config_class=DeepseekV3Config, model_class=DeepseekV3Model,
                 shapes=model_shapes, model_types=MODEL_TYPES, presets=tuple(PRESETS),
                 description="DeepSeek-V3 (DeepSeek-V3/R1 671B, Kimi-K2, Moonlight-16B-A3B): multi-head latent "
                             "attention, group-limited sigmoid top-k experts with shared experts, dense first "
                             "layers")

__all__ = ["SPEC", "DeepseekV3Config", "DeepseekV3Model"]
