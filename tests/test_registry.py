"""One module and one registry line: a strategy reaches ``labkit train``, the benchmark suite, the advisor and the
backend table through the literals beside its ``FLAGS`` (labkit.strategies), with no other edit."""
import argparse
import contextlib
import io
import sys
import textwrap

import pytest

from labkit import parallel, strategies
from labkit.advisor.plan import Plan
from labkit.advisor.search import PLANS, candidates
from labkit.bench import suite
from labkit.errors import ConfigError
from labkit.flags import dest, read_literal
from labkit.ranges import within
from labkit.strategies import backends
from labkit.train.cli import add_parser

FAKE = "labkit_registry_fake"
SOURCE = f'''
"""A strategy that exists only in this test."""
FLAGS = [{{"flag": "--fake-level", "type": "int", "range": "[1, 4]", "default": 2, "help": "how fake"}}]
ADVISOR = {{"price": "{FAKE}:price", "plans": "spread", "batch": "split", "grid": {{"fake_level": [1, 3]}}}}
BENCH = {{"ranks": 2, "flags": ["--fake-level", "3"]}}
BACKENDS = [{{"when": {{"fake_level": [3]}}, "backend": "gloo", "device": "cuda",
             "why": "--fake-level {{fake_level}} is imaginary; use --device cpu"}}]


def price(plan, prof, topo):
    """A made-up formula: ``compute = level / p`` seconds."""
    from labkit.advisor.plan import Estimate

    return Estimate(plan, {{"compute": plan.option["fake_level"] / plan.processes}}, {{"parameters": 1.0}})
'''


def _train(argv):
    """``labkit train ARGV`` parsed: (exit code or None, parsed args, stdout + stderr)."""
    parser = argparse.ArgumentParser(prog="labkit")
    add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return None, parser.parse_args(["train", *argv]), out.getvalue()
        except SystemExit as exit:
            return exit.code, None, out.getvalue()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / f"{FAKE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(strategies.STRATEGIES, "fake", f"{FAKE}:FakeStrategy")  # the one registry line
    yield "fake"
    sys.modules.pop(FAKE, None)


def test_a_new_strategy_reaches_train_the_suite_the_advisor_and_the_backend_table(fake, monkeypatch, tmp_path):
    # labkit train: its flags, its help, its range, its flag refused under another strategy
    code, args, _ = _train(["--strategy", "fake", "--fake-level", "3"])
    assert code is None and (args.strategy, args.fake_level) == ("fake", 3)
    code, _, text = _train(["--strategy", "fake", "--help"])
    assert code == 0 and "strategy fake" in text and "--fake-level" in text and "how fake" in text
    assert _train(["--strategy", "fake", "--fake-level", "9"])[0] == 2
    code, _, text = _train(["--strategy", "ddp", "--fake-level", "3"])
    assert code == 2 and "--fake-level is a flag of --strategy fake" in text
    # the benchmark suite: its run is listed and run with its ranks and flags
    assert suite.strategy_runs()["fake"] == (2, ["--fake-level", "3"]) and "fake" in suite.parts()
    ran = []
    monkeypatch.setattr(suite, "strategy_part", lambda name, *rest: ran.append(name) or {"samples_per_sec": 1.0})
    assert suite.run_suite(True, "cpu", tmp_path / "suite", ["fake"])["strategies"] == {"fake": {"samples_per_sec": 1.0}}
    assert ran == ["fake"]
    # the backend table: its row, formatted with its option; its flag's default applies to a bare name
    assert backends.key("fake", {"fake_level": 3}) == "fake:fake_level=3"
    assert backends.refusal("fake:fake_level=3", "gloo", "cuda") == "--fake-level 3 is imaginary; use --device cpu"
    assert backends.refusal("fake", "gloo", "cuda") is None and backends.refusal("fake:fake_level=3", "gloo", "cpu") is None
    assert FAKE not in sys.modules  # everything so far was read from its source
    # the advisor: every grid point on 2 and 3 ranks, priced by the module's own function, the batch split
    from test_advisor_cost import tiny_profile, topo

    ranked = candidates(lambda p: tiny_profile(), topo(ranks=3), 12, ("fake", "ddp"))
    mine = {(e.plan.processes, e.plan.option["fake_level"], e.plan.per_rank_batch): e.step_s
            for e in ranked if e.plan.strategy == "fake"}
    assert mine == pytest.approx({(2, 1, 6): 0.5, (2, 3, 6): 1.5, (3, 1, 4): 1 / 3, (3, 3, 4): 1.0})
    assert [e.plan.strategy for e in ranked].count("ddp") == 2  # p = 2, 3: the cheapest all-reduce each
    assert Plan("fake", 3, 3, 12, (("fake_level", 1),), 3).train_args("lenet", "mnist-sample")[-6:] == [
        "--strategy", "fake", "--batch-size", "4", "--fake-level", "1"]


def test_a_malformed_literal_is_one_clear_error(fake, tmp_path):
    (tmp_path / "labkit_registry_bad.py").write_text('ADVISOR = {"price": "x:y", "plans": "sideways"}\nBENCH = dict()\n')
    strategies.STRATEGIES["fake"] = "labkit_registry_bad:Bad"
    with pytest.raises(ConfigError, match="labkit_registry_bad.BENCH must be a literal"):
        read_literal("labkit_registry_bad", "BENCH")
    with pytest.raises(ConfigError, match="'plans' is 'sideways'; use one of one, spread"):
        from test_advisor_cost import tiny_profile, topo

        candidates(lambda p: tiny_profile(), topo(), 8, ("fake",))


@pytest.mark.parametrize("name", list(strategies.STRATEGIES))
def test_every_strategys_literals_name_what_exists(name):
    """Each literal names a pricing function that imports, a search kind that exists, options that are the
    strategy's own flags with values they accept, and suite flags ``labkit train`` parses."""
    import importlib

    options = {dest(f): f for f in strategies.strategy_flags(name)}
    advisor = strategies.strategy_literal(name, "ADVISOR")
    if advisor is not None:
        module, _, attr = advisor["price"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr))
        assert advisor["plans"] in PLANS
        for option, values in advisor.get("grid", {}).items():
            flag = options[option]
            parse = within(flag["type"], flag["range"]) if "range" in flag else str
            assert all(parse(str(v)) is not None and v in flag.get("choices", [v]) for v in values), (name, option)
        assert {advisor["servers"]} <= set(options) if "servers" in advisor else True
        assert set(advisor.get("options", {}).values()) <= set(options), name
    bench = strategies.strategy_literal(name, "BENCH")
    if bench is not None:
        assert _train(["--strategy", name, *bench["flags"]])[0] is None
    for row in strategies.strategy_literal(name, "BACKENDS", ()):
        assert set(row.get("when", {})) | set(row.get("unless", {})) <= set(options)
        assert row["backend"] in ("gloo", "nccl") and row["device"] in ("cpu", "cuda", "*") and "use " in row["why"]


def test_a_new_mesh_dimension_reaches_train_and_the_advisors_reader(tmp_path, monkeypatch):
    (tmp_path / "labkit_registry_dim.py").write_text(
        'FLAGS = [{"flag": "--fake-split", "action": "store_true", "help": "split fakely"}]\n'
        'ADVISOR = {"price": "labkit_registry_dim:price"}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(parallel.DIMENSIONS, "fk", "labkit_registry_dim:Fake")
    code, _, text = _train(["--strategy", "mesh", "--help"])
    assert code == 0 and "--fake-split" in text and "--dp-shard" in text
    found = parallel.registered("ADVISOR")
    assert found["fk"] == {"price": "labkit_registry_dim:price"} and found["dp"] == {"price": "labkit.parallel.dp:mesh_time"}
    assert "labkit_registry_dim" not in sys.modules
    from labkit.parallel.dp import price  # the placeholder: bytes one rank sends per step, P = 1000 bytes

    assert [price(1000.0, d, shard)["bytes"] for d in (1, 2, 4) for shard in ("none", "fsdp")] == [
        0.0, 0.0, 1000.0, 1500.0, 1500.0, 2250.0]
