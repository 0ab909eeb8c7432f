"""K-FAC learns faster per epoch than SGD: LeNet on mnist-sample, same seed, data order and LR schedule.

Both runs go through labkit's training loop with SGD (lr 0.01, momentum 0.9, constant); K-FAC is built as
``labkit train --optimizer kfac`` builds it (defaults: factors and eigendecompositions every 10 steps,
damping 0.3, KL clip 0.001). The target, 70 % test accuracy, sits between the two: in calibration runs
(seeds 0-2, then with damping 0.003) K-FAC was at 80-84 % after the first epoch while SGD was at 24-43 %,
reaching 70 % only in epoch 2 or 3. A 2,000-digit training subset keeps both runs within seconds.
"""
import torch
from torch.utils.data import TensorDataset

from labkit import data, models
from labkit.optim.kfac import from_options
from labkit.train import fit

TARGET = 0.70
EPOCHS = 3


def tensors(train: bool, size: int | None = None) -> TensorDataset:
    dataset = data.get_dataset("mnist-sample", train=train)
    items = [dataset[i] for i in range(size or len(dataset))]
    return TensorDataset(torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items]))


def epochs_to_target(optimizer_name: str, train_set, test_set) -> tuple[int | None, list[float]]:
    torch.manual_seed(0)
    model = models.get_model("lenet")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kfac = from_options(model, {"kfac_update_freq": 10}) if optimizer_name == "kfac" else None
    history = fit(model, data.make_loader(train_set, 50, shuffle=True, seed=0),
                  data.make_loader(test_set, 500, shuffle=False), optimizer, epochs=EPOCHS, preconditioner=kfac,
                  printer=lambda line: None)
    accuracy = [record["test_acc"] for record in history]
    return next((i + 1 for i, acc in enumerate(accuracy) if acc >= TARGET), None), accuracy


def test_kfac_reaches_the_target_in_fewer_epochs_than_sgd():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic on every machine, and no fight over a shared CPU
    try:
        train_set, test_set = tensors(True, 2000), tensors(False)
        kfac_epochs, kfac_acc = epochs_to_target("kfac", train_set, test_set)
        sgd_epochs, sgd_acc = epochs_to_target("sgd", train_set, test_set)
    finally:
        torch.set_num_threads(threads)
    assert kfac_epochs is not None, f"K-FAC never reached {TARGET}: {kfac_acc}"
    assert sgd_epochs is None or kfac_epochs < sgd_epochs, f"K-FAC {kfac_acc} vs SGD {sgd_acc}"
