"""labkit.train.flops and labkit.train.peak: a step's FLOPs counted by FlopCounterMode, by formula, the gap named
term by term (literal numbers, worked by hand below), the device's peak, and MFU / HFU from them."""
import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from labkit.models.cnn import get_model
from labkit.train import flops as kflops
from labkit.train import peak as kpeak
from labkit.train.flops import counted_once, step_flops
from labkit.train.peak import FlopUtilisation, Peak, gpu_peak, measured_peak
from labkit.train.run import _count_flops


def test_lenet_counted_formula_and_gap():
    """LeNet on 1x28x28, 10 classes, per sample. Forward MACs (out elements × in channels × kh × kw):
    conv1 6·24·24 · 1·5·5 = 86,400; conv2 16·8·8 · 6·5·5 = 153,600; fc1 120·256 = 30,720; fc2 84·120 = 10,080;
    fc3 10·84 = 840; Σ = 281,640. Formula 3 · 2 · 281,640 = 1,689,840. FlopCounterMode skips conv1's input
    gradient (the image needs none): 2 · 86,400 = 172,800 fewer, 1,517,040."""
    f = step_flops("lenet", num_classes=10, in_channels=1, image_size=28)
    assert (f.model, f.formula, f.hardware) == (1_517_040, 1_689_840, 1_517_040)
    assert f.gap == {"first layer's input gradient": 172_800}
    # forward conv 2·(86,400 + 153,600) = 480,000; backward conv: conv1's weight gradient 172,800 + conv2's two 614,400
    assert f.by_op == {"convolution": 480_000, "convolution_backward": 787_200, "addmm": 83_280, "mm": 166_560}


def test_gpt_counted_formula_and_gap():
    """gpt-tiny (L 2, C 128, 4 heads), vocabulary 96, T = 16 tokens (a 16-row position table), per sample.
    Parameters N = 411,136: token table 96·128 = 12,288 (tied to the head), positions 16·128 = 2,048, per block
    4 attention Linear 128·128 + 128 and the MLP 128·512 + 512, 512·128 + 128, two LayerNorms of 256: 198,272,
    final LayerNorm 256. Formula 6·N·T + 12·L·C·T² = 6·411,136·16 + 12·2·128·256 = 39,469,056 + 786,432 = 40,255,488.
    Counted: the matrices, 12,288 + 2·196,608 = 405,504 parameters: 6·405,504·16 = 38,928,384, plus attention's
    786,432 (two bmm's forward, four backward) = 39,714,816. The gap, 6·T per parameter no matmul multiplies:
    positions 2,048, biases 2·1,152, norms 2·512 + 256."""
    f = step_flops("gpt-tiny", num_classes=96, seq_len=16)
    assert (f.model, f.formula, f.tokens) == (39_714_816, 40_255_488, 16)
    assert f.gap == {"position table": 196_608, "linear biases": 221_184, "norm weights": 122_880}
    assert f.by_op["bmm"] == 786_432 and f.model + sum(f.gap.values()) == f.formula

    # HFU: every block checkpointed. Backward recomputes each block's forward up to the last tensor it saved:
    # mlp.proj's output is saved by nothing, so its 2·16·65,536 = 2,097,152 per block are not run again.
    # Recomputed: 2 · (2·16·196,608 + 4·16²·128 - 2,097,152) = 2 · 4,325,376 = 8,650,752.
    with torch.device("meta"):
        model = get_model("gpt-tiny", num_classes=96, seq_len=16)
    for block in model.blocks:
        block.forward = functools.partial(lambda f, x: checkpoint(f, x, use_reentrant=False), block.forward)
    # labkit train reads the configuration's `recompute` where it has one: without it, or "none", nothing is recomputed
    cfg, info = SimpleNamespace(model="gpt-tiny", seq_len=16), SimpleNamespace(num_classes=96, in_channels=0, image_size=0)
    rank0 = SimpleNamespace(is_main=True)
    assert _count_flops(cfg, info, model, rank0).hardware == 39_714_816
    cfg.recompute = "full"
    assert _count_flops(cfg, info, model, rank0).hardware == 39_714_816 + 8_650_752


def test_moe_gap_holds_its_dropped_choices():
    """A top-2 MoE with capacity 1.25 drops choices; each dropped one is 6·8·C² = 786,432 FLOPs the formula counts
    and the hardware never runs. The count runs on the CPU (routing reads the data)."""
    f = step_flops("gpt-moe-tiny-top2", num_classes=96, seq_len=16)
    # active parameters: gpt-tiny's 411,136 + 2 routers of 128·4 + per layer a second expert of 131,712 = 675,584
    assert f.formula == 6 * 675_584 * 16 + 786_432 == 65_642_496
    assert f.gap["dropped choices"] % 786_432 == 0 and f.gap["dropped choices"] > 0
    assert f.model + sum(f.gap.values()) == f.formula


def test_a_count_is_cached_per_model_and_shape(tmp_path, monkeypatch):
    cache = tmp_path / "flops.json"
    first = counted_once("lenet", 10, 1, 28, cache=cache)
    assert first.model == 1_517_040 and cache.exists()

    def not_again(*args, **kwargs):
        raise AssertionError("counted twice")
    monkeypatch.setattr(kflops, "step_flops", not_again)
    assert counted_once("lenet", 10, 1, 28, cache=cache) == first
    with pytest.raises(AssertionError, match="counted twice"):  # another shape is another entry
        counted_once("lenet", 10, 3, 32, cache=cache)


def test_datasheet_peaks_by_name_and_precision():
    assert gpu_peak("NVIDIA H200", "bf16") == Peak(989.5e12, "bf16", "NVIDIA H200 SXM datasheet, dense")
    assert gpu_peak("NVIDIA H100 80GB HBM3", "tf32").flops_per_s == 494.5e12
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").flops_per_s == 756.5e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32").flops_per_s == 19.5e12
    assert gpu_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on a V100: measured instead
    assert gpu_peak("Some Future GPU", "bf16") is None
    assert kpeak.precision(torch.device("cpu"), None) == "fp32" and kpeak.precision(torch.device("cpu"), "bf16") == "bf16"


def test_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "peak_flops.json"
    first = measured_peak(torch.device("cpu"), "fp32", cache, n=64)
    assert first.flops_per_s > 0 and f"cached in {cache}" in first.source and cache.exists()

    def not_again(*args, **kwargs):
        raise AssertionError("measured twice")
    monkeypatch.setattr(kpeak, "measure_matmul", not_again)
    assert measured_peak(torch.device("cpu"), "fp32", cache, n=64).flops_per_s == first.flops_per_s


def test_mfu_and_hfu_of_a_rate():
    """1,000 samples/s of LeNet's 1,517,040 FLOPs (2,000,000 with recompute) on 2 devices of 100 GFLOP/s:
    MFU 1.51704e9 / 2e11 = 0.75852 %, HFU 2e9 / 2e11 = 1 %."""
    u = FlopUtilisation(1_517_040, 2_000_000, Peak(1e11, "fp32", "test"), devices=2)
    assert u.of(1000.0) == pytest.approx({"mfu": 0.0075852, "hfu": 0.01, "model_flops_per_s": 1.51704e9})
    assert u.text(1000.0) == "MFU 0.759%, HFU 1%"
