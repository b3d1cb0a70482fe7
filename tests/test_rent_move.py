"""A job moved to a new rental (issue 46, item 4): `%gpu job move NAME --to new:runpod ...` and
`--fallback new:runpod,...` rent the cheapest fitting offer when the job's machine is lost, push
the project and the newest kept checkpoint, resume there, and stop (or release, or keep) the
rental the job left.  Against the RunPod stand-in (tests/providers/): every request and answer
checked against RunPod's published OpenAPI document, each pod a real sshd."""

from __future__ import annotations

import getpass
import json
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))

from conftest import wait_until  # noqa: E402
from gpumagic.errors import ConfigError, JobError  # noqa: E402
from gpumagic.keys import keygen  # noqa: E402
from gpumagic.remote import move  # noqa: E402
from gpumagic.rent import KeyStore, Renter, parse_new_rental  # noqa: E402
from linkemu import lose  # noqa: E402
from platforms import RunPodServer  # noqa: E402
from test_job_move import TRAIN, after_a_cell, kill_group, uninterrupted  # noqa: E402

USER = getpass.getuser()
ARGS = "--steps 60 --every 10 --pause 0.2"


@pytest.fixture
def runpod(tmp_path):
    s = RunPodServer(tmp_path / "runpod")
    yield s
    s.close()
    assert s.violations == []


@pytest.fixture
def shell(ip, tmp_path, monkeypatch, runpod):
    """``ip`` with a Renter of its own logged in to the RunPod stand-in, gpumagic's records in
    this test's folder, an SSH key pair and a project folder with train.py."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))
    ip._gpumagic.state.renter = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False),
                                       poll_s=0.02, wait_s=20)
    monkeypatch.setattr("gpumagic.rent.keystore.getpass.getpass", lambda prompt="": "good-key")
    ip.sshkey = tmp_path / "id_ed25519"
    keygen(ip.sshkey)
    ip.proj = tmp_path / "proj"
    ip.proj.mkdir()
    (ip.proj / "train.py").write_text(TRAIN, encoding="utf-8")
    with capture_output():
        gpu(ip, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    yield ip
    ip._gpumagic.state.renter = None
    ip._gpumagic.fleet.close_all()


def gpu(ip, line):
    return ip.run_line_magic("gpu", line)


def _box(shell, runpod, name):
    return runpod.boxes[shell._gpumagic.state.renter.record(name).instance_id].server


def _rent_and_start(shell, runpod, tmp_path, job, fallback=""):
    """Rent ``rpa``, push the project there and start ``job`` on it with its checkpoints kept
    here; returns (the box, its keeper) once two checkpoints are kept."""
    with capture_output():
        gpu(shell, f"rent --gpu 4090 --max-price 0.5 --name rpa -i {shell.sshkey} --trust-new-host")
        box = _box(shell, runpod, "rpa")
        gpu(shell, f"sync {shell.proj}/ rpa:{box.env['HOME']}/work/")
        shell.run_cell_magic("remote", f"--job {job} --host rpa --cwd work --keep ckpt/ --keep-every 0.2 "
                                       f"--keep-settle 10s --keep-to {tmp_path / 'kept'} {fallback} "
                                       '--resume-arg "--resume {checkpoint}"', f"python3 train.py {ARGS}")
    k = shell._gpumagic.fleet.get("rpa").keepers.get(job)
    assert wait_until(lambda: len(k.kept) >= 2, 60), (k.error, k.looks)
    return box, k


def _lose(box, job):
    kill_group(Path(box.env["HOME"]) / ".gpumagic" / "jobs" / job / "pid")
    lose(box)


def test_a_lost_job_moves_to_a_new_rental_and_the_old_one_is_stopped(shell, runpod, tmp_path):
    box, _ = _rent_and_start(shell, runpod, tmp_path, "mvnew")
    _lose(box, "mvnew")
    with capture_output() as cap:
        gpu(shell, "job move mvnew --to new:runpod --gpu 4090 --max-price 0.5 --trust-new-host")
    out = cap.stdout
    assert "renting runpod:NVIDIA GeForce RTX 4090/community (RTX 4090, 0.340 USD/h) as mvnew-runpod" in out, out
    assert "job mvnew moved from rpa to mvnew-runpod and started there" in out, out
    assert "rpa is stopped; its disk costs" in out, out
    assert len(runpod.pods) == 2
    old, new = (runpod.pods[shell._gpumagic.state.renter.record(n).instance_id] for n in ("rpa", "mvnew-runpod"))
    assert old["desiredStatus"] == "EXITED" and new["desiredStatus"] == "RUNNING"
    m = shell._gpumagic.fleet.get("mvnew-runpod")
    assert m.job("mvnew").wait(timeout=120).state_text == "exited 0", m.job("mvnew").logs(50)
    log = m.job("mvnew").logs(None)
    assert "resumed from step " in log and "moved from rpa to mvnew-runpod" in log
    home = Path(_box(shell, runpod, "mvnew-runpod").env["HOME"])
    result = json.loads((home / "work" / "result.json").read_text(encoding="utf-8"))
    assert result == uninterrupted(tmp_path, *ARGS.replace("0.2", "0").split())
    assert "rpa" not in shell._gpumagic.fleet.machines  # the stopped one is disconnected


def test_a_move_that_would_be_refused_rents_nothing(shell, runpod, tmp_path):
    with capture_output():
        gpu(shell, f"rent --gpu 4090 --max-price 0.5 --name rpa -i {shell.sshkey} --trust-new-host")
        shell.run_cell_magic("remote", "--job plain --host rpa", "sleep 60")
    with pytest.raises(JobError) as e:
        gpu(shell, "job move plain --to new:runpod --trust-new-host --yes")
    assert "started without --resume-arg" in e.value.message
    assert "`%gpu job move plain --to new:runpod --from-start`" in e.value.message  # as it can be typed
    assert len(runpod.pods) == 1  # nothing was rented for it
    with pytest.raises(UsageError, match="go with --to new:PROVIDER"):
        gpu(shell, "job move plain --to rpa --max-price 1")
    with pytest.raises(ConfigError) as bad:
        gpu(shell, "job move plain --to new:nosuch")
    assert "no provider named 'nosuch'" in bad.value.message and "new:PROVIDER[," in bad.value.hint
    shell._gpumagic.fleet.get("rpa").job("plain").kill()


def test_the_new_rental_spec_reads_each_part_and_refuses_what_it_does_not_know():
    s = parse_new_rental("new:vast,gpu=4090,vram=24,max-price=1.5,region=EU,interruptible,name=b2,old=release,"
                         "trust-new-host")
    assert (s.provider, s.gpu, s.vram_gb, s.max_price, s.region, s.interruptible, s.name, s.old, s.trust_new_host) == (
        "vast", "4090", 24.0, 1.5, "EU", True, "b2", "release", True)
    assert parse_new_rental("new:runpod").machine_name("train") == "train-runpod"
    for bad, said in (("new:vast,max-price=cheap", "is not a positive number"), ("new:vast,old=burn", "old=burn"),
                      ("new:vast,colour=red", "'colour=red' is not one of its parts"), ("vast", "not a new rental")):
        with pytest.raises(ConfigError) as e:
            parse_new_rental(bad)
        assert said in e.value.message, e.value.message


def test_a_standby_rents_a_new_machine_when_the_job_s_is_lost(shell, runpod, tmp_path, monkeypatch):
    monkeypatch.setattr(move.reaching, "LOST_AFTER", 3.0)
    monkeypatch.setattr(move.reaching, "PROBE_EVERY", 0.5)
    box, k = _rent_and_start(shell, runpod, tmp_path, "sbnew",
                             fallback="--fallback new:runpod,gpu=4090,max-price=0.5,name=rpb,trust-new-host")
    with pytest.raises(UsageError, match="add ,trust-new-host"):
        shell.run_cell_magic("remote", "--job sb --host rpa --keep ckpt/ --fallback new:runpod "
                                       '--resume-arg "--resume {checkpoint}"', "true")
    assert move.start_record("rpa", "sbnew").fallback.startswith("new:runpod")
    assert len(runpod.pods) == 1  # nothing rented while the machine is there
    _lose(box, "sbnew")
    assert wait_until(lambda: "rpb" in shell._gpumagic.fleet.machines, 120)
    m = shell._gpumagic.fleet.get("rpb")
    assert wait_until(lambda: any(j.name == "sbnew" for j in m.jobs()), 60)
    assert m.job("sbnew").wait(timeout=120).state_text == "exited 0", m.job("sbnew").logs(50)
    assert k.done.wait(60)
    said = after_a_cell(shell)
    assert "job sbnew: rpa was lost; rented rpb (new:runpod) for it" in said, said
    assert "job sbnew: rpa is stopped" in said and "moved to rpb by itself (--fallback)" in said, said
    old = runpod.pods[shell._gpumagic.state.renter.record("rpa").instance_id]
    assert old["desiredStatus"] == "EXITED" and len(runpod.pods) == 2
    home = Path(_box(shell, runpod, "rpb").env["HOME"])
    result = json.loads((home / "work" / "result.json").read_text(encoding="utf-8"))
    assert result == uninterrupted(tmp_path, *ARGS.replace("0.2", "0").split())
