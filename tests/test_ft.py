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


def test_a_bad_kill_or_what_a_replica_mesh_cannot_hold_is_one_line(capsys, tmp_path):
    assert parse_kill("1@12", 3) == (1, 12) and parse_kill(None, 3) is None
    for text, words in (("1", "is not REPLICA@STEP"), ("3@2", "there are 3 replicas"), ("0@0", "step 1 or later")):
        with pytest.raises(ConfigError, match=words):
            parse_kill(text, 3)
    assert _exit_code(["train", "--ft-replicas", "2", "--mesh", "dp=2", "--dp-shard", "zero2", "--model", "mlp",
                       "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "labkit: error: --ft-replicas with --mesh dp=2 --dp-shard zero2: the replicas all-reduce whole gradients; "
        "ZeRO/FSDP shards inside a replica are not supported (use --dp-shard none)")
    assert _exit_code(["train", "--ft-replicas", "2", "--mesh", "tp=0", "--out", str(tmp_path)]) == 2
    assert "--mesh" in capsys.readouterr().err
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


def test_replicas_that_are_meshes_train_as_one_process_and_heal_rank_by_rank(tmp_path, monkeypatch):
    """Two replicas, each a ``tp=2`` mesh of two processes (the GPT's blocks split over them): until the drill, each
    step's mean loss over the replicas is the one-process run's on their global batch (the reference the supervisor
    trains, recorded here through the same ``fit``); rank 0 of replica 1 is killed in step 3, its partner is stopped
    with it, the step is discarded, both restart and heal rank by rank from replica 0, and the two replicas end
    with the same shards on each rank."""
    from labkit.strategies.base import Strategy
    from labkit.train.cli import config_from_argv
    from labkit.train.ft_supervise import supervise

    single, plain = [], Strategy.forward_backward

    def recorded(self, *args):  # the reference: --strategy single in this process, after the replicas
        loss, out = plain(self, *args)
        single.append(float(loss))
        return loss, out

    monkeypatch.setattr(Strategy, "forward_backward", recorded)
    steps = 10
    cfg = config_from_argv(["--ft-replicas", "2", "--mesh", "tp=2", "--ft-kill", "1@3", "--ft-timeout-s", "1",
                            "--model", "gpt-tiny", "--dataset", "text-sample", "--seq-len", "32", "--test-size",
                            "64", "--batch-size", "4", "--steps", str(steps), "--step-delay-s", "0.1",
                            "--out", str(tmp_path)])
    report = supervise(cfg)
    rows = report["timeline"]
    assert [r["committed"] for r in rows] == [True, True, True, False] + [True] * (steps - 4), rows
    assert [(e["event"], e["replica"]) for e in report["events"]] == [("lost", 1), ("restarted", 1), ("healed", 1)]
    assert report["events"][0]["exit"] == -9 and rows[-1]["members"] == [0, 1]  # healed before the end
    assert len(single) == steps  # the reference's steps (a full quorum's global batch each)
    for row, loss in zip(rows[:3], single):
        assert row["members"] == [0, 1] and abs(row["loss"] - loss) < 1e-5, (row, loss)
    for rank in (0, 1):  # rank r of each replica: the same shard, after the same committed steps
        a, b = (torch.load(tmp_path / f"replica{r}" / f"checkpoint.rank{rank}.pt", weights_only=True)["model"]
                for r in (0, 1))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
