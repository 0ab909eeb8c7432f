"""Text for the language models: characters (or GPT-2 BPE tokens) cut into windows of ``seq_len`` tokens.

    ds = text_split("text-sample", train=True, seq_len=128)      # resident windows on the CPU
    x, y = ds[0]                                                  # x: (128,) int64 tokens, y: x shifted by one
    tok = tokenizer("text-sample"); tok.decode(x.tolist())        # back to text

Names (:data:`TEXT_NAMES`):

- ``text-sample``: the reference documentation that ships with every Python (``pydoc_data.topics``, ~465 KB of
  English): all topic strings joined in sorted key order. No download, works offline everywhere.
- ``tinyshakespeare``: the 1 MB of Shakespeare of char-rnn; fetch it once on a machine with internet with
  ``labkit data fetch tinyshakespeare`` (it lands in ``<data root>/tinyshakespeare/input.txt``).
- ``tinyshakespeare-bpe``: the same text in GPT-2's byte-pair encoding (50,257 tokens) through ``tiktoken``,
  which must be installed (``pip install tiktoken``) and downloads its encoding once: not available offline.

Characters: the vocabulary is the sorted set of the text's characters, a token is a character's index in it.
Split: the first 90 % of the tokens train, the last 10 % validate (by position, deterministic). Examples are
non-overlapping windows: window ``i`` is ``x = tokens[iT : iT + T]``, ``y = tokens[iT + 1 : iT + T + 1]``, so
an epoch is a fixed ``(len - 1) // T`` windows, shuffled by the loader.
"""
from __future__ import annotations

import math
import os
import tempfile
import urllib.request
from functools import lru_cache
from pathlib import Path

import torch

from labkit.data.disk import text_file
from labkit.errors import ConfigError, DatasetMissing
from labkit.results import file_mode

#: the text datasets; every one is a next-token language-modelling task
TEXT_NAMES = ("text-sample", "tinyshakespeare", "tinyshakespeare-bpe")
#: ``--seq-len`` when not given
DEFAULT_SEQ_LEN = 128
#: share of the tokens (from the start) in the training split
TRAIN_FRACTION = 0.9
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
BPE_VOCAB = 50257  # GPT-2's encoding
_BPE_NEEDS = ("tinyshakespeare-bpe needs tiktoken and its GPT-2 encoding, which it downloads once: "
              "pip install tiktoken on a machine with internet (not available offline); "
              "offline: --dataset text-sample or tinyshakespeare")


def check_available(name: str) -> None:
    """DatasetMissing at once for a BPE dataset without tiktoken (before any work starts)."""
    if name.endswith("-bpe"):
        import importlib.util

        if importlib.util.find_spec("tiktoken") is None:
            raise DatasetMissing(_BPE_NEEDS)


def read_text(name: str, base: Path) -> str:
    """The whole text of ``name``; DatasetMissing with the fetch command if it is not on disk."""
    if name == "text-sample":
        from pydoc_data.topics import topics

        return "".join(topics[key] for key in sorted(topics))
    path = text_file(base)
    if not path.exists():
        raise DatasetMissing(f"dataset {name!r} is not on disk under {base}; fetch it once on a machine with "
                             f"internet: labkit data fetch tinyshakespeare --root {base} (or set LABKIT_DATA); "
                             f"offline stand-in: text-sample")
    return path.read_text(encoding="utf-8")


class CharTokenizer:
    """Characters <-> token ids over ``vocab`` (a sorted list of distinct characters)."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab
        self.index = {ch: i for i, ch in enumerate(vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ConfigError naming a character outside the vocabulary."""
        missing = sorted(set(text) - self.index.keys())
        if missing:
            raise ConfigError(f"characters not in the vocabulary: {''.join(missing)!r}")
        return [self.index[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


class BPETokenizer:
    """GPT-2's byte-pair encoding through ``tiktoken``."""

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise DatasetMissing(_BPE_NEEDS) from None
        try:
            self.encoding = tiktoken.get_encoding("gpt2")
        except Exception as err:  # tiktoken raises requests' and its own errors when the download fails
            raise DatasetMissing(f"{_BPE_NEEDS} ({str(err).splitlines()[0][:120]})") from None
        self.vocab_size = self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


@lru_cache(maxsize=4)
def tokenizer(name: str, base: Path = Path(".")) -> CharTokenizer | BPETokenizer:
    """The tokenizer of dataset ``name``: its characters' vocabulary, or GPT-2 BPE for ``-bpe``."""
    if name.endswith("-bpe"):
        return BPETokenizer()
    return CharTokenizer(sorted(set(read_text(name, base))))


def vocab_size(name: str, base: Path) -> int:
    """Number of distinct tokens of ``name`` (the GPT's vocabulary); BPE's without loading tiktoken."""
    return BPE_VOCAB if name.endswith("-bpe") else tokenizer(name, Path(base)).vocab_size


@lru_cache(maxsize=4)
def tokens(name: str, base: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens), int64, split by position at :data:`TRAIN_FRACTION`."""
    tok = tokenizer(name, base)  # first: tiktoken's absence is the error a -bpe name gets
    ids = torch.tensor(tok.encode(read_text(name.removesuffix("-bpe"), base)), dtype=torch.int64)
    cut = int(len(ids) * TRAIN_FRACTION)
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: ``x`` (n, T) = ``ids[iT : iT + T]``, ``y`` (n, T) = ``ids[iT + 1 : iT + T + 1]``,
    ``n = (len - 1) // T``."""
    n = (len(ids) - 1) // seq_len
    x = ids[:n * seq_len].view(n, seq_len)
    y = ids[1:n * seq_len + 1].view(n, seq_len)
    return x, y


class TensorTokens(torch.utils.data.Dataset):
    """A split's windows held as tensors on one device: ``data`` (N, T) and ``targets`` (N, T), int64; batches
    are one gather (the interface of :class:`labkit.data.tensor.TensorImages`, which
    :class:`~labkit.data.loader.TensorLoader` walks)."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor):
        self.data, self.targets = data, targets

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def head(self, n: int | None) -> TensorTokens:
        """The first ``n`` windows (all if ``n`` is None or larger), sharing storage."""
        return self if n is None or n >= len(self) else TensorTokens(self.data[:n], self.targets[:n])

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``index`` (B,) as ``(x (B, T), y (B, T))``."""
        return self.data[index], self.targets[index]

    def as_dataset(self) -> torch.utils.data.TensorDataset:
        """The same windows as a plain dataset, for ``torch.utils.data.DataLoader`` (``--loader torch``)."""
        return torch.utils.data.TensorDataset(self.data, self.targets)


def text_split(name: str, train: bool, base: Path, seq_len: int | None = None, limit: int | None = None,
               device: torch.device | str = "cpu") -> TensorTokens:
    """The train or validation windows of ``name``, the first ``limit`` of them, on ``device``.

    Raises:
        ConfigError: a split shorter than one window of ``seq_len`` tokens.
        DatasetMissing: the text is not on disk (or tiktoken is missing for ``-bpe``).
    """
    seq_len = seq_len or DEFAULT_SEQ_LEN
    ids = tokens(name, Path(base))[0 if train else 1]
    if len(ids) <= seq_len:
        raise ConfigError(f"--seq-len {seq_len} is longer than the {'training' if train else 'validation'} split "
                          f"of {name} ({len(ids)} tokens); use a shorter --seq-len")
    x, y = windows(ids, seq_len)
    return TensorTokens(x.to(device), y.to(device)).head(limit)


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy in nats of the token distribution of ``ids``: the loss of the best model that ignores context."""
    counts = torch.bincount(ids).double()
    p = counts[counts > 0] / len(ids)
    return float(-(p * p.log()).sum())


def fetch(name: str, base: Path) -> None:
    """Download tinyshakespeare into ``base`` (atomically); DatasetMissing with the reason when offline."""
    if name == "text-sample":
        print(f"{name}: offline dataset, nothing to download")
        return
    if name.endswith("-bpe"):
        BPETokenizer()  # tiktoken's one-time download of the encoding
    path = text_file(base)
    if not path.exists():
        try:
            with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=60) as response:
                blob = response.read()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
            os.fchmod(fd, file_mode())
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as err:  # no network: URLError, an OSError
            reason = str(getattr(err, "reason", err)).strip().splitlines()[-1]
            raise DatasetMissing(f"could not download {name} into {base} ({reason}); run labkit data fetch {name} "
                                 f"on a machine with internet, e.g. a cluster login node") from err
    print(f"{name}: ready in {base} ({math.ceil(path.stat().st_size / 1024)} KB)")
