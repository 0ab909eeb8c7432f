"""``advise`` ranks every plan (table, ``advice.json``, seed 000's FlexFlow comparison); ``parallelize`` applies one."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from torch import nn

from labkit.advisor.measure import CACHE, load_or_measure, local_topology
from labkit.advisor.plan import Advice, Estimate, Plan, Profile
from labkit.advisor.search import best_per_strategy, candidates, check_fits
from labkit.advisor.topology import MB, Topology, allreduce_time
from labkit.advisor.validate import off_terms, ranking
from labkit.data import datasets as kdata
from labkit.dist.group import DistEnv
from labkit.errors import ConfigError
from labkit.models import cnn as kmodels
from labkit.ranges import check
from labkit.strategies import get_strategy
from labkit.strategies.base import Strategy

FLEXFLOW_ALEXNET_2GPU = ("conv1 pool2 conv3 pool4 conv5 conv6 conv7 pool8 flat: data parallel on gpu 0 and 1\n"
                         "linear9 linear10 linear11: gpu 0 only")


def advise(model: str, dataset: str = "mnist-sample", ranks: int = 2, batch_size: int = 64,
           memory_limit_gb: float | None = None, topology: Topology | None = None, cache: str | Path = CACHE,
           refresh: bool = False, profile_topology: Topology | None = None, timing: dict | None = None) -> Advice:
    """Rank every plan for ``model`` on ``dataset`` over ``ranks`` devices (this machine unless ``topology``) at
    global batch ``batch_size``, marking those over ``memory_limit_gb`` per device (none fitting: a ConfigError)."""
    if model not in kmodels.MODELS:
        raise ConfigError(f"unknown model {model!r}; choose one of: {', '.join(kmodels.MODELS)}")
    kdata.dataset_info(dataset)
    check("--ranks", ranks, "int", "[1, inf)")  # also where a topology is given (local_topology checks its own)
    check("--batch-size", batch_size, "int", "[1, inf)")
    check("--memory-limit", memory_limit_gb, "float", "(0, inf)")  # None: no limit
    topo = (topology or local_topology(ranks, cache=cache, refresh=refresh)).with_memory(memory_limit_gb)
    measure_on = profile_topology or topo

    @lru_cache(maxsize=None)
    def prof_for(p: int) -> Profile:  # the profile at the threads of p processes
        return load_or_measure(model, dataset, batch_size, measure_on.threads(p), cache, refresh, **(timing or {}))

    ranked = candidates(prof_for, topo, batch_size)
    if memory_limit_gb is not None:
        check_fits(ranked, memory_limit_gb)
    return Advice(model, dataset, batch_size, topo, ranked, [e for e in best_per_strategy(ranked) if e.applicable],
                  {p: prof_for(p) for p in {1, ranks}})


def table(advice: Advice) -> str:
    """Ranked plans (predicted; once validated, also measured, the ranking and ``off:`` lines), then their commands.

    ``model MB/dev`` is what the plan itself puts on a device (parameters, gradients, optimizer state, activations,
    buffers); the runtime every CPU process holds whatever it trains (the same for every plan) is said once below
    the table, and ``meas MB`` (a process's peak) includes it."""
    r = ranking(advice)
    lines = [f"{'#':>2} {'plan':<30} {'pred samples/s':>14} {'pred step ms':>12} {'model MB/dev':>12} {'main term':<17}"]
    if r["plans"]:
        lines[0] += f" {'meas samples/s':>14} {'meas step ms':>12} {'meas/pred':>9} {'spread':>6} {'meas MB':>8}"
    for i, est in enumerate(advice.table, 1):
        model_bytes = est.peak_bytes - est.memory.get("runtime", 0.0)
        line = (f"{i:>2} {est.plan.label:<30} {est.samples_per_s:>14.1f} {est.step_s * 1e3:>12.1f} "
                f"{model_bytes / MB:>12.2f} {est.main_term:<17}")
        if "error" in (m := advice.measured.get(est.plan.label, {})):
            line += f"  run failed: {m['error']}"
        elif m:
            line += (f" {m['samples_per_s']:>14.1f} {m['step_s'] * 1e3:>12.1f} {m['ratio']:>9.2f} {m['spread']:>6.0%} "
                     f"{m['peak_bytes'] / MB:>8.1f}")
        lines.append(line + ("" if est.feasible else "  (does not fit)"))
    runtime = max((e.memory.get("runtime", 0.0) for e in advice.table), default=0.0)
    if runtime:
        lines.append(f"plus on every CPU process the runtime's {runtime / MB:.0f} MB (measured once, the same for "
                     "every plan: torch and its libraries), in the predicted peak and in meas MB")
    if r["plans"]:
        lines.append(f"ranking over {r['plans']} plans: Spearman rho {r['spearman']:.2f}; the predicted best "
                     f"measured {r['best_ratio']:.2f}x the measured best")
        lines += [f"off: {line}" for line in off_terms(advice)]
    lines += ["", *(f"{i:>2} {advice.command(e)}" for i, e in enumerate(advice.table, 1))]
    return "\n".join(lines)


def flexflow_comparison(advice: Advice) -> str:
    """Seed 000's placement (FlexFlow's: AlexNet, two 1080Ti) beside the advisor's best, the terms they differ by,
    and why: hybrid saves the FC weights' all-reduce and pays rank 0 running the FC layers on B samples, not B/2."""
    def terms(est: Estimate) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in est.time.items() if v > 0)

    hybrid = next((e for e in advice.estimates if e.plan.strategy == "hybrid" and e.plan.processes == 2
                   and e.applicable), None)
    best, topo = advice.best, advice.topology
    lines = ["seed 000, FlexFlow on 2 GeForce 1080Ti:", *("  " + s for s in FLEXFLOW_ALEXNET_2GPU.splitlines()),
             "  = labkit's hybrid strategy (convolutions replicated, classifier on rank 0)",
             f"advisor on {topo.name}: {best.plan.label} ({terms(best)})"]
    if hybrid is None:
        return "\n".join(lines + ["  hybrid does not apply here (it needs 2 ranks and a model with features)"])
    if best.plan == hybrid.plan:
        lines.append("  the same placement: here too the cost terms favour it")
    else:
        lines.append(f"hybrid here: {hybrid.step_s * 1e3:.1f} ms/step ({terms(hybrid)}), "
                     f"{hybrid.step_s / best.step_s:.2f}× the best")
        deltas = sorted((hybrid.time.get(k, 0.0) - best.time.get(k, 0.0), k) for k in {*hybrid.time, *best.time})
        why = [f"{k} {d * 1e3:+.1f} ms" for d, k in reversed(deltas) if abs(d) > 0.02 * best.step_s]
        lines.append("they differ by: " + (", ".join(why) or "less than 2 % in every term (a tie within noise)"))
    prof = advice.profiles.get(2)
    if prof is None or prof.feature_layers is None:
        return "\n".join(lines + ["why: the cost terms above"])
    fc = range(prof.feature_layers, len(prof.layers))
    saved = allreduce_time(prof.params(fc), 2, "native", topo)
    paid = prof.time(advice.batch_size, fc) - prof.time(advice.batch_size / 2, fc)
    link = topo.link_of("all_reduce", 2)
    ddp = next((e for e in advice.estimates if e.plan.strategy == "ddp" and e.plan.processes == 2 and e.applicable),
               None)  # the best data-parallel plan: what hybrid's FC placement replaces
    instead = ("" if ddp is None else
               f" Hybrid sends the features to rank 0 and their gradients back instead: its communication term is "
               f"{hybrid.time['communication'] * 1e3:.1f} ms against {ddp.plan.label}'s {ddp.time['communication'] * 1e3:.1f} ms "
               f"({(hybrid.time['communication'] - ddp.time['communication']) * 1e3:+.1f} ms).")
    return "\n".join(lines + [
        f"why: the FC layers hold {prof.params(fc) / 2**20:.1f} of {prof.param_bytes / 2**20:.1f} MB of weights; "
        f"all-reducing them alone costs {saved * 1e3:.1f} ms on this link (α {link.alpha * 1e6:.0f} µs, "
        f"{1 / max(link.beta, 1e-30) / 1e9:.2f} GB/s), an all-reduce hybrid skips.{instead} Running the FC layers "
        f"on rank 0 for the whole batch instead of half costs {paid * 1e3:.1f} ms more, which hybrid pays. "
        "FlexFlow's GPUs computed the FC layers fast over a slow PCIe link, so saving the all-reduce won there."])


Parallelized = NamedTuple("Parallelized", [("model", nn.Module), ("strategy", Strategy), ("plan", Plan),
                                           ("command", str)])


def parallelize(model: nn.Module | str, plan: Plan | Estimate | dict | str = "auto", *, model_name: str | None = None,
                dataset: str = "mnist-sample", ranks: int = 2, batch_size: int = 64, env: DistEnv | None = None,
                extra: tuple[str, ...] = ()) -> Parallelized:
    """``labkit.parallelize``: ``model`` (a kit model's name, built for ``dataset`` as ``labkit train`` builds it, or
    an ``nn.Module``, flattened if the strategy cuts layers, with ``model_name``) prepared for ``plan`` (``"auto"``:
    the advised best; a label; a plan) on each rank of ``env`` (default one CPU process); its command has ``extra``."""
    name = model if isinstance(model, str) else model_name
    if name is None:
        raise ConfigError("give model_name=... (a kit model): the advisor profiles it and the command builds it")
    if isinstance(plan, str):
        advice = advise(name, dataset, ranks, batch_size)
        plan = advice.best if plan == "auto" else advice.find(plan)
    chosen = Plan.from_dict(plan) if isinstance(plan, dict) else plan.plan if isinstance(plan, Estimate) else plan
    if not isinstance(chosen, Plan):
        raise ConfigError(f"plan must be 'auto', a label, a Plan, an Estimate or a dict, got {type(plan).__name__}")
    env = env or DistEnv()
    if env.world_size != chosen.processes:
        raise ConfigError(f"plan {chosen.label} runs on {chosen.processes} process(es) but this job has "
                          f"{env.world_size}; call parallelize on every rank of a {chosen.processes}-rank job")
    strategy = get_strategy(chosen.strategy)(env, chosen.option)
    if isinstance(model, str):
        info = kdata.dataset_info(dataset)
        model = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size)
    module = kmodels.to_sequential(model) if strategy.sequential_model else model
    return Parallelized(strategy.prepare(module), strategy, chosen, chosen.command(name, dataset, list(extra)))
