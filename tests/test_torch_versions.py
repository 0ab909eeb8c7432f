"""The PyTorch releases labkit runs on: every torch.distributed / torch.optim name it uses, against the release that
introduced it.

labkit supports torch 2.6 and later (``pyproject.toml``). The scan below reads every module of ``labkit/`` (ast, no
import) and lists each ``torch.distributed`` name it uses (``torch.distributed.tensor``, ``device_mesh``,
``pipelining``, ``fsdp``, ``elastic`` and the C extension's ``torch._C._distributed_c10d`` included), each
``torch.optim`` name, each ``torch.cpu`` name (what FSDP2 needs on CPU ranks), and each keyword argument passed to
them (``name(kw=)``): through ``import ... as``, ``from ... import``, ``getattr`` / ``hasattr`` / ``setattr`` with a
literal name (or a loop over literal names), a variable bound to a torch object, and a labkit function that returns a
torch module (``torch_pipelining()``).

:data:`INTRODUCED` says, for each, the first release whose source has it and the file there. It was written by
reading the Python source (and the ``.pyi`` stubs, and for two C functions the extension's strings) of each
release's PyPI wheel: 2.0.1, 2.1.2, 2.2.2, 2.3.1, 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1,
2.13.0, 2.14.1, 2.15.0. "2.0" means 2.0 or earlier: no older release was read.

A name missing from the table fails, and so does one newer than the floor used where no feature check guards it:
``if hasattr(module, "name")`` (or a flag set from one, or ``X if hasattr(...) else Y``), ``getattr`` with a
default, or a ``try`` that catches ImportError / AttributeError. A dynamic ``getattr(torch_object, expression)``
must be listed in :data:`DYNAMIC` with what it can name. Then the table is checked against the torch installed:
each name at most its version resolves, each keyword is in the signature, and each newer name is absent.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LABKIT = ROOT / "labkit"
#: the oldest release labkit supports: pyproject.toml's bound, README's range
FLOOR = (2, 6)
SCANNED = ("torch.distributed", "torch._C._distributed_c10d", "torch.optim", "torch.cpu")
CATCHES = {"ImportError", "ModuleNotFoundError", "AttributeError"}

C10D = "torch/distributed/distributed_c10d.py"
PYI = "torch/_C/_distributed_c10d.pyi"
TP = "torch/distributed/tensor/parallel/style.py"
ELASTIC = "torch/distributed/elastic/multiprocessing/api.py"
SCHED = "torch/distributed/pipelining/schedules.py"
#: name (a keyword argument as ``name(kw=)``) -> (release, file of that release's wheel that defines it)
INTRODUCED = {
    "torch._C._distributed_c10d": ("2.0", PYI),
    # the flight recorder's dumps: the extension's own strings (no stub names them); labkit checks for both
    "torch._C._distributed_c10d._dump_fr_trace_json": ("2.8", "torch/lib/libtorch_python (2.8.0, not 2.7.1)"),
    "torch._C._distributed_c10d._dump_fr_trace": ("2.8", "torch/lib/libtorch_python (2.8.0, not 2.7.1)"),
    "torch._C._distributed_c10d._dump_nccl_trace": ("2.6", "NCCL builds only: the 2.6.0 Linux wheel has it"),
    "torch.distributed": ("2.0", "torch/distributed/__init__.py"),
    "torch.distributed.DistError": ("2.2", "torch/distributed/__init__.py: DistError = torch._C._DistError"),
    "torch.distributed.P2POp": ("2.0", C10D),
    "torch.distributed.ProcessGroup": ("2.0", PYI),
    "torch.distributed.ProcessGroupGloo": ("2.0", PYI),
    "torch.distributed.PrefixStore": ("2.0", PYI),
    "torch.distributed.Store": ("2.0", PYI),
    "torch.distributed.TCPStore": ("2.0", PYI),
    "torch.distributed.ReduceOp.MAX": ("2.0", PYI),
    "torch.distributed.ReduceOp.MIN": ("2.0", PYI),
    "torch.distributed.ReduceOp.SUM": ("2.0", PYI),
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook":
        ("2.0", "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py"),
    "torch.distributed.all_gather": ("2.0", C10D),
    "torch.distributed.all_gather(group=)": ("2.0", C10D),
    "torch.distributed.all_gather_into_tensor": ("2.0", C10D),
    "torch.distributed.all_gather_object": ("2.0", C10D),
    "torch.distributed.all_gather_object(group=)": ("2.0", C10D),
    # the new name of all_gather_into_tensor, which 2.13 deprecates (labkit.dist.group picks the one torch has)
    "torch.distributed.all_gather_single": ("2.13", C10D),
    "torch.distributed.all_reduce": ("2.0", C10D),
    "torch.distributed.all_reduce(async_op=)": ("2.0", C10D),
    "torch.distributed.all_reduce(group=)": ("2.0", C10D),
    "torch.distributed.all_reduce(op=)": ("2.0", C10D),
    "torch.distributed.all_to_all_single": ("2.0", C10D),
    "torch.distributed.all_to_all_single(group=)": ("2.0", C10D),
    "torch.distributed.barrier": ("2.0", C10D),
    "torch.distributed.barrier(group=)": ("2.0", C10D),
    "torch.distributed.batch_isend_irecv": ("2.0", C10D),
    "torch.distributed.broadcast": ("2.0", C10D),
    "torch.distributed.broadcast(group=)": ("2.0", C10D),
    "torch.distributed.broadcast(src=)": ("2.0", C10D),
    "torch.distributed.destroy_process_group": ("2.0", C10D),
    "torch.distributed.distributed_c10d": ("2.0", C10D),
    "torch.distributed.distributed_c10d.__file__": ("2.0", C10D),
    "torch.distributed.distributed_c10d._get_default_group": ("2.0", C10D),
    "torch.distributed.distributed_c10d._rank_not_in_group": ("2.0", C10D),
    "torch.distributed.elastic.multiprocessing.errors.record":
        ("2.0", "torch/distributed/elastic/multiprocessing/errors/__init__.py"),
    "torch.distributed.get_process_group_ranks": ("2.0", C10D),
    "torch.distributed.irecv(group=)": ("2.0", C10D),
    "torch.distributed.irecv(tag=)": ("2.0", C10D),
    "torch.distributed.isend(group=)": ("2.0", C10D),
    "torch.distributed.isend(tag=)": ("2.0", C10D),
    "torch.distributed.run.get_args_parser": ("2.0", "torch/distributed/run.py"),
    "torch.distributed.run.run": ("2.0", "torch/distributed/run.py"),
    "torch.distributed.device_mesh.DeviceMesh": ("2.2", "torch/distributed/device_mesh.py"),
    "torch.distributed.device_mesh.init_device_mesh": ("2.2", "torch/distributed/device_mesh.py"),
    "torch.distributed.device_mesh.init_device_mesh(mesh_dim_names=)": ("2.2", "torch/distributed/device_mesh.py"),
    "torch.distributed.distributed_c10d._get_default_store": ("2.0", C10D),
    "torch.distributed.elastic.multiprocessing.api": ("2.0", ELASTIC),
    "torch.distributed.elastic.multiprocessing.api.SignalException": ("2.0", ELASTIC),
    "torch.distributed.elastic.multiprocessing.api.SignalException(sigval=)": ("2.0", ELASTIC),
    "torch.distributed.elastic.multiprocessing.api._terminate_process_handler": ("2.0", ELASTIC),
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError":
        ("2.0", "torch/distributed/elastic/multiprocessing/errors/__init__.py"),
    # FSDP2's public path (2.4 and 2.5 have it as torch.distributed._composable.fsdp.fully_shard)
    "torch.distributed.fsdp.fully_shard": ("2.6", "torch/distributed/fsdp/__init__.py (from ._fully_shard)"),
    "torch.distributed.fsdp.fully_shard(mesh=)": ("2.6", "torch/distributed/fsdp/_fully_shard/_fully_shard.py"),
    "torch.distributed.fsdp.fully_shard(reshard_after_forward=)":
        ("2.6", "torch/distributed/fsdp/_fully_shard/_fully_shard.py"),
    # the memory lesson's tracker (notebook 12, labkit.lab.memory); torch/distributed/_tools appeared in 2.5
    "torch.distributed._tools.mem_tracker.MemTracker": ("2.5", "torch/distributed/_tools/mem_tracker.py"),
    "torch.distributed.gather": ("2.0", C10D),
    "torch.distributed.gather(dst=)": ("2.0", C10D),
    "torch.distributed.gather(group=)": ("2.0", C10D),
    "torch.distributed.gather_object": ("2.0", C10D),
    "torch.distributed.gather_object(dst=)": ("2.0", C10D),
    "torch.distributed.gather_object(group=)": ("2.0", C10D),
    "torch.distributed.get_backend": ("2.0", C10D),
    "torch.distributed.get_global_rank": ("2.0", C10D),
    "torch.distributed.get_rank": ("2.0", C10D),
    "torch.distributed.get_world_size": ("2.0", C10D),
    "torch.distributed.group.WORLD": ("2.0", C10D),
    "torch.distributed.init_process_group": ("2.0", C10D),
    "torch.distributed.init_process_group(backend=)": ("2.0", C10D),
    "torch.distributed.init_process_group(device_id=)": ("2.3", C10D),
    "torch.distributed.init_process_group(rank=)": ("2.0", C10D),
    "torch.distributed.init_process_group(timeout=)": ("2.0", C10D),
    "torch.distributed.init_process_group(world_size=)": ("2.0", C10D),
    "torch.distributed.irecv": ("2.0", C10D),
    "torch.distributed.irecv(src=)": ("2.0", C10D),
    "torch.distributed.is_available": ("2.0", "torch/distributed/__init__.py"),
    "torch.distributed.is_initialized": ("2.0", C10D),
    "torch.distributed.is_nccl_available": ("2.0", C10D),
    "torch.distributed.isend": ("2.0", C10D),
    "torch.distributed.isend(dst=)": ("2.0", C10D),
    "torch.distributed.new_group": ("2.0", C10D),
    "torch.distributed.new_group(backend=)": ("2.0", C10D),
    "torch.distributed.pipelining": ("2.4", "torch/distributed/pipelining/__init__.py"),
    "torch.distributed.pipelining.PipelineStage": ("2.4", "torch/distributed/pipelining/stage.py"),
    "torch.distributed.pipelining.PipelineStage(group=)": ("2.4", "torch/distributed/pipelining/stage.py"),
    "torch.distributed.pipelining.Schedule1F1B": ("2.4", SCHED),
    "torch.distributed.pipelining.ScheduleGPipe": ("2.4", SCHED),
    "torch.distributed.pipelining.schedules": ("2.4", SCHED),
    "torch.distributed.pipelining.schedules._batch_p2p": ("2.4", SCHED),
    "torch.distributed.pipelining.schedules._wait_batch_p2p": ("2.8", SCHED),
    "torch.distributed.recv": ("2.0", C10D),
    # the new name of reduce_scatter_tensor, which 2.13 deprecates (labkit.dist.group picks the one torch has)
    "torch.distributed.reduce_scatter_single": ("2.13", C10D),
    "torch.distributed.reduce_scatter_tensor": ("2.0", C10D),
    "torch.distributed.scatter": ("2.0", C10D),
    "torch.distributed.scatter(group=)": ("2.0", C10D),
    "torch.distributed.scatter(src=)": ("2.0", C10D),
    "torch.distributed.send": ("2.0", C10D),
    "torch.distributed.set_debug_level_from_env": ("2.0", PYI),
    # DTensor's public path (before 2.5: torch.distributed._tensor)
    "torch.distributed.tensor.DTensor": ("2.5", "torch/distributed/tensor/__init__.py (from ._api)"),
    "torch.distributed.tensor.DTensor.from_local": ("2.5", "torch/distributed/tensor/_api.py"),
    "torch.distributed.tensor.DTensor.from_local(shape=)": ("2.5", "torch/distributed/tensor/_api.py"),
    "torch.distributed.tensor.DTensor.from_local(stride=)": ("2.5", "torch/distributed/tensor/_api.py"),
    "torch.distributed.tensor.Replicate": ("2.5", "torch/distributed/tensor/placement_types.py"),
    "torch.distributed.tensor.Shard": ("2.5", "torch/distributed/tensor/placement_types.py"),
    "torch.distributed.tensor.parallel.ColwiseParallel": ("2.0", TP),
    # 2.2 rewrote the parallel styles: layouts instead of prepare functions
    "torch.distributed.tensor.parallel.ColwiseParallel(input_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.ColwiseParallel(output_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.ColwiseParallel(use_local_output=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleInput": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleInput(desired_input_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleInput(input_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleOutput": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleOutput(desired_output_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.PrepareModuleOutput(output_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.RowwiseParallel": ("2.0", TP),
    "torch.distributed.tensor.parallel.RowwiseParallel(input_layouts=)": ("2.2", TP),
    "torch.distributed.tensor.parallel.RowwiseParallel(output_layouts=)": ("2.2", TP),
    # 2.1 had another SequenceParallel, 2.2 none; today's (shards the sequence dim) since 2.3
    "torch.distributed.tensor.parallel.SequenceParallel": ("2.3", TP),
    "torch.distributed.tensor.parallel.loss_parallel": ("2.3", "torch/distributed/tensor/parallel/loss.py"),
    "torch.distributed.tensor.parallel.parallelize_module": ("2.0", "torch/distributed/tensor/parallel/api.py"),
    "torch.cpu.Stream": ("2.1", "torch/cpu/__init__.py"),
    # what FSDP2 calls on CPU ranks: labkit refuses --strategy fsdp / --dp-shard fsdp on CPU ranks without it
    "torch.cpu.Stream.record_event": ("2.7", "torch/cpu/__init__.py"),
    "torch.optim": ("2.0", "torch/optim/__init__.py"),
    "torch.optim.Adam": ("2.0", "torch/optim/adam.py"),
    "torch.optim.AdamW": ("2.0", "torch/optim/adamw.py"),
    "torch.optim.AdamW(betas=)": ("2.0", "torch/optim/adamw.py"),
    "torch.optim.AdamW(lr=)": ("2.0", "torch/optim/adamw.py"),
    "torch.optim.AdamW(weight_decay=)": ("2.0", "torch/optim/adamw.py"),
    "torch.optim.Muon": ("2.9", "torch/optim/_muon.py (2.9.0, not 2.8.0)"),
    "torch.optim.Adam(lr=)": ("2.0", "torch/optim/adam.py"),
    "torch.optim.Adam(weight_decay=)": ("2.0", "torch/optim/adam.py"),
    "torch.optim.Optimizer": ("2.0", "torch/optim/optimizer.py"),
    "torch.optim.SGD": ("2.0", "torch/optim/sgd.py"),
    "torch.optim.SGD(lr=)": ("2.0", "torch/optim/sgd.py"),
    "torch.optim.SGD(momentum=)": ("2.0", "torch/optim/sgd.py"),
    "torch.optim.SGD(nesterov=)": ("2.0", "torch/optim/sgd.py"),
    "torch.optim.SGD(weight_decay=)": ("2.0", "torch/optim/sgd.py"),
    "torch.optim.lr_scheduler.LambdaLR": ("2.0", "torch/optim/lr_scheduler.py"),
    "torch.optim.optimizer.register_optimizer_step_post_hook": ("2.0", "torch/optim/optimizer.py"),
    "torch.optim.optimizer.register_optimizer_step_pre_hook": ("2.0", "torch/optim/optimizer.py"),
}
#: getattr / setattr on a torch object with a computed name: where, and what it can name
DYNAMIC = {
    # rank_facts counts the bytes handed to dist.all_reduce, dist.all_gather and the reduce-scatter under
    # labkit.dist.group.REDUCE_SCATTER_TENSOR (one of the two names group.py checks for)
    "labkit/viz/mesh.py rank_facts: getattr(dist, called[n])",
    "labkit/viz/mesh.py rank_facts: setattr(dist, called[n], wrap(n, originals[called[n]]))",
    "labkit/viz/mesh.py rank_facts: setattr(dist, n, fn)",
    # --check-collectives wraps every collective and point-to-point function both namespaces have (its WRAPPED
    # names, those this torch has: getattr with a default)
    "labkit/faults/consistency.py install: getattr(c10d, name, None)",
    "labkit/faults/consistency.py install: getattr(dist, name)",
    "labkit/faults/consistency.py install: setattr(c10d, name, wrapped)",
    "labkit/faults/consistency.py install: setattr(dist, name, wrapped if current is original else _checked(name, current))",
}


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


# ----- the scan ------------------------------------------------------------------------------------------------

class _Module(ast.NodeVisitor):
    """One module's uses of the scanned names, each with whether a feature check guards it."""

    def __init__(self, returns: dict[str, str], own: str, lines: list[str]):
        self.lines = lines
        self.alias: dict[str, str] = {}        # local name -> dotted path of the torch object it is bound to
        self.returns = returns                 # labkit function (dotted) -> the torch module it returns
        self.calls = {k.removeprefix(own + "."): v for k, v in returns.items() if k.rsplit(".", 1)[0] == own}
        self.flags: dict[str, set[str]] = {}   # a variable set from a check -> the names it checks
        self.loops: dict[str, tuple[str, ...]] = {}  # for NAME in ("a", "b"): its values
        self.guards: list[set[str]] = []       # names checked by the enclosing conditions
        self.tries = 0                         # enclosing try blocks that catch a missing name
        self.function = "<module>"
        self.uses: list[tuple[str, int, bool]] = []
        self.dynamic: list[str] = []

    def resolve(self, node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        base = None
        if isinstance(node, ast.Call) and not node.args and not node.keywords:
            base = self.calls.get(ast.unparse(node.func))
        elif isinstance(node, ast.Name):
            base = self.alias.get(node.id)
        return ".".join([base, *reversed(parts)]) if base else None

    def _named(self, node) -> list[str] | None:
        """The names ``getattr(X, key)`` can read: a literal, or a loop variable over literals."""
        key = node.args[1]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return [key.value]
        if isinstance(key, ast.Name) and key.id in self.loops:
            return list(self.loops[key.id])
        return None

    def checked_in(self, test) -> set[str]:
        out = set()
        for node in ast.walk(test):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("hasattr", "getattr") and len(node.args) >= 2:
                base, names = self.resolve(node.args[0]), self._named(node)
                if base and names:
                    out |= {f"{base}.{n}" for n in names}
            if self.flags and isinstance(node, (ast.Name, ast.Attribute)):
                out |= self.flags.get(ast.unparse(node), set())
        return out

    def use(self, name: str, line: int, checked: bool = False) -> None:
        if name.startswith(SCANNED):
            checked = checked or self.tries > 0 or any(
                name == g or name.startswith(g + ".") or name.startswith(g + "(") for guard in self.guards
                for g in guard)
            self.uses.append((name, line, checked))

    def visit_Import(self, node):
        for a in node.names:
            if a.asname:
                self.alias[a.asname] = a.name
            else:
                self.alias.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            self.use(a.name, node.lineno)

    def visit_ImportFrom(self, node):
        for a in node.names:
            full = f"{node.module}.{a.name}"
            if full in self.returns:
                self.calls[a.asname or a.name] = self.returns[full]
            elif (node.module or "").startswith("torch"):
                self.alias[a.asname or a.name] = full
                self.use(full, node.lineno)

    def visit_Assign(self, node):
        self.generic_visit(node)
        text = self.lines[node.lineno - 1:node.end_lineno]
        checks = self.checked_in(node.value) if any("hasattr(" in t or "getattr(" in t for t in text) else set()
        value = self.resolve(node.value)
        for target in node.targets:
            if checks:
                self.flags[ast.unparse(target)] = checks
            if value and isinstance(target, ast.Name):
                self.alias[target.id] = value

    def visit_For(self, node):
        if isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)) and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts):
            self.loops[node.target.id] = tuple(e.value for e in node.iter.elts)
        self.generic_visit(node)

    def _scope(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_FunctionDef = visit_AsyncFunctionDef = _scope

    def _guarded(self, test, body, orelse):
        self.visit(test)
        self.guards.append(self.checked_in(test))
        for n in body if isinstance(body, list) else [body]:
            self.visit(n)
        self.guards.pop()
        for n in orelse if isinstance(orelse, list) else [orelse]:
            self.visit(n)

    def visit_If(self, node):
        self._guarded(node.test, node.body, node.orelse)

    visit_While = visit_If

    def visit_IfExp(self, node):
        self._guarded(node.test, node.body, node.orelse)

    def visit_BoolOp(self, node):  # hasattr(x, "a") and x.a
        pushed = 0
        for value in node.values:
            self.visit(value)
            if isinstance(node.op, ast.And):
                self.guards.append(self.checked_in(value))
                pushed += 1
        del self.guards[len(self.guards) - pushed:]

    def visit_Try(self, node):
        caught = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {ast.unparse(k) for k in kinds if k is not None}
        catches = bool(caught & CATCHES)
        self.tries += catches
        for n in node.body:
            self.visit(n)
        self.tries -= catches
        for n in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(n)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
            base, names = self.resolve(node.args[0]), self._named(node)
            if base and names is None and base.startswith(SCANNED):
                self.dynamic.append(f"{self.function}: {ast.unparse(node)}")
            for n in (names or []) if base else []:
                checks = f.id == "hasattr" or (f.id == "getattr" and len(node.args) == 3)
                self.use(f"{base}.{n}", node.lineno, checked=checks)
        elif (name := self.resolve(f)) is not None:
            for kw in node.keywords:
                if kw.arg:
                    self.use(f"{name}({kw.arg}=)", node.lineno)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        name = self.resolve(node)
        if name:
            self.use(name, node.lineno)  # the inner parts of the chain are prefixes of it
        else:
            self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.alias:
            self.use(self.alias[node.id], node.lineno)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _returned_modules(trees: dict[Path, ast.Module], root: Path) -> dict[str, str]:
    """Top-level functions that import a module under a name and return it: ``labkit.x.f`` -> ``torch.y``."""
    out = {}
    for path, tree in trees.items():
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.body and isinstance(fn.body[-1], ast.Return) and \
                    isinstance(fn.body[-1].value, ast.Name):
                bound = {a.asname: a.name for n in ast.walk(fn) if isinstance(n, ast.Import) for a in n.names
                         if a.asname}
                if fn.body[-1].value.id in bound:
                    out[f"{_module_name(root, path)}.{fn.name}"] = bound[fn.body[-1].value.id]
    return out


def scan(root: Path = LABKIT) -> tuple[dict[str, list[str]], list[str]]:
    """``({name: places it is used without a check, "checked" for each checked use}, [dynamic accesses])``."""
    sources = {path: path.read_text() for path in sorted(root.rglob("*.py"))}
    trees = {path: ast.parse(text) for path, text in sources.items() if "torch" in text}
    returns = _returned_modules(trees, root)
    # a module that names no torch may still call a function that returns a torch module
    trees |= {path: ast.parse(text) for path, text in sources.items()
              if path not in trees and any(f.rsplit(".", 1)[1] in text for f in returns)}
    found: dict[str, list[str]] = {}
    dynamic: list[str] = []
    for path, tree in trees.items():
        rel = path.relative_to(root.parent).as_posix()
        module = _Module(returns, _module_name(root, path), sources[path].splitlines())
        module.visit(tree)
        for name, line, checked in module.uses:
            found.setdefault(name, []).append("checked" if checked else f"{rel}:{line}")
        dynamic += [f"{rel} {what}" for what in module.dynamic]
    return found, dynamic


def unchecked_newer(found: dict[str, list[str]], table: dict, floor: tuple[int, int]) -> list[str]:
    return sorted(f"{name} (torch {table[name][0]}) at {where}" for name, places in found.items()
                  if name in table and _version(table[name][0]) > floor for where in places if where != "checked")


# ----- the tests -----------------------------------------------------------------------------------------------

def test_every_name_labkit_uses_is_in_the_table_and_newer_ones_are_checked():
    found, dynamic = scan()
    assert sorted(set(found) - set(INTRODUCED)) == []  # a name the table lacks: add it, with its release
    assert sorted(set(INTRODUCED) - set(found)) == []  # no longer used: take it out
    assert unchecked_newer(found, INTRODUCED, FLOOR) == []
    assert set(dynamic) == DYNAMIC
    # the two names torch 2.13 gave the single-tensor collectives are used, each behind its check
    assert found["torch.distributed.all_gather_single"] and set(found["torch.distributed.all_gather_single"]) == \
        set(found["torch.distributed.reduce_scatter_single"]) == {"checked"}


def test_the_scan_sees_each_way_of_naming_and_of_checking(tmp_path):
    pkg = tmp_path / "kit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lazy.py").write_text("def pipes():\n    import torch.distributed.pipelining as p\n    return p\n")
    (pkg / "uses.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.tensor import DTensor\n"
        "from kit.lazy import pipes\n"
        "def f(t, name):\n"
        "    dist.all_gather_single(t, t)\n"
        "    torch.distributed.init_process_group(device_id=0)\n"
        "    DTensor.from_local(t)\n"
        "    pp = pipes()\n"
        "    pp.ScheduleGPipe\n"
        "    if hasattr(dist, 'reduce_scatter_single'):\n"
        "        dist.reduce_scatter_single(t, t)\n"
        "    ok = hasattr(pipes().schedules, '_wait_batch_p2p')\n"
        "    if ok:\n"
        "        pipes().schedules._wait_batch_p2p([])\n"
        "    try:\n"
        "        from torch.distributed.fsdp import fully_shard\n"
        "    except ImportError:\n"
        "        pass\n"
        "    getattr(dist, name)\n")
    found, dynamic = scan(pkg)
    assert {n: sorted(set(p)) for n, p in found.items()} == {
        "torch.distributed": ["kit/uses.py:11", "kit/uses.py:2", "kit/uses.py:20"],
        "torch.distributed.tensor.DTensor": ["kit/uses.py:3"],
        "torch.distributed.all_gather_single": ["kit/uses.py:6"],
        "torch.distributed.init_process_group": ["kit/uses.py:7"],
        "torch.distributed.init_process_group(device_id=)": ["kit/uses.py:7"],
        "torch.distributed.tensor.DTensor.from_local": ["kit/uses.py:8"],
        "torch.distributed.pipelining": ["kit/lazy.py:2", "kit/lazy.py:3"],
        "torch.distributed.pipelining.ScheduleGPipe": ["kit/uses.py:10"],
        "torch.distributed.reduce_scatter_single": ["checked"],
        "torch.distributed.pipelining.schedules": ["kit/uses.py:13"],
        "torch.distributed.pipelining.schedules._wait_batch_p2p": ["checked"],
        "torch.distributed.fsdp.fully_shard": ["checked"],
    }
    assert dynamic == ["kit/uses.py f: getattr(dist, name)"]
    table = {"torch.distributed.all_gather_single": ("2.13", ""), "torch.distributed.reduce_scatter_single":
             ("2.13", ""), "torch.distributed.init_process_group(device_id=)": ("2.3", "")}
    assert unchecked_newer(found, table, (2, 6)) == [
        "torch.distributed.all_gather_single (torch 2.13) at kit/uses.py:6"]
    assert unchecked_newer(found, table, (2, 2)) == [
        "torch.distributed.all_gather_single (torch 2.13) at kit/uses.py:6",
        "torch.distributed.init_process_group(device_id=) (torch 2.3) at kit/uses.py:7"]


def test_the_floor_is_what_pyproject_and_readme_say():
    bound = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert _version(bound) == FLOOR
    pins = re.search(r"^torch==([\d.]+)$", (ROOT / "requirements-pins.txt").read_text(), re.M).group(1)
    assert _version(pins) >= FLOOR
    assert f"torch {FLOOR[0]}.{FLOOR[1]} and later" in (ROOT / "README.md").read_text()


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_the_table_holds_for_the_torch_installed():
    """Each name at most this torch's release resolves (a keyword: in the signature), each newer one does not."""
    here = _version(torch.__version__)
    wrong = []
    for name, (release, _) in INTRODUCED.items():
        if "nccl" in name and not torch.distributed.is_nccl_available():
            continue
        base, _, kw = name.partition("(")
        try:
            obj = _resolve(base)
            present = kw[:-2] in inspect.signature(obj).parameters if kw else True
        except (ImportError, AttributeError):
            present = False
        if present != (_version(release) <= here):
            wrong.append(f"{name}: {'present' if present else 'missing'} in torch {torch.__version__}, table {release}")
    assert wrong == []


def test_fsdp_on_cpu_ranks_without_the_cpu_streams_events_is_one_line(monkeypatch):
    """torch 2.6's FSDP2 fails on CPU ranks in its first forward (``torch.cpu.Stream`` has no ``record_event``):
    refused in one line before any work, naming the release that has it."""
    from labkit.parallel.dp import fsdp_refusal

    assert fsdp_refusal("--strategy fsdp", "cuda") is None
    if hasattr(torch.cpu.Stream, "record_event"):
        assert fsdp_refusal("--strategy fsdp", "cpu") is None
        monkeypatch.delattr(torch.cpu.Stream, "record_event")  # what torch 2.6 has
    assert fsdp_refusal("--dp-shard fsdp", "cuda") is None
    assert fsdp_refusal("--dp-shard fsdp", "cpu") == (
        "--dp-shard fsdp on CPU ranks needs torch 2.7 or later (FSDP2 records events on the CPU stream, which torch "
        f"2.7 added), this is torch {torch.__version__}; use --strategy zero --zero-stage 3 (the same sharding, "
        "labkit's own) or GPUs")


def test_the_watchdog_on_gloo_without_its_flight_recorder_is_one_line(monkeypatch, tmp_path):
    """Before torch 2.8 gloo keeps no flight recorder the watchdog can read: ``labkit train --watchdog`` on gloo and
    the faults lab's runs are refused in one line before any rank starts; NCCL's recorder is older."""
    from torch._C import _distributed_c10d as c10d

    from labkit.errors import ConfigError
    from labkit.faults.runner import run_program
    from labkit.faults.watchdog import refusal, start_for_training

    if hasattr(c10d, "_dump_fr_trace_json"):
        assert refusal("gloo") is None
        monkeypatch.delattr(c10d, "_dump_fr_trace_json")  # what torch 2.6 and 2.7 have
    assert refusal("nccl") is None
    why = (f"the hang watchdog reads gloo's flight recorder, which torch 2.8 added, and this is torch "
           f"{torch.__version__}; run without --watchdog, or on torch 2.8 or later")
    for start in (lambda: start_for_training(5, 60, "gloo"), lambda: run_program(tmp_path / "never_run.py")):
        with pytest.raises(ConfigError) as err:
            start()
        assert str(err.value) == why


def test_1f1b_on_gloo_without_waiting_every_send_and_receive_is_one_line(monkeypatch):
    """torch 2.6's Schedule1F1B hangs on two gloo ranks (it waits for only the last operation of each batch of sends
    and receives; 2.8 waits for each): refused in one line before any work; GPipe, and NCCL, run."""
    from labkit.parallel.pipeline_stages import schedule_refusal, torch_pipelining

    schedules = torch_pipelining().schedules
    if hasattr(schedules, "_wait_batch_p2p"):
        assert schedule_refusal("1f1b", "gloo") is None
        monkeypatch.delattr(schedules, "_wait_batch_p2p")  # what torch 2.6 and 2.7 have
    assert schedule_refusal("gpipe", "gloo") is None and schedule_refusal("1f1b", "nccl") is None
    assert schedule_refusal("1f1b", "gloo") == (
        "--schedule 1f1b on gloo ranks needs torch 2.8 or later (before it, the schedule waits for only the last of "
        f"each batch of sends and receives, and 1F1B hangs on gloo), this is torch {torch.__version__}; use "
        "--schedule gpipe, or GPUs (NCCL)")


def test_muon_before_torch_2_9_is_one_line(monkeypatch):
    """``--optimizer muon`` on a torch without ``torch.optim.Muon`` (before 2.9): one ConfigError naming the release."""
    from torch import nn

    from labkit.errors import ConfigError
    from labkit.optim.muon import MuonWithAdamW

    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    hidden, head = nn.Linear(4, 4), nn.Linear(4, 2)
    with pytest.raises(ConfigError) as err:
        MuonWithAdamW([hidden.weight], [hidden.bias, *head.parameters()], lr=0.01, distributed=False)
    assert str(err.value) == (f"--optimizer muon needs torch.optim.Muon, which torch 2.9 added; this is torch "
                              f"{torch.__version__}: upgrade torch, or train with --optimizer adam")
