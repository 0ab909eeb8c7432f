"""``labkit bench report RUNS...``: one HTML page (and its PNGs) comparing benchmark suites side by side.

    labkit bench report runs/suite-mine results/reference/cpu-2c-torch2.14.1 --out runs/report

Each RUN is a folder holding ``suite.json`` (:mod:`labkit.bench.suite`) or that file itself. The page shows:

- throughput: samples/s of every strategy on the same model and data;
- MFU: each strategy's model FLOP/s over its devices' peak (:mod:`labkit.train.peak`; the table names the peak, a
  suite recorded before runs reported MFU has no bar);
- scaling efficiency: DDP weak scaling, ``speedup(n) / n`` with ``speedup(n) = rate(n) / rate(1)``;
- peak memory per device: the CUDA allocator's peak on each GPU, or the process's peak RSS on a CPU;
- communication share: ``1 - efficiency(n)``, the part of each DDP step not spent computing (gradient
  all-reduce and waiting for the slowest rank) - an upper bound on the time communication costs;
- time to accuracy: test accuracy against training time, per strategy;
- labkit vs plain PyTorch: the median paired ratios of the benchmark harness.
"""
from __future__ import annotations

import argparse
import html
import json
from pathlib import Path

from labkit.errors import ConfigError

PLOTS = ("throughput", "mfu", "scaling", "memory", "communication", "time_to_accuracy")


#: ``labkit bench report`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "runs", "nargs": "+", "metavar": "RUN", "help": "suite folders (or their suite.json)"},
    {"flag": "--out", "default": "runs/report", "help": "folder for report.html and the PNGs"},
]


def load_suite(path: str | Path) -> dict:
    """The ``suite.json`` of a folder (or the file); ConfigError if missing or not a suite."""
    path = Path(path)
    file = path / "suite.json" if path.is_dir() else path
    try:
        suite = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is not a readable suite result ({type(exc).__name__}); run labkit bench suite "
                          "first") from None
    if suite.get("kind") != "suite":
        raise ConfigError(f"{file} is not a labkit bench suite result (no \"kind\": \"suite\")")
    return suite


def load_suites(paths, printer=print) -> list[dict]:
    """The suites of ``paths`` as a shell glob gives them (``results/reference/*``): a file there that is not a
    suite (the folder's README) is skipped with a note; a missing path or a folder without ``suite.json`` is a
    ConfigError, and so is a list with no suite at all."""
    suites = []
    for path in map(Path, paths):
        if path.is_file() and path.name != "suite.json":
            try:
                suites.append(load_suite(path))
            except ConfigError:
                printer(f"note: skipped {path}: not a suite result")
            continue
        suites.append(load_suite(path))
    if not suites:
        raise ConfigError(f"none of {' '.join(map(str, paths))} is a suite result; run labkit bench suite first")
    return suites


def _label(suite: dict) -> str:
    return suite["tag"] + (" (quick)" if suite.get("quick") else "")


def _ok(section: dict) -> dict:
    return {k: v for k, v in section.items() if "error" not in v}


def _names(suites: list[dict]) -> tuple[list[str], list[str]]:
    """Strategies in any suite, and their tick labels (the model where it is not LeNet)."""
    runs = {n: r for s in suites for n, r in _ok(s["strategies"]).items()}
    return list(runs), [n if r.get("model", "lenet") == "lenet" else f"{n}\n({r['model']})" for n, r in runs.items()]


def plot_throughput(suites: list[dict], ax) -> None:
    names, ticks = _names(suites)
    width = 0.8 / len(suites)
    for i, suite in enumerate(suites):
        ok = _ok(suite["strategies"])
        ax.bar([k + i * width for k in range(len(names))], [ok.get(n, {}).get("samples_per_sec") or 0 for n in names],
               width, label=_label(suite))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], ticks, rotation=20)
    ax.set_ylabel("samples/s")
    ax.set_title("throughput, LeNet on mnist-sample")


def plot_mfu(suites: list[dict], ax) -> None:
    names, ticks = _names(suites)
    width = 0.8 / len(suites)
    for i, suite in enumerate(suites):
        ok = _ok(suite["strategies"])
        ax.bar([k + i * width for k in range(len(names))], [100 * (ok.get(n, {}).get("mfu") or 0) for n in names],
               width, label=_label(suite))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], ticks, rotation=20)
    ax.set_ylabel("MFU (% of peak)")
    ax.set_title("model FLOPs utilisation: model FLOP/s ÷ (devices × peak)")


def _efficiency(suite: dict) -> dict[int, float]:
    ddp = _ok(suite["benches"]).get("bench-ddp", {})
    return {int(n): e for n, e in ddp.get("efficiency", {}).items()}


def plot_scaling(suites: list[dict], ax) -> None:
    for suite in suites:
        eff = _efficiency(suite)
        if eff:
            ax.plot(list(eff), list(eff.values()), marker="o", label=_label(suite))
    ax.axhline(1.0, ls="--", color="gray")
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("DDP ranks")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("weak scaling: speedup(n) / n")


def plot_memory(suites: list[dict], ax) -> None:
    names, ticks = _names(suites)
    width = 0.8 / len(suites)
    for i, suite in enumerate(suites):
        ok = _ok(suite["strategies"])
        ax.bar([k + i * width for k in range(len(names))], [1024 * (ok.get(n, {}).get("peak_memory_gb") or 0)
                                                            for n in names], width, label=_label(suite))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], ticks, rotation=20)
    ax.set_ylabel("peak memory per device (MB)")
    ax.set_title("peak memory (GPU: allocator peak; CPU: process peak RSS)")


def plot_communication(suites: list[dict], ax) -> None:
    width = 0.8 / len(suites)
    for i, suite in enumerate(suites):
        share = {n: 1 - e for n, e in _efficiency(suite).items() if n > 1}
        ax.bar([k + i * width for k in range(len(share))], [100 * v for v in share.values()], width,
               label=_label(suite), tick_label=[f"{n} ranks" for n in share])
    ax.set_ylabel("% of a DDP step")
    ax.set_title("communication + waiting share (1 - efficiency)")


def plot_time_to_accuracy(suites: list[dict], ax) -> None:
    styles = ["-", "--", ":", "-."]
    for i, suite in enumerate(suites):
        for name, run in _ok(suite["strategies"]).items():
            times, accs, total = [0.0], [0.1], 0.0  # chance accuracy at time 0
            for epoch in run["epochs"]:
                total += epoch["time_s"]
                times.append(total)
                accs.append(epoch["test_acc"])
            ax.plot(times, accs, styles[i % len(styles)], marker="o", label=f"{name} [{suite['tag']}]")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("time to accuracy")


def _ratio_rows(suite: dict) -> list[tuple[str, str]]:
    benches = _ok(suite["benches"])
    rows = []
    for name, key, what in (("bench-single", "ratio", "labkit / plain loop, one device"),
                            ("bench-ddp", "ratio", "labkit DDP / plain DDP"),
                            ("bench-gpipe", "ratio", "labkit GPipe / raw torchgpipe")):
        if key in benches.get(name, {}):
            rows.append((what, f"{benches[name][key]:.3f}"))
    for contender, row in benches.get("bench-kfac", {}).items():
        if isinstance(row, dict) and "ratio" in row:
            rows.append((f"K-FAC step time / SGD, {contender}", f"{row['ratio']:.2f}"))
    return rows


def _utilisation(run: dict) -> list[str]:
    """``MFU 3.41%, HFU 3.41% of <peak>`` for a run that recorded them, else nothing."""
    if run.get("mfu") is None:
        return []
    return [f"MFU {100 * run['mfu']:.3g}%, HFU {100 * run['hfu']:.3g}% of {run.get('peak') or 'the peak'}"]


def render(suites: list[dict], out: str | Path) -> Path:
    """Write ``out/report.html`` and one PNG per plot; return the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.results import atomic_write, atomic_write_text, make_dirs
    from labkit.viz.figcheck import legend_beside

    out = make_dirs(out)
    draw = {"throughput": plot_throughput, "mfu": plot_mfu, "scaling": plot_scaling, "memory": plot_memory,
            "communication": plot_communication, "time_to_accuracy": plot_time_to_accuracy}
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        draw[name](suites, ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            legend_beside(ax, fontsize=7)  # measured: no place inside is free in every run
        fig.tight_layout()
        atomic_write(out / f"{name}.png", lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
        plt.close(fig)
    parts = ["<!doctype html><meta charset='utf-8'><title>labkit benchmark report</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:2px 8px;text-align:left}"
             "</style><h1>labkit benchmark report</h1>"]
    for suite in suites:
        m = suite["machine"]
        parts.append(f"<h2>{html.escape(_label(suite))}</h2><p>{html.escape(str(m['device']))}, {m['cpu_count']} "
                     f"cores, {m['gpus']} GPU(s); torch {m['torch']}, CUDA {m['cuda']}, NCCL {m['nccl']}</p><table>")
        for what, value in _ratio_rows(suite):
            parts.append(f"<tr><td>{html.escape(what)}</td><td>{value}</td></tr>")
        for name, run in suite["strategies"].items():
            cell = run.get("error") or "; ".join(_utilisation(run) + run["memory_lines"])
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(cell)}</td></tr>")
        parts.append("</table>")
    parts += [f"<h2>{name.replace('_', ' ')}</h2><img src='{name}.png' alt='{name}'>" for name in PLOTS]
    page = out / "report.html"
    atomic_write_text(page, "\n".join(parts) + "\n")
    return page


def main(args: argparse.Namespace) -> int:
    page = render(load_suites(args.runs), args.out)
    print(f"report written to {page} ({', '.join(n + '.png' for n in PLOTS)})")
    return 0


def reference_suites(root: str | Path | None = None) -> list[dict]:
    """Every committed reference suite (``results/reference/<machine tag>/suite.json`` of the checkout)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2] / "results" / "reference"
    return [load_suite(p) for p in sorted(root.glob("*/suite.json"))]


def plot_beside_reference(run, strategy: str, metric: str = "samples_per_sec", ax=None, references=None,
                          printer=print):
    """Bars: the learner's ``run`` (a folder, :class:`labkit.results.Run` or summary dict) next to the reference
    machines' value of ``metric`` for ``strategy`` - only references of the same model and dataset (like with
    like). Where none exists, nothing is drawn (one bar compares with nothing): ``printer`` says so and names
    what the references did train, and the function returns None."""
    import matplotlib.pyplot as plt

    from labkit.results import Run, load_run

    summary = run.summary if isinstance(run, Run) else run if isinstance(run, dict) else load_run(run).summary
    references = reference_suites() if references is None else references
    config = summary.get("config", {})
    model, dataset = config.get("model") or summary.get("name", "?"), config.get("dataset")
    labels, values, others = [f"your run ({model})"], [summary["metrics"][metric]], set()
    for suite in references:
        ref = _ok(suite["strategies"]).get(strategy, {})
        if ref.get(metric) is None:
            continue
        ref_model = ref.get("model", "lenet")
        if ref_model == model and (dataset is None or ref.get("dataset", dataset) == dataset):
            labels.append(f"{_label(suite)} ({ref_model}, {ref['ranks']} rank(s))")
            values.append(ref[metric])
        else:
            others.add(f"{ref_model} on {ref.get('dataset', '?')}")
    if len(values) == 1:
        printer(f"{strategy}: no reference run of {model}{f' on {dataset}' if dataset else ''} yet, so no chart"
                + (f" (the references train {', '.join(sorted(others))})" if others else "")
                + f"; your run: {values[0]:,.1f} {metric.replace('_per_sec', '/s').replace('_', ' ')}")
        return None
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.8))
    ax.barh(labels, values, color=["tab:orange"] + ["tab:blue"] * (len(values) - 1))
    ax.set_xlabel(metric.replace("_per_sec", "/s").replace("_", " "))
    ax.set_ylabel("run")
    ax.set_title(f"{strategy}: your run beside the reference machines", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    return ax
