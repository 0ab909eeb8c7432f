"""Notebook kernels for the test run, forked from a process that already imported what every notebook imports.

A kernel that starts as a new Python imports torch, ``torch._dynamo`` (every optimizer's first step), matplotlib,
ipykernel and labkit before the notebook's first line runs: about 6 CPU-seconds each here, for every notebook
nbval runs. Here one process per pytest worker (the *zygote*) imports them once, and each kernel is forked from
it, so a kernel starts in a fraction of a second. The kernel itself is unchanged: ipykernel's own application,
with the connection file, working folder, environment and standard streams nbval's kernel manager gave.

The command in the kernel spec is this file run as a small client (standard library only)::

    python tests/forked_kernels.py -f CONNECTION_FILE

It hands the zygote its arguments, folder, environment and its file descriptors 0-2, then stands in for the
kernel towards jupyter_client: it passes on the signals it gets (an interrupt is SIGINT) and exits with the
kernel's status. For each request the zygote forks a *watcher*, which forks the kernel (a process group of its
own) and waits for either end: the kernel's exit (reported to the client) or the client's death (jupyter_client
kills the kernel's process group with SIGKILL at shutdown, which reaches the client only): the watcher then kills
the kernel's group, as that SIGKILL would have. Nothing in these processes runs a thread before it forks.

``LABKIT_FORKED_KERNELS=0`` turns it off (each kernel a new Python, as without this module).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

#: what the zygote imports before it forks kernels (what the notebooks' first cells import)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "matplotlib.pyplot", "ipykernel.kernelapp",
           "labkit", "labkit.train.run", "labkit.viz.figcheck", "labkit.dist.testing")
_ENV = "LABKIT_KERNEL_ZYGOTE"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# --- in the pytest worker -------------------------------------------------------------------------------------

_zygote: subprocess.Popen | None = None


def install() -> None:
    """Make the kernel spec nbval uses (``--nbval-current-env``) start kernels through the zygote (on Linux: its
    sockets carry file descriptors in packets, which not every system's Unix sockets do)."""
    if not sys.platform.startswith("linux"):
        return
    import ipykernel.kernelspec

    original = ipykernel.kernelspec.get_kernel_dict

    def get_kernel_dict(*args, **kwargs) -> dict:
        spec = original(*args, **kwargs)
        if spec["argv"][1:3] == ["-m", "ipykernel_launcher"]:
            _start_zygote()
            spec["argv"] = [spec["argv"][0], __file__, *spec["argv"][3:]]
        return spec

    ipykernel.kernelspec.get_kernel_dict = get_kernel_dict


def _start_zygote() -> None:
    global _zygote
    if _zygote is not None and _zygote.poll() is None:
        return
    folder = tempfile.mkdtemp(prefix="labkit-kernels-")
    path, log = os.path.join(folder, "zygote.sock"), os.path.join(folder, "zygote.log")
    with open(log, "w") as out:  # not the worker's streams: nothing outlives the run holding them
        _zygote = subprocess.Popen([sys.executable, __file__, "--serve", path], stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=out)
    atexit.register(_stop_zygote, _zygote, folder)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):  # it binds before it imports: requests wait in its backlog meanwhile
        if _zygote.poll() is not None or time.monotonic() > deadline:
            with open(log) as out:
                raise RuntimeError(f"the kernel zygote did not start (exit code {_zygote.poll()}):\n{out.read()}")
        time.sleep(0.02)
    os.environ[_ENV] = path


def _stop_zygote(zygote: subprocess.Popen, folder: str) -> None:
    zygote.kill()
    zygote.wait()
    shutil.rmtree(folder, ignore_errors=True)


# --- the zygote -----------------------------------------------------------------------------------------------

def serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    parent = os.getppid()
    server.settimeout(1.0)
    while os.getppid() == parent:  # the worker gone: so is the zygote
        try:
            conn, _ = server.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            conn.settimeout(None)
            if os.fork() == 0:
                server.close()
                _watch(conn)  # never returns
            conn.close()
        while True:  # reap the watchers that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _watch(conn: socket.socket) -> None:
    code = 1
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        kernel = os.fork()
        if kernel == 0:
            conn.close()
            _become_kernel(request, fds)
        for fd in fds:
            os.close(fd)
        conn.send(str(kernel).encode())
        while True:
            readable, _, _ = select.select([conn], [], [], 0.2)
            done, status = os.waitpid(kernel, os.WNOHANG)
            if done:
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                code = 0
                break
            if readable and not conn.recv(16):  # the client is gone (killed): the kernel's group goes too
                os.killpg(kernel, signal.SIGKILL)
                os.waitpid(kernel, 0)
                code = 0
                break
    finally:
        os._exit(code)


def _become_kernel(request: dict, fds: list[int]) -> None:
    import importlib.util

    os.setpgid(0, 0)
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(_ENV, None)
    for sig in _SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"]]
    code = 0
    try:
        from ipykernel import kernelapp

        kernelapp.launch_new_instance()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# --- the client (the kernel spec's command) -------------------------------------------------------------------

def client(argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(os.environ[_ENV])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    kernel = int(conn.recv(64))
    for sig in _SIGNALS:
        signal.signal(sig, lambda signum, frame: os.kill(kernel, signum))
    status = conn.recv(64)
    code = int(status) if status else 1
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
