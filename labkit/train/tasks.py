"""What a model is trained to do: the loss, what a batch counts, and the metrics the loop reports.

    task = get_task("lm")                     # from the dataset: labkit.data.datasets.dataset_info(name).task
    criterion = task.criterion()              # (logits (B, T, V), targets (B, T)) -> mean loss over B·T tokens
    sums = task.sums(loss, out, y)            # (3,) float64 on the device: loss sum, metric sum, count
    task.metrics(*sums.tolist())              # {"loss": ..., "ppl": ...}

Two tasks:

- ``classification``: logits (B, C), labels (B,); cross-entropy averaged over the B samples; metrics loss and
  accuracy (``argmax`` over classes). A batch counts B samples.
- ``lm`` (next-token language modelling): logits (B, T, V), targets (B, T) = the inputs shifted by one token;
  cross-entropy averaged over the B·T tokens; metrics loss and perplexity = exp(mean loss). A batch counts B
  sequences and B·T tokens, and the throughput is reported in tokens/s beside samples/s.

:func:`labkit.train.loop.fit` keeps per-step running sums of ``(loss × count, metric sum, count)`` on the device (no
host sync per step) and turns them into metrics once per epoch; a dimension may replace the criterion (tensor
parallelism's vocabulary-parallel cross-entropy takes the same ``(logits, targets)``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import ConfigError


class TokenCrossEntropy(nn.Module):
    """Mean cross-entropy over every token: ``(logits (B, T, V), targets (B, T)) -> scalar``."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())  # (B·T, V), (B·T,)


class Task:
    """Classification: cross-entropy over samples, accuracy. Subclasses change the loss and the metric."""

    name = "classification"
    #: the metric beside the loss, as the epoch records name it: ``train_acc`` / ``test_acc``
    metric = "acc"

    def criterion(self) -> nn.Module:
        return nn.CrossEntropyLoss()

    def tokens_per_sample(self, x: torch.Tensor) -> int:
        """Tokens in one sample of the batch ``x`` (1 for classification: a sample is one prediction)."""
        return 1

    def sums(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(loss × count, correct, count)`` of one batch, float64 on ``out``'s device, without a host sync.

        ``loss`` is the batch's mean loss, ``out`` the logits (B, C), ``y`` the labels (B,) on ``out``'s device.
        """
        count = torch.full((), float(len(y)), dtype=torch.float64, device=out.device)  # a fill kernel, no copy
        return torch.stack([loss.double() * len(y), (out.argmax(1) == y).sum().double(), count])

    def metrics(self, loss_sum: float, metric_sum: float, count: float) -> dict[str, float]:
        """``{"loss": mean loss, "acc": accuracy}`` from the summed :meth:`sums` (``nan`` for an empty split)."""
        if not count:
            return {"loss": math.nan, self.metric: math.nan}
        return {"loss": loss_sum / count, self.metric: metric_sum / count}


class LanguageModelling(Task):
    """Next-token prediction: cross-entropy over the B·T tokens; perplexity = exp(mean loss)."""

    name = "lm"
    metric = "ppl"

    def criterion(self) -> nn.Module:
        return TokenCrossEntropy()

    def tokens_per_sample(self, x: torch.Tensor) -> int:
        return x.shape[-1] if x.ndim > 1 else 1  # (B, T): T tokens a sequence

    def sums(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(loss × tokens, 0, tokens)`` of one batch: ``y`` (B, T) holds B·T targets. ``out`` is not read, so a
        rank holding a shard of the vocabulary (tensor parallelism) counts the same as a whole one."""
        tokens = y.numel()
        device = loss.device
        return torch.stack([loss.double() * tokens, torch.zeros((), dtype=torch.float64, device=device),
                            torch.full((), float(tokens), dtype=torch.float64, device=device)])

    def metrics(self, loss_sum: float, metric_sum: float, count: float) -> dict[str, float]:
        if not count:
            return {"loss": math.nan, self.metric: math.nan}
        loss = loss_sum / count
        return {"loss": loss, self.metric: math.exp(min(loss, 700.0))}  # exp overflows a float past ~709


#: task name (``DatasetInfo.task``) -> its class
TASKS: dict[str, type[Task]] = {"classification": Task, "lm": LanguageModelling}


def get_task(name: str) -> Task:
    """The :class:`Task` called ``name``; ConfigError if there is none."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]()
