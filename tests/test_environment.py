"""The install files agree: environment.yml installs what pyproject.toml and the pin file name."""
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_matches_pyproject_and_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    lines = [line.strip()[2:].strip() for line in (ROOT / "environment.yml").read_text().splitlines()
             if line.strip().startswith("- ")]
    pip_section = [line for line in lines if line not in ("python=3.11", "pip", "pip:", "conda-forge")]
    assert "-e .[test]" in pip_section
    named = {_name(r) for r in pip_section if not r.startswith("-e")}
    assert named == wanted
    pins = [line for line in (ROOT / "requirements-pins.txt").read_text().splitlines() if "==" in line]
    assert set(pins) <= set(pip_section), "environment.yml must pin torch/torchvision exactly as requirements-pins.txt"


def test_readme_opens_with_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text().splitlines()
    block = readme[readme.index("```bash") + 1: readme.index("```bash") + 3]
    assert block[0].endswith("labkit tour")
    assert block[1].endswith("python -m pytest")
    assert block[1] in (ROOT / ".ci" / "run").read_text()
