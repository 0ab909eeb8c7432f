"""The pipeline learns real digits: LeNet on the 5,000 shipped MNIST digits reaches >= 90 % test accuracy."""
from labkit.train.config import TrainConfig
from labkit.train.run import run


def test_lenet_learns_mnist_sample(tmp_path):
    cfg = TrainConfig(model="lenet", dataset="mnist-sample", epochs=4, batch_size=64, base_lr=0.05,
                      device="cpu", out=str(tmp_path), checkpoint=False, log_every=100)
    summary = run(cfg)
    assert summary["metrics"]["final_test_acc"] >= 0.90, summary["metrics"]
