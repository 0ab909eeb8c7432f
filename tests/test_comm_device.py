"""Collectives on the rank's communication device, and one GPU per NCCL rank, checked without a GPU.

NCCL reduces CUDA tensors only: a CPU tensor handed to it fails on the first GPU job. Every collective in
labkit goes through labkit.dist.group's helpers, which move the tensor to ``comm_device()``; the scan below fails on a
bare ``torch.distributed`` collective anywhere else in ``labkit/`` (the hand-written algorithms aside).
"""
import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.dist import group as kdist
from labkit.dist import launch_info
from labkit.dist.testing import run_ranks
from labkit.errors import DeviceError

LABKIT = Path(kdist.__file__).resolve().parents[1]
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor", "gather",
               "scatter", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv"}
#: where a bare collective is the point: the helpers themselves, the all-reduce algorithms, the exercises and the
#: broken programs of the faults lab that teach torch.distributed, the strategies' own protocols whose buffers the
#: backend/device table keeps right, and the stop check, which launches its all-reduce without waiting
#: (``async_op``) on a tensor it keeps on the rank's device itself, the advisor's link fit, whose collectives are
#: what it times (its buffers are made on the communication device), and the pipeline runtime's point-to-point
#: sends (on the stage's device, which the pp BACKENDS row keeps right: no gloo on CUDA)
ALLOWED_FILES = {"dist/group.py", "collectives", "exercises", "faults"}
ALLOWED_FUNCTIONS = {("strategies/ps/worker.py", "push_pull"),
                     ("strategies/ps/server.py", "ServerState.receive"),
                     ("strategies/ps/server.py", "ServerState.reply"),
                     ("train/preempt.py", "StopCheck._launch"),
                     ("advisor/measure.py", "_fit_rank"), ("advisor/measure.py", "_fit_rank.ring_step"),
                     ("parallel/pp_runtime.py", "ScheduleRuntime._send"),
                     ("parallel/pp_runtime.py", "ScheduleRuntime._recv")}


class _Calls(ast.NodeVisitor):
    """Calls of torch.distributed collectives, by the function they are in."""

    def __init__(self):
        self.names: set[str] = set()    # local names bound to torch.distributed
        self.direct: dict[str, str] = {}  # local name -> collective imported by name
        self.stack: list[str] = []
        self.found: list[tuple[str, str, int]] = []

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name == "torch.distributed" and alias.asname:
                self.names.add(alias.asname)

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if node.module == "torch" and alias.name == "distributed":
                self.names.add(alias.asname or "distributed")
            if node.module == "torch.distributed" and alias.name in COLLECTIVES:
                self.direct[alias.asname or alias.name] = alias.name

    def _scope(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Call(self, node):
        f = node.func
        name = None
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            base = ast.unparse(f.value)
            if base in self.names or base == "torch.distributed":
                name = f.attr
        elif isinstance(f, ast.Name) and f.id in self.direct:
            name = self.direct[f.id]
        if name:
            self.found.append((".".join(self.stack), name, node.lineno))
        self.generic_visit(node)


def bare_collectives(root: Path = LABKIT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ALLOWED_FILES or rel.split("/")[0] in ALLOWED_FILES:
            continue
        calls = _Calls()
        calls.visit(ast.parse(path.read_text()))
        out += [f"labkit/{rel}:{line} {where}: dist.{name}" for where, name, line in calls.found
                if (rel, where) not in ALLOWED_FUNCTIONS]
    return out


def test_no_bare_collective_outside_the_helpers():
    assert bare_collectives() == []


def test_the_scan_finds_each_way_of_calling_a_collective(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import torch.distributed as dist\nimport torch\nfrom torch.distributed import broadcast as b\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.gather(t)\n    b(t, 0)\n    dist.barrier()\n")
    assert [line.split(" ", 1)[1] for line in bare_collectives(tmp_path)] == [
        "f: dist.all_reduce", "f: dist.gather", "f: dist.broadcast"]


def test_comm_device_is_the_rank_gpu_under_nccl_and_the_cpu_under_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert kdist.comm_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert kdist.comm_device() == torch.device("cpu")


class _Handed(Exception):
    pass


@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "all_gather", "gather", "scatter", "all_gather_tensor"])
def test_every_helper_hands_the_collective_tensors_on_the_comm_device(call, monkeypatch):
    """``meta`` stands in for the GPU: a helper that forgot to move a tensor hands the collective a CPU one."""
    seen = []

    def collective(*args, **kwargs):
        for arg in [*args, *kwargs.values()]:
            for t in arg if isinstance(arg, list) else [arg]:
                if isinstance(t, torch.Tensor):
                    seen.append(t.device)
        raise _Handed  # the copy back from meta has no data to copy

    monkeypatch.setattr(kdist, "comm_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, kdist.ALL_GATHER_TENSOR if call == "all_gather_tensor" else call, collective)
    t, parts = torch.ones(2), [torch.zeros(2), torch.zeros(2)]
    args = {"all_reduce": (t,), "broadcast": (t, 0), "all_gather": (parts, t), "gather": (t, parts, 0),
            "scatter": (t, parts, 0), "all_gather_tensor": (torch.zeros(4), t)}[call]
    with pytest.raises(_Handed):
        getattr(kdist, call)(*args)
    assert seen and set(seen) == {torch.device("meta")}
    assert len(seen) == {"all_reduce": 1, "broadcast": 1, "all_gather": 3, "gather": 3, "scatter": 3,
                         "all_gather_tensor": 2}[call]


def _helpers(env):
    r = env.rank
    peak = kdist.all_reduce(torch.tensor([1.0 + r]), op=dist.ReduceOp.MAX)
    b = kdist.broadcast(torch.tensor([10.0 * (r + 1)]), src=1)
    parts = kdist.all_gather([torch.zeros(1), torch.zeros(1)], torch.tensor([float(r)]))
    parts_on_0 = [torch.zeros(1), torch.zeros(1)] if r == 0 else None
    kdist.gather(torch.tensor([5.0 + r]), parts_on_0, dst=0)
    got = kdist.scatter(torch.zeros(1), [torch.tensor([7.0]), torch.tensor([8.0])] if r == 0 else None, src=0)
    single = kdist.all_gather_tensor(torch.zeros(2), torch.tensor([3.0 * r]))
    return peak.item(), b.item(), [p.item() for p in parts], parts_on_0 and [p.item() for p in parts_on_0], \
        got.item(), single.tolist()


def test_helpers_on_two_gloo_ranks():
    rank0, rank1 = run_ranks(_helpers, 2)
    assert rank0 == (2.0, 20.0, [0.0, 1.0], [5.0, 6.0], 7.0, [0.0, 3.0])
    assert rank1 == (2.0, 20.0, [0.0, 1.0], None, 8.0, [0.0, 3.0])


# ----- one GPU per NCCL rank ----------------------------------------------------------------------------------

def _gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_ranks_map_to_gpus_by_local_rank(monkeypatch):
    _gpus(monkeypatch, 2)
    assert [launch_info.resolve_device("cuda", r) for r in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]
    assert launch_info.resolve_device("cuda:1", 0) == torch.device("cuda", 1)


def test_more_nccl_ranks_than_gpus_is_refused_before_the_group_starts(monkeypatch):
    _gpus(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the check"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("group started before the check"))
    environ = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(DeviceError) as err:
        with kdist.distributed(device="auto", environ=environ):
            pass
    message = str(err.value)
    assert "\n" not in message and message.startswith("4 ranks on this node but 2 GPU(s) visible")
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in message and "--backend gloo" in message
    # as many ranks as GPUs, gloo, or NCCL told to share a GPU: allowed
    launch_info.check_gpu_per_rank("nccl", torch.device("cuda", 0), 2, {})
    launch_info.check_gpu_per_rank("gloo", torch.device("cuda", 0), 4, {})
    share = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    launch_info.check_gpu_per_rank("nccl", torch.device("cuda", 0), 4, share, nccl_version=(2, 30, 3))
    # ... but an NCCL older than 2.30 ignores the variable and stops the ranks later: refused here, in one line
    with pytest.raises(DeviceError) as err:
        launch_info.check_gpu_per_rank("nccl", torch.device("cuda", 0), 4, share, nccl_version=(2, 28, 9))
    assert str(err.value) == ("NCCL_MULTI_RANK_GPU_ENABLE=1 is set, but the installed NCCL 2.28.9 lets ranks share "
                              "a GPU only from 2.30: start at most 2 rank(s) per node, or use --backend gloo")
