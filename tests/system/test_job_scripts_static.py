"""Static checks of every ``jobs/**/job_*.sh``: it parses, names only files that exist, and keeps
the job-script conventions of ``jobs/README.md``. Fast; needs no SLURM.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .jobs import JOBS, JUPYTER_JOB, NO_RESULTS, PREEMPTION_NONE, job_scripts, script_id
from .provision import REPO
from .slurm_cluster import requested_nodes, sbatch_directives

pytestmark = pytest.mark.system

SCRIPTS = job_scripts()
# A relative path to a source-like file: what a script runs, sources or points learners to.
FILE_WORD = re.compile(r"(?<![\w$/.{-])((?:\.{1,2}/)?[\w.-]+(?:/[\w.-]+)*\.(?:py|sh|ipynb|ya?ml|toml|cfg|txt|md))\b")
# ``python -m package.module``: the module must exist in the repository (or be installed).
MODULE = re.compile(r"-m\s+(labkit(?:\.\w+)*)")
# Words that name things the job writes or that live on the cluster, not in the repository.
NOT_OURS = ("runs/", "data/", "test-artifacts/")


def named_files(script: Path) -> set[str]:
    return {m for m in FILE_WORD.findall(script.read_text()) if not m.startswith(NOT_OURS)}


def test_there_are_job_scripts() -> None:
    assert SCRIPTS, f"no job_*.sh under {JOBS}"


@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_script_parses_with_bash(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_every_file_the_script_names_exists(script: Path) -> None:
    # Scripts run from the repository root; a helper may also sit beside its script.
    missing = [name for name in sorted(named_files(script))
               if not (REPO / name).exists() and not (script.parent / name).exists()]
    assert not missing, f"{script.relative_to(REPO)} names files that do not exist: {missing}"
    for module in MODULE.findall(script.read_text()):
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), (
            f"{script.relative_to(REPO)} runs `python -m {module}`, which does not exist")


@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_script_keeps_the_job_conventions(script: Path) -> None:
    text = script.read_text()
    name = script.relative_to(REPO)
    assert text.startswith("#!/bin/bash"), f"{name}: first line must be #!/bin/bash"
    assert re.search(r"^#\s*Usage", text, re.MULTILINE | re.IGNORECASE), f"{name}: no usage header"
    directives = list(sbatch_directives(script))
    assert any(re.fullmatch(r"--gres=gpu:\d+", d) for d in directives), (
        f"{name}: needs an `#SBATCH --gres=gpu:N` line before the first command (GPU node; "
        f"CPU partitions override it with SBATCH_GRES=none); has {directives}")
    if script != JUPYTER_JOB and not NO_RESULTS.search(text):
        assert "LABKIT_OUT" in text, (
            f"{name}: must write its results under $LABKIT_OUT when set (or declare "
            "`# results: none` in its header)")


def commands(script: Path) -> list[str]:
    """The script's lines that are not comments, without their trailing comments."""
    return [line.split(" #")[0] for line in script.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_ranks_start_through_labkits_torchrun(script: Path) -> None:
    """Plain torchrun follows a rank's one-line configuration error with its own error block and exit 1."""
    plain = [line for line in commands(script)
             if "torch.distributed.run" in line or re.search(r"(?<![\w.])torchrun\b", line)]
    assert not plain, f"{script.relative_to(REPO)}: start ranks with `python -m labkit.dist.torchrun`, not {plain}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != JUPYTER_JOB], ids=script_id)
def test_training_script_checkpoints_and_requeues_on_the_warning(script: Path) -> None:
    """A script that trains asks for SLURM's warning, a requeue and an output file a requeue appends to, and starts
    every run through ``run_ranks`` (jobs/lib/run.sh) with ``--resume`` on a requeued run; one with nothing to
    continue says so in its header."""
    text, name = script.read_text(), script.relative_to(REPO)
    directives = list(sbatch_directives(script))
    code = commands(script)
    if PREEMPTION_NONE.search(text):
        assert "--requeue" not in directives, f"{name}: says `# pre-emption: none` but asks for --requeue"
        return
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives) and "--requeue" in directives, (
        f"{name}: needs `#SBATCH --signal=B:USR1@120` and `#SBATCH --requeue` (or `# pre-emption: none` and why)")
    assert "--open-mode=append" in directives, (
        f"{name}: needs `#SBATCH --open-mode=append`: SLURM truncates the output file when a job is requeued")
    assert "source jobs/lib/run.sh" in [line.strip() for line in code], (
        f"{name}: must `source jobs/lib/run.sh`")
    runs = [line for line in code if line.strip().startswith("run_ranks ")]
    assert runs, f"{name}: starts no run through `run_ranks OUT CMD...`"
    assert '"${resume[@]}"' in text, f"{name}: a requeued run must pass \"${{resume[@]}}\" (--resume) to labkit"
    direct = [line for line in code if re.match(r'\s*(srun\b|"\$\{(cmd|launch)\[@\]\}")', line)]
    assert not direct, f"{name}: starts ranks outside run_ranks (no checkpoint on the warning): {direct}"


def test_requested_nodes_reads_only_the_sbatch_header(tmp_path: Path) -> None:
    """How the multi-node scripts are told apart from the one-node ones."""
    cases = {
        "#SBATCH --gres=gpu:4\n": 1,
        "#SBATCH --nodes=2 --gres=gpu:4  # two nodes\n": 2,
        "#SBATCH -N 3\n": 3,
        "#SBATCH -N4\n": 4,
        "#SBATCH --nodes 2-8\n": 2,
        "# a comment\n#SBATCH --time=1:00:00\necho hi\n#SBATCH --nodes=5\n": 1,  # after a command
    }
    for i, (header, nodes) in enumerate(cases.items()):
        script = tmp_path / f"job_{i}.sh"
        script.write_text("#!/bin/bash\n" + header)
        assert requested_nodes(script) == nodes, (header, list(sbatch_directives(script)))
