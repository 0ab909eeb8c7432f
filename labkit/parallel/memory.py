"""Where a GPT's training memory goes on one rank, predicted: parameters, gradients, optimizer state and the
activations of each layer, with and without recomputation, under every mesh dimension; the one formula the
lesson (``notebooks/12_flops_and_memory.ipynb``, measured there) and the advisor's mesh search
(:func:`labkit.parallel.pricing.price_mesh`) both call. Torch-free.

    predict_memory(shape, batch=8)                                 # one process: {"parameters": ..., "peak": ...}
    predict_memory(shape, 8, tp=2, sequence_parallel=True, recompute="full")
    layer_activation_bytes(b=8, s=128, h=128, a=4, tp=2, sp=True)  # one block, one rank

Notation: ``L`` blocks, micro-batch ``b`` sequences of ``s`` tokens (``s = T/cp`` on a context-parallel rank),
width ``h`` (``C``), ``a`` heads, vocabulary ``V``, ``t`` tensor-parallel ranks, ``e`` bytes per activation
element (4: fp32, 2: bf16).

**One block's activations** (:func:`layer_activation_bytes`): what autograd keeps for backward, each storage
once, as this GPT runs (dropout 0: no masks; scaled_dot_product_attention's fused kernel, and ring attention
under cp, keep q, k, v, the output and a per-row log-sum-exp, never the ``s × s`` scores):

* ``none`` without SP: the layer norms' inputs, the inputs of q/k/v and of fc, replicated (4·sbh), the layer
  norms' mean and 1/std (4·sb); split by heads: q, k, v (3·sbh/t), attention's output (sbh/t), the GELU's input
  and output (8·sbh/t), the log-sum-exp (a·sb/t)::

      e·[sbh·(4 + 12/t) + 4·sb + a·sb/t]

* ``none`` with SP: the layer norms and their statistics on s/t tokens, the all-gathered inputs of q/k/v and fc
  kept whole::

      e·[sbh·(2 + 14/t) + 4·sb/t + a·sb/t]

* ``selective``: attention's core, softmax(q kᵀ) v, is recomputed from q, k, v: the log-sum-exp goes
  (``− e·a·sb/t``; ring attention, not recomputed, keeps it). With dropout on, the core is where the math kernel
  keeps its three ``a·s²·b/t`` tensors (softmax, mask, dropped scores), the ``5·a·s/h`` term of Korthikanti et
  al. (:func:`labkit.parallel.megatron_cost.korthikanti_bytes_per_layer`) that selective recompute removes;
* ``full``: the block's input only, ``e·sbh`` (``e·sbh/t`` with SP); in backward one block's ``none``
  activations are rebuilt at a time.

**The rest of a stage's activations**: the last stage's head keeps ``ln_f``'s input, output and statistics and
the log-softmax over its ``V/t`` vocabulary: ``e·b·s·(2·h + 2 + V/t)``; the token ids and the targets are int64
(``16·b·s``), the positions too (``8·s``), the loss one float (4). A pipeline stage holds ``m_f`` micro-batches in flight (1F1B: ``min(pp, m)``; GPipe: ``m``;
:func:`labkit.parallel.pricing.pipeline_step` simulates it), each with ``L/pp`` blocks.

**Weights** on a rank: ``P`` parameters of its stage (``(L/pp)·(12h² + 13h) + (V + T)·h``, divided by ``t``),
``p`` bytes each, ``g`` bytes per gradient, ``o`` bytes of optimizer state per parameter (Adam in fp32: 8, its
two moments; in mixed precision: 12, with the fp32 master copy). ZeRO over the ``d`` data-parallel ranks that
hold the same weights: stage 1 shards the optimizer state, 2 also the gradients, 3 (and FSDP) also the
parameters::

    W = p·P / d₃        G = g·P / d₂        O = o·P / d₁        (d_k = d if ZeRO ≥ k else 1)

**The peak** is the largest of three moments of a step (gradients are freed before each forward,
``zero_grad(set_to_none=True)``):

1. the start of backward: ``W + O + A + 2·4·b·s·V/t`` (every activation kept, plus the loss's two fp32
   temporaries the size of the logits: the log-softmax's gradient and the logits');
2. under ``full``, the backward of the last block: ``W + O + G_h + A + A₁`` (``A`` now the kept inputs, ``A₁`` one
   block's ``none`` activations rebuilt, ``G_h`` the gradients already made, the head's and one block's:
   ``G · (V·h + 12h² + 13h) / (t·P)``);
3. the end of backward: ``W + O + G``.

Not counted: the optimizer's own temporaries during its step (PyTorch's foreach Adam), the allocator's rounding
and caching, communication buffers, a process's runtime (on a CPU, the libraries' hundreds of MB: the lesson
measures tensors, not the process).
"""
from __future__ import annotations

RECOMPUTE = ("none", "full", "selective")


def layer_activation_bytes(b: int, s: int, h: int, a: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", e: int = 4, ring: bool = False) -> float:
    """Bytes one block keeps for backward on one rank (the module docstring's formulas, in its order); ``s`` the
    rank's tokens per sequence, ``ring``: attention is ring attention (cp > 1), which keeps its log-sum-exp."""
    t = tp if tp > 1 else 1
    sp = sp and t > 1
    if recompute == "full":
        return e * s * b * h / (t if sp else 1)
    if sp:
        elements = s * b * h * (2 + 14 / t) + 4 * s * b / t + a * s * b / t
    else:
        elements = s * b * h * (4 + 12 / t) + 4 * s * b + a * s * b / t
    if recompute == "selective" and not ring:
        elements -= a * s * b / t
    return e * elements


def stage_params(n_layer: int, n_embd: int, vocab_size: int, seq: int, pp: int = 1, tp: int = 1) -> float:
    """``P`` on one rank: ``((L/pp)·(12h² + 13h) + (V + T)·h) / t`` (the module docstring)."""
    h = n_embd
    return (n_layer / pp * (12 * h * h + 13 * h) + (vocab_size + seq) * h) / tp


def weight_bytes(replicas: list[tuple[float, int]], zero: int = 0, param_bytes: float = 4, grad_bytes: float = 4,
                 optimizer_bytes: float = 8) -> dict[str, float]:
    """``W``, ``G``, ``O`` of the module docstring summed over ``replicas`` (``[(P, d), ...]``: parameters held alike
    by ``d`` ranks), ZeRO stage ``zero`` sharding each over its ``d``."""
    W = G = O = 0.0
    for P, d in replicas:
        d1, d2, d3 = (d if zero >= k else 1 for k in (1, 2, 3))
        W, G, O = W + param_bytes * P / d3, G + grad_bytes * P / d2, O + optimizer_bytes * P / d1
    return {"parameters": W, "gradients": G, "optimizer": O}


def predict_memory(shape, batch: int, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
                   sequence_parallel: bool = False, recompute: str | bool = "none", in_flight: float = 1,
                   replicas: list[tuple[float, int]] | None = None, param_bytes: int = 4, grad_bytes: int = 4,
                   optimizer_bytes: int = 8, e: int = 4, extra_layer_bytes: float = 0.0) -> dict:
    """The fullest rank's memory (the module docstring's terms, computed in its order) for a GPT ``shape`` (any
    object with ``n_layer``, ``n_head``, ``n_embd``, ``vocab_size``, ``seq``: a :class:`GPTConfig` with
    ``seq = block_size`` or :class:`labkit.parallel.pricing.GPTShape`) on micro-batches of ``batch`` sequences
    per rank; ``replicas``: ``[(P, d), ...]``, the rank's parameters and the ranks ZeRO shards them over, when the
    caller counts them itself (default ``[(P, dp)]``; the advisor's: a stage over ``dp·cp``, a MoE's experts over
    ``dp`` and its shared weights over ``dp·ep``);
    ``extra_layer_bytes``: more activation bytes per block (a MoE's extra experts); ``recompute``: True is
    ``"full"``.

    Returns ``{"parameters", "gradients", "optimizer", "activations", "layer", "phases", "peak", "at_peak"}``:
    the whole-step terms in bytes, one block's activations, the three moments' totals, the largest, and its
    terms (``at_peak``: parameters, optimizer, gradients, activations, temporaries, summing to ``peak``).
    """
    mode = {True: "full", False: "none"}.get(recompute, recompute)
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    L, h, a, V = shape.n_layer, shape.n_embd, shape.n_head, shape.vocab_size
    seq = getattr(shape, "seq", None) or shape.block_size
    b, s, t = batch, seq // cp, tp
    # weights: W, G, O, sharded by ZeRO stage over dp
    weights = weight_bytes(replicas or [(stage_params(L, h, V, seq, pp, t), dp)], zero, param_bytes, grad_bytes,
                           optimizer_bytes)
    W, G, O = weights["parameters"], weights["gradients"], weights["optimizer"]
    # activations: L/pp blocks per micro-batch in flight, the head and the ids
    ring = cp > 1
    layer = layer_activation_bytes(b, s, h, a, t, sequence_parallel, mode, e, ring) + extra_layer_bytes
    head = e * b * s * (2 * h + 2 + V / t) + 16 * b * s + 8 * s + 4
    A = in_flight * L / pp * layer + head
    # the peak: three moments of the step
    loss_temps = 2 * 4 * b * s * V / t
    phases = {"backward start": W + O + A + loss_temps, "backward end": W + O + G}
    at = {"backward start": {"parameters": W, "optimizer": O, "gradients": 0.0, "activations": A,
                             "temporaries": loss_temps},
          "backward end": {"parameters": W, "optimizer": O, "gradients": G, "activations": 0.0, "temporaries": 0.0}}
    if mode == "full":
        rebuilt = layer_activation_bytes(b, s, h, a, t, sequence_parallel, "none", e, ring) + extra_layer_bytes
        made = G * (V * h + 12 * h * h + 13 * h) / (t * stage_params(L, h, V, seq, pp, t))
        phases["last block's backward"] = W + O + made + A + rebuilt
        at["last block's backward"] = {"parameters": W, "optimizer": O, "gradients": made,
                                       "activations": A + rebuilt, "temporaries": 0.0}
    moment = max(phases, key=phases.get)
    return {"parameters": W, "gradients": G, "optimizer": O, "activations": A, "layer": layer, "phases": phases,
            "moment": moment, "peak": phases[moment], "at_peak": at[moment]}
