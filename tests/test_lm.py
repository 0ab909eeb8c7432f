"""Language modelling: the LM task's counts and metrics, the text-sample windows, a GPT trained through
``labkit train``'s path below the unigram baseline, ``labkit sample`` from its checkpoint, and the one-line errors."""
import math
import urllib.error

import pytest
import torch

from labkit.cli import main
from labkit.data import datasets as kdata
from labkit.data import loader as loaders
from labkit.data import text as text_data
from labkit.data.tensor import load_split
from labkit.errors import ConfigError
from labkit.train.config import TrainConfig
from labkit.train.run import run
from labkit.train.tasks import get_task


def test_task_counts_and_metrics():
    lm = get_task("lm")
    logits, targets = torch.zeros(2, 3, 4), torch.tensor([[0, 1, 2], [3, 0, 1]])  # uniform over 4 tokens
    loss = lm.criterion()(logits, targets)
    assert loss.item() == pytest.approx(math.log(4))
    sums = lm.sums(loss, logits, targets)
    assert sums.dtype == torch.float64 and sums[2].item() == 6  # 2 sequences × 3 tokens
    metrics = lm.metrics(*sums.tolist())
    assert metrics["loss"] == pytest.approx(math.log(4)) and metrics["ppl"] == pytest.approx(4.0)
    assert lm.tokens_per_sample(targets) == 3
    cls = get_task("classification")
    out, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 0, 1])
    sums = cls.sums(cls.criterion()(out, labels), out, labels)
    assert sums[1:].tolist() == [1.0, 3.0]  # one of three right
    assert cls.metrics(*sums.tolist())["acc"] == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="unknown task"):
        get_task("regression")


def test_text_sample_windows_split_and_loaders():
    x, y = text_data.windows(torch.arange(10), 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert text_data.unigram_entropy(torch.tensor([0, 0, 1, 1])) == pytest.approx(math.log(2))
    base = kdata.data_root()
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    tok = text_data.tokenizer("text-sample", base)
    assert tok.vocab == sorted(set(text)) and kdata.dataset_info("text-sample").num_classes == len(tok.vocab)
    train, val = text_data.tokens("text-sample", base)
    assert len(train) == int(len(text) * 0.9) and tok.decode(train.tolist() + val.tolist()) == text
    ds = load_split("tensor", "text-sample", train=False, seq_len=16, limit=40)
    assert len(ds) == 40 and ds.batch(torch.tensor([2]))[0].tolist() == [val[32:48].tolist()]
    tensor = loaders.make_loader(load_split("tensor", "text-sample", True, seq_len=16, limit=50), 8, True, seed=1)
    torch_ = loaders.make_loader(load_split("torch", "text-sample", True, seq_len=16, limit=50), 8, True, seed=1)
    assert type(torch_).__name__ == "DataLoader" and len(tensor) == len(torch_) == 7
    for (x1, y1), (x2, y2) in zip(tensor, torch_):  # the same windows in the same order
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    with pytest.raises(ConfigError, match="longer than the validation split"):
        load_split("tensor", "text-sample", train=False, seq_len=len(val))


def test_gpt_trains_below_the_unigram_baseline_and_samples(tmp_path, capsys):
    out = tmp_path / "gpt"
    summary = run(TrainConfig(model="gpt", dataset="text-sample", seq_len=32, batch_size=8, max_steps=80,
                              test_size=64, log_every=100, out=str(out), device="cpu"))
    metrics = summary["metrics"]
    baseline = text_data.unigram_entropy(text_data.windows(text_data.tokens("text-sample", kdata.data_root())[1],
                                                           32)[1][:64].flatten())
    assert metrics["final_test_loss"] < baseline - 0.15, (metrics["final_test_loss"], baseline)  # 2.78 vs 3.06
    assert metrics["final_test_ppl"] == pytest.approx(math.exp(metrics["final_test_loss"]))
    assert metrics["tokens_per_sec"] == pytest.approx(32 * metrics["samples_per_sec"])
    assert summary["config"]["optimizer"] == "adam" and summary["config"]["base_lr"] == 1e-3
    lines = capsys.readouterr().out.splitlines()
    assert any(" tokens/sec" in line and line.startswith("train | epoch 1/1 (100%)") for line in lines)
    assert metrics["mfu"] > 0 and metrics["flops"]["tokens_per_sample"] == 32
    assert any(line.startswith("epoch 1/1 | train loss") and " ppl " in line and " | MFU " in line for line in lines)

    texts = []
    for _ in range(2):
        assert main(["sample", "--out", str(out), "--tokens", "25", "--prompt", "The ", "--seed", "3"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("The ") and len(texts[0]) == 4 + 25 + 1  # + print's \n
    assert main(["sample", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("labkit: error:") == 1


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "gpt", "--dataset", "mnist-sample"], "is a language model"),
    (["train", "--model", "lenet", "--dataset", "text-sample"], "is text"),
    (["train", "--model", "lenet", "--seq-len", "16"], "--seq-len applies to text datasets"),
    (["train", "--model", "gpt-tiny", "--dataset", "tinyshakespeare", "--data-root", "{tmp}"], "labkit data fetch"),
    (["data", "fetch", "tinyshakespeare", "--root", "{tmp}"], "could not download tinyshakespeare"),
])
def test_bad_text_commands_are_one_line(argv, message, tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(text_data.urllib.request, "urlopen", offline)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "train" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error:") and message in err[0], err


def test_bpe_without_tiktoken_is_one_line(tmp_path, capsys):
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tiktoken is installed: the BPE dataset loads")
    assert main(["train", "--model", "gpt", "--dataset", "tinyshakespeare-bpe", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tiktoken" in err[0]
