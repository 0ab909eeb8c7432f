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


#: ``--recompute``'s values (:mod:`labkit.models.recompute`)
RECOMPUTE = ("none", "full", "selective")
#: the CNNs with residual blocks, which ``--recompute full`` recomputes one by one
BLOCK_MODELS = ("resnet8", "resnet20", "resnet32", "resnet50")


def check_recompute(model: str, mode: str, attention: bool | None = None, blocks: bool | None = None) -> None:
    """ConfigError unless ``--recompute mode`` applies to ``--model model`` (``attention``, ``blocks``: what the
    model has, by default read from its name)."""
    from labkit.errors import ConfigError

    attention = model in LANGUAGE_MODELS if attention is None else attention
    blocks = (attention or model in BLOCK_MODELS) if blocks is None else blocks
    if mode not in RECOMPUTE:
        raise ConfigError(f"--recompute {mode!r} is not one of: {', '.join(RECOMPUTE)}")
    if mode == "selective" and not attention:
        raise ConfigError(f"--recompute selective recomputes attention's scores and {model} has no attention; use "
                          "--recompute full (each residual block) or a GPT")
    if mode == "full" and not blocks:
        raise ConfigError(f"--recompute full recomputes each block and {model} has none; use it with "
                          f"{', '.join(BLOCK_MODELS)} or a GPT")
