"""The notebooks' rule (docs/ARCHITECTURE.md, "Jobs and notebooks"), as far as reading them can enforce it:
a notebook that shows a test accuracy asserts one against a number, so a quick-mode run at chance accuracy,
or a claim the learner cannot see, fails the notebook instead of being shown as evidence."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
SHOWS_ACCURACY = re.compile(r"\btest_acc\b|final_test_acc")
ASSERT = re.compile(r"^\s*assert\b.*$", re.M)
COMPARED = re.compile(r"[<>]=?\s*(\d*\.\d+|\w+\[[^]]*\]\[\"test_acc\"\])")  # with a number or another run's accuracy
#: notebooks that show a test accuracy without asserting one yet, and why
NOT_YET: dict[str, str] = {}


def _asserts_accuracy(code: str) -> bool:
    return any("acc" in line and COMPARED.search(line) for line in ASSERT.findall(code))


def _code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_shown_accuracy_is_asserted(path):
    code = _code(path)
    if not SHOWS_ACCURACY.search(code) or path.stem in NOT_YET:
        return
    assert _asserts_accuracy(code), (f"{path.name} shows a test accuracy but asserts none against a number "
                                           "(a run at chance accuracy would pass unnoticed)")


def test_the_rule_reads_an_assertion_and_not_a_print():
    assert _asserts_accuracy('assert all(a > 0.7 for a in accuracy.values()), "learns"')
    assert _asserts_accuracy('x = 1\nassert kfac[e]["test_acc"] > sgd[e]["test_acc"]')
    assert not _asserts_accuracy('print(f"test accuracy {acc:.3f}")\nassert steps > 0.5')
    assert not _asserts_accuracy('assert len(accuracy) == 2')
    assert set(NOT_YET) <= {p.stem for p in NOTEBOOKS}
