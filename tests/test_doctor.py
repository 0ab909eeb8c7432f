"""labkit doctor (``python -m labkit.dist.torchrun --watchdog S --check-collectives ...``) on plain scripts that
import nothing from labkit: each distributed bug ends with one sentence naming it and each rank's line, before
the watchdog's time; a right program runs through the check unchanged; without the check nothing is wrapped."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.cli import main
from labkit.dist.torchrun import _parse
from labkit.faults import consistency
from labkit.faults.runner import run_script
from labkit.faults.table import hang_table

HEAD = "import torch\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\nrank = dist.get_rank()\n"
#: name -> (the script after HEAD (its first line is line 6), the sentence rank 0 prints)
FAULTS = {
    "roots": ("t = torch.zeros(4)\nif rank == 0:\n    dist.broadcast(t, src=1)\nelse:\n    dist.broadcast(t, src=0)\n",
              "rank 0 broadcasts from root 1, rank 1 from root 0 at broadcast #1 on the default group "
              "(rank 0 at roots.py:8, rank 1 at roots.py:10)"),
    "dtype": ("for step in range(3):\n    grad = torch.ones(100, dtype=torch.float64 if rank == 1 and step == 2 "
              "else torch.float32)\n    dist.all_reduce(grad)\n",
              "all_reduce #3 on the default group: rank 0 sends float32 (100,), rank 1 float64 (100,) (dtype.py:8)"),
    "length": ("t = torch.ones(100 if rank == 0 else 50)\ndist.all_reduce(t)\n",
               "all_reduce #1 on the default group: rank 0 sends float32 (100,), rank 1 float32 (50,) (length.py:7)"),
    "reduce_op": ("t = torch.ones(3)\ndist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)\n",
                  "all_reduce #1 on the default group: rank 0 reduces with SUM, rank 1 with MAX (reduce_op.py:7)"),
    "subgroup": ("pair = dist.new_group([0, 1])\nt = torch.ones(3)\nif rank == 0:\n    dist.all_reduce(t, group=pair)\n"
                 "dist.all_reduce(t)\n",
                 "rank 0 calls all_reduce #1 on group 1 (ranks 0, 1) (subgroup.py:9), rank 1 calls all_reduce #1 on the "
                 "default group (subgroup.py:10): each waits for the other on a different group (a rank skipped a "
                 "collective of one)"),
    "send": ("t = torch.ones(3)\nif rank == 0:\n    dist.send(t, 1)\ndist.all_reduce(t)\n",
             "rank 0 calls send #1 to rank 1 (send.py:8), rank 1 calls all_reduce #1 on the default group "
             "(send.py:9): rank 0's send has no matching recv on rank 1"),
}
#: every kind of call the check wraps, right: DDP's own collectives from C++ (counted by the group's sequence
#: number), the object collectives' inner ones, a sub-group, blocking and batched point-to-point
RIGHT = """from torch import nn
from torch.nn.parallel import DistributedDataParallel

torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(2, 1))
model(torch.ones(4, 2)).sum().backward()
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)                                  # 3
dist.broadcast(t, src=1)                            # 3
dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)         # rank 0: 3
out = [torch.zeros(3) for _ in range(2)]
dist.all_gather(out, t * (rank + 1))                # 3, 6 (rank 0); 3, 6 (rank 1)
dist.all_reduce(t, group=dist.new_group([0, 1]))    # 6
if rank == 0:
    dist.send(t, 1)
    dist.recv(t, 1)
else:
    dist.recv(t, 0)
    dist.send(t + 1, 0)                             # rank 0: 7
got = torch.zeros(3)
for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]):
    work.wait()
names = [None, None]
dist.all_gather_object(names, f"r{rank}")
dist.barrier()
print(rank, float(t[0]), float(got[0]), [float(o[0]) for o in out], names, float(model.module.bias.grad))
"""


def test_each_fault_of_a_plain_script_gets_its_sentence(tmp_path):
    """Six plain scripts, each with a bug outside the lab's list, under --check-collectives (watchdog 20 s);
    the broadcast from different roots once more without the check, ended by the watchdog's table; and a right
    script, which the check lets through. All at once, 2 forked ranks each."""
    runs = {name: ["--watchdog", "20", "--check-collectives", str(tmp_path / f"{name}.py")] for name in FAULTS}
    runs["table"] = ["--watchdog", "1", str(tmp_path / "roots.py")]
    runs["right"] = ["--watchdog", "20", "--check-collectives", str(tmp_path / "right.py")]
    for name, (body, _) in FAULTS.items():
        (tmp_path / f"{name}.py").write_text(HEAD + body)
    (tmp_path / "right.py").write_text(HEAD + RIGHT)
    with ThreadPoolExecutor(len(runs)) as pool:
        got = dict(zip(runs, pool.map(run_script, runs.values())))
    for name, (_, sentence) in FAULTS.items():  # exit 124 on both ranks, one line from rank 0
        assert got[name] == {0: (124, f"labkit: collective mismatch: {sentence}\n"), 1: (124, "")}, name
    code, table = got["table"][0]
    assert code == 124 and table.startswith("labkit: hang: a rank waited over 1 s in one collective"), table
    assert table.endswith("labkit: mismatch: ranks 0, 1 are in broadcast #1 of shape (4,) float32: the same "
                          "collective with a different root: rank 0 passes root 1, rank 1 root 0\n"), table
    assert "roots.py:8 dist.broadcast(t, src=1)" in table and "roots.py:10 dist.broadcast(t, src=0)" in table
    # bias gradient: 4 ones summed on each rank, averaged by DDP; the rest as the comments in RIGHT say
    assert got["right"] == {0: (0, "0 7.0 6.0 [3.0, 6.0] ['r0', 'r1'] 4.0\n"),
                            1: (0, "1 6.0 7.0 [3.0, 6.0] ['r0', 'r1'] 4.0\n")}, got["right"]


def test_torchrun_wrapper_starts_each_rank_through_doctor(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    args = _parse(["--watchdog", "60", "--check-collectives", "--nproc-per-node", "2", str(script), "--lr", "1"])
    assert (args.training_script, args.module, args.training_script_args) == (
        "labkit", True, ["doctor", "--watchdog", "60", "--check-collectives", str(script), "--lr", "1"])
    args = _parse(["--check-collectives", "-m", "mypkg.train", "--lr", "1"])
    assert args.training_script_args == ["doctor", "--check-collectives", "-m", "mypkg.train", "--lr", "1"]
    args = _parse(["--nproc-per-node", "2", str(script), "--watchdog", "5"])  # after the script: the script's
    assert (args.training_script, args.training_script_args) == (str(script), ["--watchdog", "5"])
    for argv, message in ((["--watchdog", "5", "--no-python", "train.sh"], "drop --no-python"),
                          (["--watchdog", "5", "missing.py"], "no such script 'missing.py'"),
                          (["--watchdog", "-1", str(script)], "--watchdog must be >= 0")):
        with pytest.raises(SystemExit) as stop:
            _parse(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("labkit: error: "), err
        assert message in err[0], err


def test_without_the_check_nothing_is_wrapped(tmp_path, monkeypatch, capsys):
    script = tmp_path / "probe.py"
    script.write_text("import sys\nimport torch.distributed as dist\n"
                      "sys.exit(3 if hasattr(dist.all_reduce, 'labkit_checked') else 4)\n")
    assert main(["doctor", "--watchdog", "0", str(script)]) == 4
    for name in (*consistency.COLLECTIVES, *consistency.P2P):  # put back what --check-collectives wraps
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
        monkeypatch.setattr(dist, name, getattr(dist, name))
    assert main(["doctor", "--watchdog", "0", "--check-collectives", str(script)]) == 3
    assert main(["doctor", "missing.py"]) == 2
    assert "labkit: error: no such script 'missing.py'" in capsys.readouterr().err


def test_table_names_the_argument_the_ranks_disagree_on():
    def report(rank, dtype):
        return {"rank": rank, "where": "a.py:3", "completed": [],
                "current": {"op": "all_reduce", "seq": 3, "shape": [100], "dtype": dtype, "group": "0"}}
    text = hang_table([report(0, "float32"), report(1, "float64")], 2, 5)
    assert text.endswith("labkit: mismatch: rank 0 is in all_reduce #3 of shape (100,) float32, rank 1 is in "
                         "all_reduce #3 of shape (100,) float64: the same collective with a different dtype: rank 0 "
                         "passes dtype float32, rank 1 dtype float64")


def _sig(rank, op, n=1, where="a.py:5", **more):
    return {"rank": rank, "op": op, "n": n, "where": where, "group": "0", "label": "the default group", **more}


def test_the_check_names_what_the_spawned_faults_do_not_reach():
    """The sentences for a recv nobody sends to, a send into a recv buffer of another size, two different
    collectives, and a rank that ran more of the collectives the check does not see (DDP's, from C++)."""
    recv, barrier = _sig(0, "recv", peer=1, shape=[3], dtype="float32"), _sig(1, "barrier", where="a.py:9", ranks=[0, 1])
    assert consistency.crossed(barrier, recv) == (
        "rank 0 calls recv #1 from rank 1 (a.py:5), rank 1 calls barrier #1 on the default group (a.py:9): rank 0's "
        "recv has no matching send on rank 1")
    send = _sig(1, "send", peer=0, shape=[4], dtype="float32", where="a.py:7")
    assert consistency.p2p_difference(send, recv) == (
        "send #1 from rank 1 to rank 0: rank 1 sends float32 (4,), rank 0 receives into float32 (3,) "
        "(rank 0 at a.py:5, rank 1 at a.py:7)")
    assert consistency.p2p_difference(send, dict(recv, shape=[4])) is None
    reduce = _sig(0, "all_reduce", 33, shape=[10], dtype="float32", reduce_op="SUM", seq=40, p2p=0)
    assert consistency.difference(reduce, _sig(1, "barrier", 33, where="a.py:9", seq=40, p2p=0)) == (
        "rank 0 calls all_reduce #33 on the default group, rank 1 calls barrier #33 on the default group "
        "(rank 0 at a.py:5, rank 1 at a.py:9): different collectives (a rank-dependent branch, or uneven inputs)")
    assert consistency.difference(reduce, dict(reduce, rank=1, seq=41)) == (
        "before all_reduce #33 on the default group (a.py:5), rank 0 had issued 40 calls on the group and rank 1 41: "
        "one ran collectives the check does not see (DDP's own, from C++) that the other did not")
    assert consistency.difference(reduce, dict(reduce, rank=1, seq=41, p2p=2)) is None  # gloo counts p2p there too
    assert consistency.difference(reduce, dict(reduce, rank=1)) is None
