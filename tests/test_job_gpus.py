"""The job scripts' GPU count is what torch will see: CUDA_VISIBLE_DEVICES when set, not every GPU nvidia-smi
lists (a fake nvidia-smi with 4 GPUs, one split into MIG slices, stands in for the node)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE = "\n".join([*(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}a{i})" for i in range(4)),
                  "  MIG 3g.40gb     Device  0: (UUID: MIG-5b5)"])


def visible_gpus(tmp_path, nvidia_smi=True, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{NODE}\nEOF\n")
        fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE")}
    path = f"{bin_dir}:/usr/bin:/bin"
    proc = subprocess.run(["bash", "-c", "source jobs/lib/gpus.sh && visible_gpus"], cwd=ROOT, text=True,
                          capture_output=True, env={**base, "PATH": path, **env}, check=True)
    return int(proc.stdout)


@pytest.mark.parametrize("env, count", [
    ({}, 4), ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2), ({"CUDA_VISIBLE_DEVICES": "2"}, 1),
    ({"CUDA_VISIBLE_DEVICES": ""}, 0), ({"CUDA_VISIBLE_DEVICES": "GPU-0a0,GPU-3a3,MIG-5b5"}, 3),
    ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, 1), ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, 4),
    ({"SLURM_GPUS_ON_NODE": "2"}, 2), ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "3"}, 1)])
def test_visible_gpus(env, count, tmp_path):
    assert visible_gpus(tmp_path, **env) == count


def test_no_nvidia_smi_is_no_gpu(tmp_path):
    assert visible_gpus(tmp_path, nvidia_smi=False) == 0
    assert visible_gpus(tmp_path, nvidia_smi=False, CUDA_VISIBLE_DEVICES="0,1") == 0


def test_every_job_script_counts_gpus_through_visible_gpus():
    scripts = [p for p in (ROOT / "jobs").rglob("*.sh") if p.name != "gpus.sh"]
    assert [p.name for p in scripts if "nvidia-smi -L" in p.read_text()] == []
    users = sorted(p.name for p in scripts if "visible_gpus" in p.read_text())
    assert users == ["job_allreduce.sh", "job_gpipe.sh", "job_model_parallel.sh", "ranks.sh"]
