"""The advisor's table, and seed 000's FlexFlow placement for AlexNet on two GPUs beside the advisor's choice."""
from __future__ import annotations

from labkit.advisor.advise import Advice
from labkit.advisor.plan import Estimate

MB = 2**20

#: FlexFlow's best strategy for AlexNet on two GeForce 1080Ti (seed 000): ``dtm(2) gpu(0 1)`` = the operator
#: split over both GPUs along the batch, ``gpu(0 0)`` = both parts on GPU 0
FLEXFLOW_ALEXNET_2GPU = (
    "conv1 pool2 conv3 pool4 conv5 conv6 conv7 pool8 flat: data parallel on gpu 0 and 1\n"
    "linear9 linear10 linear11: gpu 0 only")


def table(advice: Advice) -> str:
    """Ranked plans: predicted samples/s, peak memory per device, main term, measured columns if validated
    (the median step of the runs, their spread ``(max − min) / median``), and the ranking's figures of merit."""
    measured = any("step_s" in advice.measured.get(e.plan.label, {}) for e in advice.table)
    head = f"{'#':>2} {'plan':<30} {'pred samples/s':>14} {'pred step ms':>12} {'pred MB/dev':>11} {'main term':<17}"
    if measured:
        head += f" {'meas samples/s':>14} {'meas step ms':>12} {'meas/pred':>9} {'spread':>6} {'meas MB':>8}"
    lines = [head]
    for i, est in enumerate(advice.table, 1):
        mark = "" if est.feasible else "  (does not fit)"
        line = (f"{i:>2} {est.plan.label:<30} {est.samples_per_s:>14.1f} {est.step_s * 1e3:>12.1f} "
                f"{est.peak_bytes / MB:>11.1f} {est.main_term:<17}")
        m = advice.measured.get(est.plan.label)
        if m and "error" in m:
            line += f"  run failed: {m['error']}"
        elif m:
            line += (f" {m['samples_per_s']:>14.1f} {m['step_s'] * 1e3:>12.1f} {m['ratio']:>9.2f} {m['spread']:>6.0%} "
                     f"{m['peak_bytes'] / MB:>8.1f}")
        lines.append(line + mark)
    if measured:
        from labkit.advisor.validate import ranking

        r = ranking(advice)
        lines.append(f"ranking over {r['plans']} plans: Spearman rho {r['spearman']:.2f}; the predicted best "
                     f"measured {r['best_ratio']:.2f}x the measured best")
    lines.append("")
    lines += [f"{i:>2} {advice.command(e)}" for i, e in enumerate(advice.table, 1)]
    return "\n".join(lines)


def terms(est: Estimate) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in est.time.items() if v > 0)


def flexflow_comparison(advice: Advice) -> str:
    """Seed 000's placement beside the advisor's best, and which cost terms make them differ."""
    hybrid = next((e for e in advice.estimates if e.plan.strategy == "hybrid" and e.plan.processes == 2), None)
    best = advice.best
    lines = ["seed 000, FlexFlow on 2 GeForce 1080Ti:", *("  " + s for s in FLEXFLOW_ALEXNET_2GPU.splitlines()),
             "  = labkit's hybrid strategy (convolutions replicated, classifier on rank 0)",
             f"advisor on {advice.topology.name}: {best.plan.label} ({terms(best)})"]
    if hybrid is None:
        return "\n".join(lines + ["  hybrid was not priced (it needs 2 ranks)"])
    if best.plan == hybrid.plan:
        return "\n".join(lines + ["  the same placement: here too the cost terms favour it"])
    lines.append(f"hybrid here: {hybrid.step_s * 1e3:.1f} ms/step ({terms(hybrid)}), "
                 f"{hybrid.step_s / best.step_s:.2f}× the best")
    deltas = sorted(((hybrid.time.get(k, 0.0) - best.time.get(k, 0.0), k) for k in {*hybrid.time, *best.time}),
                    reverse=True)
    why = [f"{k} {d * 1e3:+.1f} ms" for d, k in deltas if abs(d) > 0.02 * best.step_s]
    lines.append("they differ by: " + (", ".join(why) or "less than 2 % in every term (a tie within noise)"))
    lines.append("why: " + _why(advice))
    return "\n".join(lines)


def _why(advice: Advice) -> str:
    """The two costs FlexFlow traded, priced on this topology: the FC weights' all-reduce (what hybrid saves)
    against rank 0 running the FC layers on the whole batch (what hybrid pays)."""
    from labkit.advisor.alphabeta import allreduce_time

    topo = advice.topology
    prof = advice.profiles.get(topo.threads(2))
    if prof is None or prof.feature_layers is None:
        return "the cost terms above"
    fc = range(prof.feature_layers, len(prof.layers))
    saved = allreduce_time(prof.params(fc), 2, "ring", topo)
    paid = prof.time(advice.batch_size, fc) - prof.time(advice.batch_size / 2, fc)
    link = topo.link
    return (f"the FC layers hold {prof.params(fc) / 2**20:.1f} of {prof.param_bytes / 2**20:.1f} MB of weights; "
            f"all-reducing them costs {saved * 1e3:.1f} ms on this link (α {link.alpha * 1e6:.0f} µs, "
            f"{1 / max(link.beta, 1e-30) / 1e9:.2f} GB/s), which hybrid saves, while running them on rank 0 for "
            f"the whole batch instead of half costs {paid * 1e3:.1f} ms more, which hybrid pays. FlexFlow's GPUs "
            "computed the FC layers fast over a slow PCIe link, so saving the all-reduce won there.")
