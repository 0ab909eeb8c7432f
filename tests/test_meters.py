"""labkit.train.meters: the seed-003 lines (with the epoch said as "epoch 1/3"), exactly."""
import re

import torch

from labkit.train.meters import ThroughputMeter, memory_lines, process_memory_gb, throughput_line


def test_throughput_lines_match_seed_format():
    assert throughput_line(1, 1, 4, 100, 692.34, True) == "train | epoch 1/1 (4%) | 692 samples/sec (estimated)"
    assert throughput_line(1, 1, 100, 100, 718.4634, False) == "train | epoch 1/1 (100%) | 718 samples/sec"
    assert throughput_line(3, 10, 0, 7, 1.0, False) == "train | epoch 3/10 (0%) | 1.00 samples/sec"
    assert throughput_line(1, 2, 5, 10, 9.0876, False, 71880.4) == (
        "train | epoch 1/2 (50%) | 9.09 samples/sec, 71880 tokens/sec")
    assert throughput_line(1, 1, 0, 1, 0.0, True) == "train | epoch 1/1 (0%) | 0 samples/sec (estimated)"


def test_cpu_memory_line_is_labelled():
    (line,) = memory_lines([torch.device("cpu")])
    assert re.fullmatch(r"CPU \(process, all devices\): resident \d+\.\d{3} GB, peak \d+\.\d{3} GB", line)
    rss, peak = process_memory_gb()
    assert 0 < rss <= peak  # one reading of the kernel's counter and its high-water mark: never peak < resident
    grown = torch.ones(64 * 1024 * 1024 // 8, dtype=torch.float64)  # 64 MiB touched: the pair still reads alike
    rss_grown, peak_grown = process_memory_gb()
    assert 0 < rss_grown <= peak_grown and grown[-1] == 1


def test_meter_prints_estimates_then_final_line_and_counts_samples():
    lines = []
    meter = ThroughputMeter(2, 5, steps=10, every=3, warmup=1, printer=lines.append, world_factor=2)
    for _ in range(10):
        meter.update(8)
    rate = meter.finish()
    assert all(line.endswith("(estimated)") for line in lines[:-1]) and len(lines) == 3  # steps 3, 6, then final
    assert re.fullmatch(r"train \| epoch 2/5 \(100%\) \| [\d.]+ samples/sec", lines[-1])
    assert meter.samples == 9 * 8 and rate > 0  # first step is warm-up, not throughput


def test_resumed_epoch_counts_from_its_first_step():
    """An epoch of 10 steps resumed after step 7: 3 steps run here, too few to spare a warm-up, so all are timed;
    the lines say how much of the epoch is done (80 %, then 100 %), never 0 samples/sec."""
    lines = []
    meter = ThroughputMeter(2, 3, steps=10, every=1, printer=lines.append, first=7)
    for _ in range(3):
        meter.update(4)
    rate = meter.finish()
    assert [line.split(" | ")[1] for line in lines] == ["epoch 2/3 (80%)", "epoch 2/3 (90%)", "epoch 2/3 (100%)"]
    assert meter.samples == 12 and meter.timed_steps == 3 and rate > 0
    assert all(float(line.split(" | ")[2].split()[0]) > 0 for line in lines), lines
