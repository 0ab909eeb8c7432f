"""``--check-collectives`` on NCCL: the plain scripts of ``tests/test_doctor.py`` with their tensors on the GPUs,
through ``python -m labkit.dist.torchrun --watchdog 60 --check-collectives``, end with the same sentences (the
check stops each rank before NCCL is handed the disagreeing call), and the right script gives the same numbers."""
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

CPU = runpy.run_path(str(Path(__file__).parents[1] / "test_doctor.py"))
#: as many lines as the gloo HEAD, so each script's line numbers stay those of its sentence
HEAD = ("import torch\nimport torch.distributed as dist\n\ndist.init_process_group('nccl'); "
        "torch.cuda.set_device(dist.get_rank()); torch.set_default_device('cuda')\nrank = dist.get_rank()\n")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 GPUs, this node has {torch.cuda.device_count()}")
def test_each_fault_on_nccl_gets_the_same_sentence(tmp_path):
    assert HEAD.count("\n") == CPU["HEAD"].count("\n")
    scripts = {name: body for name, (body, _) in CPU["FAULTS"].items()} | {"right": CPU["RIGHT"]}
    for name, body in scripts.items():
        (tmp_path / f"{name}.py").write_text(HEAD + body)

    def run(name):
        return subprocess.run([sys.executable, "-m", "labkit.dist.torchrun", "--watchdog", "60", "--check-collectives",
                               "--standalone", "--nproc-per-node", "2", str(tmp_path / f"{name}.py")],
                              capture_output=True, text=True, timeout=300)
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(scripts, pool.map(run, scripts)))
    for name, (_, sentence) in CPU["FAULTS"].items():
        assert got[name].returncode == 124, (name, got[name].stderr[-2000:])
        assert f"labkit: collective mismatch: {sentence}\n" in got[name].stderr, (name, got[name].stderr[-2000:])
    assert got["right"].returncode == 0, got["right"].stderr[-2000:]
    assert sorted(got["right"].stdout.splitlines()) == ["0 7.0 6.0 [3.0, 6.0] ['r0', 'r1'] 4.0",
                                                        "1 6.0 7.0 [3.0, 6.0] ['r0', 'r1'] 4.0"]
