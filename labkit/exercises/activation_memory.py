"""Notebook 12's exercise (``labkit check activation-memory FILE``): the activation bytes one transformer block
keeps for backward on one rank under tensor parallelism with sequence parallelism.

A block of this kit's GPT (``labkit/models/gpt.py``), micro-batch ``b`` sequences of ``s`` tokens, width ``h``,
``a`` heads, on one of ``tp`` ranks with ``--sequence-parallel``, keeps (:func:`labkit.parallel.memory.
layer_activation_bytes`, measured in ``tests/test_megatron.py``), in elements of ``bytes_per_element`` bytes:

* on the rank's ``s/tp`` tokens: the two layer norms' inputs (2·sbh/tp) and their mean and 1/std (4·sb/tp);
* all-gathered, whole: the inputs of q/k/v and of fc (2·sbh);
* on the rank's ``a/tp`` heads: q, k, v (3·sbh/tp), attention's output (sbh/tp), the GELU's input and output
  (8·sbh/tp), attention's log-sum-exp, one per head and token (a·sb/tp); never the ``s × s`` scores (the fused
  kernel recomputes them in backward).

``recompute="selective"`` recomputes attention's core from q, k, v: its log-sum-exp is not kept.

``block_activation_bytes(b, s, h, a, tp, recompute, bytes_per_element)`` returns that number. The checker
compares it with the kit's formula on several shapes, fp32 and bf16, and names the usual mistakes.
"""
from __future__ import annotations

from typing import Callable

from labkit.exercises import command
from labkit.parallel.memory import layer_activation_bytes

STARTER = '''\
def block_activation_bytes(b, s, h, a, tp, recompute="none", bytes_per_element=2):
    """Bytes one GPT block keeps for backward on one of tp ranks with sequence parallelism.

    b sequences of s tokens, width h, a heads; recompute "none" or "selective";
    bytes_per_element 4 (fp32) or 2 (bf16)
    """
    elements = 16 * s * b * h  # TODO: which tensors are split over tp, which over the sequence, which whole?
    return elements * bytes_per_element
'''

#: (b, s, h, a, tp, recompute, bytes per element)
CASES = [(2, 16, 32, 4, 2, "none", 4), (4, 64, 64, 8, 2, "none", 2), (1, 32, 48, 6, 2, "selective", 2),
         (2, 128, 64, 4, 4, "selective", 4), (8, 16, 16, 2, 2, "none", 2)]


def reference(b, s, h, a, tp, recompute="none", bytes_per_element=2):
    """The kit's formula (the one memory model's block term)."""
    return layer_activation_bytes(b, s, h, a, tp, True, recompute, bytes_per_element)


def _diagnose(got: float, case) -> str:
    b, s, h, a, tp, recompute, e = case
    want = reference(*case)
    where = f" (b={b}, s={s}, h={h}, a={a}, tp={tp}, recompute={recompute!r}, {e} bytes per element)"
    mistakes = [
        (layer_activation_bytes(b, s, h, a, 1, False, recompute, e),
         "nothing is divided by tp: the rank holds a/tp heads (q, k, v, attention's output, the log-sum-exp), 4h/tp "
         "of the MLP's hidden columns, and with sequence parallelism s/tp tokens of the layer norms"),
        (layer_activation_bytes(b, s, h, a, tp, False, recompute, e),
         "counted without sequence parallelism: with SP the two layer norms' inputs and their mean and 1/std are on "
         "the rank's s/tp tokens; only the all-gathered inputs of q/k/v and fc are whole"),
        (layer_activation_bytes(b, s, h, a, tp, True, "none", e) if recompute == "selective" else None,
         "the log-sum-exp is counted under selective recompute: attention's core is recomputed from q, k, v in "
         "backward, so its a·s·b/tp statistics are not kept"),
        (want + e * 3 * a * s * s * b / tp,
         "counted the s × s attention scores: this GPT's fused attention kernel never keeps them (it recomputes them "
         "in backward), and under selective recompute they would go too"),
        (want + e * a * s * s * b / tp,
         "counted the s × s attention scores: this GPT's fused attention kernel never keeps them, only a log-sum-exp "
         "per head and token"),
        (want * 4 / e if e == 2 else None,
         "counted 4 bytes per element: in bf16 an element is 2 bytes (use bytes_per_element)"),
        (want * 2 / e if e == 4 else None,
         "counted 2 bytes per element: in fp32 an element is 4 bytes (use bytes_per_element)"),
    ]
    for value, message in mistakes:
        if value is not None and abs(got - value) < 0.5 and abs(value - want) >= 0.5:
            return message + where
    return f"{got:g} bytes, expected {want:g}" + where


def check(block_activation_bytes: Callable) -> list[str]:
    """Problems of ``block_activation_bytes`` over :data:`CASES`; [] when it is right."""
    for case in CASES:
        b, s, h, a, tp, recompute, e = case
        try:
            got = float(block_activation_bytes(b, s, h, a, tp, recompute=recompute, bytes_per_element=e))
        except Exception as exc:  # the learner's code: say what it raised, do not crash
            return [f"block_activation_bytes raised {type(exc).__name__}: {exc}"]
        if abs(got - reference(*case)) >= 0.5:
            return [_diagnose(got, case)]
    return []


def main(argv: list[str]) -> int:
    return command("activation-memory", __doc__, "block_activation_bytes", check,
                   "block_activation_bytes is what one block keeps under tp with sequence parallelism", argv)
