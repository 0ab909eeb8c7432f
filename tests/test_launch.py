"""labkit.launch.local: torchrun from Python streams the ranks' output and returns the results; failures raise
with the log tail; sbatch submits, follows the job's output file and reads the results back.

The sbatch tests put stand-in ``sbatch``/``scontrol``/``sacct`` commands on PATH that run the script in
the background and answer like SLURM does (the real cluster is exercised by tests/system).
"""
import os
import textwrap

import pytest

from labkit.errors import ConfigError
from labkit.launch.common import RunFailed, _child_env
from labkit.launch.local import torchrun
from labkit.launch.slurm import sbatch
from labkit.train.meters import ThroughputMeter

TINY = ["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "128",
        "--test-size", "50", "--epochs", "1", "--device", "cpu", "--log-every", "2", "--no-checkpoint"]


def test_torchrun_streams_output_and_returns_the_run(tmp_path):
    lines = []
    run = torchrun([*TINY, "--global-batch-size", "32", "--allreduce", "ring", "--out", str(tmp_path / "run")],
                   nproc=2, echo=lines.append, timeout=300)
    assert any(line.startswith("labkit train | mlp on synthetic-mnist | strategy ddp | 2 rank(s)") and
               "batch 16/rank, 32 global" in line for line in lines), lines
    final = [line for line in lines if line.startswith("train |") and line.endswith("samples/sec")]
    assert len(final) == 1 and "epoch 1/1 (100%)" in final[0]  # the end-of-epoch throughput line: a whole epoch
    memory = [line for line in lines if "CPU (process, all devices)" in line]
    assert [line.split(":")[0] for line in memory] == ["rank 0", "rank 1"]  # each rank's own process, named
    assert run.summary["metrics"]["memory_lines"] == memory
    assert {s["rank"] for s in run.records_of("utilisation")} == {0, 1}  # every rank's CPU use, sampled
    assert len(run.summary["metrics"]["utilisation"]["cpu_percent_mean"]) == 2
    assert run.summary["environment"]["world_size"] == 2
    assert run.summary["metrics"]["global_batch_size"] == 32
    assert run.summary["config"]["strategy_options"]["global_batch_size"] == 32
    assert run.summary["config"]["strategy_options"]["allreduce"] == "ring"  # the hand-made mode trains
    (epoch,) = run.records_of("epoch")
    assert epoch["samples_per_sec"] > 0 and 0 <= epoch["test_acc"] <= 1
    log = (tmp_path / "run" / "launch.log").read_text()
    assert "--nproc-per-node 2" in log and lines[-1] in log


def test_config_error_of_the_ranks_is_their_one_line(tmp_path):
    # world size larger than the data: every rank stops with one clear error and exit code 2, and torchrun's
    # own error block (ChildFailedError, "Root Cause") is left out
    lines = []
    with pytest.raises(RunFailed) as info:
        torchrun([*TINY, "--train-size", "1", "--out", str(tmp_path / "bad")], nproc=2, echo=lines.append,
                 timeout=300)
    assert isinstance(info.value, ConfigError)
    assert str(info.value) == ("the training set has 1 samples, fewer than one global batch (2 ranks × "
                               "--batch-size 64); use fewer ranks or a smaller batch")
    assert [ln for ln in lines if "error" in ln.lower()] == [f"labkit: error: {info.value}"], lines
    assert not [ln for ln in lines if "Traceback" in ln or "Root Cause" in ln or "exitcode" in ln], lines


def test_ranks_get_a_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _child_env(None, 1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert _child_env({"X": 1}, 1)["OMP_NUM_THREADS"] == "3"


FAKE_SBATCH = """\
#!/bin/bash
# stand-in for sbatch --parsable --output=FILE [opts] SCRIPT [args]: runs SCRIPT in the background
out=""; while [[ "$1" == -* ]]; do case "$1" in --output=*) out="${1#--output=}";; esac; shift; done
id=4242; dir="$FAKE_SLURM"; log="${out//%j/$id}"
echo RUNNING > "$dir/state"
( SLURM_JOB_ID=$id bash "$@" > "$log" 2>&1; rc=$?
  if [[ $rc == 0 ]]; then echo COMPLETED > "$dir/state"; else echo FAILED > "$dir/state"; fi
  echo "$rc:0" > "$dir/exit" ) &
echo "$id;cluster"
"""
FAKE_SCONTROL = """\
#!/bin/bash
# stand-in for scontrol -o show job ID; forgets finished jobs like a controller past MinJobAge
state=$(cat "$FAKE_SLURM/state")
[[ "$state" == RUNNING ]] || exit 1
echo "JobId=$4 JobName=x JobState=$state Reason=None ExitCode=0:0"
"""
FAKE_SACCT = """\
#!/bin/bash
echo "$(cat "$FAKE_SLURM/state")|$(cat "$FAKE_SLURM/exit")"
"""
JOB = """\
#!/bin/bash
echo "job $SLURM_JOB_ID starts, EPOCHS=$EPOCHS"
sleep 0.5
echo "{epoch_line}"
[[ "$EPOCHS" == 0 ]] && { echo "labkit: error: --epochs must be > 0, got 0"; exit 2; }
cat > "$LABKIT_OUT/summary.json" <<EOF
{"schema": "labkit.run/1", "name": "fake", "kind": "train", "config": {}, "environment": {},
 "metrics": {"samples_per_sec": 123.0}}
EOF
echo '{"kind": "epoch", "epoch": 1, "test_acc": 0.5}' > "$LABKIT_OUT/metrics.jsonl"
"""


def finished_epoch_line() -> str:
    """The line labkit's meter prints at the end of a 7-step epoch (what the fake job prints as its own)."""
    lines = []
    meter = ThroughputMeter(epoch=1, epochs=1, steps=7, every=3, printer=lines.append)
    for _ in range(7):
        meter.update(16)
    meter.finish()
    return lines[-1]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"sbatch": FAKE_SBATCH, "scontrol": FAKE_SCONTROL, "sacct": FAKE_SACCT}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(tmp_path))
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(JOB).replace("{epoch_line}", finished_epoch_line()))
    return script


def test_sbatch_follows_the_job_and_returns_its_results(fake_slurm, tmp_path):
    lines = []
    run = sbatch(fake_slurm, env={"EPOCHS": "3"}, out=tmp_path / "out", poll_s=0.1, echo=lines.append, timeout=60)
    assert lines[0].startswith(f"submitted {fake_slurm} as SLURM job 4242; output: ")
    assert lines[1] == "job 4242 starts, EPOCHS=3" and len(lines) == 3
    assert lines[2].startswith("train | epoch 1/1 (100%) | ") and lines[2].endswith(" samples/sec")
    assert run.summary["metrics"]["samples_per_sec"] == 123.0
    assert run.records_of("epoch") == [{"kind": "epoch", "epoch": 1, "test_acc": 0.5}]
    assert (tmp_path / "out" / "slurm-4242.out").exists()


def test_sbatch_failure_raises_with_state_and_tail(fake_slurm, tmp_path):
    with pytest.raises(RunFailed, match=r"SLURM job 4242 ended FAILED \(exit code 2:0") as info:
        sbatch(fake_slurm, env={"EPOCHS": "0"}, out=tmp_path / "out", poll_s=0.1, echo=None, timeout=60)
    assert str(info.value).endswith("labkit: error: --epochs must be > 0, got 0")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_sbatch_missing_script_or_slurm_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="job script .*nope.sh does not exist"):
        sbatch(tmp_path / "nope.sh")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="sbatch is not installed here: .* bash .*job.sh"):
        sbatch(script, out=tmp_path / "out")
