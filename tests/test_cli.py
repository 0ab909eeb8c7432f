"""The labkit command: sub-commands, and bad input -> one clear line, exit code 2."""
import subprocess
import sys

import pytest
import torch

from labkit.cli import main
from labkit.dist.testing import run_cli_ranks


def test_help_lists_subcommands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("tour", "train", "data", "allreduce", "bench", "check"):
        assert command in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "nope", "--dataset", "synthetic-mnist"], "unknown model 'nope'"),
    (["train", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["train", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["check", "nothing"], "unknown check 'nothing'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    try:
        code = main(argv + (["--out", str(tmp_path)] if argv[0] == "train" else []))
    except SystemExit as exc:  # a flag argparse refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: ") and message in err[0]


def test_missing_dataset_offline_names_the_fetch_command(capsys, tmp_path):
    assert main(["train", "--dataset", "cifar10", "--data-root", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "labkit data fetch cifar10" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_flag_on_cpu_node_exits_2_from_the_real_command(tmp_path):
    """The command's exit code is the process's: ``labkit train`` on a rank forked as torchrun would start it (a
    fresh interpreter would only import torch again; tests/test_edges.py runs the console script itself)."""
    [(code, _, err)] = run_cli_ranks(["train", "--device", "cuda", "--out", str(tmp_path)], 1)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]
    assert "no usable GPU" in err and "--device cpu" in err


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    """Every sub-command's help (and its argument errors) is answered before torch is imported, every
    benchmark's too, and so are ``data list`` and ``check allreduce --init``."""
    from labkit.bench import BENCHMARKS

    argvs = [["--help"], ["tour", "--help"], ["data", "--help"], ["data", "fetch", "--help"], ["allreduce", "--help"],
             ["allreduce", "verify", "--help"], ["allreduce", "animate", "--ranks", "x"], ["bench", "--help"],
             ["bench", "nosuch"], ["check", "--help"], ["train", "--help"], ["train", "--epochs", "x"], ["nosuch"],
             *(["bench", name, "--help"] for name in BENCHMARKS), ["bench", "single", "--steps", "x"],
             ["bench", "gpipe", "sweep", "--checkpoint", "sometimes"], ["data", "list", "--root", str(tmp_path)],
             ["check", "allreduce", "--init", str(tmp_path / "ring.py")], ["sample", "--help"]]
    probe = ("import sys\nfrom labkit.cli import main\n"
             f"for argv in {argvs!r}:\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "NO TORCH", proc.stderr
    assert "--ranks must be a whole number, got 'x'" in proc.stderr and "invalid choice: 'nosuch'" in proc.stderr
    assert "labkit: error: argument --checkpoint: invalid choice: 'sometimes'" in proc.stderr.splitlines()[-1]
    for name in BENCHMARKS:
        assert f"usage: labkit bench {name} [-h]" in proc.stdout, name
    assert f"data root: {tmp_path}" in proc.stdout and "synthetic-mnist    generated" in proc.stdout
    assert "``" not in proc.stdout and "`labkit check NAME [ARGS]`" in proc.stdout  # reST markup is not help text
    shown = " ".join(proc.stdout.split())
    assert "tokens to generate (default: 200)" in shown and "random (default: 1.0)" in shown
    # a plain `labkit train --help` shows the device mesh, which --mesh reaches without --strategy mesh
    assert "the device mesh (--mesh alone means --strategy mesh" in shown
    assert all(f"{flag} " in shown for flag in ("--mesh DIM=N,...", "--sequence-parallel", "--num-microbatches M",
                                                 "--dp-shard {none,zero1,zero2,zero3,fsdp}"))
    assert (tmp_path / "ring.py").read_text() == __import__("labkit.exercises.allreduce").exercises.allreduce.STARTER


def test_bench_flags_agree_with_the_code_they_feed():
    """The benchmarks' flag literals name the same choices as the modules that use them, and parse to
    the options their ``main`` reads."""
    from labkit.bench import largebatch, parser, suite
    from labkit.strategies.gpipe import CHECKPOINT_MODES

    args = parser("gpipe").parse_args(["sweep", "--chunks", "1", "4", "--checkpoint", "always", "never"])
    assert (args.mode, args.chunks, args.checkpoint) == ("sweep", [1, 4], ["always", "never"])
    assert args.func.args == ("labkit.bench.gpipe",)
    gpipe_flags = {f["flag"]: f for f in __import__("labkit.flags").flags.read_flags("labkit.bench.gpipe")}
    assert tuple(gpipe_flags["--checkpoint"]["choices"]) == CHECKPOINT_MODES
    assert parser("largebatch").parse_args([]).optimizers == list(largebatch.RECIPES)
    only_help = next(a.help for a in parser("suite")._actions if a.dest == "only")
    assert only_help.endswith(", ".join(suite.BENCHES)) and "BENCH entry" in only_help
    datapath = parser("datapath")
    assert datapath.parse_args([]).augment is True and datapath.parse_args(["--no-augment"]).augment is False
    assert parser("zero").parse_args(["--worker"]).worker is True
    assert "--worker" not in parser("zero").format_help()


def test_data_help_names_every_dataset_and_the_root_it_uses(tmp_path, monkeypatch):
    from pathlib import Path

    from labkit.data import cli as data_cli
    from labkit.data import datasets as data

    assert tuple(data.DATASETS) == data_cli.DATASET_NAMES
    # the help promises: $LABKIT_DATA, else the checkout's data/ (from any folder), else ./data
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path / "mine"))
    assert data.data_root() == tmp_path / "mine" and "$LABKIT_DATA" in data_cli.ROOT_HELP
    monkeypatch.delenv("LABKIT_DATA")
    assert data.data_root() == Path(data.__file__).resolve().parents[2] / "data"
    assert "data/ folder of the labkit checkout" in data_cli.ROOT_HELP


def test_tour_lists_every_notebook():
    from pathlib import Path

    from labkit.tour import NOTEBOOKS

    listed = [line.split()[0] for line in NOTEBOOKS.splitlines()]
    assert listed == sorted(p.stem for p in (Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_tour_next_steps_run_as_printed(tmp_path, monkeypatch):
    """Each command the tour prints names an executable that exists from where the user stands, and the
    exercise starter command works as printed."""
    import shlex
    import shutil

    from labkit.tour import format_next_steps, next_steps

    commands = [command for command, _ in next_steps(tmp_path)]
    for command in commands:
        exe, *args = shlex.split(command)
        assert (tmp_path / exe).is_file() or shutil.which(exe), command
        assert all((tmp_path / a).exists() for a in args if "/" in a), command
    printed = format_next_steps(next_steps(tmp_path)).splitlines()
    assert [line.strip() for line in printed[::2]] == commands  # a command alone on its line, nothing after it
    init = next(c for c in commands if "--init" in c)  # its executable exists (above); its words, in this process
    monkeypatch.chdir(tmp_path)
    assert shlex.split(init)[0].endswith("labkit") and main(shlex.split(init)[1:]) == 0
    assert "def ring_schedule(p):" in (tmp_path / "my_ring.py").read_text()


def test_switch_help_states_no_misleading_default(capsys):
    """A switch's help says what giving it does; "--no-checkpoint ... (default: True)" read as the opposite."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-checkpoint do not write checkpoints --profile" in text
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "--epochs EPOCHS" in text and "(default: " in text  # valued flags keep their default
