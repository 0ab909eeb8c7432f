"""The alpha-beta(-gamma) model: closed forms per algorithm, fitting, bus bandwidth, the seed formula."""
import math

import numpy as np
import pytest

from labkit.collectives import get_schedule
from labkit.collectives.bench import format_size, parse_size
from labkit.collectives.cost import CostModel, algbw, busbw, fit_alpha_beta, ring_formula
from labkit.errors import ConfigError

A, B = 5e-5, 1e-9            # 50 us per message, 1 GB/s


@pytest.mark.parametrize("p", [2, 4, 8])
def test_predictions_equal_closed_forms_for_powers_of_two(p):
    model, n, size = CostModel(A, B), 1024 * p, 4
    nb = n * size
    log = int(math.log2(p))
    closed = {
        "ring": 2 * (p - 1) * (A + B * nb / p),
        "tree": 2 * log * (A + B * nb),
        "butterfly": log * (A + B * nb),
        "rabenseifner": 2 * log * A + 2 * (p - 1) / p * B * nb,
        "master-worker": 2 * ((p - 1) * A + (p - 1) * B * nb),
        "all-to-all": (p - 1) * A + (p - 1) * B * nb,
        "round-robin": 2 * ((p - 1) * A + (p - 1) / p * B * nb),
    }
    for name, want in closed.items():
        assert model.predict(get_schedule(name, p), n, size) == pytest.approx(want, rel=1e-12), name


def test_gamma_prices_the_additions():
    p, n = 4, 4096
    plain, with_adds = CostModel(A, B), CostModel(A, B, gamma=2e-10)
    # the ring adds n/p elements in each of its p-1 share-reduce steps
    extra = with_adds.predict(get_schedule("ring", p), n) - plain.predict(get_schedule("ring", p), n)
    assert extra == pytest.approx((p - 1) * (n // p) * 4 * 2e-10)


def test_seed_formula_is_the_ring_prediction():
    p, n = 5, 5000
    model = CostModel(A, B)
    t_transfer = model.transfer_time(n * 4 / p)
    assert ring_formula(p, t_transfer) == pytest.approx(model.predict(get_schedule("ring", p), n, 4))


def test_fit_recovers_alpha_beta_exactly_and_under_noise():
    sizes = np.array([4, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22], dtype=float)
    alpha, beta = fit_alpha_beta(sizes, A + B * sizes)
    assert alpha == pytest.approx(A, rel=1e-9) and beta == pytest.approx(B, rel=1e-9)
    noise = 1 + 0.03 * np.random.default_rng(0).standard_normal(len(sizes))
    alpha, beta = fit_alpha_beta(sizes, (A + B * sizes) * noise)
    assert alpha == pytest.approx(A, rel=0.1) and beta == pytest.approx(B, rel=0.1)


def test_fit_needs_two_sizes():
    with pytest.raises(ConfigError, match=r"at least two distinct sizes to fit alpha and beta, got sizes \[8.0, 8.0\]"):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])


def test_bus_bandwidth_as_nccl_tests():
    assert algbw(2e9, 2.0) == 1e9
    assert busbw(2e9, 2.0, 4) == pytest.approx(1e9 * 2 * 3 / 4)
    assert busbw(1e9, 1.0, 2) == pytest.approx(1e9)


def test_sizes_parse_and_print():
    assert [parse_size(s) for s in ("1KiB", "64KiB", "1MiB", "16MiB", "512", "2KB")] == \
        [1024, 65536, 1 << 20, 16 << 20, 512, 2000]
    assert [format_size(b) for b in (1024, 16 << 20, 1000)] == ["1KiB", "16MiB", "1000B"]
    with pytest.raises(ConfigError, match=r"cannot read the size '12XB'; write e.g. 1KiB"):
        parse_size("12XB")


def test_fit_stays_physical_under_noise_that_tilts_the_line():
    # a slow tiny message makes the straight fit slope downwards; beta must stay positive
    alpha, beta = fit_alpha_beta([4, 1 << 20], [5e-3, 1e-3])
    assert beta == pytest.approx(1e-3 / (1 << 20))
    # alpha refitted with weights 1/y = 200 and 1000: (200² × 5e-3 + 1000² × ~0) / (200² + 1000²) = 1.923e-4
    assert alpha == pytest.approx(1.923e-4, rel=1e-3)
    assert alpha < 5e-3 and alpha + beta * (1 << 20) > 1e-3  # one point above the line, one below
    # a line that would cross below zero at 0 bytes goes through the origin instead, still through the points
    alpha, beta = fit_alpha_beta([1000, 2000, 3000], [1e-6, 3e-6, 5e-6])
    assert alpha == 0 and 1e-6 / 1000 < beta < 5e-6 / 3000
