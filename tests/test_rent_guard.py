"""The guard that stops the bill (issue 46, item 3): on a rental, the budget guard and a job's
``--then-shutdown`` call the platform's stop (or release) from the machine itself, with the
key the platform injects there (vast.ai, RunPod) or, by consent, the user's own (Lambda).

Against the stand-ins of tests/providers/ (each instance a real sshd with a replaying
nvidia-smi); the stand-ins count each stop and release, and with which kind of key."""

from __future__ import annotations

import getpass
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))

import gpumagic  # noqa: E402
from gpumagic.budget import Ledger  # noqa: E402
from gpumagic.errors import BudgetError  # noqa: E402
from gpumagic.keys import keygen  # noqa: E402
from gpumagic.rent import KeyStore, Renter  # noqa: E402
from gpumagic.rent.billstop import RentalStop  # noqa: E402

from conftest import wait_until  # noqa: E402
from platforms import LambdaServer, RunPodServer, VastServer  # noqa: E402

KEY = "good-key"
USER = getpass.getuser()
#: Generous bounds for events to happen (never asserted as durations).
EVENT_S = 90


def _checked(server):
    yield server
    server.close()
    assert server.violations == [], "requests or answers outside the published document"


@pytest.fixture
def vast(tmp_path):
    yield from _checked(VastServer(tmp_path / "vast"))


@pytest.fixture
def runpod(tmp_path):
    yield from _checked(RunPodServer(tmp_path / "runpod"))


@pytest.fixture
def lam(tmp_path):
    yield from _checked(LambdaServer(tmp_path / "lambda", limits={}))


@pytest.fixture
def sshkey(tmp_path):
    path = tmp_path / "id_ed25519"
    keygen(path)
    return path


class Rented:
    """A rental connected as ``%gpu rent`` connects it (its guard stops the bill)."""

    def __init__(self, tmp_path, server, provider, sshkey, offer=None, **settings):
        self.server = server
        self.r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False),
                        poll_s=0.02, wait_s=20)
        self.r.configure(provider, user=USER, **settings)
        self.r.keys.set(provider, KEY)
        pub = Path(str(sshkey) + ".pub").read_text(encoding="utf-8").strip()
        self.inst = self.r.rent(self.r.pick(offer, provider=provider), name="g1", public_key=pub, key_path=str(sshkey))
        self.box = next(b for b in server.boxes.values() if b.server.port == self.inst.port
                        and b.server.host == self.inst.host)
        self.m = gpumagic.connect(f"{USER}@{self.inst.host}:{self.inst.port}", key=str(sshkey), name="g1",
                                  trust_new_host=True)
        self.m.rental = RentalStop(self.r, "g1")
        self.ledger = Ledger(tmp_path / "ledger.json")

    def guard_file(self, name) -> str:
        f = self.box.home / ".gpumagic" / "guard" / name
        return f.read_text(encoding="utf-8") if f.exists() else ""

    def state(self) -> dict:
        return dict(ln.split("=", 1) for ln in self.guard_file("state").splitlines() if "=" in ln)

    def checks(self) -> int:
        return int(self.state().get("checks") or 0)

    def close(self):
        import shutil

        self.m.close()
        shutil.rmtree(self.box.home / ".gpumagic" / "guard", ignore_errors=True)  # a guard left ends


def _rented(request, *args, **kw) -> Rented:
    rented = Rented(*args, **kw)
    request.addfinalizer(rented.close)
    return rented


def test_an_idle_vast_rental_stops_its_bill_once_with_the_instance_key_after_the_link_is_cut(
        request, tmp_path, vast, sshkey):
    g = _rented(request, tmp_path, vast, "vast", sshkey, "vast:4101", base_url=vast.url)
    iid = g.inst.id
    status = g.m.budget.guard(idle=2, grace=0, poll=1, ledger=g.ledger)
    assert status.state == "armed" and status.idle.startswith("idle GPU utilisation 0%")
    g.m.close()  # the laptop's link is cut: the machine goes on alone
    assert wait_until(lambda: "confirmed through the API" in g.guard_file("log"), EVENT_S), g.guard_file("log")
    assert wait_until(lambda: g.state().get("state") == "fired", EVENT_S)
    assert vast.stops == [(iid, "stop", "instance")]  # once, with the key vast.ai injects
    assert g.r.status("g1").state == "stopped"
    log = g.guard_file("log")
    assert f"PUT /api/v0/instances/{iid} with environment -> 200" in log
    assert "confirmed through the API: intended_status=stopped (read 1)" in log
    assert "inst-" not in log and KEY not in log  # no key in the log


def test_a_cell_a_job_and_gpu_use_hold_the_guard_off_until_each_ends(request, tmp_path, runpod, sshkey):
    g = _rented(request, tmp_path, runpod, "runpod", sshkey, base_url=runpod.rest_url, catalog_url=runpod.url)
    home = g.box.home
    job = g.m.start_job("hold", f"while [ ! -e {home}/job-go ]; do sleep 0.2; done")
    cell = threading.Thread(target=g.m.run, args=(f"while [ ! -e {home}/cell-go ]; do sleep 0.2; done",),
                            kwargs={"quiet": True})
    cell.start()
    assert wait_until(lambda: list((home / ".gpumagic" / "running").glob("*")), EVENT_S)
    g.box.server.set_gpu("h200-load")
    g.m.budget.guard(idle=1, grace=0, poll=1, ledger=g.ledger)

    def held_by(reason):
        seen = g.checks()
        assert wait_until(lambda: g.state().get("idle", "").startswith(reason) and g.checks() >= seen + 2,
                          EVENT_S), g.state()
        assert runpod.stops == []

    held_by("busy gpumagic job hold is running")
    (home / "job-go").touch()
    assert job.wait(timeout=EVENT_S).exit_code == 0
    held_by("busy a gpumagic cell is running")
    (home / "cell-go").touch()
    cell.join(EVENT_S)
    held_by("busy GPU utilisation")
    g.m.close()  # the link is cut while the GPU works: still held
    held_by("busy GPU utilisation")
    g.box.server.set_gpu("h200-idle")
    assert wait_until(lambda: runpod.stops, EVENT_S)
    assert wait_until(lambda: "confirmed through the API: desiredStatus=EXITED" in g.guard_file("log"), EVENT_S)
    assert runpod.stops == [(g.inst.id, "stop", "instance")]
    assert g.r.status("g1").raw_state == "EXITED"


def test_a_second_guard_on_the_same_machine_never_stops_twice(request, tmp_path, vast, sshkey):
    g = _rented(request, tmp_path, vast, "vast", sshkey, "vast:4101", base_url=vast.url)
    home = g.box.home
    # a job that shuts down as it ends (--then-shutdown), and the idle guard: both fire
    g.m.start_job("last", f"while [ ! -e {home}/go ]; do sleep 0.2; done", then_shutdown=0)
    g.m.budget.guard(idle=1, grace=0, poll=1, ledger=g.ledger)
    g.m.close()
    (home / "go").touch()
    assert wait_until(lambda: g.state().get("state") == "fired", EVENT_S), g.guard_file("log")
    job_log = home / ".gpumagic" / "jobs" / "last" / "shutdown.log"
    assert wait_until(lambda: job_log.exists() and "bill-stop" in job_log.read_text(encoding="utf-8"), EVENT_S)
    both = g.guard_file("log") + job_log.read_text(encoding="utf-8")
    assert both.count("-> 200") == 1 and "another guard has already asked for its stop; not asked again" in both
    assert vast.stops == [(g.inst.id, "stop", "instance")]


def test_lambda_without_consent_is_one_line_that_says_which_options_to_add(request, tmp_path, lam, sshkey):
    g = _rented(request, tmp_path, lam, "lambda", sshkey, base_url=lam.api_url, ssh_port=lam.ssh_port)
    with pytest.raises(BudgetError) as e:
        g.m.budget.guard(idle=60, ledger=g.ledger)
    assert e.value.message == ("g1: lambda cannot stop an instance, only terminate it, so the guard can end its "
                               "bill only by releasing it")
    assert e.value.hint == "add --release (the instance and its disk are then deleted) and --with-my-key"
    g.r.guard_choice("g1", release=True)
    with pytest.raises(BudgetError) as e:
        g.m.budget.guard(idle=60, ledger=g.ledger)
    assert e.value.message == ("lambda puts no API key on its machines, so the guard of g1 can release it "
                               "only with your key placed there")
    assert e.value.hint.startswith("add --with-my-key (it is stored on g1 in ~/.gpumagic/bill/key, 0600")
    assert not (g.box.home / ".gpumagic" / "bill" / "key").exists()
    with pytest.raises(BudgetError):  # --then-shutdown: the same plan, the same refusal
        g.m.start_job("j", "true", then_shutdown=0)
    assert lam.stops == []


def test_lambda_with_consent_releases_once_with_the_users_key_stored_0600(request, tmp_path, lam, sshkey):
    g = _rented(request, tmp_path, lam, "lambda", sshkey, base_url=lam.api_url, ssh_port=lam.ssh_port)
    g.r.guard_choice("g1", release=True, with_my_key=True)
    g.m.budget.guard(idle=1, grace=0, poll=1, ledger=g.ledger)
    key = g.box.home / ".gpumagic" / "bill" / "key"
    assert key.read_text(encoding="utf-8") == KEY + "\n" and (key.stat().st_mode & 0o777) == 0o600
    assert (key.parent.stat().st_mode & 0o777) == 0o700
    g.m.close()
    assert wait_until(lambda: "confirmed through the API" in g.guard_file("log"), EVENT_S), g.guard_file("log")
    assert lam.stops == [(g.inst.id, "release", "account")]
    assert "status=terminat" in g.guard_file("log") and KEY not in g.guard_file("log")
    assert lam.instances[g.inst.id]["status"] == "terminated"


def test_the_instance_key_is_good_for_its_own_instance_only(tmp_path, vast, runpod):
    """The stand-ins accept the injected keys as the platforms document them: for that instance."""
    import httpx

    vast.instance_keys["inst-x"] = runpod.instance_keys["inst-x"] = "1"
    r = httpx.put(f"{vast.url}/api/v0/instances/2", json={"state": "stopped"}, headers={"Authorization": "Bearer inst-x"})
    assert r.status_code == 401
    r = httpx.post(f"{runpod.url}/v1/pods/other/stop", headers={"Authorization": "Bearer inst-x"})
    assert r.status_code == 401
    assert vast.stops == runpod.stops == []


def _check(tmp_path, env_lines: str, environ: dict, **config) -> str:
    """``rent-stop.py check`` of a folder whose settings read ``env_lines`` as the platform's
    exported variables (as /etc/environment or /etc/rp_environment), run here."""
    import json
    import os
    import subprocess

    from gpumagic.remote import program

    d = tmp_path / "bill"
    d.mkdir(exist_ok=True)
    (tmp_path / "exported").write_text(env_lines, encoding="utf-8")
    cfg = {"instance_id": "pod7", "key_env": "RUNPOD_API_KEY", "id_env": "RUNPOD_POD_ID",
           "env_files": [str(tmp_path / "exported")], **config}
    (d / "stop.json").write_text(json.dumps(cfg), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")} | environ
    return subprocess.run([sys.executable, "-c", program.source("rent-stop.py"), "check", str(d)], env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=60).stdout.strip()


def test_the_program_finds_the_injected_key_where_the_platforms_images_export_it(tmp_path):
    exported = 'export RUNPOD_POD_ID="pod7"\nexport RUNPOD_API_KEY="rpa_scoped"\nPATH=/usr/bin\n'
    assert _check(tmp_path, exported, {}).endswith(f" {tmp_path / 'exported'}")  # the file, as RunPod writes it
    assert _check(tmp_path, "", {"RUNPOD_API_KEY": "k", "RUNPOD_POD_ID": "pod7"}).endswith(" environment")
    assert _check(tmp_path, exported, {"RUNPOD_POD_ID": "pod9"}) == "wrongid RUNPOD_POD_ID=pod9"
    assert _check(tmp_path, "", {}) == "nokey RUNPOD_API_KEY"
    (tmp_path / "bill" / "key").write_text("users-key\n", encoding="utf-8")
    assert _check(tmp_path, "", {}, key_file=True).endswith(f" your_key_({tmp_path / 'bill' / 'key'})")


def test_an_image_that_hides_the_injected_key_is_one_line_then_with_my_key_stops_with_yours(
        request, tmp_path, vast, sshkey):
    g = _rented(request, tmp_path, vast, "vast", sshkey, "vast:4101", base_url=vast.url)
    g.m.close()
    g.box.server.env.pop("CONTAINER_API_KEY")  # an image that exports it nowhere SSH sessions see
    g.box.stop()
    g.box.start(g.box.server.port)
    g.m = gpumagic.connect(f"{USER}@{g.inst.host}:{g.inst.port}", key=str(sshkey), name="g1", trust_new_host=True)
    g.m.rental = RentalStop(g.r, "g1")
    with pytest.raises(BudgetError) as e:
        g.m.budget.guard(idle=60, ledger=g.ledger)
    assert e.value.message.startswith("g1: CONTAINER_API_KEY is not on the machine") and "\n" not in e.value.message
    assert e.value.hint.startswith("add --with-my-key to place your vast key there instead")
    g.r.guard_choice("g1", with_my_key=True)
    g.m.budget.guard(idle=1, grace=0, poll=1, ledger=g.ledger)
    g.m.close()
    assert wait_until(lambda: "confirmed through the API" in g.guard_file("log"), EVENT_S), g.guard_file("log")
    assert vast.stops == [(g.inst.id, "stop", "account")]
