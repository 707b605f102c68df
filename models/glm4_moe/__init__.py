"""GLM-4.5 (transformers' ``glm4_moe``: GLM-4.5, GLM-4.5-Air): config, single-device model with
its MTP layer, Hugging Face weights, shapes."""
from models.glm4_moe.config import MODEL_TYPES, PRESETS, Glm4MoeConfig
from models.glm4_moe.costs import model_shapes
from models.glm4_moe.model import Glm4MoeModel
from models.registry import ModelSpec

SPEC = ModelSpec(family="glm4_moe", config_class=Glm4MoeConfig, model_class=Glm4MoeModel,
                 shapes=model_shapes, model_types=MODEL_TYPES, presets=tuple(PRESETS),
                 description="GLM-4.5 (GLM-4.5 355B, GLM-4.5-Air 106B): GQA with q/k/v biases, optional q/k "
                             "norms and partial RoPE, group-limited sigmoid top-k experts with shared experts, "
                             "dense first layers, an MTP layer")

__all__ = ["SPEC", "Glm4MoeConfig", "Glm4MoeModel"]
