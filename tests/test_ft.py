"""Fault-tolerant data parallelism (--ft-replicas): the quorum's decisions, the refusals, and one drill on real
replica processes: a replica killed mid-step, the run continuing on the other, the restart healing from it."""
import json

import pytest
import torch
from torch.utils.data import DistributedSampler

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.strategies.ft import parse_kill
from labkit.strategies.ft_quorum import Decision


def test_a_decision_reads_back_as_written():
    d = Decision(7, False, (0, 2), 3, ((1, 2),))
    assert d.text() == "0;0,2;3;1:2"
    assert Decision.parse(7, "0;0,2;3;1:2") == d
    assert Decision.parse(4, "1;0,1,2;0;") == Decision(4, True, (0, 1, 2), 0, ())


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_a_bad_kill_or_a_replica_that_is_a_mesh_is_one_line(capsys, tmp_path):
    assert parse_kill("1@12", 3) == (1, 12) and parse_kill(None, 3) is None
    for text, words in (("1", "is not REPLICA@STEP"), ("3@2", "there are 3 replicas"), ("0@0", "step 1 or later")):
        with pytest.raises(ConfigError, match=words):
            parse_kill(text, 3)
    assert _exit_code(["train", "--ft-replicas", "2", "--mesh", "dp=2", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("labkit: error: --ft-replicas runs each replica as one process; a "
                                               "replica that is itself a mesh (--mesh dp=2) is not supported: "
                                               "leave out --mesh")
    assert _exit_code(["train", "--ft-replicas", "2", "--ft-kill", "2@3", "--model", "mlp", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "labkit: error: --ft-kill 2@3: there are 2 replicas (0 to 1)"
    assert _exit_code(["train", "--ft-replicas", "2", "--resume", "--model", "mlp", "--out", str(tmp_path)]) == 2
    assert "--resume does not apply to --ft-replicas" in capsys.readouterr().err


def test_a_killed_replica_is_dropped_then_heals_and_no_sample_counts_twice(tmp_path):
    from labkit.data.tensor import load_split
    from labkit.train.cli import config_from_argv
    from labkit.train.ft_supervise import supervise

    steps, batch, size = 10, 8, 400
    cfg = config_from_argv(["--ft-replicas", "2", "--ft-kill", "1@2", "--ft-timeout-s", "1", "--ft-restart-delay-s",
                            "0.3", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", str(size),
                            "--test-size", "200", "--batch-size", str(batch), "--steps", str(steps),
                            "--step-delay-s", "0.1", "--out", str(tmp_path)])
    report = supervise(cfg)
    rows = report["timeline"]
    assert [r["step"] for r in rows] == list(range(steps))  # the run went on to its last step
    assert [r["committed"] for r in rows[:3]] == [True, True, False]  # the step the replica died in: discarded
    assert report["discarded"] == 1 and report["committed"] == steps - 1
    assert rows[0]["members"] == [0, 1] and rows[-1]["members"] == [0, 1]
    healed = [e for e in report["events"] if e["event"] == "healed"]
    lost = [e for e in report["events"] if e["event"] == "lost"]
    assert [(e["replica"], e["exit"]) for e in lost] == [(1, -9)] and [e["replica"] for e in healed] == [1]
    assert all(r["members"] == [0] for r in rows[3:healed[0]["step"]])  # alone till then (if it was away a while)
    assert all(r["members"] == [0, 1] for r in rows[healed[0]["step"]:])
    # the same weights on the survivor and the healed replica (every member applied the same committed steps)
    states = [torch.load(tmp_path / f"replica{r}" / "checkpoint.pt", weights_only=True)["model"] for r in (0, 1)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    # samples: replica r's shard of step k is DistributedSampler(2, r)'s k-th batch; trained on once at most, and
    # dropped exactly where the quorum had no r or discarded the step
    data = load_split(loader="tensor", name="synthetic-mnist", root=None, download=False,
                      device=torch.device("cpu"), seq_len=None, train=True, augment=False, limit=size)
    shards = []
    for r in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(0)
        order = list(sampler)
        shards.append([order[k * batch:(k + 1) * batch] for k in range(steps)])
    trained = []
    for r in (0, 1):
        for line in (tmp_path / f"ft_replica{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "ids" in rec:
                assert rec["ids"] == shards[r][rec["step"]]
                if rec["committed"]:
                    trained += rec["ids"]
    expected = [i for row in rows if row["committed"] for r in row["members"] for i in shards[r][row["step"]]]
    assert sorted(trained) == sorted(expected) and len(set(trained)) == len(trained)
    dropped = batch * (2 * steps - sum(r["quorum"] for r in rows if r["committed"]))
    assert len(trained) == 2 * batch * steps - dropped
    # the uninterrupted run (one process, the full quorum's global batch) and the gap to it
    assert report["shards_trained"] == sum(r["quorum"] for r in rows if r["committed"]) < report["shards"] == 2 * steps
    assert abs(report["gap"]["test_loss"]) < 0.2, report["gap"]
