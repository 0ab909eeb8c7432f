"""labkit.data.tensor: resident datasets, batched transforms, DataLoader-equal order; --amp and --channels-last."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from labkit.data import loader as loaders
from labkit.data.loader import TensorLoader
from labkit.data.tensor import TensorImages, crop_flip, load_split, tensor_dataset
from labkit.errors import ConfigError
from labkit.models import cnn as models
from labkit.train.checkpoint import load_checkpoint
from labkit.train.config import TrainConfig
from labkit.train.loop import fit
from labkit.train.meters import ThroughputMeter
from labkit.train.precision import check_amp
from labkit.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("name", ["mnist-sample", "synthetic-cifar10"])
def test_tensor_path_yields_the_torchvision_batches(name):
    """Same seed, same epoch, same sampler: the same normalised images and labels, batch for batch."""
    reference, resident = load_split("torch", name, True, limit=192), load_split("tensor", name, True, limit=192)
    assert resident.data.dtype == torch.float32  # small: normalised once at load time
    assert torch.equal(resident[7][0], reference[7][0]) and resident[7][1] == reference[7][1]
    assert len(reference) == len(resident) == 192
    torch_loader = loaders.make_loader(reference, 48, shuffle=True, seed=3)
    tensor_loader = loaders.make_loader(resident, 48, shuffle=True, seed=3)
    assert isinstance(tensor_loader, TensorLoader)
    for epoch in (0, 1):  # reseeded per epoch, as fit does
        loaders.set_loader_epoch(torch_loader, epoch, seed=3)
        loaders.set_loader_epoch(tensor_loader, epoch, seed=3)
        _same(_batches(torch_loader), _batches(tensor_loader))
    samplers = [DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, seed=5, drop_last=True)
                for ds in (reference, resident)]
    for s in samplers:
        s.set_epoch(4)
    _same(_batches(loaders.make_loader(reference, 20, True, samplers[0], drop_last=True)),
          _batches(loaders.make_loader(resident, 20, True, samplers[1], drop_last=True)))
    _same(_batches(loaders.make_loader(load_split("torch", name, train=False, limit=100), 32, shuffle=False)),
          _batches(loaders.make_loader(load_split("tensor", name, train=False, limit=100), 32, shuffle=False)))


def test_large_uint8_splits_stay_uint8_and_normalise_per_batch(monkeypatch):
    monkeypatch.setattr("labkit.data.tensor.FLOAT_BYTES", 1000)
    pixels = torch.randint(0, 256, (20, 3, 4, 4), dtype=torch.uint8)
    big = TensorImages(pixels, torch.arange(20), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    assert big.data.dtype == torch.uint8
    expected = (pixels[[3, 7]].float() / 255 - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) \
        / torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    torch.testing.assert_close(big.batch(torch.tensor([3, 7]))[0], expected)
    monkeypatch.setattr("labkit.data.tensor.FLOAT_BYTES", 10 ** 6)
    small = TensorImages(pixels, torch.arange(20), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    assert small.data.dtype == torch.float32 and torch.equal(small.batch(torch.tensor([3, 7]))[0],
                                                                big.batch(torch.tensor([3, 7]))[0])


def test_shards_are_disjoint_complete_and_reshuffled():
    n, world, batch = 103, 3, 8
    ds = TensorImages(torch.zeros(n, 1, 2, 2), torch.arange(n), (0.0,), (1.0,))

    def shards(epoch):
        out = []
        for rank in range(world):
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1, drop_last=True)
            sampler.set_epoch(epoch)
            loader = TensorLoader(ds, batch, shuffle=True, sampler=sampler, drop_last=True)
            out.append(torch.cat([y for _, y in loader]).tolist())
        return out

    first = shards(0)
    assert [len(s) for s in first] == [n // world // batch * batch] * world
    seen = [i for s in first for i in s]
    assert len(seen) == len(set(seen))  # disjoint
    full = [set(DistributedSampler(ds, world, r, seed=1, drop_last=True)) for r in range(world)]
    assert set().union(*full) <= set(range(n)) and len(set().union(*full)) == n - n % world  # complete shards
    assert all(set(s) <= full[r] for r, s in enumerate(first))
    assert shards(0) == first != shards(1)  # same order for a seed and epoch; a new epoch reshuffles


def test_crop_flip_is_the_literal_crop_and_flip_with_uniform_draws():
    b, pad = 4000, 4
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    x = ((rows + 1) * 100 + cols + 1).float().expand(b, 2, 32, 32)  # every pixel names its position
    torch.manual_seed(0)
    out = crop_flip(x, pad)
    padded = F.pad(x, (pad,) * 4)
    centre = out[:, 0, 16, 16].long()
    flip = out[:, 0, 16, 17] < out[:, 0, 16, 16]
    dy = centre // 100 - 1 - 12
    dx = centre % 100 - 1 - torch.where(flip, 11, 12)
    for k in range(0, b, 397):  # the literal reference: slice the padded image, flip with torch.flip
        crop = padded[k, :, dy[k]:dy[k] + 32, dx[k]:dx[k] + 32]
        assert torch.equal(out[k], crop.flip(-1) if flip[k] else crop)
    for offsets in (dy, dx):
        counts = torch.bincount(offsets, minlength=2 * pad + 1)
        assert len(counts) == 2 * pad + 1 and counts.min() > 0.8 * b / 9 and counts.max() < 1.2 * b / 9
    assert abs(flip.float().mean().item() - 0.5) < 0.03
    aug = tensor_dataset("synthetic-cifar10", augment=True, size=64)
    assert aug.augment and not tensor_dataset("synthetic-cifar10", train=False, augment=True).augment
    assert not tensor_dataset("synthetic-mnist", augment=True, size=8).augment  # MNIST: no augmentation


def _cfg(tmp_path, **kw):
    base = dict(model="mlp", dataset="synthetic-cifar10", train_size=96, test_size=64, batch_size=16, epochs=2,
                device="cpu", log_every=1000, out=str(tmp_path / "run"))
    return TrainConfig(**{**base, **kw})


def test_loaders_train_alike_and_augmented_resume_is_bit_identical(tmp_path):
    by_loader = [run(_cfg(tmp_path, loader=name, epochs=1, out=str(tmp_path / name)))["metrics"]["final_train_loss"]
                 for name in ("tensor", "torch")]
    assert by_loader[0] == by_loader[1]
    run(_cfg(tmp_path, augment=True, out=str(tmp_path / "straight")))
    run(_cfg(tmp_path, augment=True, epochs=1, out=str(tmp_path / "resumed")))
    run(_cfg(tmp_path, augment=True, resume=True, out=str(tmp_path / "resumed")))
    a, b = (load_checkpoint(tmp_path / r / "checkpoint.pt")["model"] for r in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="--num-workers applies to --loader torch"):
        run(_cfg(tmp_path, num_workers=2))
    with pytest.raises(ConfigError, match="--loader 'disk'"):
        run(_cfg(tmp_path, loader="disk"))


def test_amp_bf16_and_channels_last():
    ds = tensor_dataset("synthetic-cifar10", size=64)
    torch.manual_seed(0)
    template = models.get_model("lenet", 10, 3, 32)
    dtypes = []
    trained = {}
    for amp, channels_last in ((None, False), (None, True), ("bf16", False)):
        model = copy.deepcopy(template)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        hook = model.conv1.register_forward_hook(lambda m, i, o: dtypes.append((o.dtype, o.is_contiguous(
            memory_format=torch.channels_last))))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        fit(model, TensorLoader(ds, 16, shuffle=False), None, opt, epochs=1, amp=amp, channels_last=channels_last,
            printer=lambda line: None)
        hook.remove()
        trained[(amp, channels_last)] = model.state_dict()
    assert dtypes[0] == (torch.float32, False) and dtypes[4] == (torch.float32, True)
    assert dtypes[8][0] == torch.bfloat16  # the conv ran in bf16 under autocast
    fp32 = trained[(None, False)]
    for k, v in trained[(None, True)].items():  # NHWC: the same training up to float reassociation
        torch.testing.assert_close(v.contiguous(), fp32[k], rtol=1e-4, atol=1e-5)
    drift = max((trained[("bf16", False)][k] - fp32[k]).abs().max().item() for k in fp32)
    assert 0 < drift < 0.05  # bf16 changes the numbers a little, not the training
    with pytest.raises(ConfigError, match="autocast is per thread"):
        check_amp("bf16", "gpipe")
    with pytest.raises(ConfigError, match="--amp 'fp16' is not supported"):
        check_amp("fp16", "single")


def test_max_steps_beyond_an_epoch_says_so_and_meter_skips_two_steps(monkeypatch):
    ds = tensor_dataset("synthetic-mnist", size=32)
    model = models.get_model("mlp", 10, 1, 28)
    lines = []
    history = fit(model, TensorLoader(ds, 8, shuffle=True), None, torch.optim.SGD(model.parameters(), lr=0.01),
                  epochs=1, max_steps=50, printer=lines.append)
    assert lines[0] == "note: --max-steps 50 is more than the 4 steps of an epoch; each epoch runs its 4 steps"
    assert history[0]["timed_steps"] == 4  # too short to spare a warm-up: timed whole, and said so
    now = [0.0]
    monkeypatch.setattr("labkit.train.meters.time.perf_counter", lambda: now[0])
    meter = ThroughputMeter(1, 1, steps=8, every=3, printer=lambda line: None)
    for seconds in (10.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0):  # steps 1 and 2 slow (first call, DDP re-bucketing)
        now[0] += seconds
        meter.update(4)
    assert meter.timed_steps == 6 and meter.finish() == pytest.approx(6 * 4 / 6.0)
