"""torchrun jobs (issue 18): real PyTorch torchrun with the gloo backend on CPU, on sandbox
machines (real sshd on loopback with separate homes).  Skipped without torch."""

from __future__ import annotations

import subprocess
import pytest

import gpumagic
from conftest import add_client_entry, make_server, wait_until
from gpumagic.errors import JobError

#: The one command that adds torch (a CPU build) to the test environment.
INSTALL = ".venv/bin/pip install torch==2.13.0"
pytest.importorskip("torch", reason=f"torch is not installed; add it with `{INSTALL}`")

ALLREDUCE = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.tensor([r])
dist.all_reduce(t)
print(f"rank {r} world {dist.get_world_size()} sum {t.item()}", flush=True)
if os.environ.get("BOOM") == str(r):
    raise ValueError(f"boom on rank {r}")
if os.environ.get("HANG"):
    import time; time.sleep(600)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def pair():
    servers = []
    for alias in ("tra", "trb"):
        s = make_server(alias)
        add_client_entry(s, alias)
        servers.append(s)
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def a(pair):
    m = gpumagic.connect("tra")
    yield m
    m.close()


@pytest.fixture
def b(pair):
    m = gpumagic.connect("trb")
    yield m
    m.close()


def procs(word):
    """``ps`` lines of this computer's processes (the sandboxes' too) whose command line holds
    ``word`` (a job's torchrun folder: torchrun and every worker name it)."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if word in ln]


def test_case1_two_ranks_one_machine(a, pair):
    job = a.start_job("ar1", ALLREDUCE, torchrun=2)
    assert job.wait(timeout=240) == "exited 0", job.parts[0].logs(None)
    assert "rank 0 world 2 sum 1" in job.logs(rank=0)
    r1 = job.logs(rank=1)
    assert "rank 1 world 2 sum 1" in r1 and "rank 0" not in r1
    assert "[tra:1] rank 1 world 2 sum 1" in job.logs_all()
    with pytest.raises(JobError, match="no rank 5"):
        job.logs(rank=5)


def test_case1_kill_ends_every_rank(a, pair):
    job = a.start_job("ar-hang", ALLREDUCE, torchrun=2, env={"HANG": "1"})
    assert wait_until(lambda: "sum 1" in job.logs_all(), 240), job.parts[0].logs(None)
    assert len(job.ranks()) == 2
    assert len(procs("torchrun/ar-hang/")) >= 3  # torchrun and two workers: the check can fail
    job.kill()
    assert job.state.startswith("killed")
    assert procs("torchrun/ar-hang/") == []


def test_case5_rank_raises_names_host_rank_and_line(a, pair):
    job = a.start_job("ar-boom", ALLREDUCE, torchrun=2, env={"BOOM": "1"})
    state = job.wait(timeout=240)
    assert state.startswith("failed: rank 1 on tra"), state
    assert "ValueError: boom on rank 1" in state
    assert not any(i.running for i in job.infos())
    assert procs("torchrun/ar-boom/") == []


def test_torchrun_number_is_checked(a):
    with pytest.raises(JobError, match="--torchrun takes"):
        a.start_job("bad", "print(1)", torchrun="zero")


def test_auto_without_gpu_says_so(a):
    with pytest.raises(JobError, match="auto counts the visible GPUs"):
        a.start_job("auto1", "print(1)", torchrun="auto")
