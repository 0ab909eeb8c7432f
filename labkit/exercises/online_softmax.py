"""Notebook 10's exercise (``labkit check online-softmax FILE``): merge two partial attention results.

Ring attention (:mod:`labkit.parallel.ring_attention`) computes the attention of a rank's queries one block of
keys at a time. A block over keys ``a`` gives its output ``out_a = softmax(s_a) v_a`` (softmax over the block's
keys only) and its log-sum-exp ``lse_a = log Σ_j exp(s_aj)``, one per query. Two blocks make the result over
both key sets (the online softmax):

* ``lse = log(exp(lse_a) + exp(lse_b))``, computed without overflow (``torch.logaddexp``, or subtract the
  larger of the two before exponentiating);
* ``out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b``: each partial output is rescaled by the share
  of the softmax's denominator its keys hold; the two weights sum to 1.

``merge(out_a, lse_a, out_b, lse_b)`` takes outputs (B, H, T, D) and log-sum-exps (B, H, T) and returns
``(out, lse)``. The checker compares with ``scaled_dot_product_attention`` over all the keys at once and names
the usual mistakes.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from labkit.exercises import command

STARTER = '''\
import torch


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of blocks a and b from the two blocks' results.

    out_a, out_b: (B, H, T, D) softmax-weighted values of each block's keys alone
    lse_a, lse_b: (B, H, T) log-sum-exp of each block's scores
    returns (out, lse) over all the keys
    """
    lse = lse_a  # TODO: the log-sum-exp over both blocks (without overflow)
    out = out_a + out_b  # TODO: rescale each partial output by its share exp(lse_x - lse)
    return out, lse
'''

#: (seed, queries, keys in block a, keys in block b, score scale): the last one's scores reach thousands, where
#: exp() of a log-sum-exp overflows even in float64
CASES = [(0, 5, 3, 4, 0.5), (1, 4, 6, 2, 1.0), (2, 3, 4, 4, 1000.0)]
TOL = dict(rtol=1e-9, atol=1e-10)


def _blocks(seed: int, t: int, n_a: int, n_b: int, scale: float):
    """Queries, keys, values and the two blocks' (out, lse), in float64, computed on their own keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, t, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n_a + n_b, 4, generator=g, dtype=torch.float64) for _ in range(2))
    parts = []
    for keys in (slice(0, n_a), slice(n_a, None)):
        s = q @ k[..., keys, :].transpose(-2, -1) * scale
        parts += [torch.softmax(s, -1) @ v[..., keys, :], torch.logsumexp(s, -1)]
    return q, k, v, parts


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and torch.allclose(a, b, **TOL)


def _weighted(parts, w_a, w_b):
    return w_a.unsqueeze(-1) * parts[0] + w_b.unsqueeze(-1) * parts[2]


def _diagnose_out(got, want, parts, lse) -> str:
    out_a, lse_a, out_b, lse_b = parts
    m = torch.maximum(lse_a, lse_b)
    if not torch.isfinite(got).all():
        return ("out holds inf or nan: exp() of a log-sum-exp overflows when the scores are large; exponentiate "
                "differences only, exp(lse_a - lse), never exp(lse_a) on its own")
    if _close(got, out_a + out_b) or _close(got, (out_a + out_b) / 2):
        return ("out adds the partial outputs as they are: rescale each by its share of the softmax's "
                "denominator, exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b")
    if _close(got, _weighted(parts, torch.exp(lse - lse_a), torch.exp(lse - lse_b))):
        return "out's weights have the wrong sign: exp(lse_a - lse), not exp(lse - lse_a) (each weight is <= 1)"
    if _close(got, _weighted(parts, torch.exp(lse_a - m), torch.exp(lse_b - m))):
        return ("out is rescaled by exp(lse_x - max) but not renormalised: divide by exp(lse_a - max) + "
                "exp(lse_b - max), i.e. use exp(lse_x - lse) with the merged log-sum-exp, so the weights sum to 1")
    diff = (got - want).abs().max().item() if got.shape == want.shape else None
    return (f"out differs from attention over all the keys by up to {diff:.3g}" if diff is not None else
            f"out has shape {tuple(got.shape)}, expected {tuple(want.shape)} (the shape of out_a)")


def _diagnose_lse(got, want, parts) -> str:
    lse_a, lse_b = parts[1], parts[3]
    if got.shape == want.shape and torch.equal(got, torch.maximum(lse_a, lse_b)):
        return ("lse is the max of the two: the log-sum-exp over both blocks is log(exp(lse_a) + exp(lse_b)) "
                "(torch.logaddexp), larger than either")
    if not torch.isfinite(got).all():
        return "lse holds inf or nan: exp(lse) overflows; use torch.logaddexp(lse_a, lse_b) or subtract the max first"
    if got.shape == want.shape and (_close(got, lse_a) or _close(got, lse_b)):
        return "lse is one block's log-sum-exp: it must cover both blocks, log(exp(lse_a) + exp(lse_b))"
    if got.shape != want.shape:
        return f"lse has shape {tuple(got.shape)}, expected {tuple(want.shape)} (the shape of lse_a)"
    return f"lse differs from the log-sum-exp over all the keys by up to {(got - want).abs().max().item():.3g}"


def check(merge: Callable) -> list[str]:
    """Problems of ``merge`` over three pairs of blocks (the last with large scores); [] when it is right."""
    for seed, t, n_a, n_b, scale in CASES:
        q, k, v, parts = _blocks(seed, t, n_a, n_b, scale)
        want_out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        want_lse = torch.logsumexp(q @ k.transpose(-2, -1) * scale, -1)
        try:
            with torch.no_grad():
                got_out, got_lse = merge(*(p.clone() for p in parts))
        except Exception as exc:  # the learner's code: say what it raised, do not crash
            return [f"merge raised {type(exc).__name__}: {exc}"]
        got_out, got_lse = torch.as_tensor(got_out), torch.as_tensor(got_lse)
        where = f" (blocks of {n_a} and {n_b} keys, scores × {scale:g})"
        problems = []
        if not _close(got_out, want_out):
            problems.append(_diagnose_out(got_out, want_out, parts, want_lse) + where)
        if not _close(got_lse, want_lse):
            problems.append(_diagnose_lse(got_lse, want_lse, parts) + where)
        if problems:
            return problems
    return []


def reference(out_a, lse_a, out_b, lse_b):
    """The solution, written from the rule."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b, lse


def main(argv: list[str]) -> int:
    return command("online-softmax", __doc__, "merge", check,
                   "merge equals attention over both blocks' keys (the online softmax of ring attention)", argv)
