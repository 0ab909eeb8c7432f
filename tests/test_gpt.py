"""The GPT model: shapes, parameter counts, causality, the tied head."""
import torch

from labkit.models.gpt import GPT_SIZES, gpt


def test_parameter_counts_are_gpt2s():
    assert sum(p.numel() for p in gpt("gpt-tiny", 96).parameters()) == 425_472
    with torch.device("meta"):  # shapes only: no memory, no initialisation work
        big = gpt("gpt-100m", 50_257)
    assert sum(p.numel() for p in big.parameters()) == 124_439_808  # GPT-2 small, tied head
    assert big.head.weight is big.tok_emb.weight


def test_causal_and_shapes():
    torch.manual_seed(0)
    model = gpt("gpt-tiny", 32, block_size=16).eval()
    x = torch.randint(0, 32, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 32)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 32  # the future must not change the past's logits
    assert torch.equal(model(changed)[:, :10], logits[:, :10])
    assert not torch.equal(model(changed)[:, 10:], logits[:, 10:])


def test_explicit_positions_equal_default():
    model = gpt("gpt-tiny", 32, block_size=16).eval()
    x = torch.randint(0, 32, (1, 8))
    assert torch.equal(model(x, torch.arange(8)), model(x))
    assert GPT_SIZES["gpt-small"].head_dim == 64
