"""torchrun jobs (issue 18): real PyTorch torchrun with the gloo backend on CPU, on sandbox
machines (real sshd on loopback with separate homes).  Skipped without torch."""

from __future__ import annotations

import pathlib
import subprocess
import time
import pytest

import gpumagic
from conftest import _TMP, add_client_entry, make_server, wait_until
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
print(f"rank {r} ifnames", *(f"{v}={os.environ.get(v)}" for v in
      ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")), flush=True)
if os.environ.get("BOOM") == str(r):
    # a rank that exits with its gloo group alive may abort at interpreter exit ("terminate called
    # without an active exception", pytorch#190489): CI saw exit -6 and no traceback, once
    dist.destroy_process_group()
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


def procs(word, *, ours=True):
    """``ps`` lines of this computer's processes (the sandboxes' too) whose command line holds
    ``word`` (a job's torchrun folder: torchrun and every worker name it).  ``ours``: only those
    of this test run (the folder is in a machine's HOME, under the suite's temp dir), not those of
    another test run on the same computer, whose jobs have the same names."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True, encoding="utf-8").stdout
    return [ln for ln in out.splitlines() if word in ln and (not ours or f"{_TMP}/" in ln)]


def test_case1_two_ranks_one_machine(a, pair):
    job = a.start_job("ar1", ALLREDUCE, torchrun=2)
    assert job.wait(timeout=240) == "exited 0", job.parts[0].logs(None)
    assert "rank 0 world 2 sum 1" in job.logs(rank=0)
    r1 = job.logs(rank=1)
    assert "rank 1 world 2 sum 1" in r1 and "rank 0" not in r1
    assert "[tra:1] rank 1 world 2 sum 1" in job.logs_all()
    with pytest.raises(JobError, match="no rank 5"):
        job.logs(rank=5)


def test_torchrun_state_is_private_and_the_script_keeps_the_users_umask(a, pair):
    script = ALLREDUCE + "open(f'made-by-rank-{r}', 'w').close()\n"
    job = a.start_job("arpriv", script, torchrun=2)
    assert job.wait(timeout=240) == "exited 0", job.parts[0].logs(None)
    home = pair[0].dir / "home"
    state = home / ".gpumagic" / "torchrun"
    paths = [state, *state.joinpath("arpriv").rglob("*")]
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in paths
             if p.stat().st_mode & 0o777 != (0o700 if p.is_dir() else 0o600)}
    assert len(paths) > 8 and wrong == {}  # script.py, rank.py, hosts, ranks/*, logs/**
    umask = a.run("umask", quiet=True).stdout.strip()
    made = [p for p in home.rglob("made-by-rank-*")]
    assert len(made) == 2
    assert {oct(p.stat().st_mode & 0o777) for p in made} == {oct(0o666 & ~int(umask, 8))}


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


# -- two machines (cases 2-5) ----------------------------------------------------------------


def test_case2_two_machines_world_4_same_sum_and_kill(a, b):
    job = gpumagic.start_distributed([a, b], "ar2", ALLREDUCE, nproc=2, env={"HANG": "1"})
    assert job.plan.endpoint.startswith("127.0.0.1:")
    assert wait_until(lambda: len(job.ranks()) == 4 and job.logs_all().count("sum 6") == 4, 300), \
        [j.logs(None) for j in job.parts]
    for r in range(4):
        assert f"rank {r} world 4 sum 6" in job.logs(rank=r)
    # every backend that picks an interface by itself has the one the rendezvous chose, on
    # both machines (only NCCL_SOCKET_IFNAME was set: Gloo picked its own)
    assert set(job.plan.devs) == {"tra", "trb"}, job.plan.devs
    for r in range(4):
        line = next(ln for ln in job.logs(rank=r).splitlines() if f"rank {r} ifnames " in ln)
        got = dict(w.split("=", 1) for w in line.split(" ifnames ", 1)[1].split())
        assert set(got) == {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"}, line
        assert len(set(got.values())) == 1 and next(iter(got.values())) in job.plan.devs.values(), line
    hosts = {host for host in ("tra", "trb") if f"[{host}:" in job.logs_all()}
    assert hosts == {"tra", "trb"}
    assert len(procs("torchrun/ar2/")) >= 6  # two torchruns and four workers, before the kill
    job.kill()
    assert procs("torchrun/ar2/") == []
    assert all(not i.running for i in job.infos())


@pytest.mark.slow(200, reason="4 torch ranks on two machines, each importing torch")
def test_case5_rank_3_raises_on_b(a, b):
    job = gpumagic.start_distributed([a, b], "ar5", ALLREDUCE, nproc=2, env={"BOOM": "3"})
    state = job.wait(timeout=300)
    ranks = job.ranks()
    assert ranks[3][0].machine.name == "trb"  # c10d put rank 3 on b
    assert state.startswith("failed: rank 3 on trb"), state
    assert "ValueError: boom on rank 3" in state
    assert procs("torchrun/ar5/") == []


def test_case3_same_dir_size_differs(a, b, pair):
    homes = [s.env["HOME"] for s in pair]
    for home, size in zip(homes, (10, 12)):
        d = pathlib.Path(home) / "data"
        d.mkdir(exist_ok=True)
        (d / "train.bin").write_bytes(b"x" * size)
        (d / "same.bin").write_bytes(b"y" * 5)
    with pytest.raises(JobError) as e:
        gpumagic.start_distributed([a, b], "ar3", ALLREDUCE, nproc=1, cwd="~", same_dir="data")
    msg = str(e.value)
    assert "data train.bin" in msg and "10 bytes" in msg and "12 bytes" in msg
    assert "same.bin" not in msg
    assert not a.jobs() or all(j.name != "ar3" for j in a.jobs())
    # content differs, size equal: only --same-dir-hash sees it
    (pathlib.Path(homes[1]) / "data" / "train.bin").write_bytes(b"z" * 10)
    with pytest.raises(JobError, match=r"data train.bin +sha256:"):
        gpumagic.start_distributed([a, b], "ar3", ALLREDUCE, nproc=1, cwd="~", same_dir="data",
                                   same_dir_hash=True)


def test_case4_unreachable_endpoint_refused_within_deadline(a, b):
    t0 = time.monotonic()
    with pytest.raises(JobError) as e:
        gpumagic.start_distributed([a, b], "ar4", ALLREDUCE, nproc=1, endpoint_host="192.0.2.1",
                                   deadline=3)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "192.0.2.1" in msg and "cannot be reached" in msg and "trb" in msg
    assert took < 60
    assert procs("torchrun_listen", ours=False) == [] or wait_until(  # its text names no folder
        lambda: procs("torchrun_listen", ours=False) == [], 40)
    assert all(j.name != "ar4" for j in a.jobs() + b.jobs())


# -- fan-out (case 6) -------------------------------------------------------------------------


def test_case6_each_machine_sees_its_own_setting_and_sync_from_all(ip, pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("gpu", "connect tra")
    ip.run_line_magic("gpu", "connect trb")
    cell = 'mkdir -p ~/runs && echo "LR=$LR on $(hostname)" > ~/runs/out.txt && echo "seen LR=$LR"\n'
    ip.run_cell_magic("remote", '--job fan --hosts tra,trb --each "LR=1" "LR=2"', cell)
    fleet = ip._gpumagic.fleet
    for name, lr in (("tra", "1"), ("trb", "2")):
        job = fleet.get(name).job("fan")
        job.wait(timeout=120)
        assert f"seen LR={lr}" in job.logs(None)
    ip.run_line_magic("gpu", "sync --from-all :~/runs/ results/")
    assert (tmp_path / "results" / "tra" / "out.txt").read_text(encoding="utf-8").startswith("LR=1 ")
    assert (tmp_path / "results" / "trb" / "out.txt").read_text(encoding="utf-8").startswith("LR=2 ")


def test_case6_each_count_must_match_hosts(a, b):
    from gpumagic.remote.distributed import fan_out

    with pytest.raises(JobError, match="--each gives 1 settings for 2 machines"):
        fan_out([a, b], "fan2", "true", ["LR=1"])
    assert all(j.name != "fan2" for j in a.jobs() + b.jobs())


def test_magics_torchrun_logs_rank_and_kill(ip, pair, capsys):
    ip.run_line_magic("gpu", "connect tra")
    ip.run_line_magic("gpu", "connect trb")
    ip.run_cell_magic("remote", "--job mag --torchrun 2 --hosts tra,trb --env HANG=1", ALLREDUCE)
    assert "world size 4" in capsys.readouterr().out
    m = ip._gpumagic.fleet.get("tra")
    from gpumagic.remote import distributed

    job = distributed.find(ip._gpumagic.fleet.get, m, "mag")
    assert job.hosts == ["tra", "trb"]
    assert wait_until(lambda: job.logs_all().count("sum 6") == 4, 300), [j.logs(None) for j in job.parts]
    ip.run_line_magic("gpu", "logs mag --rank 1")
    out = capsys.readouterr().out
    assert "rank 1 world 4 sum 6" in out and "rank 0 " not in out
    ip.run_line_magic("gpu", "logs mag --all")
    out = capsys.readouterr().out
    assert out.count("sum 6") == 4 and "[trb:" in out
    ip.run_line_magic("gpu", "kill mag --host trb")
    assert "every rank was stopped" in capsys.readouterr().out
    assert procs("torchrun/mag/") == []
    ip.run_line_magic("gpu", "jobs --all")
    out = capsys.readouterr().out
    assert "tra " in out and "trb " in out and "mag" in out


# -- --then-shutdown: every machine of the run, after every rank has ended ---------------------

#: The stand-in `shutdown`: records the call (epoch seconds, the job, its arguments).
RECORDER = '#!/bin/sh\necho "$(date +%s) ${GPUMAGIC_JOB:-?} $*" >> "$HOME/shutdown-calls"\n'
#: A plain user's `sudo -n CMD`: runs CMD (this computer's own sudo is never called).
SUDO_STAND_IN = '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n'


@pytest.fixture
def recorders(pair):
    import os

    made = []
    for s in pair:
        made.append(s.install_bin("shutdown", RECORDER))
        if os.geteuid() != 0:
            made.append(s.install_bin("sudo", SUDO_STAND_IN))
    calls = [pathlib.Path(s.env["HOME"]) / "shutdown-calls" for s in pair]
    for c in calls:
        c.unlink(missing_ok=True)
    yield calls
    for p in made:
        p.unlink()
    for c in calls:
        c.unlink(missing_ok=True)


@pytest.mark.slow(360, reason="each machine's shutdown comes a minute after its ranks end, by design")
def test_then_shutdown_shuts_every_machine_down_after_all_ranks_end(ip, pair, recorders, capsys):
    from gpumagic.budget.shutdown import find_shutdown

    ip.run_line_magic("gpu", "connect tra")
    ip.run_line_magic("gpu", "connect trb")
    fleet = ip._gpumagic.fleet
    for s, name in zip(pair, ("tra", "trb")):  # never a real shutdown: the plan is the stand-in
        assert find_shutdown(fleet.get(name)).command.endswith(f"{s.bin}/shutdown -h now")
    timed = ALLREDUCE + 'import time\nprint(f"ended at {time.time():.3f}", flush=True)\n'
    ip.run_cell_magic("remote", "--job sdall --torchrun 1 --hosts tra,trb --then-shutdown 0", timed)
    out = capsys.readouterr().out
    assert "world size 2" in out and "once every rank has ended successfully, tra, trb shut down 0 min later" in out
    from gpumagic.remote import distributed

    job = distributed.find(fleet.get, fleet.get("tra"), "sdall")
    assert job.wait(timeout=300) == "exited 0", [j.logs(None) for j in job.parts]
    # When each rank's script ended (this computer's clock, as the recorder's: same computer).
    ends = [float(ln.rsplit(" ", 1)[1]) for ln in job.logs_all(None).splitlines() if "ended at " in ln]
    assert len(ends) == 2
    assert wait_until(lambda: all(c.exists() for c in recorders), 60), [j.info() for j in job.parts]
    for c in recorders:
        (line,) = c.read_text(encoding="utf-8").splitlines()
        when, name, args = line.split(" ", 2)
        assert (name, args) == ("sdall", "-h now")
        assert int(when) >= int(max(ends))  # after every rank of the run (on both machines) ended

    # Armed for later, then cancelled on every machine by one `%gpu kill NAME --shutdown`.
    for c in recorders:
        c.unlink()
    ip.run_cell_magic("remote", "--job sdlater --torchrun 1 --hosts tra,trb --then-shutdown 30", ALLREDUCE)
    job = distributed.find(fleet.get, fleet.get("tra"), "sdlater")
    assert job.wait(timeout=300) == "exited 0"
    assert all(i.shutdown_state == "pending" for i in job.infos())
    capsys.readouterr()
    ip.run_line_magic("gpu", "kill sdlater --shutdown")
    assert "shutdown of torchrun job sdlater: tra: cancelled; trb: cancelled" in capsys.readouterr().out
    assert all(i.shutdown_state == "cancelled" for i in job.infos())
    assert not any(c.exists() for c in recorders)


def test_then_shutdown_refuses_before_any_start_when_one_machine_cannot(a, b, recorders, monkeypatch):
    from gpumagic.budget.shutdown import ShutdownPlan

    monkeypatch.setattr(b, "shutdown_plan", lambda: ShutdownPlan(None, "no shutdown command here"))
    with pytest.raises(JobError) as e:
        gpumagic.start_distributed([a, b], "sdno", ALLREDUCE, nproc=1, then_shutdown=1)
    assert str(e.value).startswith("--then-shutdown: trb cannot shut itself down, so the job was not "
                                   "started: no shutdown command here")
    assert all(j.name != "sdno" for j in a.jobs() + b.jobs())
    assert procs("torchrun/sdno/") == []


# -- alerts name the rank and the machine ------------------------------------------------------

NAN_ON_RANK_3 = """\
import time, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
print(f"rank {r} step 1 loss 0.5", flush=True)
if r == 3:
    print("step 2 loss nan", flush=True)
time.sleep(600)
"""


def _notify_message(home: str, name: str, machine: str, monkeypatch):
    """The job-end message the machine-side budget-notifier.py composes for job ``name`` in ``home``."""
    from gpumagic.remote import program

    ns: dict = {"__name__": "gpumagic_notify_under_test", "__file__": f"{home}/.gpumagic/notify/notify.py"}
    exec(compile(program.source("budget-notifier.py"), "notify.py", "exec"), ns)
    monkeypatch.setenv("HOME", home)
    return ns["job_message"]({"job": name, "job_dir": f"{home}/.gpumagic/jobs/{name}"}, machine)


@pytest.mark.slow(200, reason="4 torch ranks on two machines, each importing torch")
def test_alerts_and_stop_on_name_the_rank_and_machine(a, b, pair, monkeypatch):
    job = gpumagic.start_distributed([a, b], "nan3", NAN_ON_RANK_3, nproc=2, stop_on="nan")
    try:
        # c10d gives the node ranks in the order the machines joined: rank 3 is on either one
        assert wait_until(lambda: len(job.ranks()) == 4, 300), [j.logs(None) for j in job.parts]
        where = job.ranks()[3][0].machine.name
        m = (a, b)[("tra", "trb").index(where)]

        def info_on_m():
            return next(i for i in m.jobs() if i.name == "nan3")

        assert wait_until(lambda: info_on_m().state == "killed", 300), [j.logs(None) for j in job.parts]
        info = info_on_m()
        assert info.state_text == f"killed (nan, rank 3 on {where})"
        assert [al.label for al in info.alerts if al.kind == "nan"] == [f"NaN/inf loss from rank 3 on {where}"]
        seen = []
        m.job("nan3").follow(out=lambda t: None, alert=seen.append, lines=None)
        assert [al.where for al in seen if al.kind == "nan"] == [f"rank 3 on {where}"]
        # the notification sent from that machine when its part ended
        home = pair[("tra", "trb").index(where)].env["HOME"]
        title, text, details = _notify_message(home, "nan3", where, monkeypatch)
        assert title == f"job nan3 stopped (nan, rank 3 on {where})"
        assert f"stopped by --stop-on nan from rank 3 on {where} at: [rank 3]:step 2 loss nan" in text
        assert details["rank"] == f"rank 3 on {where}"
    finally:
        job.kill()
    assert procs("torchrun/nan3/") == []


def test_failure_notification_names_the_rank_and_machine(a, b, pair, monkeypatch):
    job = gpumagic.start_distributed([a, b], "boom3", ALLREDUCE, nproc=2, env={"BOOM": "3"})
    said = job.wait(timeout=300)
    # c10d's rendezvous gives the node ranks in the order the machines joined: ranks 2 and 3
    # are on either machine, and the message names the one they were on
    where = job.ranks()[3][0].machine.name
    assert where in ("tra", "trb") and said.startswith(f"failed: rank 3 on {where}"), said
    home = pair[("tra", "trb").index(where)].env["HOME"]
    title, text, details = _notify_message(home, "boom3", where, monkeypatch)
    assert title == f"job boom3 failed (rank 3 on {where})"
    assert text.startswith(f"job boom3 failed (rank 3 on {where}) on {where}: rank 3 on {where} failed first, exit code 1")
    assert "[default" not in text  # torchrun's local prefixes are relabelled with global ranks


def test_each_then_shutdown_shuts_each_machine_down_after_its_own_job(a, b, recorders):
    from gpumagic.remote.distributed import fan_out
    from gpumagic.remote.jobs import JobOptions

    started = fan_out([a, b], "fansd", 'echo "LR=$LR"', ["LR=1", "LR=2"], JobOptions(then_shutdown=0))
    for j in started:
        assert j.wait(timeout=60).exit_code == 0
    assert wait_until(lambda: all(c.exists() for c in recorders), 60)
    for c in recorders:
        assert c.read_text(encoding="utf-8").split()[1:] == ["fansd", "-h", "now"]
