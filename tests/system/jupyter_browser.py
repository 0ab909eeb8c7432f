"""JupyterLab served for a browser test, and the steps a learner takes in it, via Playwright.

The server serves a *copy* of ``notebooks/`` (the rest of the repository is symlinked beside it),
so running notebooks in the browser never writes outputs into the committed files; autosave is
off as well. Facts about JupyterLab 4 these helpers rely on:

- ``?reset`` drops any restored workspace, so only the notebook we open is running;
- the toolbar kernel indicator reads idle before a kernel exists, and a Run All sent then is
  lost, so we wait for the status bar's ``(ipykernel) | Idle``;
- JupyterLab scrolls inside its own panel, so we screenshot elements, never the full page.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .provision import REPO, free_port, wait_for

# User settings written before start: keep the corner free of the news/update notification,
# never save notebooks behind our back, and keep every cell in the DOM.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}

# JavaScript: the input prompts ("[3]:", "[*]:", "[ ]:") of the visible notebook's code cells.
PROMPTS = ("Array.from(document.querySelectorAll("
           "'.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt'))"
           ".map(e => e.textContent.trim())")
# Run All took effect: cells are queued ("[*]") or, for a fast notebook, already all numbered.
STARTED_JS = ("() => { const p = " + PROMPTS + "; "
              "return p.some(t => t.includes('*')) || p.every(t => /\\[\\d+\\]/.test(t)); }")
STOPPED_JS = "() => !" + PROMPTS + ".some(t => t.includes('*'))"


class JupyterLab:
    """A JupyterLab server on 127.0.0.1 with a token, rooted in a temp copy of the repository."""

    def __init__(self, root: Path, token: str, env: dict[str, str],
                 notebooks: Path = REPO / "notebooks") -> None:
        self.root = root
        self.serve = root / "serve"  # what the server serves: notebooks/ copied, the rest symlinked
        self.notebooks = notebooks
        self.token = token
        self.env = env
        self.port = 0
        self.log = root / "jupyterlab.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        serve = self.serve
        serve.mkdir()
        for entry in REPO.iterdir():
            if entry.name in (".git", "notebooks", "test-artifacts"):
                continue
            (serve / entry.name).symlink_to(entry)
        shutil.copytree(self.notebooks, serve / "notebooks",
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        settings = self.root / "settings"
        for rel, values in SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.port = free_port()
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={serve}",
               f"--LabApp.workspaces_dir={self.root / 'workspaces'}",
               f"--LabApp.user_settings_dir={settings}"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({self._proc.returncode}):\n{self.log_tail()}")
            return self.get(f"/api/status?token={self.token}")[0] == 200

        wait_for(ready, timeout, f"JupyterLab on port {self.port}", interval=0.5)

    def request(self, method: str, path: str, auth: bool = False) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request without following redirects: (status, headers, body); status 0 if refused."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Authorization": f"token {self.token}"} if auth else {}
        try:
            conn.request(method, path, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        except OSError:
            return 0, {}, b""
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict[str, str]]:
        status, headers, _ = self.request("GET", path)
        return status, headers

    def shutdown_kernels(self) -> None:
        """Stop every running kernel (each notebook's torch kernel holds hundreds of MB)."""
        status, _, body = self.request("GET", "/api/kernels", auth=True)
        for kernel in json.loads(body) if status == 200 else []:
            self.request("DELETE", f"/api/kernels/{kernel['id']}", auth=True)

    def url(self, path: str) -> str:
        """Browser URL for ``path`` with the token and ``reset`` (no restored workspace)."""
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}&reset"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM the server's process group (server and kernels), SIGKILL if it lingers."""
        if self._proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._proc.poll() is not None:
                break
            os.killpg(self._proc.pid, sig)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                continue
        self._proc = None


def notebook_prefix(path: Path, marker: str) -> list[dict]:
    """The cells of the notebook ``path`` up to and including the first code cell whose source has ``marker``."""
    cells = json.loads(path.read_text())["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and marker in "".join(cell["source"]):
            return cells[:i + 1]
    raise AssertionError(f"{path.name}: no code cell contains {marker!r}")


def prepare_notebook(server: JupyterLab, name: str, parts: list[tuple[str, str]]) -> str:
    """Write ``notebooks/<name>`` into the served copy: for each ``(notebook, marker)`` of ``parts``, that
    notebook's cells up to its cell with ``marker`` (:func:`notebook_prefix`), in order, without outputs.

    A browser check then runs the cells it looks at and the ones they need, not a whole notebook (nbval
    executes every notebook in full). Returns the path to open, relative to the server's root.
    """
    first = json.loads((server.notebooks / parts[0][0]).read_text())
    cells = []
    for notebook, marker in parts:
        for cell in notebook_prefix(server.notebooks / notebook, marker):
            cell = dict(cell, id=f"{notebook[:3]}{cell.get('id', len(cells))}"[:64])  # ids stay unique
            if cell["cell_type"] == "code":
                cell.update(outputs=[], execution_count=None)
            cells.append(cell)
    prepared = dict(first, cells=cells)
    (server.serve / "notebooks" / name).write_text(json.dumps(prepared, indent=1))
    return f"notebooks/{name}"


def open_notebook(page, server: JupyterLab, relpath: str, timeout_s: float = 120) -> None:
    """Open ``relpath`` in a clean workspace and wait until its kernel exists and is idle."""
    page.goto(server.url(f"lab/tree/{relpath}"))
    idle = page.locator("#jp-main-statusbar").get_by_text(re.compile(r"\(ipykernel\) \| Idle"))
    # A notebook without kernelspec metadata asks which kernel to use: answer as a learner would.
    select = page.locator(".jp-Dialog", has_text="Select Kernel").get_by_role("button", name="Select")
    wait_for(lambda: idle.is_visible() or (select.is_visible() and select.click()), timeout_s,
             f"the kernel of {relpath} to be idle", interval=0.5)
    idle.wait_for(timeout=timeout_s * 1000)


def run_all(page, timeout_s: float = 300) -> list[str]:
    """Run > Run All Cells, wait until execution stops, and return the cells' prompts.

    Execution has stopped when no prompt is ``[*]`` any more; a cell that raised leaves the
    cells after it unnumbered, which the caller's assertion then shows.
    """
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
    page.wait_for_function(STARTED_JS, timeout=30_000)
    page.wait_for_function(STOPPED_JS, timeout=timeout_s * 1000, polling=500)
    return page.evaluate("() => " + PROMPTS)


def errors_shown(page) -> list[str]:
    """Text of every error traceback in the notebook's outputs (empty when none)."""
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
        ".map(e => e.innerText).filter(t => t.includes('Traceback'))")


def assert_all_ran(page, prompts: list[str], name: str) -> None:
    """Every code cell has an execution count, else show which did not and why."""
    unrun = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:?", p)]
    assert prompts and not unrun, (
        f"{name}: code cells {unrun} of {len(prompts)} did not run (prompts {prompts}); "
        f"errors shown: {errors_shown(page)[:2]}")

