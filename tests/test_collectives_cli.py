"""``labkit allreduce verify|animate|bench`` end to end (2 gloo ranks), and bad input -> exit 2 + one line."""
import argparse

import pytest
from PIL import Image

from labkit.collectives import ALGORITHMS
from labkit.collectives.cli import add_parser
from labkit.collectives.verify import VerifyRow, format_verify, summarize
from labkit.results import load_run


def run_cli(argv):
    from labkit.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # a flag argparse refuses
        return exc.code


def test_parser_has_the_three_actions():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["allreduce", "bench", "--algo", "ring", "--ranks", "2,4"])
    assert (args.algo, args.ranks, args.sizes, args.func.__name__) == ("ring", "2,4", "1KiB,64KiB,1MiB,16MiB", "bench")
    assert parser.parse_args(["allreduce", "verify"]).func.__name__ == "verify"
    assert parser.parse_args(["allreduce", "animate", "--out", "x.html"]).func.__name__ == "animate"


def test_verify_prints_one_line_per_algorithm_and_exits_0(capsys):
    assert run_cli(["allreduce", "verify", "--ranks", "2", "--algo", "all"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(ALGORITHMS)
    assert all(line.split()[1] == "ok" and "identical on all ranks" in line for line in lines)
    assert "n in [1, 3, 16, 19, 1000]" in lines[0]          # includes lengths not divisible by 2


def test_verify_report_flags_a_mismatch():
    rows = [VerifyRow("ring", 5, "float32", 0.0, True, True), VerifyRow("ring", 7, "float64", 0.5, False, True),
            VerifyRow("tree", 5, "float32", 0.0, True, False)]
    summary = summarize(rows)
    assert summary["ring"] == (False, "MISMATCH: n=7 float64 err 5.00e-01")
    assert summary["tree"] == (False, "MISMATCH: n=5 float32 ranks differ")
    assert format_verify(rows, 3).splitlines()[0].startswith("ring           FAIL  p=3: MISMATCH")


def test_bench_verifies_then_writes_results_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "bench"
    code = run_cli(["allreduce", "bench", "--algo", "ring,tree", "--ranks", "2", "--sizes", "1KiB,64KiB",
                    "--repeats", "2", "--out", str(out), "--verify"])
    assert code == 0
    printed = capsys.readouterr().out
    # --verify: verify's lines first (one per algorithm, from the same ranks), then the timings
    checked = printed.splitlines()[:2]
    assert [line.split()[:3] for line in checked] == [["ring", "ok", "p=2:"], ["tree", "ok", "p=2:"]], printed
    assert "measured ms" in printed and "predicted ms" in printed and "busbw GB/s" in printed
    assert "p=2, 64KiB: native busbw " in printed
    run = load_run(out)
    assert run.summary["kind"] == "bench" and run.summary["config"]["sizes"] == [1024, 65536]
    records = run.records_of("bench")
    assert sorted({(r["algorithm"], r["bytes"]) for r in records}) == sorted(
        (a, b) for a in ("ring", "tree", "native") for b in (1024, 65536))
    for r in records:
        assert r["world_size"] == 2 and r["time_s"] > 0 and r["predicted_s"] > 0 and len(r["times_s"]) == 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert all(r["vs_native"] == 1.0 for r in records if r["algorithm"] == "native")
    model = run.records_of("cost-model")[0]
    assert model["alpha"] >= 0 and model["beta"] > 0
    trace = run.records_of("trace")[0]
    assert trace["algorithm"] == "ring" and len(trace["steps"]) == 2 * 2   # 2 steps x 2 ranks


def test_animate_writes_html_and_gif(tmp_path, capsys):
    html, gif = tmp_path / "ring.html", tmp_path / "tree.gif"
    assert run_cli(["allreduce", "animate", "--algo", "ring", "--ranks", "3", "--out", str(html)]) == 0
    text = html.read_text()
    assert text.count("data:image/png;base64") == 2 * (3 - 1) + 1    # one frame per step + the start
    assert run_cli(["allreduce", "animate", "--algo", "tree", "--ranks", "3", "--out", str(gif)]) == 0
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames == 4 + 1
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["allreduce", "verify", "--ranks", "1"], "--ranks '1': give world sizes >= 2"),
    (["allreduce", "verify", "--algo", "ring,bogus"], "unknown all-reduce algorithm 'bogus'"),
    (["allreduce", "bench", "--sizes", "12XB"], "cannot read the size '12XB'"),
    (["allreduce", "bench", "--repeats", "0"], "--repeats must be >= 1, got 0 (see labkit allreduce bench --help)"),
    (["allreduce", "animate", "--algo", "spiral", "--out", "x.html"], "unknown algorithm 'spiral' for --algo"),
    (["allreduce", "animate", "--out", "x.mp4"], "use a .html or .gif file name"),
    (["allreduce", "animate", "--ranks", "1", "--out", "x.html"], "--ranks must be >= 2 and <= 64, got 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("labkit: error: ") and message in err and "\n" not in err


def test_verify_and_bench_times_nothing_after_a_mismatch(monkeypatch):
    """bench --verify on each rank: a mismatch in the check means no timing (the rows are the same on every
    rank, so all ranks skip it together)."""
    import labkit.collectives.bench as bench_module
    import labkit.collectives.verify as verify_module
    from labkit.collectives.cli import _verify_and_bench

    timed = []
    monkeypatch.setattr(bench_module, "bench_rank", lambda env, *args: timed.append(args) or {"records": []})
    good, bad = VerifyRow("ring", 5, "float32", 0.0, True, True), VerifyRow("tree", 5, "float32", 0.5, False, True)
    monkeypatch.setattr(verify_module, "verify_rank", lambda env, algorithms: [good, bad])
    assert _verify_and_bench(None, ["ring", "tree"], [1024], 2, "float32") == ([good, bad], None) and timed == []
    monkeypatch.setattr(verify_module, "verify_rank", lambda env, algorithms: [good])
    assert _verify_and_bench(None, ["ring"], [1024], 2, "float32") == ([good], {"records": []})
    assert timed == [(["ring"], [1024], 2, "float32")]
