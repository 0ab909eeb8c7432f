"""Test-run settings shared by tests/ and the notebooks nbval executes."""
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Notebooks run in quick mode (offline data, CPU-minutes); kernels inherit this environment.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Every figure a notebook draws must be readable: the kernels nbval starts load labkit.viz.figcheck as an IPython
# extension (through this process's own IPython directory), which fails the cell that draws a figure with a defect.
_ipython_dir = Path(tempfile.mkdtemp(prefix="labkit-ipython-"))
(_ipython_dir / "profile_default").mkdir()
(_ipython_dir / "profile_default" / "ipython_kernel_config.py").write_text(
    'c.InteractiveShellApp.extensions = ["labkit.viz.figcheck"]\n')
os.environ["IPYTHONDIR"] = str(_ipython_dir)
atexit.register(shutil.rmtree, _ipython_dir, True)
# Plain log lines instead of progress bars in captured output.
os.environ.setdefault("LABKIT_PLAIN", "1")
# One compute thread per process (workers, notebook kernels, launched ranks): the pytest workers already fill
# the cores, and a second OpenMP thread per process only spins against the other workers' processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The matmul peak a CPU run's MFU is measured against (labkit.train.peak) is cached here, not in the user's cache
# folder: measured while the tests fill the cores it is low, and a learner's MFU read against it would be high.
os.environ.setdefault("LABKIT_CACHE", os.path.join(tempfile.gettempdir(), "labkit-test-cache"))
# Python's bytecode cache on, for this process and every one it starts (workers, kernels, ranks, SLURM jobs): the
# run starts a few hundred interpreters, and where PYTHONDONTWRITEBYTECODE is set (some images set it) each of them
# would compile torch from source again (12.6 CPU-s to import torch and torch._dynamo instead of 5.1). The first
# process to import a module writes its .pyc; the install need not compile all 14,000 modules beforehand.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# nbval's kernels are forked from a process per worker that imported torch, matplotlib, ipykernel and labkit once
# (tests/forked_kernels.py): about 6 CPU-seconds less per notebook. LABKIT_FORKED_KERNELS=0: each a new Python.
if os.environ.get("LABKIT_FORKED_KERNELS", "1") != "0":
    _spec = importlib.util.spec_from_file_location("labkit_forked_kernels",
                                                   Path(__file__).parent / "tests" / "forked_kernels.py")
    _forked_kernels = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_forked_kernels)
    _forked_kernels.install()

# nbval's kernels talk to the worker over Unix sockets (ZeroMQ's ipc transport), each kernel under a name of its
# own, not over five TCP ports each: jupyter_client picks a TCP port by binding to a free one and letting it go, and
# until the kernel binds it again another process of the run (a worker's kernel, a rank's rendezvous, a SLURM
# daemon) may take it, and the kernel dies before it answers.
_ipc_dir = tempfile.mkdtemp(prefix="labkit-kernels-ipc-")
atexit.register(shutil.rmtree, _ipc_dir, True)


def _kernel_manager_over_ipc() -> None:
    import uuid

    import nbval.kernel

    class KernelManagerOverIpc(nbval.kernel.KernelManager):
        def __init__(self, **kwargs):
            super().__init__(transport="ipc", ip=os.path.join(_ipc_dir, uuid.uuid4().hex), **kwargs)

    nbval.kernel.KernelManager = KernelManagerOverIpc
    start = nbval.kernel.start_new_kernel

    def start_new_kernel(*args, **kwargs):
        """A kernel that dies before it answers is started once more (and said so): a second death fails the
        notebook as before."""
        try:
            return start(*args, **kwargs)
        except RuntimeError as exc:
            print(f"nbval's kernel did not start ({exc}); starting it again", file=sys.stderr)
            return start(*args, **kwargs)

    nbval.kernel.start_new_kernel = start_new_kernel


_kernel_manager_over_ipc()


# The system layer is two units of work, one per xdist worker at the start: everything on the session's SLURM
# cluster (its job scripts, pre-emption, the Jupyter job, the two-node cluster) and the browser (JupyterLab and
# Chromium) with the static job-script checks. Each unit's session fixtures are built once, on its worker.
SLURM_UNIT = ("tests/system/test_slurm_", "tests/system/test_jupyter_job.py")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or one of the system layer's two units."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(SLURM_UNIT):
        return "tests/system (SLURM)"
    return "tests/system (browser)" if path.startswith("tests/system/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n N`` (pytest-xdist): each file runs on one worker (a notebook's cells share one kernel; a
    module's fixtures are built once), the system layer as its two units (:func:`work_unit`). Units go out in the
    order :func:`pytest_collection_modifyitems` sorts them (longest first, not xdist's most-tests-first), and a
    worker gets its next unit only once it has nothing left to run, so that no unit waits behind a long test on
    one worker while the other worker is idle."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _reschedule(self, node) -> None:
            # A worker holds back the last test it was given until more arrive (it needs the next test to tear
            # down fixtures), so "at most 1 pending" is idle; xdist's default (2) queues a unit behind a running test.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return ByUnit(config, log)


# Units that took about 10 s or more in a CI run (pytest --durations on two cores, summed per unit), longest first,
# sent out right after the system layer (the pre-emption tests, timing-sensitive, not beside the system layer's
# start-up). The order only balances the workers; a name missing here or a file renamed changes no result.
LONGEST = ("notebooks/04_pipeline.ipynb", "notebooks/06_cifar10_resnet32_multi_gpu.ipynb", "tests/test_preempt.py",
           "notebooks/08_strategy_advisor.ipynb", "notebooks/03_model_parallel.ipynb",
           "notebooks/09_transformer_parallelism.ipynb", "notebooks/11_when_it_breaks.ipynb",
           "notebooks/02_data_parallel.ipynb", "tests/test_faults.py", "notebooks/04b_pipeline_schedules.ipynb",
           "notebooks/01_allreduce.ipynb", "notebooks/10_long_context_and_experts.ipynb",
           "notebooks/07_sharded_data_parallel.ipynb", "notebooks/12_flops_and_memory.ipynb",
           "notebooks/01b_synchronisation.ipynb", "tests/test_launch.py", "tests/test_mesh.py",
           "notebooks/00_single_device.ipynb", "notebooks/05_kfac.ipynb", "tests/test_numeric_flags.py",
           "notebooks/05b_second_order_at_scale.ipynb", "tests/test_resume_placement.py", "tests/test_doctor.py",
           "tests/test_defaults.py", "tests/test_pp_runtime.py", "tests/test_bad_input.py", "tests/test_gpipe_handson.py",
           "tests/test_moe.py", "tests/test_kfac.py", "tests/test_matrix_optimizers.py", "tests/test_ft.py",
           "tests/test_models.py", "tests/test_exercises.py", "tests/test_step_collectives.py")


def pytest_collection_modifyitems(config, items):
    """Longest work first, so that the workers end together: the system layer's SLURM unit, then its browser unit,
    the :data:`LONGEST` units, the other notebooks (a unit each), then the test files (many short units that fill
    the gaps)."""
    def rank(item) -> tuple[int, int]:
        unit = work_unit(item.nodeid)
        if unit in LONGEST:
            return 2, LONGEST.index(unit)
        return (0 if unit == "tests/system (SLURM)" else 1 if unit.startswith("tests/system") else
                3 if unit.startswith("notebooks/") else 4), 0

    items.sort(key=rank)  # stable: each file's own order is kept
