"""Step-3.7: the text decoder and, with a vision_config, the whole vision-language model (vision
tower and projector on the first stage): config, single-device model, Hugging Face weights, shapes."""
from models.common.decoder import count_parameters
from models.registry import ModelSpec
from models.step37.config import PRESETS, Step37Config
from models.step37.costs import model_shapes
from models.step37.image_processing import Step37ImageProcessor
from models.step37.model import Step37Model

SPEC = ModelSpec(family="step37", config_class=Step37Config, model_class=Step37Model, shapes=model_shapes,
                 model_types=("step3p5", "step3p7", "step3p7_text"), presets=tuple(PRESETS),
                 description="StepFun Step-3.5 / Step-3.7 text decoder (gated GQA, sliding windows, "
                              "sigmoid-routed MoE with a shared expert, MTP; with a vision_config the 2-D RoPE ViT, "
                              "downsamplers and projector of the Step-3.7 VLM)",
                 image_processor=Step37ImageProcessor)

__all__ = ["SPEC", "Step37Config", "Step37ImageProcessor", "Step37Model", "count_parameters"]
