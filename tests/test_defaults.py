"""Every shipped model trains with the defaults: ``labkit train --model NAME`` with no --base-lr / optimizer flags
gives a finite loss that goes down on the model's quick dataset.

Three passes over one batch of 8 samples (resnet50, whose steps cost the most on a CPU, two): a few steps of a
deep network show a trend on samples it has seen, not yet on new ones. A default that is far too large still fails
here (alexnet_small at 10x its rate: the loss goes from 2.4 to 14)."""
import math

import pytest
import torch

from labkit.data import loader as loaders
from labkit.models.cnn import MODELS
from labkit.train.config import TrainConfig
from labkit.train.run import run

#: the offline dataset each model is shown on (the CIFAR networks on CIFAR-shaped data)
QUICK_DATASET = {"mlp": "mnist-sample", "lenet": "mnist-sample", "resnet8": "synthetic-cifar10",
                 "resnet20": "synthetic-cifar10", "resnet32": "synthetic-cifar10", "resnet50": "synthetic-mnist",
                 "alexnet_small": "synthetic-cifar10"}


def test_every_model_has_a_quick_dataset():
    assert set(QUICK_DATASET) == set(MODELS)


#: (passes, samples, batch): three steps on the same batch of 8, two for resnet50 (its steps cost the most)
PASSES = (3, 8, 8)
SMALLER = {"resnet50": (2, 8, 8)}


@pytest.mark.parametrize("model", MODELS)
def test_model_trains_with_the_defaults(tmp_path, one_thread, model):
    """A few passes over a small training set: the last pass's mean loss is below the first's, and every loss is
    finite (``fit`` raises TrainingDiverged on a NaN)."""
    epochs, samples, batch = SMALLER.get(model, PASSES)
    cfg = TrainConfig(model=model, dataset=QUICK_DATASET[model], epochs=epochs, train_size=samples, test_size=8,
                      batch_size=batch, device="cpu", out=str(tmp_path), checkpoint=False, log_every=1)
    history = [r["train_loss"] for r in run(cfg) and _epochs(tmp_path)]
    assert all(math.isfinite(x) for x in history), history
    assert history[-1] < history[0], history


def _epochs(out):
    from labkit.results import load_run

    return load_run(out).records_of("epoch")


@pytest.mark.parametrize("update_freq", [1, 10])
def test_kfac_defaults_keep_loss_and_logits_bounded(one_thread, update_freq):
    """K-FAC with its default damping, KL clip and factor decay on LeNet / mnist-sample: with kfac_pytorch's
    damping (0.003) on labkit's textbook-scale factors the logits reached |z| > 1,000 and the loss 27 within
    62 steps at update frequency 1 (past |z| = 100 and loss 2 ln 10 by step 10). 30 steps: the last 10 losses of
    a run with the default damping sum to about 8.5 against the first 10's 22.8."""
    from torch import nn

    from labkit.data import datasets as data
    from labkit.models import cnn as models
    from labkit.optim.kfac.preconditioner import from_options

    torch.manual_seed(0)
    model = models.get_model("lenet")
    optimizer = torch.optim.SGD(model.parameters(), lr=models.default_lr("lenet"), momentum=0.9)
    kfac = from_options(model, {"kfac_update_freq": update_freq}, optimizer=optimizer)
    loader = loaders.make_loader(data.get_dataset("mnist-sample"), 64, shuffle=True, seed=0)
    losses, logits = [], 0.0
    for step, (x, y) in zip(range(30), loader):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        kfac.step()
        optimizer.step()
        losses.append(loss.item())
        logits = max(logits, out.abs().max().item())
    assert logits < 100 and max(losses) < 2 * math.log(10), (logits, max(losses))
    assert sum(losses[-10:]) < sum(losses[:10]) / 2, losses  # and it learns
