"""``--recompute none|full|selective`` through the ``labkit.train.loop.fit`` a user runs: a GPT with dropout (the
replay must draw the same masks) and a ResNet with batch norm (the replay must not update its statistics twice)
give the same loss every step and the same weights and buffers after the last, bit for bit; what a block keeps
for backward, counted. The multi-rank compositions (tp + sp, cp, pp, fsdp, zero) are in tests/test_mesh.py."""
import pytest
import torch
from torch.utils.data import TensorDataset

from labkit.data.loader import make_loader
from labkit.errors import ConfigError
from labkit.models.cnn import get_model
from labkit.models.gpt import GPT, GPTConfig
from labkit.models.recompute import set_recompute
from labkit.parallel.cp_memory import saved_tensor_bytes
from labkit.train.loop import fit
from labkit.train.tasks import LanguageModelling, Task

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


def _train(kind: str, mode: str, steps: int = 3):
    """``steps`` steps of fit (Adam for the GPT, SGD with momentum for the ResNet); the losses and the state."""
    from labkit.dist.group import DistEnv
    from labkit.dist.testing import record_losses
    from labkit.strategies.base import Strategy

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    if kind == "gpt":
        model, task = set_recompute(GPT(CFG), mode), LanguageModelling()
        tokens = torch.randint(0, 32, (4 * steps, 17), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        model, task = get_model("resnet8", 5, 1, 8, recompute=mode), Task()
        data = TensorDataset(torch.randn(4 * steps, 1, 8, 8, generator=g), torch.randint(0, 5, (4 * steps,), generator=g))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = Strategy(DistEnv())
    losses = record_losses(strategy)
    fit(model, make_loader(data, 4, shuffle=True, seed=0), None, optimizer, epochs=1, strategy=strategy, seed=0,
        task=task, criterion=task.criterion(), printer=lambda line: None)
    return torch.stack(losses), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,modes", [("gpt", ("full", "selective")), ("cnn", ("full",))])
def test_recompute_equals_no_recompute_bitwise(kind, modes):
    losses, state = _train(kind, "none")
    assert losses.shape == (3,) and losses[-1] < losses[0]
    for mode in modes:
        again, after = _train(kind, mode)
        assert torch.equal(again, losses), mode
        assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state), mode


def test_what_a_block_keeps_for_backward():
    """Saved bytes of the 2-block GPT's forward to a sum (B·T = 32 tokens, C=16, H=2, float32, dropout 0; the
    parameters left out). Per token: each block 16·C + H + 4 = 262 values (labkit.parallel.cp_memory), the final
    layer norm 2·C + 2 = 34, and the int64 ids (8 bytes; the 16 positions 8 each):
    none = 4·32·(2·262 + 34) + 8·32 + 8·16 = 71,808; full keeps each block's input, C values:
    4·32·(2·16 + 34) + 384 = 8,832; selective drops each block's log-sum-exp, H values: 71,808 − 4·32·2·2 = 71,296."""
    torch.manual_seed(0)
    x = torch.randint(0, 32, (2, 16))
    kept = {}
    for mode in ("none", "full", "selective"):
        model = set_recompute(GPT(CFG.replace(dropout=0.0)), mode)
        kept[mode] = saved_tensor_bytes(lambda: model(x).sum(), model.parameters())
    assert kept == {"none": 71_808, "full": 8_832, "selective": 71_296}


def test_a_model_without_attention_or_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^--recompute selective recomputes attention's scores and resnet8 has no"):
        get_model("resnet8", recompute="selective")
    with pytest.raises(ConfigError, match="^--recompute full recomputes each block and lenet has none; use it with "
                                          "resnet8, resnet20, resnet32, resnet50 or a GPT$"):
        get_model("lenet", recompute="full")


def test_labkit_train_refuses_a_bad_recompute_before_work():
    from labkit.train.config import TrainConfig

    for cfg, words in [(TrainConfig(model="lenet", recompute="full"), "--recompute full recomputes each block and "
                                                                       "lenet has none"),
                       (TrainConfig(model="gpt-tiny", dataset="text-sample", recompute="some"),
                        "--recompute 'some' is not one of: none, full, selective")]:
        with pytest.raises(ConfigError, match="^" + words):
            cfg.validate()
