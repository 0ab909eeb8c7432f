"""labkit.dist.group: launch-variable parsing, device choice, and real process groups via run_ranks."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from labkit.dist.group import distributed
from labkit.dist.launch_info import first_host, launch_info, resolve_device
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError, DeviceError


@pytest.mark.parametrize("nodelist, host", [
    ("gpu07", "gpu07"), ("gpu[07-09,12]", "gpu07"), ("node[3,5]", "node3"), ("a1,b2", "a1"), ("c[001-004]x", "c001"),
])
def test_first_host_of_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_launch_info_prefers_torchrun_then_slurm_then_single():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "n1", "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert launch_info(torchrun) == dict(rank=3, world_size=8, local_rank=1, local_world_size=2,
                                         master_addr="n1", master_port="1234")
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "3",
             "SLURM_JOB_NODELIST": "gpu[10-11]"}
    assert launch_info(slurm) == dict(rank=5, world_size=6, local_rank=2, local_world_size=3,
                                      master_addr="gpu10", master_port="29500")
    assert launch_info({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert launch_info({}) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match="no usable GPU.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="nccl needs GPUs"):
        with distributed(device="cpu", backend="nccl", environ={}):
            pass


def test_unknown_device_and_backend():
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="unknown backend 'mpi2'"):
        with distributed(device="cpu", backend="mpi2", environ={}):
            pass


def test_single_process_has_no_group_and_is_seeded():
    with distributed(device="cpu", seed=7, environ={}) as env:
        assert (env.rank, env.world_size, env.distributed, env.is_main) == (0, 1, False, True)
        a = torch.rand(3)
    with distributed(device="cpu", seed=7, environ={}):
        assert torch.equal(a, torch.rand(3))
    assert not dist.is_initialized()


def _sum_ranks(env, scale):
    t = torch.full((4,), float(env.rank + 1)) * scale
    dist.all_reduce(t)
    return env.rank, env.world_size, env.backend, t, torch.rand(2), torch.get_num_threads()


def test_run_ranks_real_gloo_group():
    out = run_ranks(_sum_ranks, 3, 2.0)
    assert [o[:3] for o in out] == [(0, 3, "gloo"), (1, 3, "gloo"), (2, 3, "gloo")]
    for o in out:
        assert torch.equal(o[3], torch.full((4,), 12.0))  # 2 * (1 + 2 + 3)
        assert torch.equal(o[4], out[0][4])  # same seed on every rank -> same initial weights
        assert o[5] == 1


def _rank1_fails(env):
    if env.rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without run_ranks' failure handling


def test_run_ranks_reports_failing_rank_without_hanging():
    """Rank 0's own error in the report proves the failure released it from the barrier (a rank still
    waiting would be killed without one); a hang would end in run_ranks' TimeoutError instead."""
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom on rank one.*rank 0 also failed"):
        run_ranks(_rank1_fails, 2, timeout=60)


def _rank1_vanishes(env):
    import os

    if env.rank == 1:
        os._exit(3)  # as a rank the kernel kills: no traceback, no result
    dist.barrier()


def test_run_ranks_reports_a_rank_that_ends_without_a_word():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*rank 1 ended \(exit code 3\) without returning"):
        run_ranks(_rank1_vanishes, 2, timeout=60)


def _callers_state(env):
    import os

    return os.environ.get("LABKIT_RANKS_MARK"), os.getcwd()


def test_run_ranks_see_the_callers_environment_and_folder_of_now(tmp_path, monkeypatch):
    """The ranks are forked from a server started by an earlier call; they still see the caller as it is now."""
    monkeypatch.setenv("LABKIT_RANKS_MARK", "before")
    assert run_ranks(_callers_state, 2)[0][0] == "before"
    monkeypatch.setenv("LABKIT_RANKS_MARK", "after")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_callers_state, 2) == [("after", str(tmp_path))] * 2


def test_run_ranks_at_the_top_of_a_script_without_main_guard_fails_fast(tmp_path):
    """Every rank imports the caller's script again; one that starts ranks at its top level would start them in
    each rank too: the caller gets one error naming the guard (not a timeout), read from its script's source
    before any rank or forkserver starts."""
    script = tmp_path / "unguarded.py"
    script.write_text("from labkit.dist.testing import run_ranks\n\n\ndef rank_of(env):\n    return env.rank\n\n\n"
                      "print(run_ranks(rank_of, 2, timeout=600))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("Traceback") == 1, proc.stderr  # the caller's own: no rank printed one
    assert proc.stderr.strip().splitlines()[-1].startswith("RuntimeError: the script that starts ranks runs again")
    assert 'under `if __name__ == "__main__":`' in proc.stderr


def test_the_ranks_store_is_bound_before_they_start_and_gone_after():
    """labkit.dist.store: the port is held from the moment it is chosen (no other process can take it before
    rank 0 would have bound it), every rank connects as a client, and the store ends with the block."""
    import datetime
    import socket

    import torch.multiprocessing as mp

    from labkit.dist.store import hosted_store

    with hosted_store(mp.get_context("fork")) as rendezvous:
        port = int(rendezvous["MASTER_PORT"])
        assert rendezvous["TORCHELASTIC_USE_AGENT_STORE"] == "True" and rendezvous["MASTER_ADDR"] == "127.0.0.1"
        with socket.socket() as sock, pytest.raises(OSError):
            sock.bind(("127.0.0.1", port))
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert client.get("key") == b"value"
        del client
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nobody listens there any more


def test_free_port_is_below_the_range_the_system_hands_out():
    """A port another process cannot get from bind(0) or an outgoing connection while it waits to be bound."""
    from pathlib import Path

    from labkit.dist.testing import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < low and not 29000 <= p < 31000 for p in ports), ports
