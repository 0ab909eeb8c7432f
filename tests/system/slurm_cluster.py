"""A real SLURM cluster that lives in one temporary directory, for tests.

It runs its own ``munged`` (own key and socket), one ``slurmctld`` and one ``slurmd -N NAME`` per
node, all as root, with config, state, spool, logs and pid files under ``root`` and ports picked
free, so it never touches a cluster that is already running and two test runs can coexist.
Several nodes on one host are emulated by several ``slurmd`` on their own ports; the node names
must resolve (see :func:`hosts_entry`).

No systemd here, so the daemons are started by hand; no cgroups either, hence
``proctrack/linuxproc`` and ``task/none``. The nodes advertise the size of a GPU node
(``SlurmdParameters=config_overrides`` lets that exceed the real machine) so job scripts' real
``#SBATCH`` requests are accepted unchanged; tests ask for 8 of the 16 CPUs and a share of the memory,
so two jobs run at a time on each node.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .provision import free_port, pid_alive, stop_pid

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                      "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


@dataclass
class Job:
    """A submitted batch job and the last ``scontrol show job`` record seen for it."""

    job_id: str
    name: str
    output: Path
    info: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.info.get("JobState", "UNKNOWN")

    @property
    def exit_code(self) -> int | None:
        """The batch script's exit status (``ExitCode=status:signal``), None while unknown."""
        code = self.info.get("ExitCode")
        return int(code.split(":")[0]) if code else None

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def describe(self, tail: int = 40) -> str:
        """One paragraph for an assertion message: state, exit code, reason, end of the log."""
        lines = self.log().splitlines()[-tail:] or ["(no output file)"]
        return (f"{self.name}: job {self.job_id} {self.state}, ExitCode={self.info.get('ExitCode')}, "
                f"Reason={self.info.get('Reason')}, output {self.output}; last lines:\n"
                + "\n".join(lines))


def parse_record(line: str) -> dict[str, str]:
    """``scontrol -o`` prints space-separated ``Key=Value`` pairs on one line.

    A value with spaces in it (a command line) comes back cut at its first space; the fields
    these tests read (JobState, ExitCode, Reason, NodeList, NumNodes, RunTime) have none.
    """
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


class SlurmCluster:
    """Start, use and stop a private SLURM cluster.

    Args:
        root: an empty directory that will hold everything the cluster writes.
        nodes: node names; one ``slurmd`` each. They must resolve to 127.0.0.1.
        node_cpus: CPUs each node advertises.
        node_memory_mb: memory each node advertises (RealMemory).
    """

    def __init__(self, root: Path, nodes: list[str], node_cpus: int = 16,
                 node_memory_mb: int = 64000) -> None:
        self.root = root
        self.nodes = nodes
        self.node_cpus = node_cpus
        self.node_memory_mb = node_memory_mb
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"
        self._pidfiles: list[Path] = []

    # -- daemons ---------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        """Start munged, slurmctld and the slurmds; return once every node is idle."""
        self.root.chmod(0o755)  # munged insists its socket's directories are searchable by all
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o755)
        try:
            self._start_munge()
            self._write_conf()
            self._daemon(["slurmctld", "-f", str(self.conf)], self.root / "slurmctld.pid",
                         self.root / "log" / "slurmctld.log")
            for node in self.nodes:
                self._daemon(["slurmd", "-f", str(self.conf), "-N", node],
                             self.root / f"slurmd-{node}.pid",
                             self.root / "log" / f"slurmd-{node}.log")
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.command("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            idle = dict(zip(states[::2], states[1::2]))
            if all(idle.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {idle}\n{self.logs()}")
            time.sleep(0.3)

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        m = self.root / "munge"
        self._daemon(["munged", f"--socket={self.munge_socket}", f"--key-file={key}",
                      f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
                      f"--seed-file={m / 'munged.seed'}"], m / "munged.pid", m / "munged.log")

    def _daemon(self, cmd: list[str], pidfile: Path, log: Path) -> None:
        """Run a self-daemonising command and remember its pid file for :meth:`stop`."""
        proc = subprocess.run(cmd, check=False, env=self.env(), capture_output=True, text=True,
                              timeout=60)
        deadline = time.monotonic() + 15  # the daemon writes its pid file a moment after forking
        pid = None
        while proc.returncode == 0 and time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int(pidfile.read_text())
            if pid is not None and pid_alive(pid):
                break
            time.sleep(0.1)
        if pid is None or not pid_alive(pid):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"`{' '.join(cmd)}` did not start (exit {proc.returncode}): "
                               f"{proc.stdout}{proc.stderr}\n{log}:\n{tail}")
        self._pidfiles.append(pidfile)

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        r = self.root
        node_lines = [f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.node_cpus} "
                      f"RealMemory={self.node_memory_mb} State=UNKNOWN" for n in self.nodes]
        self.conf.write_text("\n".join([
            "ClusterName=labkit-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s; 5 is
            # SLURM's minimum); a step's credential is used within a second of being issued here
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log/slurmctld.log'}", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "SlurmdParameters=config_overrides", "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1", "MpiDefault=none",
            "ReturnToService=2", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            # KillWait: SIGTERM to SIGKILL; a job that cleans up on SIGTERM (JupyterLab's) may need a while on a busy
            # machine
            "KillWait=30", "MinJobAge=600", "InactiveLimit=0", "SlurmdTimeout=60",
            *node_lines,
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def stop(self) -> None:
        """Cancel every job, wait for them to end, then stop the daemons this cluster started."""
        if self._pidfiles and self.conf.exists():
            with contextlib.suppress(Exception):
                ids = self.command("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if ids:
                    self.command("scancel", *ids, check=False)
                    deadline = time.monotonic() + 30
                    while self.command("squeue", "-h", "-o", "%i", check=False).stdout.split():
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.5)
        for pidfile in reversed(self._pidfiles):  # slurmds, slurmctld, munged last
            with contextlib.suppress(FileNotFoundError, ValueError):
                stop_pid(int(pidfile.read_text()))
        self._pidfiles.clear()

    def logs(self) -> str:
        """The end of every daemon log, for failure messages."""
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                 for p in sorted((self.root / "log").glob("*.log"))]
        return "\n".join(parts)

    # -- jobs --------------------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's env) pointed at this cluster.

        Inherited SLURM/sbatch variables (as when the tests run inside a job) would leak into the
        submission, so they are dropped; only ``SBATCH_GRES`` is kept, the caller's GPU override.
        """
        env = {k: v for k, v in (base if base is not None else os.environ).items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) or k == "SBATCH_GRES"}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(args), check=False, env=self.env(), capture_output=True, text=True,
                              timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def submit(self, script: Path, *, name: str, output: Path, env: dict[str, str],
               args: tuple[str, ...] = (), cwd: Path | None = None) -> Job:
        """``sbatch`` ``script`` with ``env`` exported, stdout+stderr to ``output``."""
        output.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["sbatch", "--parsable", "--export=ALL", f"--job-name={name}", f"--output={output}",
               *args, str(script)]
        proc = subprocess.run(cmd, check=False, env=self.env(env), cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` was refused: {proc.stderr.strip()}")
        return Job(job_id=proc.stdout.strip().split(";")[0], name=name, output=output)

    def refresh(self, job: Job) -> Job:
        proc = self.command("scontrol", "-o", "show", "job", job.job_id, check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            job.info = parse_record(proc.stdout.strip().splitlines()[0])
        return job

    def refresh_all(self, jobs: list[Job]) -> None:
        """Update every job in ``jobs`` from one ``scontrol -o show job`` (one line per job the cluster knows;
        ``MinJobAge`` keeps finished ones): one process and one request per poll, however many jobs."""
        proc = self.command("scontrol", "-o", "show", "job", check=False)
        records = {}
        for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
            record = parse_record(line)
            records[record.get("JobId")] = record
        for job in jobs:
            job.info = records.get(job.job_id, job.info)

    def wait(self, jobs: list[Job], timeout: float, states: frozenset[str] = TERMINAL,
             interval: float = 1.0) -> bool:
        """Poll every ``interval`` seconds until every job is in one of ``states``; False if ``timeout`` passed
        first."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh_all(jobs)
            if all(j.state in states for j in jobs):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(interval)

    def cancel(self, job: Job) -> None:
        self.command("scancel", job.job_id, check=False)


def sbatch_directives(script: Path) -> Iterator[str]:
    """The ``#SBATCH`` option words of ``script`` (only those before the first command count)."""
    for line in script.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            yield from stripped[len("#SBATCH"):].split("#", 1)[0].split()
        elif stripped and not stripped.startswith("#"):
            return


def requested_nodes(script: Path) -> int:
    """How many nodes the script's ``#SBATCH --nodes/-N`` asks for (1 if it does not say)."""
    words = list(sbatch_directives(script))
    for i, word in enumerate(words):
        value = None
        if word.startswith("--nodes="):
            value = word.split("=", 1)[1]
        elif word in ("--nodes", "-N") and i + 1 < len(words):
            value = words[i + 1]
        elif re.fullmatch(r"-N\d+.*", word):
            value = word[2:]
        if value is not None:
            return int(re.split(r"[-:]", value)[0])
    return 1


@contextlib.contextmanager
def hosts_entry(names: list[str], hosts: Path = Path("/etc/hosts")) -> Iterator[None]:
    """Make ``names`` resolve to 127.0.0.1 while inside; removes exactly the line it added.

    Removing our own marked line (instead of writing back a copy) keeps a concurrent run's
    entry intact.
    """
    marker = f"# labkit system test, pid {os.getpid()}"
    text = hosts.read_text()
    with hosts.open("a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + f"127.0.0.1 {' '.join(names)} {marker}\n")
    try:
        yield
    finally:
        lines = hosts.read_text().splitlines(keepends=True)
        hosts.write_text("".join(line for line in lines if marker not in line))
