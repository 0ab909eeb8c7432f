"""Bad input found by testing the real commands: each case is one ``labkit: error:`` line and exit code 2,
and files the kit writes are what the user asked for."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.dist.group import DistEnv
from labkit.errors import ConfigError
from labkit.parallel.pipelining import PipelineStrategy
from labkit.results import RunWriter, atomic_write_text

QUICK = ["--dataset", "synthetic-mnist", "--model", "mlp", "--train-size", "64", "--test-size", "32",
         "--batch-size", "16", "--max-steps", "2", "--device", "cpu", "--log-every", "100"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: "), err
    return err[0]


@pytest.mark.parametrize("out", ["/proc/labkit/run", "/dev/null/run"])
def test_unwritable_out_is_one_line_and_exit_2(capsys, out):
    assert main(["train", *QUICK, "--out", out]) == 2
    line = _one_error_line(capsys)
    assert f"cannot write {out}" in line and "--out" in line


def test_unwritable_run_writer_and_atomic_write(tmp_path):
    from labkit.errors import OutputError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="cannot write"):
        RunWriter(blocker / "run")
    with pytest.raises(OutputError, match="cannot write"):
        atomic_write_text(blocker / "summary.json", "{}")


def test_zero_microbatches_is_rejected(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:  # refused as the flag is read
        main(["train", *QUICK, "--strategy", "gpipe", "--num-microbatches", "0", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--num-microbatches must be >= 1, got 0" in _one_error_line(capsys)
    two_stages = DistEnv(world_size=2, local_world_size=2)  # the check comes before any communication
    with pytest.raises(ConfigError, match="--num-microbatches must be >= 1, got 0"):
        PipelineStrategy(two_stages, {"num_microbatches": 0})
    assert PipelineStrategy(two_stages, {"num_microbatches": None}).options["num_microbatches"] == 4


def test_more_microbatches_than_samples_is_refused_before_the_banner(capsys, tmp_path):
    args = ["train", *QUICK, "--strategy", "gpipe", "--num-microbatches", "100", "--batch-size", "8"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no "labkit train | ..." banner before the refusal
    assert err == ("labkit: error: --num-microbatches 100 is larger than the batch (8 samples); every micro-batch "
                   "needs a sample: use --num-microbatches <= 8 or a larger batch\n")


def test_recorded_microbatches_are_the_ones_that_ran(tmp_path):
    assert main(["train", *QUICK, "--strategy", "gpipe", "--out", str(tmp_path)]) == 0
    options = json.loads((tmp_path / "summary.json").read_text())["config"]["strategy_options"]
    assert options["num_microbatches"] == 4 and options["checkpoint_mode"] == "except_last"


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        writer = RunWriter(tmp_path)
        writer.log({"kind": "epoch", "epoch": 1})
        writer.finish("r", "train", {}, {})
        atomic_write_text(tmp_path / "trace.json", "{}")
    finally:
        os.umask(old)
    for name in ("metrics.jsonl", "summary.json", "trace.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def _fake_cifar(root, broken: str | None):
    """The CIFAR10 files with their real names; only MD5 checks can tell them from the download."""
    from torchvision.datasets import CIFAR10

    folder = root / CIFAR10.base_folder
    folder.mkdir(parents=True)
    for name, _ in [*CIFAR10.train_list, *CIFAR10.test_list, [CIFAR10.meta["filename"], None]]:
        (folder / name).write_bytes(b"garbage" if name == broken else b"")
    return folder


def test_corrupt_dataset_is_told_apart_from_a_missing_one(capsys, tmp_path):
    assert main(["data", "list", "--root", str(tmp_path / "empty")]) == 0
    assert "cifar10            missing (labkit data fetch cifar10)" in capsys.readouterr().out

    folder = _fake_cifar(tmp_path / "data", broken="data_batch_1")
    assert main(["data", "list", "--root", str(tmp_path / "data")]) == 0
    listed = capsys.readouterr().out
    assert f"cifar10            corrupt: {folder / 'data_batch_1'} (MD5 mismatch" in listed
    assert main(["train", *QUICK[2:], "--dataset", "cifar10", "--data-root", str(tmp_path / "data"),
                 "--out", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert f"{folder / 'data_batch_1'} is corrupt (MD5 mismatch)" in line
    assert f"rm {folder / 'data_batch_1'} && labkit data fetch cifar10" in line


def test_truncated_mnist_file_is_corrupt(capsys, tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", 60_000), ("t10k", 10_000)):
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01" + count.to_bytes(4, "big") + bytes(count))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(  # header of a full file, a tenth of the pixels
            b"\0\0\x08\x03" + b"".join(n.to_bytes(4, "big") for n in (count, 28, 28)) + bytes(count * 784 // 10))
    assert main(["data", "list", "--root", str(tmp_path)]) == 0
    assert f"corrupt: {raw / 'train-images-idx3-ubyte'} (4704016 bytes, expected 47040016" in capsys.readouterr().out
    assert main(["train", *QUICK[2:], "--dataset", "mnist", "--data-root", str(tmp_path),
                 "--out", str(tmp_path / "run")]) == 2
    assert "train-images-idx3-ubyte is corrupt (4704016 bytes, expected 47040016)" in _one_error_line(capsys)


def test_config_error_under_torchrun_is_printed_once_and_the_job_script_exits_2(tmp_path):
    """Both ranks hit the same bad value; one line is printed, and the job script (run without SLURM) exits 2
    although torchrun itself exits 1."""
    env = dict(os.environ, LABKIT_QUICK="1", NPROC="2", EXTRA_ARGS="--epochs 0", LABKIT_OUT=str(tmp_path / "run"),
               PYTHON=sys.executable, LABKIT_PLAIN="1")
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(["bash", "jobs/job_ddp.sh"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors == ["labkit: error: --epochs must be >= 1, got 0"], proc.stderr[-2000:]
    block = [ln for ln in proc.stderr.splitlines() if "Traceback" in ln or "Root Cause" in ln or "exitcode" in ln]
    assert not block, proc.stderr[-2000:]  # torchrun's own error block is left out


def test_a_crash_under_torchrun_still_shows_its_traceback(tmp_path):
    """Only labkit's exit codes are quietened: a rank that raises shows its traceback and torchrun's report."""
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('not a configuration error')\n")
    proc = subprocess.run([sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nproc-per-node", "1",
                           str(script)], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "RuntimeError: not a configuration error" in proc.stderr and "Traceback" in proc.stderr
    assert "ChildFailedError" in proc.stderr and "exitcode  : 1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("command", [["bench", "report", "results/reference/cpu-2c-torch2.14.1"], ["tour"]])
def test_report_and_tour_refuse_an_unwritable_out_in_one_line(capsys, monkeypatch, command):
    """Both write through results.make_dirs/atomic_write: the folder is checked before any work is done."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main([*command, "--out", "/proc/labkit/out"]) == 2
    line = _one_error_line(capsys)
    assert "/proc/labkit/out" in line and "choose a writable folder" in line, line


def test_any_unwritable_path_is_one_line(capsys, tmp_path):
    """The command's safety net for paths written outside results.py (here a collective animation)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["allreduce", "animate", "--algo", "ring", "--ranks", "2", "--out", str(blocker / "a.html")]) == 2
    line = _one_error_line(capsys)
    assert f"cannot use {blocker}" in line and "File exists" in line, line


def _exit_code(argv: list[str]) -> int:
    """``main``'s exit code, whether it returns it or a flag error exits with it as the flag is read."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("mesh, expected", [
    ("xx=2", "--mesh 'xx=2': unknown dimension 'xx'; choose from pp, dp, ep, cp, tp"),
    ("dp=0", "--mesh 'dp=0': dp must be >= 1, got 0"),
    ("dp=2,dp=2", "--mesh 'dp=2,dp=2': dp is given twice"),
    ("dp:2", "--mesh 'dp:2': 'dp:2' is not name=size"),
])
def test_bad_mesh_is_one_line_and_exit_2(capsys, tmp_path, mesh, expected):
    assert _exit_code(["train", *QUICK, "--out", str(tmp_path), "--mesh", mesh]) == 2
    assert _one_error_line(capsys).startswith(f"labkit: error: {expected}")
    assert not list(tmp_path.iterdir())  # refused before any work


def test_a_mesh_of_another_rank_count_is_refused_before_any_communication():
    from labkit.parallel.mesh import MeshStrategy

    with pytest.raises(ConfigError, match=r"^--mesh dp=2,tp=2 has 4 ranks \(2 x 2\) but the job has 2; start 4 ranks"):
        MeshStrategy(DistEnv(world_size=2, local_world_size=2), {"mesh": "dp=2,tp=2"})


def test_a_mesh_is_parsed_once_into_one_shape_every_reader_takes():
    from labkit.dist.mesh import MeshShape

    shape = MeshShape.parse("tp=2, dp=2")
    assert MeshShape.parse("tp=2, dp=2") is shape and MeshShape.parse(shape) is shape  # parsed once
    assert shape == {"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 2} and list(shape) == ["pp", "dp", "ep", "cp", "tp"]
    assert str(shape) == "dp=2,tp=2" and shape.ranks == 4 and str(MeshShape.parse("pp=1")) == "dp=1"
    assert [shape.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [shape.coordinates(r)["dp"] for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match=r"^--mesh tp=2, dp=2 has 4 ranks \(2 x 2\) but the job has 8"):
        shape.check_world(8)


def test_a_mesh_flag_with_another_strategy_is_one_line(capsys, tmp_path):
    assert _exit_code(["train", *QUICK, "--out", str(tmp_path), "--strategy", "ddp", "--mesh", "dp=2"]) == 2
    assert _one_error_line(capsys) == "labkit: error: --mesh is a flag of --strategy mesh and --strategy ft, not of --strategy ddp"


class _Mesh:
    """A stand-in for a DeviceMesh of ``sizes``: what a Dimension reads when it is made, no process group."""

    def __init__(self, **sizes):
        self.mesh_dim_names, self.sizes = tuple(sizes), sizes

    def size(self, i):
        return self.sizes[self.mesh_dim_names[i]]

    def get_group(self, name):
        return None

    def get_local_rank(self, name):
        return 0


@pytest.mark.parametrize("tp, model, options, expected", [
    (2, "lenet", {"sequence_parallel": True}, "--mesh tp=2 --sequence-parallel cuts a transformer's sequence: it "
                                              "needs --model gpt"),
    (3, "gpt-tiny", {}, "--mesh tp=3 does not divide gpt-tiny's 4 attention heads"),
])
def test_a_mesh_dimension_the_model_cannot_take_is_refused_before_any_work(tp, model, options, expected):
    from labkit.parallel import get_dimension

    with pytest.raises(ConfigError, match=f"^{expected}"):
        get_dimension("tp")(_Mesh(pp=1, dp=1, ep=1, cp=1, tp=tp), options).check(model)


def test_what_cp_cannot_take_is_refused_from_the_flags_before_the_data(monkeypatch, tmp_path):
    """--seq-len and --dropout reach the mesh's checks, which run before any data is loaded: cp's refusals come from
    the flags, not from the built model."""
    from labkit.parallel import get_dimension
    from labkit.train import run as train_run
    from labkit.train.cli import config_from_argv

    cp = get_dimension("cp")(_Mesh(pp=1, dp=1, ep=1, cp=2, tp=1), {})
    with pytest.raises(ConfigError, match=r"^--mesh cp=2: ring attention has no attention dropout; .*\(--dropout 0.1\)$"):
        cp.check("gpt-tiny", 16, 0.1)
    with pytest.raises(ConfigError, match=r"a length of 30 does not split; use a multiple of 4, e.g. 28 or 32$"):
        cp.check("gpt-tiny", 30)
    cp.check("gpt-tiny", 32)  # 4 chunks of 8 tokens: accepted

    seen = []

    class Refusing:  # a strategy that records what its check was given, and refuses
        def __init__(self, env, options):
            pass

        def check_model(self, model_name, seq_len=None, dropout=0.0):
            seen.append((model_name, seq_len, dropout))
            raise ConfigError("refused")

    monkeypatch.setattr(train_run, "get_strategy", lambda name: Refusing)
    monkeypatch.setattr(train_run, "load_split", lambda **kw: pytest.fail("the data was loaded before the check"))
    for extra, expected in (([], ("gpt-tiny", 128, 0.0)), (["--seq-len", "30", "--dropout", "0.1"],
                                                          ("gpt-tiny", 30, 0.1))):
        cfg = config_from_argv(["--model", "gpt-tiny", "--dataset", "text-sample", "--out", str(tmp_path), *extra])
        with pytest.raises(ConfigError, match="^refused$"):
            train_run.run(cfg)
        assert seen.pop() == expected
