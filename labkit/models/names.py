"""The language models' ``--model`` names and their defaults, without torch (the ``labkit train`` parser reads
them before torch loads; :mod:`labkit.models.cnn` builds them)."""
from __future__ import annotations

#: the language models (:mod:`labkit.models.gpt`): ``--model`` name -> size in ``GPT_SIZES``; their vocabulary and
#: sequence length come from the text dataset and ``--seq-len``
LANGUAGE_MODELS: dict[str, str] = {"gpt": "gpt-tiny", "gpt-tiny": "gpt-tiny", "gpt-small": "gpt-small",
                                   "gpt-100m": "gpt-100m"}
#: the GPTs whose MLPs are mixtures of experts (:data:`labkit.models.moe.MOE_SIZES`)
LANGUAGE_MODELS.update({name: name for name in ("gpt-moe", "gpt-moe-tiny", "gpt-moe-tiny-top2", "gpt-moe-small")})


def default_optimizer(name: str) -> str:
    """``--optimizer`` when not given: Adam for a GPT, SGD (momentum 0.9) for the CNNs."""
    return "adam" if name in LANGUAGE_MODELS else "sgd"


def model_task(name: str) -> str:
    """The task (:mod:`labkit.train.tasks`) model ``name`` is built for: ``"lm"`` or ``"classification"``."""
    return "lm" if name in LANGUAGE_MODELS else "classification"
