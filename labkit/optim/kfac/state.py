"""What K-FAC moves and keeps: the payload of its own collectives per step, and its checkpoint state.

:class:`KFACState` is a base of :class:`labkit.optim.kfac.preconditioner.KFAC`; it reads the optimizer's layers, method, ranks
and step count.
"""
from __future__ import annotations

from labkit.errors import CheckpointError
from labkit.optim.kfac import distributed as kfac_dist
from labkit.optim.kfac import kaisa as kfac_kaisa


class KFACState:
    """The communication model and the checkpoint side of :class:`labkit.optim.kfac.preconditioner.KFAC`."""

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
        self._stale = not all(restored) or len(restored) < len(self.layers)
