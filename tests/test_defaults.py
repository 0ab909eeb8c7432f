"""Every shipped model trains with the defaults: ``labkit train --model NAME`` with no --base-lr / optimizer flags
gives a finite loss that goes down on the model's quick dataset."""
import math

import pytest

from labkit.models import MODELS
from labkit.train import TrainConfig, run

#: the offline dataset each model is shown on (the CIFAR networks on CIFAR-shaped data)
QUICK_DATASET = {"mlp": "mnist-sample", "lenet": "mnist-sample", "resnet20": "synthetic-cifar10",
                 "resnet32": "synthetic-cifar10", "resnet50": "synthetic-mnist", "alexnet_small": "synthetic-cifar10"}


def test_every_model_has_a_quick_dataset():
    assert set(QUICK_DATASET) == set(MODELS)


@pytest.mark.parametrize("model", list(MODELS))
def test_model_trains_with_the_defaults(tmp_path, one_thread, model):
    """Three passes over 192 samples: the last pass's mean loss is below the first's, and every loss is finite
    (``fit`` raises TrainingDiverged on a NaN)."""
    cfg = TrainConfig(model=model, dataset=QUICK_DATASET[model], epochs=3, train_size=192, test_size=32,
                      device="cpu", out=str(tmp_path), checkpoint=False, log_every=1)
    history = [r["train_loss"] for r in run(cfg) and _epochs(tmp_path)]
    assert all(math.isfinite(x) for x in history), history
    assert history[-1] < history[0], history


def _epochs(out):
    from labkit.results import load_run

    return load_run(out).records_of("epoch")
