"""`tensorpar generate`'s sampling options (`tensorpar.config.options` composes them): greedy by default, else a
seeded sample within top-k / top-p / min-p; the penalties on the tokens seen apply either way."""

from __future__ import annotations

import dataclasses

from tensorpar.config.fields import option


@dataclasses.dataclass
class SamplingOptions:
    """How `tensorpar generate` picks each next token."""

    greedy: bool = option(False, "greedy decoding (the default without sampling options)", group="sampling")
    temperature: float | None = option(None, "sample with this temperature (default 1)", group="sampling")
    top_k: int | None = option(None, "sample among the k most likely tokens (0: all)", group="sampling")
    top_p: float | None = option(None, "sample from the nucleus of this probability mass", group="sampling")
    seed: int | None = option(None, "sampling seed (default 0): same seed, same tokens", group="sampling")
    min_p: float | None = option(None, "sample among the tokens at least this share of the most likely one's "
                                       "probability (0: all)", group="sampling")
    repetition_penalty: float = option(1.0, "divide the positive logits of the tokens of the prompt and the "
                                            "continuation by this, multiply the negative ones (greedy too)",
                                       group="sampling")
    presence_penalty: float = option(0.0, "subtract this from the logits of the tokens generated so far (-2 to 2)",
                                     group="sampling")
    frequency_penalty: float = option(0.0, "subtract this times their count from the logits of the tokens generated "
                                           "so far (-2 to 2)", group="sampling")
