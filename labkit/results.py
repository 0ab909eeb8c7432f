"""One results format for every run: training, benchmarks, all-reduce measurements.

A run directory holds::

    metrics.jsonl   one JSON object per line, each with a "kind": "epoch", "bench", "step", "trace", ...
    summary.json    {"schema": "labkit.run/1", "name", "kind", "config", "environment", "metrics"}

Notebooks read runs back with :func:`load_run` and plot them with :func:`plot_metric`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from labkit.errors import OutputError

SCHEMA = "labkit.run/1"
LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _jsonable(value: Any) -> Any:
    # torch only where it is loaded already: without it there is no tensor or device to convert (reading and
    # summarising runs stays free of torch's import)
    torch = sys.modules.get("torch")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if torch is not None and isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path) or (torch is not None and isinstance(value, torch.device)):
        return str(value)
    if isinstance(value, float) and value != value:
        return None
    return value


@contextlib.contextmanager
def output_errors(path: str | Path):
    """Turn an ``OSError`` while writing ``path`` into one :class:`OutputError` line naming it."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; choose a writable folder "
                          "(e.g. --out runs/NAME)") from None


def make_dirs(path: str | Path) -> Path:
    """``mkdir -p path``; a path that cannot be created raises :class:`OutputError`."""
    path = Path(path)
    with output_errors(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_writable(path: str | Path) -> Path:
    """Fail now, not after the work, if ``path`` cannot be written: its folder is made and a file created in it
    and removed (:class:`OutputError` otherwise)."""
    path = Path(path)
    make_dirs(path.parent)
    with output_errors(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        os.unlink(tmp)
    return path


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: 0o666 minus the process umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | Path, write: Callable, binary: bool = False) -> None:
    """Call ``write(file)`` on a temp file next to ``path``, then rename it over ``path``: readers never see
    half a file, a crash mid-write keeps the previous one, and the file gets the umask's mode like any other.

    The file's bytes reach the disk (``fsync``) before the rename, and the folder's entry after it: without
    that, a node crash on a cluster filesystem can leave the new name pointing at an empty file, a lost
    checkpoint.
    """
    path = Path(path)
    make_dirs(path.parent)
    with output_errors(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, file_mode())  # mkstemp creates 0600: the group could not read a shared run
            with os.fdopen(fd, "wb" if binary else "w") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new file in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; the rename itself is done
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(text))


def environment(env=None) -> dict:
    """Where a run happened: versions, host, devices, world size, backend."""
    import torch

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    if env is not None:
        info.update(world_size=env.world_size, backend=env.backend, device=str(env.device))
    return info


def host_environment(run: Run) -> dict:
    """``run``'s environment without what its ranks added (world size, backend, device): what
    :func:`environment` gives on the host it ran on. A summary of runs made on this host passes it to
    :meth:`RunWriter.finish` (``host=``), so that writing it needs no torch."""
    return {k: v for k, v in run.summary["environment"].items() if k not in ("world_size", "backend", "device")}


@contextlib.contextmanager
def run_dir_lock(out_dir: str | Path):
    """Hold ``<out_dir>/.lock`` while inside (a POSIX record lock: released when this process ends, however it
    ends, and not inherited by the processes it forks); yields ``None`` when taken, else one sentence naming the
    process that holds it. Two runs writing into one folder would interleave their records and checkpoints."""
    make_dirs(Path(out_dir))
    path = Path(out_dir) / LOCK_FILE
    with output_errors(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            yield (f"{out_dir} is in use by another run ({holder}); wait for it to end, or give this run "
                   "another --out")
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield None
    finally:
        os.close(fd)  # closing releases the lock


class RunWriter:
    """Appends records to ``metrics.jsonl`` and writes ``summary.json``; a no-op when ``enabled`` is False
    (every rank can call it, only rank 0 writes)."""

    def __init__(self, out_dir: str | Path | None, enabled: bool = True, append: bool = False):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.enabled = enabled and self.out_dir is not None
        if self.enabled:
            make_dirs(self.out_dir)
            if not append:
                with output_errors(self.out_dir / METRICS_FILE):
                    (self.out_dir / METRICS_FILE).write_text("")

    def log(self, record: dict) -> None:
        """Append one record; it must carry a ``"kind"``."""
        if "kind" not in record:
            raise ValueError(f"a results record needs a 'kind', got keys {sorted(record)}")
        if self.enabled:
            with output_errors(self.out_dir / METRICS_FILE), open(self.out_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")

    def read(self, kind: str) -> list[dict]:
        """The records of ``kind`` in ``metrics.jsonl`` so far (a resumed run's earlier attempts included);
        [] where this writer does not write."""
        path = self.out_dir / METRICS_FILE if self.enabled else None
        if path is None or not path.exists():
            return []
        records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        return [r for r in records if r.get("kind") == kind]

    def finish(self, name: str, kind: str, config: dict, metrics: dict, env=None, *, host: dict | None = None,
               **extra) -> dict:
        """Write ``summary.json`` and return it. ``host``: the environment to write, known already (see
        :func:`host_environment`), instead of :func:`environment` of ``env``."""
        summary = {"schema": SCHEMA, "name": name, "kind": kind, "config": config,
                   "environment": dict(host) if host is not None else environment(env), "metrics": metrics,
                   **extra}
        summary = _jsonable(summary)
        if self.enabled:
            atomic_write_text(self.out_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        return summary


@dataclass
class Run:
    """A run read back from disk."""

    path: Path
    summary: dict
    records: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.summary.get("name") or self.path.name

    def records_of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def series(self, y: str, x: str = "epoch", kind: str = "epoch") -> tuple[list, list]:
        rows = [r for r in self.records_of(kind) if y in r and x in r]
        return [r[x] for r in rows], [r[y] for r in rows]


def load_run(path: str | Path) -> Run:
    """Read a run directory written by :class:`RunWriter`."""
    path = Path(path)
    summary_path = path / SUMMARY_FILE
    if not summary_path.exists():
        raise FileNotFoundError(f"no {SUMMARY_FILE} in {path}: the run did not finish or wrote elsewhere")
    summary = json.loads(summary_path.read_text())
    if summary.get("schema") != SCHEMA:
        raise ValueError(f"{summary_path} has schema {summary.get('schema')!r}, expected {SCHEMA!r}")
    records = []
    metrics_path = path / METRICS_FILE
    if metrics_path.exists():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return Run(path, summary, records)


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    return [load_run(p) for p in paths]


def plot_metric(runs: Run | Iterable[Run], y: str | None = None, x: str = "epoch", kind: str = "epoch",
                ax=None, labels: Iterable[str] | None = None, **plot_kwargs):
    """Plot ``y`` against ``x`` for one or more runs on one axis; returns the axis. ``y`` defaults to
    ``test_acc``, or ``test_loss`` when the first run has no accuracy (a language model's)."""
    import matplotlib.pyplot as plt

    runs = [runs] if isinstance(runs, Run) else list(runs)
    if y is None:
        y = "test_acc" if not runs or runs[0].series("test_acc", x, kind)[1] else "test_loss"
    labels = list(labels) if labels is not None else [r.name for r in runs]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for run, label in zip(runs, labels):
        xs, ys = run.series(y, x, kind)
        ax.plot(xs, ys, marker="o", label=label, **plot_kwargs)
    if x == "epoch":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.grid(alpha=0.3)
    if len(runs) > 1 or labels:
        ax.legend()
    return ax
