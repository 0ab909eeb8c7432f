"""Pipeline parallelism across processes: one stage per rank, micro-batches scheduled by
``torch.distributed.pipelining`` (GPipe fill-drain, or 1F1B as in PipeDream-flush).

    launch:   torchrun --nproc_per_node 2 -m labkit train --strategy pipeline --schedule 1f1b \\
                  --model resnet50 --dataset mnist --batch-size 256 --num-microbatches 8 \\
                  --pipeline-trace runs/pipe/timeline.json
    the same: torchrun --nproc_per_node 2 -m labkit train --mesh pp=2 --schedule 1f1b ...

``--strategy pipeline`` is a preset of the mesh's ``pp`` dimension over every rank of the job
(:class:`PipelineStrategy`, ``--mesh pp=<ranks>``, :mod:`labkit.parallel.pp`), which holds the stages, the
schedules and the measured timeline (``--pipeline-trace``, :class:`labkit.parallel.pp.Timeline`); its flags are the
``pp`` dimension's. Rank ``r`` keeps layers ``balance[r]`` of the ``nn.Sequential`` (``--balance``, default: layer
counts as even as possible). Every rank loads the same batches; rank 0 feeds the inputs, the last rank owns the
outputs, the targets and the loss, so only it returns ``(loss, output)`` to the training loop.

Schedules, per step with ``P`` stages and ``M`` micro-batches:

* ``gpipe``: all ``M`` forwards, then all ``M`` backwards; every stage holds ``M`` micro-batches' activations.
* ``1f1b``: after ``P - r`` warm-up forwards, stage ``r`` alternates one forward, one backward; it holds at
  most ``P - r`` micro-batches' activations. Same bubble ``(P - 1) / (M + P - 1)``, less memory.

Both scale gradients by ``1 / M`` (the loss is a mean per micro-batch), so a step equals one step on the
whole batch. A batch must split into equal micro-batches; a smaller last batch uses the largest ``m <= M``
that divides it.

This module holds the preset and the advisor's price of it (:func:`price_pipeline`).
"""
from __future__ import annotations

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import common_terms, compute_scale, memory_terms, pipeline_terms, stages_of
from labkit.errors import ConfigError
from labkit.parallel.mesh import MeshStrategy
from labkit.parallel.pipeline_stages import pipeline_options

#: ``labkit train --strategy pipeline`` flags: the pp dimension's, declared once there (labkit.flags)
SHARED_FLAGS = {"labkit.parallel.pp": ["--num-microbatches", "--balance", "--schedule", "--pp-schedule",
                                       "--pp-virtual", "--pipeline-trace", "--trace-steps"]}
#: backend/device combinations refused before any work (labkit.strategies.backends): gloo's send/recv take CPU tensors only
BACKENDS = [
    {"backend": "gloo", "device": "cuda",
     "why": "--strategy pipeline's stages send activations point to point, which gloo does on CPU tensors only; use "
            "--backend nccl on GPUs, or --device cpu (or leave --device auto)"},
]
#: ``labkit advise``: a stage per rank, ``m`` micro-batches, 1f1b where gpipe's does not fit (labkit.advisor.search)
ADVISOR = {"price": "labkit.parallel.pipelining:price_pipeline", "plans": "pipeline", "processes": "each",
           "options": {"microbatches": "num_microbatches", "balance": "balance", "schedule": "schedule"}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 2, "flags": ["--num-microbatches", "4"]}


class PipelineStrategy(MeshStrategy):
    """``--strategy pipeline``: a preset of ``--mesh pp=N`` over every rank of the job, one stage per rank.

    The options are checked first in the preset's words (its stages are ranks); its stage split and timeline are
    the ``pp`` dimension's (:attr:`balance`, :meth:`trace`).
    """

    name = "pipeline"

    def __init__(self, env, options=None):
        if env.world_size < 2:
            raise ConfigError("--strategy pipeline puts one stage on each rank and needs >= 2 ranks: "
                              "torchrun --nproc_per_node 2 -m labkit train --strategy pipeline ...")
        options = dict(options or {})
        pipeline_options(options, env.world_size, on_mesh=False)
        super().__init__(env, {**options, "mesh": f"pp={env.world_size}"})
        # a flat nn.Sequential until check_model says otherwise (a GPT), for callers that build the model without it
        self.sequential_model = True

    @property
    def balance(self) -> list[int] | None:
        """Layers per stage, once the model is cut (:meth:`prepare`)."""
        return self.pipeline.balance

    def trace(self) -> dict | None:
        """The measured timeline on rank 0, None elsewhere (:meth:`labkit.parallel.pp.PipelineParallel.trace`)."""
        return self.pipeline.trace()


def price_pipeline(plan, prof, topo) -> Estimate:
    """One stage per rank (``--schedule``: ``torch.distributed.pipelining``; ``--pp-schedule``: labkit's, with
    ``--pp-virtual`` chunks per rank), ``m`` micro-batches of ``B/m``:

    ``t_j = s·T_{stage j}(B/m)``, ``c_j = 2·msg((B/m)·A_{last of j})`` (activation forward, gradient
    backward; 0 for the last stage), terms from :func:`pipeline_terms`: the schedule's action lists simulated with
    those per-stage costs (:mod:`labkit.parallel.pp_simulate`).
    Every rank loads the whole batch.
    Memory of rank ``r``: ``3·P_r + k_r·M_r(B/m)`` with ``k_r`` the simulated peak of micro-batches in flight on
    rank ``r`` (GPipe: ``m``; 1F1B: ``min(p − r, m)``; ZB-H1: ``p``), ``P_r``, ``M_r`` over its stages (the
    largest chunk's saved bytes per chunk in flight); the fullest rank counts.
    """
    from labkit.parallel.pp_schedule import chunks_of, pipe_schedule
    from labkit.parallel.pp_simulate import peak_in_flight

    o = plan.option
    p, m, B = plan.processes, o["num_microbatches"], plan.batch_size
    name, v = o.get("pp_schedule") or o.get("schedule", "gpipe"), chunks_of(o)
    stages = stages_of(o["balance"])
    bm = B / m
    msg = topo.link_of("p2p", p).transfer_time
    times = [compute_scale(topo, p, prof) * prof.time(bm, s) for s in stages]
    comm = [2 * msg(bm * prof.layers[s[-1]].out_bytes) if j < len(stages) - 1 else 0.0 for j, s in enumerate(stages)]
    schedule = pipe_schedule(name, p, m, v)
    peak = peak_in_flight(schedule)
    mem = [memory_terms(prof, topo, sum(prof.params(stages[k]) for k in schedule.stages_of(r)),
                        peak[r] * max(prof.saved_bytes(bm, stages[k]) for k in schedule.stages_of(r)))
           for r in range(p)]
    full = max(range(p), key=lambda r: sum(mem[r].values()))
    terms = pipeline_terms(times, comm, m, critical_path=True, schedule=name, chunks=v)
    terms.update(common_terms(prof, topo, max(prof.params(s) for s in stages), B))
    return Estimate(plan, terms, mem[full])
