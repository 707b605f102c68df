"""Qwen3-MoE (transformers' ``qwen3_moe``): config, single-device model, Hugging Face weights, shapes."""
from models.qwen3_moe.config import PRESETS, Qwen3MoeConfig
from models.qwen3_moe.costs import model_shapes
from models.qwen3_moe.model import Qwen3MoeModel
from models.registry import ModelSpec

SPEC = ModelSpec(family="qwen3_moe", config_class=Qwen3MoeConfig, model_class=Qwen3MoeModel,
                 shapes=model_shapes, model_types=("qwen3_moe",), presets=tuple(PRESETS),
                 description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with q/k norms, softmax "
                             "top-k experts, dense mlp_only_layers")

__all__ = ["SPEC", "Qwen3MoeConfig", "Qwen3MoeModel"]
