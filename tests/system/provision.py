"""Bring up what a system test needs (Debian and pip packages, free ports, daemons) or say why not.

A system test skips only when the machine really cannot run it, and never silently in CI:
with ``CI=true`` every :func:`unavailable` is a failure, so a CI run cannot turn green by skipping.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
_apt_updated = False
# The system layer runs on both pytest-xdist workers (two units: SLURM, browser); each may install packages, and
# apt/dpkg and pip must not run twice at once: a lock shared by every process of this machine.
INSTALL_LOCK = Path(tempfile.gettempdir()) / "labkit-system-install.lock"


@contextlib.contextmanager
def install_lock() -> Iterator[None]:
    """Hold the machine-wide install lock (blocking) while inside."""
    with INSTALL_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def in_ci() -> bool:
    """True when running under CI (``CI=true``), where a system test that cannot run always fails."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def skip_allowed() -> bool:
    """Only an explicit opt-out lets a system test skip: ``LABKIT_SKIP_SYSTEM=1`` (never under CI)."""
    return os.environ.get("LABKIT_SKIP_SYSTEM", "").lower() in ("true", "1", "yes") and not in_ci()


def unavailable(reason: str) -> NoReturn:
    """Fail the test with ``reason``, so a machine that cannot run the SLURM/browser layers says so loudly;
    skip it instead when the user opted out (:func:`skip_allowed`)."""
    if not skip_allowed():
        pytest.fail(f"system test cannot run here: {reason} (LABKIT_SKIP_SYSTEM=1 or -m 'not system' "
                    "leaves the system layer out)", pytrace=False)
    pytest.skip(reason)


def apt_install(packages: list[str], binaries: list[str]) -> None:
    """Install Debian ``packages`` unless every one of ``binaries`` is already on PATH.

    Runs ``apt-get update`` once per test session (a fresh machine has no package lists).
    """
    if all(shutil.which(b) for b in binaries):
        return
    with install_lock():
        _apt_install(packages, binaries)


def _apt_install(packages: list[str], binaries: list[str]) -> None:
    global _apt_updated
    if all(shutil.which(b) for b in binaries):  # the other worker installed them while this one waited
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        unavailable(f"{', '.join(binaries)} missing and apt-get is not usable here (needs root and Debian)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    steps = [] if _apt_updated else [["apt-get", "update", "-qq"]]
    steps.append(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages])
    for cmd in steps:
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            unavailable(f"`{' '.join(cmd)}` failed: {(proc.stdout + proc.stderr)[-1500:]}")
        _apt_updated = _apt_updated or cmd[1] == "update"
    missing = [b for b in binaries if not shutil.which(b)]
    if missing:
        unavailable(f"installed {packages} but {missing} still not on PATH")


def pip_install(module: str, requirement: str) -> None:
    """``pip install requirement`` into this interpreter unless ``module`` is importable."""
    if importlib.util.find_spec(module) is not None:
        return
    with install_lock():
        importlib.invalidate_caches()
        if importlib.util.find_spec(module) is not None:  # the other worker installed it meanwhile
            return
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement],
                              check=False, capture_output=True, text=True, timeout=600)
    importlib.invalidate_caches()
    if proc.returncode != 0 or importlib.util.find_spec(module) is None:
        unavailable(f"`pip install {requirement}` failed: {(proc.stdout + proc.stderr)[-1500:]}")


def python_env(**extra: str) -> dict[str, str]:
    """This process's environment with this interpreter's bin dir first on PATH.

    Job steps and kernels then find the same ``python``, ``labkit`` and ``torchrun`` as the test
    run, and the repository is importable even where it was not pip-installed.
    """
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie counts as dead (``kill -0`` succeeds on zombies here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM ``pid``, then SIGKILL if it is still alive after ``timeout`` seconds."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.1)


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll ``check()`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
