"""What Megatron tensor (+ sequence) parallelism costs a rank per step, as formulas the lesson and the advisor
call; ``tests/test_megatron.py`` counts the same quantities on real ranks and asserts them equal.

Notation: ``L`` blocks, batch ``B`` (``b``), sequence ``T`` (``s``), width ``C`` (``h``), ``a`` heads,
vocabulary ``V``, ``t`` tensor-parallel ranks, ``e`` bytes per element (4: fp32).

**Bytes per step** (:func:`tp_step_bytes`), the size of this rank's part handed to each collective (all-reduce:
the whole tensor; all-gather: the shard it sends; reduce-scatter: the shard it receives):

* without SP, all-reduces only. Forward: the embedding's ``g`` (B·T·C), two ``g`` per block (after attention's
  and the MLP's row-parallel projection), and the vocabulary-parallel loss: the row maxima (B·T) and
  [Σ exp, target logit] (2·B·T). Backward: two ``f`` per block (the layer norms' outputs entering q/k/v and fc)
  and the final layer norm's ``f`` into the head. Total ``e·[(4L + 2)·B·T·C + 3·B·T]``.
* with SP, each all-reduce of B·T·C becomes a reduce-scatter or all-gather of B·T·C/t: forward a reduce-scatter
  after the embedding, per block 2 all-gathers and 2 reduce-scatters, an all-gather into the head; backward the
  conjugate of each. ``e·(4L + 2)·B·T·C/t`` of all-gather and the same of reduce-scatter; all-reduces: the loss's
  ``3·B·T`` and one sum of the gradients of the parameters used on sequence shards (per block 2 layer norms and
  2 row-parallel biases, the final layer norm, the (block_size, C) position table).

A ring all-reduce of n elements sends ``2(t−1)/t·n``, an all-gather or reduce-scatter of shard n/t sends
``(t−1)/t·n``: SP moves the same bytes over the wire (:func:`ring_wire_bytes`).

**Activation memory** (:func:`labkit.parallel.memory.layer_activation_bytes`, the block term of the one memory
model): the tensors one block saves for backward, each storage once, on one rank. Korthikanti et al. (2022) count, in 2-byte units with dropout masks and the a·s²
attention matrix stored, ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` without SP and ``s·b·h/t·(34 + 5·a·s/h)`` with it
(:func:`korthikanti_bytes_per_layer`). This GPT, as it runs here (dropout 0: no masks; SDPA's fused kernel saves
q, k, v, its output and a per-row log-sum-exp instead of the s×s scores), saves in elements of ``e`` bytes:

* replicated without SP: the layer norms' inputs (2·sbh), the inputs of q/k/v and of fc (2·sbh), the layer
  norms' mean and 1/std (4·sb);
* split by heads: q, k, v (3·sbh/t), attention's output = the projection's input (sbh/t), the GELU's input and
  output (8·sbh/t), the log-sum-exp (a·s·b/t).

Without SP ``e·[sbh·(4 + 12/t) + 4·sb + a·sb/t]``. With SP the layer norms and their statistics are on T/t
tokens, but the all-gathered inputs of q/k/v and fc are kept whole: ``e·[sbh·(2 + 14/t) + 4·sb/t + a·sb/t]``.
(Megatron keeps only the shard there and all-gathers it again in backward, one more all-gather per block
pair, to reach ``17·sbh/t``; this kit does not.)
"""
from __future__ import annotations

from labkit.models.gpt import GPTConfig


def sequence_parallel_param_count(cfg: GPTConfig) -> int:
    """Elements of the parameters whose gradients SP sums over the group (layer norms, row biases, positions)."""
    ln = cfg.n_embd * (2 if cfg.bias else 1)
    row_biases = 2 * cfg.n_embd if cfg.bias else 0
    return cfg.n_layer * (2 * ln + row_biases) + ln + cfg.block_size * cfg.n_embd


def tp_step_bytes(cfg: GPTConfig, batch: int, seq: int, tp: int, sequence_parallel: bool,
                  bytes_per_element: int = 4) -> dict[str, int]:
    """Bytes of this rank's parts handed to each kind of collective in one forward + backward (see above)."""
    e, L = bytes_per_element, cfg.n_layer
    btc, bt = batch * seq * cfg.n_embd, batch * seq
    if not sequence_parallel or tp == 1:
        return {"all_reduce": e * ((4 * L + 2) * btc + 3 * bt)}
    shard = e * (4 * L + 2) * btc // tp
    return {"reduce_scatter": shard, "all_gather": shard,
            "all_reduce": e * (3 * bt + sequence_parallel_param_count(cfg))}


def ring_wire_bytes(step_bytes: dict[str, int], tp: int) -> float:
    """Bytes a rank sends with ring algorithms for :func:`tp_step_bytes`'s parts."""
    return sum(n * (2 * (tp - 1) / tp if op == "all_reduce" else tp - 1) for op, n in step_bytes.items())


def korthikanti_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, tp: int,
                                sequence_parallel: bool) -> float:
    """Korthikanti et al. (2022), eq. 2 and 4: bytes per layer in 16-bit with dropout and the s×s scores saved."""
    s, b, h, a, t = seq, batch, hidden, heads, tp
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
