"""Ring attention in one process: the KV ring as data (chunks, blocks, sends, work and byte counts), the
online-softmax merge and its backward, the zig-zag split, the animation. The ring over real ranks against
single-device ``scaled_dot_product_attention`` at cp = 2, 3, 4 is in tests/test_cp.py (its one 4-rank spawn)."""
import pytest
import torch
import torch.nn.functional as F

from labkit.collectives.kv_ring import Block, KVTransfer, kv_ring
from labkit.errors import ConfigError
from labkit.models.gpt import GPTConfig
from labkit.parallel.cp import ContextParallel
from labkit.parallel.ring_attention import attend, attend_backward, merge, positions, shard, unshard

#: float64 everywhere: the ring's result differs from SDPA only by rounding, well inside this
TOL = dict(rtol=1e-9, atol=1e-10)


def test_the_ring_as_data():
    ring = kv_ring(3, causal=True, layout="zigzag")
    assert [ring.chunks_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert ring.forward_steps == [
        (KVTransfer(0, 1, 0), KVTransfer(1, 2, 1), KVTransfer(2, 0, 2)),
        (KVTransfer(0, 1, 2), KVTransfer(1, 2, 0), KVTransfer(2, 0, 1))]
    back = ring.backward_steps
    assert len(back) == 3 and back[0][0] == KVTransfer(0, 1, 0, ("k", "v", "dk", "dv"))
    assert back[2] == (KVTransfer(0, 1, 1, ("dk", "dv")), KVTransfer(1, 2, 2, ("dk", "dv")),
                       KVTransfer(2, 0, 0, ("dk", "dv")))  # the last hop: every dK/dV reaches its owner
    # rank 1 at steps 0, 1, 2 holds the K/V of ranks 1, 0, 2
    assert ring.blocks(1, 0) == [Block((1, 4), (1, 4), True)]
    assert ring.blocks(1, 1) == [Block((1, 4), (0,), False)]     # an earlier rank: all queries, its first chunk
    assert ring.blocks(1, 2) == [Block((4,), (2, 3), False)]     # a later rank: the late queries, both chunks
    plain = kv_ring(3, causal=True, layout="contiguous")
    assert plain.blocks(0, 1) == [] and plain.blocks(2, 1) == [Block((2,), (1,), False)]
    assert kv_ring(2, causal=False, layout="contiguous").blocks(0, 1) == [Block((0,), (1,), False)]
    assert ring.describe_step(1) == ("step 1 of 2: rank 0 sends k, v of rank 0 to rank 1, rank 1 sends k, v of "
                                     "rank 1 to rank 2, rank 2 sends k, v of rank 2 to rank 0")


def test_causal_work_per_rank_with_and_without_zigzag():
    # score entries per batch row and head for T = 16 on 4 ranks: the contiguous split leaves rank 0 with a
    # quarter of the last rank's work; the zig-zag split gives each rank the same (the totals match)
    assert kv_ring(4, layout="contiguous").work(16) == [16, 32, 48, 64]
    assert kv_ring(4, layout="zigzag").work(16) == [40, 40, 40, 40]
    assert kv_ring(4, causal=False, layout="zigzag").work(16) == [64, 64, 64, 64]


def test_bytes_per_layer_equal_the_formula():
    # B=2, T=16, width C=32, fp32 on cp=2: one tensor on the wire is 2*8*32*4 = 2048 bytes; forward 1 step of
    # K+V, backward 1 step of K+V+dK+dV and one of dK+dV: (6p - 4) tensors = 8 -> 16384 bytes per layer
    assert kv_ring(2).bytes_sent(batch=2, seq_len=16, width=32, itemsize=4) == 16384
    assert kv_ring(4).bytes_sent(batch=2, seq_len=16, width=32, itemsize=4) == 20 * 2 * 4 * 32 * 4 == 20480
    # the cp dimension's price for a 2-layer GPT (C=32, V=64, block 16): the ring of both layers, and the
    # gradients of its 28,032 parameters (fp32) to the all-reduce over cp
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert ContextParallel.price(cfg, batch=2, seq=16, cp=2) == {"p2p": 32768, "all_reduce": 112128}


def test_lengths_that_do_not_split_are_rejected_with_the_valid_ones():
    with pytest.raises(ConfigError, match="a length of 15 does not split; use a multiple of 4, e.g. 12 or 16"):
        kv_ring(2).check_length(15)
    with pytest.raises(ConfigError, match="use a multiple of 6, e.g. 6$"):
        kv_ring(3).check_length(4)
    with pytest.raises(ConfigError, match="unknown context-parallel layout 'striped'"):
        kv_ring(2, layout="striped")


def test_zigzag_split_positions_and_inverse():
    ring = kv_ring(2)
    assert positions(ring, 0, 2).tolist() == [0, 1, 6, 7]
    assert positions(ring, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    parts = [shard(x, ring, r, 1) for r in range(2)]
    assert parts[1].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(unshard(parts, ring, 1), x)


def test_two_partial_results_merge_into_the_full_softmax_and_their_gradients_add_up():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 0.5
    full = F.scaled_dot_product_attention(q, k, v, scale=scale)
    o1, l1 = attend(q, k[..., :2, :], v[..., :2, :], scale)
    o2, l2 = attend(q, k[..., 2:, :], v[..., 2:, :], scale)
    out, lse = merge(o1, l1, o2, l2)
    torch.testing.assert_close(out, full, **TOL)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) * scale, -1), **TOL)
    dout = torch.randn(full.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(full, (q, k, v), dout)
    delta = (dout * out).sum(-1)
    with torch.no_grad():
        a = attend_backward(q, k[..., :2, :], v[..., :2, :], dout, lse, delta, scale)
        b = attend_backward(q, k[..., 2:, :], v[..., 2:, :], dout, lse, delta, scale)
    torch.testing.assert_close(a[0] + b[0], want[0], **TOL)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 2), want[1], **TOL)
    torch.testing.assert_close(torch.cat([a[2], b[2]], 2), want[2], **TOL)


def test_the_animation_draws_the_ring_and_who_computes_each_block():
    from matplotlib.patches import FancyArrowPatch

    from labkit.viz.kv_ring import KVRingView

    view = KVRingView(kv_ring(4, layout="contiguous"))
    ranks = [r for r, _ in view.computed_by().values()]
    assert [ranks.count(r) for r in range(4)] == [1, 2, 3, 4]  # the lower triangle of 4 x 4 chunk blocks
    zigzag = KVRingView(kv_ring(4, layout="zigzag"))
    ranks = [r for r, _ in zigzag.computed_by().values()]
    assert [ranks.count(r) for r in range(4)] == [9, 9, 9, 9]  # 36 of the 8 x 8 blocks on or below the diagonal
    zigzag.draw(3)  # the last step: four messages, one per rank
    assert sum(isinstance(patch, FancyArrowPatch) for patch in zigzag.ax.patches) == 4 and zigzag.num_frames == 4
    with pytest.raises(ConfigError, match="step 4 is outside 0..3"):
        zigzag.draw(4)
