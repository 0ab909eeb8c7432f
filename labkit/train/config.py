"""What ``labkit train`` takes, as one dataclass checked once: :class:`TrainConfig` and the ranges of its numbers.
Torch-free: the parser reads :data:`NUMBERS` here; :meth:`TrainConfig.validate` loads what it checks against.

    cfg = TrainConfig(model="lenet", dataset="mnist-sample", epochs=2)
    cfg.validate()                      # a ConfigError naming the first bad value, before any work
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import ConfigError
from labkit.models.names import LANGUAGE_MODELS, check_recompute, default_optimizer
from labkit.ranges import check

#: ``labkit train``'s own numbers, by dest: their kind and the values allowed (:mod:`labkit.ranges`), checked as
#: the flags are read and again by ``TrainConfig.validate`` for a configuration built in Python
NUMBERS = {
    "train_size": ("int", "[1, inf)"), "test_size": ("int", "[1, inf)"), "num_workers": ("int", "[0, 256]"),
    "epochs": ("int", "[1, inf)"), "batch_size": ("int", "[1, inf)"), "test_batch_size": ("int", "[1, inf)"),
    "base_lr": ("float", "(0, inf)"), "momentum": ("float", "[0, 1)"), "weight_decay": ("float", "[0, inf)"),
    "lr_decay": ("int", "[1, inf)"), "lr_decay_factor": ("float", "(0, 1]"), "warmup_epochs": ("float", "[0, inf)"),
    "max_steps": ("int", "[1, inf)"), "steps": ("int", "[1, inf)"), "seed": ("int", "[0, 4294967295]"), "timeout_s": ("float", "(0, 1e7]"),
    "log_every": ("int", "[1, inf)"), "step_delay_s": ("float", "[0, 3600]"), "seq_len": ("int", "[1, 65536]"),
    "dropout": ("float", "[0, 1)"),
}


@dataclass
class TrainConfig:
    """Everything ``labkit train`` takes. ``batch_size`` is per data-parallel rank; the global batch is
    ``batch_size × strategy.data_parallel_size``."""

    model: str = "lenet"
    dataset: str = "mnist-sample"
    epochs: int = 1
    batch_size: int = 64
    test_batch_size: int = 512
    optimizer: str | None = None  # None: the model's (labkit.models.cnn.default_optimizer: adam for GPTs, else sgd)
    base_lr: float | None = None  # None: the model's default (labkit.models.cnn.default_lr)
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_decay: list[int] = field(default_factory=list)
    lr_decay_factor: float = 0.1
    warmup_epochs: float = 0.0
    scale_lr: bool = False
    strategy: str = "single"
    device: str = "auto"
    backend: str | None = None
    seed: int = 0
    out: str | None = None
    name: str | None = None
    resume: bool = False
    checkpoint: bool = True
    profile: bool = False
    max_steps: int | None = None  # per epoch
    steps: int | None = None  # in all: the run's length, its epochs following from it
    train_size: int | None = None
    test_size: int | None = None
    augment: bool = False
    data_root: str | None = None
    download: bool = False
    num_workers: int = 0
    loader: str = "tensor"
    amp: str | None = None
    channels_last: bool = False
    deterministic: bool = False
    log_every: int = 20
    timeout_s: float = 1800.0
    step_delay_s: float = 0.0
    seq_len: int | None = None  # text datasets: tokens per example (None: labkit.data.text.DEFAULT_SEQ_LEN)
    dropout: float = 0.0  # a GPT's dropout probability
    recompute: str = "none"  # activation checkpointing: none | full (each block) | selective (a GPT's attention scores)
    strategy_options: dict = field(default_factory=dict)
    optim_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.optimizer is None:
            self.optimizer = default_optimizer(self.model)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad value."""
        from labkit.data.tensor import LOADERS  # torch: the flags' own checks above ran without it
        from labkit.train.precision import check_amp

        for key, (kind, interval) in NUMBERS.items():  # what the flags check as they are read
            check(f"--{key.replace('_', '-')}", getattr(self, key), kind, interval)
        if self.steps is not None and self.epochs != 1:
            raise ConfigError(f"--steps {self.steps} is the whole run's length and --epochs {self.epochs} another: "
                              "give one of them")
        if list(self.lr_decay) != sorted(set(self.lr_decay)):
            ordered = " ".join(map(str, sorted(set(self.lr_decay))))
            raise ConfigError(f"--lr-decay epochs must be increasing, e.g. --lr-decay {ordered}; "
                              f"got {' '.join(map(str, self.lr_decay))}")
        if self.loader not in LOADERS:
            raise ConfigError(f"--loader {self.loader!r} is not one of: {', '.join(LOADERS)}")
        if self.loader == "tensor" and self.num_workers:
            raise ConfigError("--num-workers applies to --loader torch; the tensor loader has no workers")
        check_amp(self.amp, self.strategy)
        self._check_task()

    def _check_task(self) -> None:
        """A language model needs a text dataset and an image model an image dataset; --seq-len is for text."""
        from labkit.data import datasets as kdata
        from labkit.data.text import TEXT_NAMES, check_available

        if self.dataset not in kdata.DATASETS:
            kdata.dataset_info(self.dataset)  # the unknown-dataset error
        text = kdata.DATASETS[self.dataset].task == "lm"
        if self.model in LANGUAGE_MODELS and not text:
            raise ConfigError(f"--model {self.model} is a language model: train it on a text dataset, e.g. "
                              f"--dataset text-sample (text datasets: {', '.join(TEXT_NAMES)})")
        if text and self.model not in LANGUAGE_MODELS:
            raise ConfigError(f"--dataset {self.dataset} is text: train a language model on it, "
                              f"--model {' | '.join(LANGUAGE_MODELS)}")
        if self.seq_len is not None and not text:
            raise ConfigError(f"--seq-len applies to text datasets ({', '.join(TEXT_NAMES)}), not {self.dataset}")
        check_recompute(self.model, self.recompute)
        if self.dropout and self.model not in LANGUAGE_MODELS:
            raise ConfigError(f"--dropout applies to the GPT models (--model {' | '.join(LANGUAGE_MODELS)}), "
                              f"not {self.model}")
        if text:
            check_available(self.dataset)

    @property
    def out_dir(self) -> Path:
        return Path(self.out or Path("runs") / self.run_name)

    @property
    def run_name(self) -> str:
        return self.name or f"{self.model}-{self.dataset}-{self.strategy}-{self.optimizer}"
