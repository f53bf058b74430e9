"""The LoRA options of the commands (`tensorpar.config.options` composes them): train's adapters (their shape, which
plan models too), and the PEFT adapter folder that train continues and eval, generate and serve apply."""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import LORA_TARGETS
from tensorpar.config.fields import option


@dataclasses.dataclass
class LoraAdapterOptions:
    """A PEFT LoRA adapter folder (train: continue it; eval, generate, serve: apply it to the model)."""

    lora_adapter: str | None = option(None, "a PEFT LoRA adapter folder (adapter_config.json + "
                                            "adapter_model.safetensors) of the model: train continues it (with "
                                            "--init-from the base model); eval, generate and serve merge it into "
                                            "the weights", metavar="DIR", group="lora")


@dataclasses.dataclass
class LoraShapeOptions:
    """The shape of low-rank adapters on the model's linears, the base weights frozen (train; plan models them)."""

    lora_rank: int = option(0, "train LoRA adapters of this rank on --lora-targets, every other weight frozen "
                               "(0: train every weight)", metavar="R", group="lora")
    lora_alpha: float | None = option(None, "the adapters' alpha: their product is scaled by alpha / rank "
                                            "(default: the rank)", metavar="A", group="lora")
    lora_targets: str = option(",".join(LORA_TARGETS), "comma-separated linears the adapters sit on, of "
                                                       f"{', '.join(LORA_TARGETS)}", metavar="T,T,...", group="lora")
    lora_dropout: float = option(0.0, "dropout on the adapters' input", metavar="P", group="lora")


@dataclasses.dataclass
class LoraOptions(LoraShapeOptions, LoraAdapterOptions):
    """Low-rank adapters on the model's linears, the base weights frozen (train): their shape, or a PEFT folder's."""
