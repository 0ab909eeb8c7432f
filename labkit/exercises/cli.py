"""``labkit check NAME [ARGS]``: checkers that tell a learner whether an exercise is right, and what is wrong.

    labkit check allreduce --init my_ring.py     # write the exercise's starting file
    labkit check allreduce my_ring.py            # judge it: exit 0 when right, 1 with the reasons otherwise
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from pathlib import Path

from labkit.errors import ConfigError
from labkit.faults import FAULTS
from labkit.flags import resolve

#: exercise name -> "module:function" taking argv (list of str) and returning an exit code
CHECKS: dict[str, str] = {
    "training-step": "labkit.exercises.training_step:main",
    "allreduce": "labkit.exercises.allreduce:main",
    "average-gradients": "labkit.exercises.average_gradients:main",
    "column-parallel": "labkit.exercises.column_parallel:main",
    "gpipe-exercise": "labkit.exercises.gpipe:main",
    "kfac-factors": "labkit.exercises.kfac_factors:main",
    "newton-schulz": "labkit.exercises.newton_schulz:main",
    "lr-schedule": "labkit.exercises.lr_schedule:main",
    "staleness": "labkit.exercises.staleness:main",
    "zero-stage1": "labkit.exercises.zero_stage1:main",
    "online-softmax": "labkit.exercises.online_softmax:main",
    "advisor-cost": "labkit.exercises.pipeline_bubble:main",
    "row-parallel": "labkit.exercises.row_parallel:main",
    "pp-schedule": "labkit.exercises.pp_schedule:main",
    "activation-memory": "labkit.exercises.activation_memory:main",
}

#: exercise name -> "module:ATTRIBUTE", the text of its starting file (``--init FILE``)
STARTERS: dict[str, str] = {
    "training-step": "labkit.exercises.training_step:STARTER",
    "allreduce": "labkit.exercises.allreduce:STARTER",
    "average-gradients": "labkit.exercises.average_gradients:STARTER",
    "column-parallel": "labkit.exercises.column_parallel:TEMPLATE",
    "kfac-factors": "labkit.exercises.kfac_factors:STARTER",
    "newton-schulz": "labkit.exercises.newton_schulz:STARTER",
    "lr-schedule": "labkit.exercises.lr_schedule:STARTER",
    "staleness": "labkit.exercises.staleness:STARTER",
    "zero-stage1": "labkit.exercises.zero_stage1:STARTER",
    "online-softmax": "labkit.exercises.online_softmax:STARTER",
    "advisor-cost": "labkit.exercises.pipeline_bubble:STARTER",
    "row-parallel": "labkit.exercises.row_parallel:STARTER",
    "pp-schedule": "labkit.exercises.pp_schedule:STARTER",
    "activation-memory": "labkit.exercises.activation_memory:STARTER",
}

# notebook 11: each broken program of labkit.faults is an exercise; its starting file is the program itself
CHECKS.update({f"faults-{n}": f"labkit.faults.check:check_{n.replace('-', '_')}" for n in FAULTS})
STARTERS.update({f"faults-{n}": f"labkit.faults.check:starter_{n.replace('-', '_')}" for n in FAULTS})


def _starter_text(spec: str) -> str:
    """The starting file's text, read from its module's source where it is one string literal (so ``--init``
    imports neither the checker nor torch), else the module's attribute."""
    module, _, attr = spec.partition(":")
    origin = importlib.util.find_spec(module).origin
    with open(origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    values = [node.value for node in tree.body if isinstance(node, ast.Assign)
              and attr in [getattr(target, "id", None) for target in node.targets]]
    if len(values) == 1 and isinstance(values[0], ast.Constant) and isinstance(values[0].value, str):
        return values[0].value
    return resolve(spec)


def write_starter(name: str, path: str | Path) -> Path:
    """Write the starting file of exercise ``name`` to ``path`` (never over an existing file)."""
    if name not in STARTERS:
        raise ConfigError(f"check {name!r} has no starting file; these do: {', '.join(STARTERS)}")
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} exists; pick another name or check it: labkit check {name} {path}")
    try:
        path.write_text(_starter_text(STARTERS[name]))
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from exc
    return path


def run_check(name: str, argv: list[str] | None = None) -> int:
    if name not in CHECKS:
        raise ConfigError(f"unknown check {name!r}; choose one of: {', '.join(CHECKS)}")
    argv = list(argv or [])
    if argv[:1] == ["--init"]:
        if len(argv) != 2:
            raise ConfigError(f"--init takes one FILE: labkit check {name} --init my_{name.replace('-', '_')}.py")
        path = write_starter(name, argv[1])
        todo = "find the mistake and fix it" if name.startswith("faults-") else "fill in the TODOs"
        print(f"wrote {path}: {todo}, then run  labkit check {name} {path}")
        return 0
    return int(resolve(CHECKS[name])(argv) or 0)


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check a workshop exercise", description=__doc__)
    p.add_argument("name", help=f"one of: {', '.join(CHECKS)}")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="passed to the checker (e.g. a FILE), or --init FILE to write the starting file")
    p.set_defaults(func=lambda a: run_check(a.name, a.args))
