"""Step-3.7 text decoder: config, single-device model, Hugging Face weights."""
from models.step37.config import Step37Config
from models.step37.model import Step37Model, count_parameters

__all__ = ["Step37Config", "Step37Model", "count_parameters"]
