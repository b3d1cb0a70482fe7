"""%gpu provider login, offers, rent, stop, start, release, rentals: driven through a real
InteractiveShell against the RunPod and Lambda stand-ins (tests/providers/), each "created"
instance a real sshd."""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))

from IPython.core.error import UsageError  # noqa: E402

from gpumagic.errors import BadKey, NoOffer, NotSupported, RateLimited, ReleaseRefused, UnknownHostKey  # noqa: E402
from gpumagic.keys import keygen  # noqa: E402
from gpumagic.rent import PROVIDERS, KeyStore, Renter  # noqa: E402

from platforms import LambdaServer, RunPodServer  # noqa: E402

USER = getpass.getuser()


@pytest.fixture
def runpod(tmp_path):
    s = RunPodServer(tmp_path / "runpod")
    yield s
    s.close()
    assert s.violations == []


@pytest.fixture
def lam(tmp_path):
    s = LambdaServer(tmp_path / "lambda")
    yield s
    s.close()
    assert s.violations == []


@pytest.fixture
def shell(ip, tmp_path, monkeypatch):
    """``ip`` with a Renter of its own (data under tmp_path, no keychain, quick polls), the key
    prompt answering what ``shell.typed`` holds (no ``GPUMAGIC_P_...`` variable of this
    environment), and an SSH key pair."""
    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith("GPUMAGIC_") and v.split("_")[1].lower() in PROVIDERS]:
        monkeypatch.delenv(var)  # a login takes a key (and options) from there: the typed one here
    ip._gpumagic.state.renter = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False),
                                 poll_s=0.02, wait_s=20)
    typed = {"key": "good-key"}
    monkeypatch.setattr("gpumagic.rent.keystore.getpass.getpass", lambda prompt="": typed["key"])
    ip.typed = typed
    ip.sshkey = tmp_path / "id_ed25519"
    keygen(ip.sshkey)
    yield ip
    ip._gpumagic.state.renter = None
    ip._gpumagic.fleet.close_all()


def gpu(ip, line):
    return ip.run_line_magic("gpu", line)


def test_login_checks_the_key_and_a_bad_one_is_not_stored_nor_shown(shell, runpod, capsys):
    shell.typed["key"] = "sk-WRONG-987654"
    with pytest.raises(BadKey) as e:
        gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url}")
    assert "sk-WRONG-987654" not in str(e.value) and "%gpu provider login runpod" in e.value.hint
    assert shell._gpumagic.state.renter.keys.get("runpod") is None
    shell.typed["key"] = "good-key"
    gpu(shell, "provider login runpod")
    out = capsys.readouterr().out
    assert "runpod: the key works; kept in" in out and "good-key" not in out
    gpu(shell, "provider")
    assert "runpod: key stored" in capsys.readouterr().out
    assert "good-key" not in "".join(str(h) for h in shell.history_manager.input_hist_raw)


def test_login_takes_the_key_and_options_from_the_environment_where_no_one_can_type(shell, runpod, capsys,
                                                                                   monkeypatch):
    from IPython.core.error import StdinNotImplementedError

    from gpumagic.errors import ConfigError, RentError

    def no_stdin(prompt=""):  # a notebook run by nbclient: input is not allowed
        raise StdinNotImplementedError("raw_input was called, but this frontend does not support input requests.")

    monkeypatch.setattr("gpumagic.rent.keystore.getpass.getpass", no_stdin)
    with pytest.raises(RentError) as e:
        gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url}")
    assert e.value.message == "no key was entered for runpod"
    assert e.value.hint.endswith("or set $GPUMAGIC_RUNPOD_API_KEY where no one can type it")
    monkeypatch.setenv("GPUMAGIC_RUNPOD_API_KEY", " sk-WRONG-987654\n")
    with pytest.raises(BadKey) as e:
        gpu(shell, "provider login runpod")
    assert "sk-WRONG-987654" not in str(e.value)
    assert e.value.hint == ("the key came from $GPUMAGIC_RUNPOD_API_KEY: set it to a working key, or unset it to "
                            "be asked for one")
    assert shell._gpumagic.state.renter.keys.get("runpod") is None
    # the options the line leaves out come from the environment too; one on the line wins
    monkeypatch.setenv("GPUMAGIC_RUNPOD_API_KEY", "good-key")
    monkeypatch.setenv("GPUMAGIC_RUNPOD_BASE_URL", "http://127.0.0.1:9/nowhere")
    monkeypatch.setenv("GPUMAGIC_RUNPOD_USER", USER)
    capsys.readouterr()
    gpu(shell, f"provider login runpod --base-url {runpod.rest_url}")
    assert capsys.readouterr().out.splitlines() == [
        f"runpod: the key in $GPUMAGIC_RUNPOD_API_KEY works; kept in {shell._gpumagic.state.renter.keys.where}",
        "runpod: --user from $GPUMAGIC_RUNPOD_USER"]
    assert shell._gpumagic.state.renter.keys.get("runpod") == "good-key"
    settings = shell._gpumagic.state.renter.load().providers["runpod"]
    assert (settings.base_url, settings.user) == (runpod.rest_url, USER)
    assert "good-key" not in "".join(str(h) for h in shell.history_manager.input_hist_raw)
    monkeypatch.setenv("GPUMAGIC_LAMBDA_SSH_PORT", "22x")
    with pytest.raises(ConfigError) as e:
        gpu(shell, "provider login lambda")
    assert e.value.message.startswith("$GPUMAGIC_LAMBDA_SSH_PORT='22x': ") and "\n" not in e.value.message


def test_rent_cell_stop_start_on_a_new_port_and_release_after_the_results_are_pulled(shell, runpod, capsys):
    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    capsys.readouterr()
    gpu(shell, "offers --gpu 4090")
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["runpod:NVIDIA", "GeForce"] and "0.340" in out[1] and "community" in out[1]
    # no platform publishes its machines' host keys: the new one is refused as `%gpu connect`
    # refuses an unknown host, the rental stays (billed), and `start --trust-new-host` connects
    with pytest.raises(UnknownHostKey) as refused:
        gpu(shell, f"rent --gpu 4090 --max-price 0.5 --name rp1 -i {shell.sshkey}")
    out = capsys.readouterr().out
    assert "renting runpod:NVIDIA GeForce RTX 4090/community (RTX 4090, 0.340 USD/h) as rp1" in out
    box = list(runpod.boxes.values())[0].server
    assert refused.value.fingerprint == box.host_key_fingerprint
    assert refused.value.hint.startswith(f"rp1 is running (and billed); if {box.host_key_fingerprint} is the key")
    assert "`%gpu start rp1 --trust-new-host` connects" in refused.value.hint
    gpu(shell, "start rp1 --trust-new-host")
    assert "connected to rp1 (" in capsys.readouterr().out
    assert len(runpod.pods) == 1  # connected to the one made, not a second
    first_port = shell._gpumagic.fleet.get("rp1").spec.port
    shell.run_cell_magic("remote", "", "mkdir -p runs && echo 0.93 > runs/acc.txt && echo cell-ran")
    assert "cell-ran" in capsys.readouterr().out
    # the cell ran in the pod's volume (volumeMountPath: RunPod's /workspace, the stand-in's home of
    # its sshd), the folder a stop keeps, not in the login's home
    assert (list(runpod.boxes.values())[0].home / "runs" / "acc.txt").read_text(encoding="utf-8") == "0.93\n"
    with pytest.raises(ReleaseRefused) as e:
        gpu(shell, "release rp1")
    assert "no results folder of rp1 was ever checked" in e.value.message
    gpu(shell, "wrapup --pull :runs/ ./runs/ --no-pull --host rp1")
    with pytest.raises(ReleaseRefused) as e:
        gpu(shell, "release rp1")
    assert e.value.message == "rp1 still holds results not pulled: 1 file(s) in :runs/"
    gpu(shell, "stop rp1")
    assert "rp1 is stopped; its disk costs 0.014 USD/h while stopped" in capsys.readouterr().out
    gpu(shell, "rentals")
    assert "EXITED" in capsys.readouterr().out
    gpu(shell, "start rp1")  # a new port: the key trusted for rp1 is trusted there
    assert shell._gpumagic.fleet.get("rp1").spec.port != first_port
    gpu(shell, "wrapup --host rp1")
    assert (Path("runs") / "acc.txt").read_text(encoding="utf-8") == "0.93\n"
    capsys.readouterr()
    gpu(shell, "release rp1")
    assert "rp1 is released" in capsys.readouterr().out
    assert list(runpod.pods.values())[0]["desiredStatus"] == "TERMINATED" and len(runpod.pods) == 1
    gpu(shell, "rentals")
    assert "no instances" in capsys.readouterr().out
    from gpumagic.budget import Ledger

    assert Ledger().machine("rp1").prices.rate == 0.34  # the platform's price, in the ledger
    stored = [Ledger().path, shell._gpumagic.state.renter.path]
    assert all("good-key" not in Path(f).read_text(encoding="utf-8") for f in stored)  # the key is in neither


def test_lambda_rent_a_cell_no_stop_and_release(shell, lam, capsys):
    gpu(shell, f"provider login lambda --base-url {lam.api_url} --user {USER} --ssh-port {lam.ssh_port}")
    gpu(shell, f"rent lambda:gpu_1x_a10@us-east-1 --name lm1 -i {shell.sshkey} --trust-new-host")
    shell.run_cell_magic("remote", "", "echo on-lambda")
    assert "on-lambda" in capsys.readouterr().out
    with pytest.raises(NotSupported) as e:
        gpu(shell, "stop lm1")
    assert "release" in e.value.hint
    shell.run_cell_magic("remote", "", "echo still-connected")  # the refused stop closed nothing
    assert "still-connected" in capsys.readouterr().out
    gpu(shell, "release lm1 --yes")
    assert [i["status"] for i in lam.instances.values()] == ["terminated"]


def test_errors_are_one_line_each_that_say_what_to_do(shell, runpod, capsys):
    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url}")
    with pytest.raises(NoOffer) as e:
        gpu(shell, f"rent --gpu h100 --max-price 1 --name x -i {shell.sshkey}")
    assert "\n" not in e.value.message and "--max-price" in e.value.hint
    runpod.too_many, runpod.retry_after = 10, 40  # longer than gpumagic waits by itself
    with pytest.raises(RateLimited) as e:
        gpu(shell, "offers")
    assert str(e.value) == "runpod: rate-limited (429 Too Many Requests)\n  hint: wait 40 s and run it again"


def test_a_rental_whose_sshd_answers_late_is_connected_once_it_does(shell, runpod, capsys, monkeypatch):
    from gpumagic.errors import ConnectionRefused

    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    fleet = shell._gpumagic.fleet
    real, tries = fleet.connect, []

    def late(target, **options):  # the platform says running before its sshd listens
        tries.append(target)
        if len(tries) < 3:
            raise ConnectionRefused(f"connection refused by {target}", "")
        return real(target, **options)

    monkeypatch.setattr(fleet, "connect", late)
    gpu(shell, f"rent --gpu 4090 --name late1 -i {shell.sshkey} --trust-new-host")
    assert len(tries) == 3 and len(set(tries)) == 1 and "connected to late1" in capsys.readouterr().out
    gpu(shell, "release late1 --yes")


def test_offers_of_every_platform_leave_out_one_that_fails_and_say_so(shell, runpod, lam, capsys):
    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url}")
    gpu(shell, f"provider login lambda --base-url {lam.api_url}")
    lam.keys = {"another-key"}  # the Lambda key was revoked meanwhile
    capsys.readouterr()
    gpu(shell, "offers --gpu 4090")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("left out: lambda refused the API key (401: API key *** is invalid")
    assert out[1].startswith("OFFER") and len(out) == 4  # RunPod's two 4090 offers


def test_a_start_that_brings_another_host_key_is_refused(shell, runpod, capsys):
    from gpumagic.ssh.sandbox import make_keypair

    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    gpu(shell, f"rent --gpu 4090 --name rk1 -i {shell.sshkey} --trust-new-host")
    box = list(runpod.boxes.values())[0].server
    trusted = box.host_key_fingerprint
    assert shell._gpumagic.state.renter.record("rk1").host_key == trusted
    gpu(shell, "stop rk1")
    for f in (box.host_key, Path(str(box.host_key) + ".pub")):  # the machine was rebuilt
        f.unlink()
    make_keypair(box.host_key, "rebuilt")
    with pytest.raises(UnknownHostKey) as e:
        gpu(shell, "start rk1")
    assert f"is not the {trusted} expected" in e.value.message and "\n" not in e.value.message
    assert e.value.fingerprint == box.host_key_fingerprint != trusted
    gpu(shell, "start rk1 --trust-new-host")  # the user compared it with the platform's console
    assert shell._gpumagic.state.renter.record("rk1").host_key == box.host_key_fingerprint
    gpu(shell, "release rk1 --yes")


def test_the_guard_of_a_rental_stops_its_bill_and_the_notebook_reads_stopped_through_the_api(shell, runpod, capsys):
    from gpumagic.errors import BudgetError
    from conftest import wait_until

    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    gpu(shell, f"rent --gpu 4090 --name rg1 -i {shell.sshkey} --trust-new-host")
    capsys.readouterr()
    m = shell._gpumagic.fleet.get("rg1")
    m.rental, rental = None, m.rental  # as a machine connected by `%gpu connect`, not rented here
    with pytest.raises(UsageError) as e:
        gpu(shell, "budget guard --idle 1s --with-my-key")
    assert str(e.value) == "--release and --with-my-key are for a rental (`%gpu rent`); rg1 is not one"
    m.rental = rental
    gpu(shell, "budget guard --idle 1s --grace 0s --poll 1")
    out = capsys.readouterr().out
    assert "it ends the bill with the runpod API's stop, sent from rg1 itself (the laptop may be closed)" in out
    assert "your runpod API key" not in out  # RunPod injects a pod-scoped key: the user's stays here
    box = list(runpod.boxes.values())[0]
    assert not (box.home / ".gpumagic" / "bill" / "key").exists()
    shell._gpumagic.fleet.get("rg1").close()  # the laptop's link is cut
    assert wait_until(lambda: runpod.stops, 90)
    assert runpod.stops == [(list(runpod.pods)[0], "stop", "instance")]
    gpu(shell, "budget guard --host rg1")
    assert capsys.readouterr().out == ("rg1: stopped (EXITED), as the runpod API reads it now: its GPU is no "
                                       "longer billed; `%gpu start rg1` resumes it\n")
    gpu(shell, "rentals")
    assert "EXITED" in capsys.readouterr().out
    with pytest.raises(BudgetError) as e:  # nothing is armed on a stopped machine
        gpu(shell, "budget guard --idle 1s --host rg1")
    assert e.value.message == "rg1 is stopped (EXITED) as the runpod API reads it: there is nothing to guard"
    gpu(shell, "release rg1 --yes")


def test_with_my_key_places_the_key_says_where_and_cancel_removes_it(shell, runpod, capsys):
    gpu(shell, f"provider login runpod --base-url {runpod.rest_url} --catalog-url {runpod.url} --user {USER}")
    gpu(shell, f"rent --gpu 4090 --name rk2 -i {shell.sshkey} --trust-new-host")
    capsys.readouterr()
    gpu(shell, "budget guard --idle 1h --with-my-key")
    out = capsys.readouterr().out
    assert ("your runpod API key is stored on rk2 in ~/.gpumagic/bill/key (0600), for the guard to stop it from "
            "there; `%gpu budget guard --cancel` removes it") in out
    key = list(runpod.boxes.values())[0].home / ".gpumagic" / "bill" / "key"
    assert key.read_text(encoding="utf-8") == "good-key\n" and key.stat().st_mode & 0o777 == 0o600
    gpu(shell, "budget guard --cancel")
    assert "your API key was removed from rk2" in capsys.readouterr().out and not key.exists()
    gpu(shell, "release rk2 --yes")
