r"""K-FAC: a Kronecker-factored natural-gradient preconditioner for any torch optimizer.

The math, in the order :meth:`KFAC.step` codes it
-------------------------------------------------
**Second order.** SGD steps along ``-∇L``; a natural-gradient step ``w ← w - α F⁻¹ ∇L`` first rescales the
gradient by the inverse Fisher ``F = E[∇ log p ∇ log pᵀ]`` (for our losses the Gauss-Newton matrix, a PSD
stand-in for the Hessian), so flat directions get longer steps and sharp ones shorter. F has (#params)²
entries: far too big to store, let alone invert.

**Block diagonal.** K-FAC keeps one block per layer, ``F ≈ diag(F_1, …, F_L)``, so ``F⁻¹ = diag(F_ℓ⁻¹)``.

**Kronecker factors.** A layer computes ``s = W ā`` (``ā = [a; 1]``, bias = last column of W), so with
``g = ∂ℓ/∂s`` its gradient is ``∇W = g āᵀ`` and ``vec(∇W) = ā ⊗ g``. Hence
``F_ℓ = E[ā āᵀ ⊗ g gᵀ] ≈ E[ā āᵀ] ⊗ E[g gᵀ] = A ⊗ G``, estimated from the batch with the real labels (the
empirical Fisher, as the seed's kfac_pytorch does; details in :mod:`labkit.optim.kfac.layers`, where Conv2d
uses unfolded patches as in Grosse & Martens 2016).

**Cheap inverse.** ``(A ⊗ G)⁻¹ = A⁻¹ ⊗ G⁻¹`` and ``(A ⊗ G) vec(X) = vec(G X A)``, so
``F_ℓ⁻¹ vec(∇W) = vec(G⁻¹ ∇W A⁻¹)``: two inverses of size d_in and d_out instead of one of d_in·d_out.

**Damping.** ``(F_ℓ + γI)⁻¹`` keeps tiny eigenvalues from blowing the step up. Two methods:

* ``eigen``: ``A = Q_A Λ_A Q_Aᵀ``, ``G = Q_G Λ_G Q_Gᵀ`` and
  ``P = Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ`` — *exactly* ``(A ⊗ G + γI)⁻¹ vec(∇W)``.
* ``inverse``: ``P = (G + √γ/π I)⁻¹ ∇W (A + π√γ I)⁻¹`` with ``π² = (tr A/d_in)/(tr G/d_out)`` — the
  inverse of ``A⊗G + γI + √γ(π I⊗G + A⊗I/π)``: cheaper (Cholesky) but damped more than ``γI``.

**Running averages and intervals.** Every ``factor_update_freq`` steps ``A ← ε A + (1-ε) A_batch`` (same
for G, ε = ``factor_decay``); every ``inv_update_freq`` steps the decompositions are recomputed; every
step the gradient is preconditioned with the latest ones.

**KL clipping** (Ba et al. 2017): the step is scaled by ``ν = min(1, √(κ / (α² Σ_ℓ ⟨P_ℓ, ∇W_ℓ⟩)))`` with
α the learning rate, bounding the change of the model's output distribution.

The gradients are rewritten *in place* between ``loss.backward()`` (and DDP's gradient all-reduce) and
``optimizer.step()``, so K-FAC works with SGD, Adam or any torch optimizer::

    kfac = KFAC(model, optimizer=optimizer)
    loss.backward(); kfac.step(); optimizer.step()

Under ``torch.distributed`` the factors are averaged over the ranks and the decompositions are split
between them (:mod:`labkit.optim.kfac.distributed`).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from labkit.dist.group import DistEnv, print0
from labkit.errors import CheckpointError, ConfigError, LabkitError
from labkit.optim.kfac import distributed as kfac_dist
from labkit.optim.kfac import kaisa as kfac_kaisa
from labkit.optim.kfac.clip import KLClip, inner_product
from labkit.optim.kfac.layers import LayerFactors, supports
from labkit.optim.kfac.linalg import precondition_batched
from labkit.optim.kfac.options import (
    Approx,
    Broadcast,
    Method,
    add_arguments,
    kwargs_from_options,
    parse_enum,
    validate,
)

__all__ = ["KFAC", "Approx", "Broadcast", "Method", "add_arguments", "from_options"]


class KFAC:
    """K-FAC gradient preconditioner for the Linear and Conv2d layers of ``model``.

    Args:
        model: the unwrapped model (not the DDP wrapper); its Linear and Conv2d layers are registered.
        damping: γ > 0, see the module docstring for how each method applies it.
        factor_decay: ε in [0, 1): weight of the old running average.
        kl_clip: κ >= 0; 0 disables KL clipping.
        factor_update_freq: steps between factor updates (>= 1); ``--kfac-update-freq``.
        inv_update_freq: steps between decomposition updates (>= 1; default ``factor_update_freq``).
        method: ``"eigen"`` or ``"inverse"``.
        approx: ``"expand"`` (Grosse & Martens 2016) or ``"reduce"`` (cheaper Conv2d factors).
        broadcast: ``"decompositions"`` or ``"gradients"`` (only matters on several ranks).
        grad_worker_fraction: KAISA's f in [1/W, 1] (f·W must divide W): the fraction of ranks that hold
            each layer's decomposition (:mod:`labkit.optim.kfac.kaisa`); replaces ``broadcast`` when given.
        optimizer: where KL clipping reads the learning rate; if omitted, the first optimizer that steps
            this model's parameters is attached (and that step's clipping applied just before it).
        skip_layers: module names or class names not to precondition.
        timed: synchronise the GPU around each phase so :attr:`timings` are exact (benchmarks).

    The loss must be a mean over the batch and unscaled (bf16 autocast is fine; an fp16 ``GradScaler``
    would scale G). On several ranks every rank must hold the whole model (``single`` or ``ddp``): the
    factors are averaged over all ranks of the default process group.

    Attributes:
        timings: seconds per phase (factors, communication, decomposition, precondition) measured with
            :attr:`clock` (``time.perf_counter``; a benchmark on a shared CPU may use ``time.process_time``).
        bytes_sent: payload bytes of K-FAC's own collectives, per kind.
    """

    def __init__(self, model: nn.Module, *, damping: float = 0.3, factor_decay: float = 0.95,
                 kl_clip: float = 0.001, factor_update_freq: int = 10, inv_update_freq: int | None = None,
                 method: str | Method = "eigen", approx: str | Approx = "expand",
                 broadcast: str | Broadcast = "decompositions", grad_worker_fraction: float | None = None,
                 optimizer: torch.optim.Optimizer | None = None, skip_layers: Sequence[str] = (),
                 timed: bool = False):
        inv_update_freq = factor_update_freq if inv_update_freq is None else inv_update_freq
        validate(damping, factor_decay, kl_clip, factor_update_freq, inv_update_freq)
        self.damping, self.factor_decay, self.kl_clip = float(damping), float(factor_decay), float(kl_clip)
        self.factor_update_freq, self.inv_update_freq = factor_update_freq, inv_update_freq
        self.method = parse_enum(Method, method, "--kfac-method")
        self.approx = parse_enum(Approx, approx, "--kfac-approx")
        self.broadcast = parse_enum(Broadcast, broadcast, "--kfac-broadcast")
        self.timed = timed
        self.steps = 0
        self._handles: list = []
        self.layers = self._register(model, set(skip_layers))
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        if self.world_size > 1:
            self._check_same_model()
        self.owners = kfac_dist.assign_owners([l.decomposition_cost() for l in self.layers], self.world_size)
        self.grad_worker_fraction = grad_worker_fraction
        self.kaisa = None
        if grad_worker_fraction is not None:
            g = kfac_kaisa.grad_workers(self.world_size, grad_worker_fraction)
            self.kaisa = kfac_kaisa.GradWorkerLayout(self.world_size, g, self.rank) if self.world_size > 1 else None
        self.clock = time.perf_counter
        self.timings = {"factors": 0.0, "communication": 0.0, "decomposition": 0.0, "precondition": 0.0}
        self.bytes_sent = {"factors": 0, "decompositions": 0, "gradients": 0}
        self._stale = True  # decompositions must be (re)computed at the next step
        self._closed = False
        self._arm(True)  # step 0 collects factors
        self._stacked: dict[tuple, tuple] = {}  # shape -> (decompositions, damping, stacked operands)
        self._step_buffers: tuple[list, _Buffers] | None = None  # (layers and holds, their buffers)
        self.clip = (KLClip(self.kl_clip, self.layers[0].module.weight, self._scale_grads, optimizer)
                     if self.kl_clip > 0 else None)

    # ----- set-up ------------------------------------------------------------------------------------------

    def _register(self, model: nn.Module, skip: set[str]) -> list[LayerFactors]:
        layers = []
        for name, module in model.named_modules():
            if name in skip or type(module).__name__ in skip or not supports(module):
                continue
            dtype = torch.float64 if module.weight.dtype == torch.float64 else torch.float32
            layers.append(LayerFactors(name, module, dtype, self.approx.value))
        if not layers:
            kinds = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
            raise ConfigError(f"K-FAC found no Linear or Conv2d layer to precondition in {type(model).__name__} "
                              f"(it has: {', '.join(kinds) or 'no submodules'}); use --optimizer sgd for this model")
        return layers

    def _check_same_model(self) -> None:
        # Factor all-reduces need the same layers on every rank; a pipeline stage would hang them instead.
        signature = [(l.name, l.d_in, l.d_out) for l in self.layers]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, signature)
        if any(s != signature for s in gathered):
            raise ConfigError("K-FAC needs the whole model on every rank (data parallelism: --strategy single or "
                              "ddp), but the ranks hold different layers")

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Read the learning rate for KL clipping from ``optimizer`` from now on."""
        if self.clip is not None:
            self.clip.attach(optimizer)

    def close(self) -> None:
        """Remove every hook K-FAC installed (the model trains as if K-FAC had never been attached)."""
        self._closed = True
        self._arm(False)
        if self.clip is not None:
            self.clip.close()

    def _arm(self, capture: bool) -> None:
        """The capture hooks on the registered layers when the next step collects factors, and none otherwise:
        between factor updates a forward or backward pass runs no K-FAC code at all."""
        if capture and not self._handles and not self._closed:
            self._handles = [layer.module.register_forward_hook(
                lambda m, inputs, output, layer=layer: self._forward_hook(layer, inputs, output))
                for layer in self.layers]
        elif not capture:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    # ----- the step --------------------------------------------------------------------------------------------

    def step(self, lr: float | None = None) -> None:
        """Update factors/decompositions when due and precondition every registered gradient in place.

        Call once per optimizer step, after ``loss.backward()`` (and the gradient all-reduce) and before
        ``optimizer.step()``. ``lr`` overrides the attached optimizer's learning rate for KL clipping.
        """
        if self.steps % self.factor_update_freq == 0:
            self._update_factors()
        if self._stale or self.steps % self.inv_update_freq == 0:
            self._update_decompositions()
        self._precondition(lr)
        self.steps += 1
        self._arm(self.steps % self.factor_update_freq == 0)

    def _update_factors(self) -> None:
        started = self._clock()
        active = [l for l in self.layers if l.has_batch()]
        if not active:
            raise LabkitError(f"K-FAC step {self.steps} found no captured activations: call kfac.step() once after "
                              "each loss.backward() of a forward pass in training mode")
        batches = [l.pop_batch() for l in active]
        for layer in self.layers:
            layer.clear_batch()
        self.timings["factors"] += self._clock() - started
        if self.world_size > 1:
            started = self._clock()
            mats, sent = kfac_dist.all_reduce_mean_symmetric([a for a, _ in batches] + [g for _, g in batches])
            batches = list(zip(mats[:len(active)], mats[len(active):]))
            self.bytes_sent["factors"] += sent
            self.timings["communication"] += self._clock() - started
        started = self._clock()
        for layer, (a, g) in zip(active, batches):
            layer.update_factors(a, g, self.factor_decay)
        self.timings["factors"] += self._clock() - started

    def _update_decompositions(self) -> None:
        started = self._clock()
        ready = [(l, o) for l, o in zip(self.layers, self.owners) if l.A is not None]
        for layer, owner in ready:
            if owner == self.rank:
                layer.decompose(self.method.value, self.damping)
        self.timings["decomposition"] += self._clock() - started
        if self.kaisa is not None:
            started = self._clock()
            self.bytes_sent["decompositions"] += kfac_kaisa.share_decompositions(
                [l for l, _ in ready], [o for _, o in ready], self.kaisa, self.method.value)
            self.timings["communication"] += self._clock() - started
        elif self.world_size > 1 and self.broadcast is Broadcast.DECOMPOSITIONS:
            started = self._clock()
            self.bytes_sent["decompositions"] += kfac_dist.share_decompositions(
                [l for l, _ in ready], [o for _, o in ready], self.rank, self.method.value)
            self.timings["communication"] += self._clock() - started
        self._stale = False

    def _precondition(self, lr: float | None) -> None:
        started = self._clock()
        shared_grads = self.world_size > 1 and self.broadcast is Broadcast.GRADIENTS and self.kaisa is None
        work = [(l, o) for l, o in zip(self.layers, self.owners) if l.has_grad() and l.A is not None]
        holds = [self.kaisa.holds(o) if self.kaisa is not None else not shared_grads or o == self.rank
                 for _, o in work]
        buffers = self._buffers([l for l, _ in work], holds)
        for (layer, _), grad in zip(work, buffers.grads):
            layer.grad_matrix(out=grad)
        for key, index, grads, out in buffers.blocks:  # layers of one shape: one batched product
            precondition_batched(grads, self._operands(key, [work[i][0] for i in index]), out=out)
        precond = buffers.precond
        self.timings["precondition"] += self._clock() - started
        if self.kaisa is not None:
            started = self._clock()
            self.bytes_sent["gradients"] += kfac_kaisa.share_gradients(precond, [o for _, o in work], self.kaisa)
            self.timings["communication"] += self._clock() - started
        elif shared_grads:
            started = self._clock()
            self.bytes_sent["gradients"] += kfac_dist.broadcast_from_owners([[p] for p in precond],
                                                                            [o for _, o in work])
            self.timings["communication"] += self._clock() - started
        started = self._clock()
        if self.clip is not None and work:  # ν = min(1, √(κ / (α² |Σ⟨P, ∇W⟩|))), see labkit.optim.kfac.clip
            nu = self.clip.now(inner_product(buffers.flat_precond, buffers.flat_grads, self.clip.anchor.device), lr)
            for flat in buffers.flat_precond if nu is not None else ():
                flat.mul_(nu.to(flat.device, flat.dtype))  # every layer at once, before it is written back
        for (layer, _), p in zip(work, precond):
            layer.set_grad(p)
        self.timings["precondition"] += self._clock() - started

    def _buffers(self, layers: list[LayerFactors], holds: list[bool]) -> _Buffers:
        """Where this step's gradient matrices and preconditioned gradients go (:class:`_Buffers`), kept from step to
        step while the same layers are preconditioned: no allocation per step."""
        key = [(id(l), h) for l, h in zip(layers, holds)]
        if self._step_buffers is None or self._step_buffers[0] != key:
            self._step_buffers = (key, _Buffers(layers, holds))
        return self._step_buffers[1]

    def _operands(self, key: tuple, layers: list[LayerFactors]) -> tuple[Tensor, ...]:
        """The stacked operands of ``layers`` (one shape), rebuilt only when a decomposition changed (a new
        decomposition is a new dict: :meth:`LayerFactors.decompose`, a broadcast, a checkpoint) or the damping did.
        They hold a copy of the decompositions: (d_out² + d_in² + d_out·d_in) numbers per eigen layer."""
        sources = [l.decomposition for l in layers]
        cached = self._stacked.get(key)
        if cached is not None and cached[1] == self.damping and len(cached[0]) == len(sources) and \
                all(a is b for a, b in zip(cached[0], sources)):
            return cached[2]
        per_layer = [l.operands(self.damping) for l in layers]
        operands = tuple(torch.stack(parts) for parts in zip(*per_layer))
        self._stacked[key] = (sources, self.damping, operands)
        return operands

    def _scale_grads(self, nu: Tensor) -> None:
        """ν (on the first layer's device) scales every layer's gradients on that layer's device."""
        for layer in self.layers:
            if layer.has_grad():
                for grad in [layer.module.weight.grad] + ([layer.module.bias.grad] if layer.bias else []):
                    grad.mul_(nu.to(grad.device, grad.dtype))

    def __repr__(self) -> str:
        return (f"KFAC({len(self.layers)} layers, method={self.method.value}, approx={self.approx.value}, "
                f"damping={self.damping}, factor_decay={self.factor_decay}, kl_clip={self.kl_clip}, "
                f"factor_update_freq={self.factor_update_freq}, inv_update_freq={self.inv_update_freq}, "
                f"world_size={self.world_size}, broadcast={self.broadcast.value})")

    # ----- capture: the hooks, timed into timings["factors"] ----------------------------------------------------

    def _capturing(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self.steps % self.factor_update_freq == 0

    def _forward_hook(self, layer: LayerFactors, inputs: tuple, output: Tensor) -> None:
        if not inputs or not self._capturing(layer.module):
            return
        started = self._clock()
        with torch.autocast(inputs[0].device.type, enabled=False):  # factors in float32 even under torch.amp
            layer.capture_input(inputs[0])
        if output.requires_grad:
            output.register_hook(lambda grad: self._grad_hook(layer, grad))
        self.timings["factors"] += self._clock() - started

    def _grad_hook(self, layer: LayerFactors, grad: Tensor) -> None:
        started = self._clock()
        layer.capture_output_grad(grad)
        self.timings["factors"] += self._clock() - started

    def _clock(self) -> float:
        if self.timed and torch.cuda.is_available() and self.layers[0].module.weight.is_cuda:
            torch.cuda.synchronize()
        return self.clock()

    # ----- communication model --------------------------------------------------------------------------------

    def communication_per_step(self, element_size: int = 4) -> dict[str, int]:
        """Payload bytes K-FAC's own collectives move on this rank (0 everywhere on a single process).

        Returns:
            ``{"factors": on each factor-update step, "decompositions": on each inverse-update step,
            "gradients": on every step}`` — the formulas of :mod:`labkit.optim.kfac.distributed`, or with a
            grad-worker fraction those of :mod:`labkit.optim.kfac.kaisa` (they depend on this rank's block).
        """
        shapes = [(l.d_in, l.d_out) for l in self.layers]
        if self.kaisa is None:
            return kfac_dist.communication_per_step(shapes, self.world_size, self.method.value, self.broadcast.value,
                                                    element_size)
        factors = kfac_dist.communication_per_step(shapes, self.world_size, self.method.value, "gradients",
                                                   element_size)["factors"]
        shared = kfac_kaisa.cost_per_rank(shapes, self.owners, self.world_size, self.kaisa.g, self.rank,
                                          self.method.value, element_size)
        return {"factors": factors, "decompositions": shared["decompositions"], "gradients": shared["gradients"]}

    def decomposition_bytes(self) -> int:
        """Bytes of the decompositions this rank holds (what the grad-worker fraction trades for traffic)."""
        return sum(t.numel() * t.element_size() for l in self.layers for t in l.decomposition.values())

    # ----- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Tensors and primitives only (loads with ``torch.load(weights_only=True)``)."""
        return {"method": self.method.value, "steps": self.steps,
                "layers": {l.name: l.state() for l in self.layers if l.A is not None}}

    def load_state_dict(self, state: dict) -> None:
        """Restore factors, decompositions (recomputed at the next step where missing) and the step count."""
        names = {l.name: l for l in self.layers}
        unknown = sorted(set(state.get("layers", {})) - set(names))
        if unknown:
            raise CheckpointError(f"K-FAC state has layers {unknown[:3]} that this model lacks; "
                                  "the checkpoint belongs to another model")
        same_method = state.get("method") == self.method.value
        restored = [names[name].load_state(saved, self.method.value if same_method else None)
                    for name, saved in state["layers"].items()]
        self.steps = int(state["steps"])
        self._arm(self.steps % self.factor_update_freq == 0)
        self._stale = not all(restored) or len(restored) < len(self.layers)


class _Buffers:
    """One step's gradient matrices and preconditioned gradients, in two flat buffers per (device, dtype): the
    layers of one shape side by side, so that they are one batched product's operand and result as views (no
    stacking), and the KL clip's ``Σ⟨P, ∇W⟩`` and its scaling are one operation per buffer, not per layer. They
    hold ``2 Σ_ℓ d_out·d_in`` numbers (what a step used to allocate and free), not counted as optimizer state.

    Attributes:
        grads, precond: per layer, its (d_out, d_in) view of the buffers; a layer not held (its owner broadcasts
            its preconditioned gradient) has its place too.
        blocks: per group of held layers of one shape: ``(shape key, layer indices, grads (k, d_out, d_in),
            precond (k, d_out, d_in))``.
        flat_grads, flat_precond: the buffers, one per (device, dtype).
    """

    def __init__(self, layers: list[LayerFactors], holds: list[bool]):
        groups: dict[tuple, list[int]] = {}
        for i, (layer, held) in enumerate(zip(layers, holds)):
            key = ((layer.d_out, layer.d_in), layer.dtype, layer.module.weight.device)
            groups.setdefault((key, held), []).append(i)
        sizes: dict[tuple, int] = {}
        offsets = {}
        for (key, held), index in groups.items():
            (d_out, d_in), dtype, device = key
            offsets[key, held] = sizes.get((dtype, device), 0)
            sizes[dtype, device] = offsets[key, held] + len(index) * d_out * d_in
        flats = {where: (torch.empty(n, dtype=where[0], device=where[1]), torch.empty(n, dtype=where[0],
                                                                                    device=where[1]))
                 for where, n in sizes.items()}
        self.flat_grads = [g for g, _ in flats.values()]
        self.flat_precond = [p for _, p in flats.values()]
        self.grads: list[Tensor] = [torch.empty(0)] * len(layers)
        self.precond: list[Tensor] = [torch.empty(0)] * len(layers)
        self.blocks: list[tuple[tuple, list[int], Tensor, Tensor]] = []
        for (key, held), index in groups.items():
            (d_out, d_in), dtype, device = key
            start, shape = offsets[key, held], (len(index), d_out, d_in)
            grads, precond = (flat[start:start + len(index) * d_out * d_in].view(shape)
                              for flat in flats[dtype, device])
            for j, i in enumerate(index):
                self.grads[i], self.precond[i] = grads[j], precond[j]
            if held:
                self.blocks.append((key, index, grads, precond))


# ----- the `labkit train --optimizer kfac` side (flags in labkit.optim.kfac.options) ---------------------------


def from_options(model: nn.Module, options: dict, env: DistEnv | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> KFAC | None:
    """Build K-FAC from the ``--kfac-*`` values (by ``dest``); ``None`` when ``kfac_update_freq`` is 0.

    ``optimizer`` (optional) is where KL clipping reads the learning rate; without it the first optimizer
    stepping the model's parameters is attached automatically.
    """
    kwargs = kwargs_from_options(options)
    if kwargs is None:
        return None
    kfac = KFAC(model, optimizer=optimizer, grad_worker_fraction=options.get("kfac_grad_worker_fraction"), **kwargs)
    if env is None or env.is_main:
        print0(f"K-FAC: {len(kfac.layers)} layers, {kfac.method.value}, {kfac.approx.value}, decompositions every "
               f"{kfac.inv_update_freq} steps, factors every {kfac.factor_update_freq}, damping {kfac.damping}, "
               f"KL clip {kfac.kl_clip}, {kfac.world_size} rank(s)"
               + (f", broadcast {kfac.broadcast.value}" if kfac.world_size > 1 else ""))
    return kfac
