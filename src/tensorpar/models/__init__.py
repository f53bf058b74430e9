"""Model configs and presets, the tensor-parallel transformer, dense state dicts, Hugging Face import."""

from tensorpar.models.config import ModelConfig
from tensorpar.models.presets import PRESETS, get_config
from tensorpar.models.state import full_state_dict, load_full_state_dict
from tensorpar.models.transformer import Transformer

__all__ = ["ModelConfig", "PRESETS", "get_config", "Transformer", "full_state_dict", "load_full_state_dict"]
