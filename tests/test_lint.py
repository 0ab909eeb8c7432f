"""The code stays clean under the linter the project keeps (ruff; rules in pyproject.toml's ``[tool.ruff]``)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ruff")
    if found:
        return [found]
    pytest.fail("ruff is not installed: it is in the test extras (pip install -e '.[test]')")


def test_the_code_is_clean_under_the_projects_ruff_rules():
    run = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_ruff_finds_what_the_rules_name(tmp_path):
    """The rule set is live: an unused import, imports out of order and a module without a docstring are caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nprint(os.sep)\n")
    run = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise",
                          "--config", str(ROOT / "pyproject.toml"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    found = run.stdout
    assert run.returncode == 1 and "F401" in found and "I001" in found and "D100" in found, found
