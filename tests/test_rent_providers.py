"""Renting through RunPod's and Lambda Cloud's APIs, against local stand-ins that validate every
request and answer with the platforms' published OpenAPI documents (tests/providers/)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))

import gpumagic  # noqa: E402
from gpumagic.keys import keygen  # noqa: E402
from gpumagic.rent import (BadKey, CreateTimeout, InsufficientBalance, KeyStore, NoOffer, NotSupported,  # noqa: E402
                           RateLimited, Renter, StuckPending)
from gpumagic.rent.lambdacloud import LambdaCloud  # noqa: E402
from gpumagic.rent.runpod import RunPod  # noqa: E402

from platforms import LambdaServer, RunPodServer  # noqa: E402

KEY = "good-key"


def _checked(server):
    yield server
    server.close()
    assert server.violations == [], "requests or answers outside the published document"


@pytest.fixture
def runpod(tmp_path):
    yield from _checked(RunPodServer(tmp_path / "runpod"))


@pytest.fixture
def lam(tmp_path):
    yield from _checked(LambdaServer(tmp_path / "lambda"))


@pytest.fixture
def sshkey(tmp_path):
    path = tmp_path / "id_ed25519"
    keygen(path)
    return path


def _renter(tmp_path, server, name) -> Renter:
    r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False), poll_s=0.02,
               wait_s=20)
    if name == "runpod":
        r.configure("runpod", base_url=server.rest_url, catalog_url=server.url, user=os.environ.get("USER") or
                    __import__("getpass").getuser())
    else:
        r.configure("lambda", base_url=server.api_url, user=__import__("getpass").getuser(), ssh_port=server.ssh_port)
    r.keys.set(name, KEY)
    return r


def _pub(path: Path) -> str:
    return Path(str(path) + ".pub").read_text(encoding="utf-8").strip()


def _cell(inst, sshkey, name):
    m = gpumagic.connect(f"{inst.user}@{inst.host}:{inst.port}", key=str(sshkey), name=name, trust_new_host=True)
    try:
        return m.run("echo hello from $((6*7))", capture=True).stdout.strip()
    finally:
        m.close()


def test_runpod_offers_are_the_catalog_filtered_and_sorted(tmp_path, runpod):
    r = _renter(tmp_path, runpod, "runpod")
    offers = r.offers("runpod", gpu="4090")
    assert [(o.id, o.price_hr) for o in offers] == [("NVIDIA GeForce RTX 4090/community", 0.34),
                                                   ("NVIDIA GeForce RTX 4090/secure", 0.69)]
    assert [o.id for o in r.offers("runpod", vram_gb=48)] == ["NVIDIA H100 80GB HBM3/secure"]
    assert runpod.requests == [("GET", "/v2/catalog/gpus")] * 2


def test_runpod_rent_connect_stop_start_on_a_new_port_release(tmp_path, runpod, sshkey):
    r = _renter(tmp_path, runpod, "runpod")
    lines = []
    offer = r.pick(None, provider="runpod", gpu="4090", max_price=0.5)
    inst = r.rent(offer, name="a", public_key=_pub(sshkey), key_path=str(sshkey), progress=lines.append)
    assert inst.state == "running" and inst.price_hr == 0.34
    assert lines[0].startswith("a: runpod instance ") and any("waiting for running" in ln for ln in lines)
    assert _cell(inst, sshkey, "a") == "hello from 42"
    stopped = r.stop("a")
    assert stopped.state == "stopped" and stopped.host is None
    again = r.start("a")
    assert again.state == "running" and again.port != inst.port  # read again after the start
    assert _cell(again, sshkey, "a") == "hello from 42"
    r.release("a")
    assert list(runpod.pods.values())[0]["desiredStatus"] == "TERMINATED"
    assert r.load().rentals == {} and r.rentals() == []
    assert len(runpod.pods) == 1
    assert runpod.undocumented == []


def test_lambda_rent_connect_and_release_keeping_its_rate_limits(tmp_path, lam, sshkey):
    r = _renter(tmp_path, lam, "lambda")
    offer = r.pick(None, provider="lambda", gpu="h100")
    assert (offer.id, offer.price_hr, offer.vram_gb, offer.stopped_hr) == ("gpu_1x_h100_pcie@us-west-1", 2.49, 80, None)
    inst = r.rent(offer, name="l", public_key=_pub(sshkey), key_path=str(sshkey))
    assert inst.host == "127.0.0.2" and inst.port == lam.ssh_port
    assert [k["name"] for k in lam.keys_stored] == [f"gpumagic-{k}" for k in [lam.keys_stored[0]["name"][9:]]]
    assert _cell(inst, sshkey, "l") == "hello from 42"
    with pytest.raises(NotSupported) as e:
        r.stop("l")
    assert "release" in e.value.hint
    r.release("l")
    assert lam.instances[inst.id]["status"] == "terminated"
    assert lam.undocumented == []  # paced on our side: the platform never had to say 429


def test_a_429_is_waited_out_by_its_retry_after_then_reported_in_one_line(tmp_path, lam):
    p = LambdaCloud(KEY, base_url=lam.api_url, spacing={})
    lam.too_many, lam.retry_after = 1, 1
    assert p.offers(gpu="a10")[0].id == "gpu_1x_a10@us-east-1"
    assert lam.requests == [("GET", "/api/v1/instance-types")] * 2
    p = LambdaCloud(KEY, base_url=lam.api_url, spacing={}, retries_429=0)
    lam.too_many, lam.retry_after = 1, 7
    with pytest.raises(RateLimited) as e:
        p.instances()
    assert str(e.value) == "lambda: rate-limited (429 Too Many Requests)\n  hint: wait 7 s and run it again"
    assert e.value.retry_after == 7
    assert [s for s, _ in lam.undocumented] == [429, 429]


def test_the_platforms_own_limit_answers_429_to_an_unpaced_client(tmp_path, lam):
    paced = LambdaCloud(KEY, base_url=lam.api_url)  # the documented spacing, kept here
    for _ in range(3):
        paced.instances()
    assert lam.undocumented == []
    p = LambdaCloud(KEY, base_url=lam.api_url, spacing={}, retries_429=0)
    with pytest.raises(RateLimited):
        p.instances()
        p.instances()  # within 1 s of the first
    assert [s for s, _ in lam.undocumented] == [429]


@pytest.mark.parametrize("platform", ["runpod", "lambda"])
def test_a_bad_key_is_one_line_that_never_shows_the_key(tmp_path, runpod, lam, platform):
    secret = "sk-SECRET-0123456789"
    p = (RunPod(secret, base_url=runpod.rest_url, catalog_url=runpod.url) if platform == "runpod"
         else LambdaCloud(secret, base_url=lam.api_url))
    with pytest.raises(BadKey) as e:
        p.instances()
    text = str(e.value)
    assert secret not in text and "***" in text  # the platform echoed it; it is redacted
    assert f"%gpu provider login {platform}" in e.value.hint
    assert "\n" not in e.value.message


def test_no_offer_under_the_price_names_the_cheapest_that_fits(tmp_path, runpod):
    r = _renter(tmp_path, runpod, "runpod")
    with pytest.raises(NoOffer) as e:
        r.pick(None, provider="runpod", gpu="h100", max_price=1.0)
    assert e.value.message == ("no offer under 1/h fits (the cheapest that fits: runpod:NVIDIA H100 80GB HBM3/secure "
                               "at 2.99/h)")


def test_an_offer_taken_meanwhile_says_to_pick_another(tmp_path, lam, sshkey):
    r = _renter(tmp_path, lam, "lambda")
    offer = r.pick("lambda:gpu_1x_a10@us-east-1")
    lam.capacity["gpu_1x_a10"] = []
    with pytest.raises(NoOffer) as e:
        r.rent(offer, name="x", public_key=_pub(sshkey))
    assert "taken meanwhile" in e.value.hint and lam.instances == {}
    assert r.load().rentals == {}


def test_a_create_with_no_answer_adopts_the_instance_it_made_and_makes_no_second(tmp_path, runpod, sshkey):
    r = _renter(tmp_path, runpod, "runpod")
    r.configure("runpod", timeout=0.5)
    runpod.delay["POST /pods"] = 1.5
    offer = r.pick(None, provider="runpod", gpu="4090")
    inst = r.rent(offer, name="slow", public_key=_pub(sshkey))
    assert len(runpod.pods) == 1 and inst.id == next(iter(runpod.pods))
    assert [q for q in runpod.requests if q[0] == "POST"] == [("POST", "/v1/pods")]


def test_a_create_with_no_answer_and_no_instance_says_nothing_was_rented(tmp_path, runpod, sshkey):
    from server import Reply

    p = RunPod(KEY, base_url=runpod.rest_url, catalog_url=runpod.url, timeout=0.3)
    offer = p.offers(gpu="4090")[0]
    runpod.delay["POST /pods"] = 1.0
    real_route = runpod.route

    def lost(method, path, query, body, token):  # the create fails on the platform's side, late
        if method == "POST" and path == "/pods":
            raise Reply(400, None)
        return real_route(method, path, query, body, token)

    runpod.route = lost
    with pytest.raises(CreateTimeout) as e:
        p.create(offer, name="lost", public_key=_pub(sshkey))
    assert "nothing was rented" in e.value.hint and runpod.pods == {}
    assert runpod.requests[-1] == ("GET", "/v1/pods")  # looked for it by name before saying so


@pytest.mark.parametrize("platform", ["runpod", "lambda"])
def test_insufficient_balance_says_to_add_credit(tmp_path, runpod, lam, sshkey, platform):
    server = runpod if platform == "runpod" else lam
    r = _renter(tmp_path, server, platform)
    offer = r.pick(None, provider=platform)
    runpod.balance_left = lam.account_active = False
    with pytest.raises(InsufficientBalance) as e:
        r.rent(offer, name="b", public_key=_pub(sshkey))
    assert ("Billing" if platform == "runpod" else "payment") in e.value.hint


def test_an_instance_stuck_starting_is_reported_and_kept(tmp_path, runpod, sshkey):
    runpod.boot_reads = 10_000
    r = _renter(tmp_path, runpod, "runpod")
    r.wait_s = 0.3
    with pytest.raises(StuckPending) as e:
        r.rent(r.pick(None, provider="runpod"), name="s", public_key=_pub(sshkey))
    assert e.value.message == "s stayed 'RUNNING' for 0.3 s (wanted running)"
    assert "%gpu release s" in e.value.hint and "s" in r.load().rentals


def test_keys_go_to_a_private_file_without_a_keychain_and_nowhere_else(tmp_path, runpod):
    r = _renter(tmp_path, runpod, "runpod")
    f = tmp_path / "data" / "keys" / "runpod"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    assert KEY not in (tmp_path / "data" / "rentals.json").read_text(encoding="utf-8")
    assert r.keys.get("runpod") == KEY and r.keys.delete("runpod") and r.keys.get("runpod") is None


def test_keys_go_to_the_keychain_where_keyring_has_one(tmp_path):
    import keyring
    from keyring.backend import KeyringBackend

    class Memory(KeyringBackend):
        priority = 1
        store: dict = {}

        def set_password(self, service, user, password):
            self.store[(service, user)] = password

        def get_password(self, service, user):
            return self.store.get((service, user))

        def delete_password(self, service, user):
            self.store.pop((service, user))

    old = keyring.get_keyring()
    keyring.set_keyring(Memory())
    try:
        ks = KeyStore(tmp_path / "keys")
        assert "keychain" in ks.set("lambda", "k-1")
        assert Memory.store == {("gpumagic", "lambda"): "k-1"} and not (tmp_path / "keys").exists()
        assert ks.get("lambda") == "k-1"
    finally:
        keyring.set_keyring(old)


# -- vast.ai ------------------------------------------------------------------------------------


@pytest.fixture
def vast(tmp_path):
    from platforms import VastServer

    yield from _checked(VastServer(tmp_path / "vast"))


def _vast_renter(tmp_path, server) -> Renter:
    r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False), poll_s=0.02,
               wait_s=20)
    r.configure("vast", base_url=server.url, user=__import__("getpass").getuser())
    r.keys.set("vast", KEY)
    return r


def test_vast_rent_connect_stop_start_on_a_new_port_release(tmp_path, vast, sshkey):
    r = _vast_renter(tmp_path, vast)
    offers = r.offers("vast", max_price=0.3)
    assert [(o.id, o.gpu, o.vram_gb, o.price_hr) for o in offers] == [("4102", "RTX 3090", 24, 0.221)]
    inst = r.rent(r.pick("vast:4101"), name="v", public_key=_pub(sshkey), key_path=str(sshkey), disk_gb=40)
    assert inst.state == "running" and inst.price_hr == 0.402
    assert _cell(inst, sshkey, "v") == "hello from 42"
    stopped = r.stop("v")
    assert stopped.state == "stopped" and stopped.stopped_hr == round(0.15 * 40 / 730, 5)
    again = r.start("v")
    assert again.port != inst.port and _cell(again, sshkey, "v") == "hello from 42"
    r.release("v")
    assert vast.instances == {} and r.rentals() == []
    assert [s for s, _ in vast.undocumented] == []


def test_vast_an_offer_rented_by_someone_else_meanwhile(tmp_path, vast, sshkey):
    r = _vast_renter(tmp_path, vast)
    offer = r.pick(None, provider="vast", gpu="4090")
    vast.offers[0]["rentable"] = False  # someone else was quicker
    with pytest.raises(NoOffer) as e:
        r.rent(offer, name="late", public_key=_pub(sshkey))
    assert "someone else rented that offer meanwhile" in e.value.hint and vast.instances == {}


def test_vast_an_empty_balance_is_said_before_anything_is_rented(tmp_path, vast, sshkey):
    r = _vast_renter(tmp_path, vast)
    vast.balance = 0.0
    with pytest.raises(InsufficientBalance) as e:
        r.rent(r.pick(None, provider="vast"), name="poor", public_key=_pub(sshkey))
    assert e.value.message == "vast: the account's balance is 0.00 USD" and vast.instances == {}
    assert not any(m == "PUT" for m, _ in vast.requests)


def test_vast_a_bad_key_is_redacted(tmp_path, vast):
    from gpumagic.rent.vast import Vast

    with pytest.raises(BadKey) as e:
        Vast("vk-SECRET-42", base_url=vast.url).balance()
    assert "vk-SECRET-42" not in str(e.value) and "***" in str(e.value)


def test_vast_an_instance_stuck_scheduling_is_reported(tmp_path, vast, sshkey):
    vast.boot_reads = 10_000
    r = _vast_renter(tmp_path, vast)
    r.wait_s = 0.3
    with pytest.raises(StuckPending) as e:
        r.rent(r.pick(None, provider="vast"), name="sched", public_key=_pub(sshkey))
    assert e.value.message == "sched stayed 'scheduling' for 0.3 s (wanted running)"


def test_the_stand_ins_refuse_what_the_published_documents_do_not_define(tmp_path, runpod, lam, vast):
    # the check every other test relies on: an invented field or value is a violation, not a pass
    import httpx

    c = httpx.Client(headers={"Authorization": f"Bearer {KEY}"})
    assert c.put(vast.url + "/api/v0/instances/1", json={"state": "paused"}).status_code == 400
    assert c.post(runpod.rest_url + "/pods", json={"name": "x", "gpuTypeIds": ["NVIDIA GeForce RTX 4090"],
                                                   "sshPublicKey": "ssh-ed25519 AAAA"}).status_code == 400
    assert c.post(lam.api_url + "/instance-operations/launch",
                  json={"region_name": "us-east-1", "instance_type_name": "gpu_1x_a10",
                        "ssh_key_names": ["a", "b"]}).status_code == 400
    found = vast.violations + runpod.violations + lam.violations
    assert ["state: 'paused' is not one of" in v for v in vast.violations] == [True]
    assert len(runpod.violations) == 1 and len(lam.violations) == 1 and "ssh_key_names" in lam.violations[0]
    for s in (vast, runpod, lam):
        s.violations.clear()
    assert len(found) == 3


_WRITER = """
import sys, time
from gpumagic.rent import KeyStore, Renter
from gpumagic.rent.rentals import RentalRecord
r = Renter(sys.argv[1], keys=KeyStore(sys.argv[1] + "/keys", use_keyring=False))
while not __import__("os").path.exists(sys.argv[3]):  # both start writing at once
    time.sleep(0.001)
for i in range(40):
    with r.update() as f:
        f.rentals[f"{sys.argv[2]}{i}"] = RentalRecord("runpod", f"{sys.argv[2]}-{i}")
"""


def test_two_notebooks_recording_rentals_at_once_lose_no_record(tmp_path):
    import subprocess

    data, go = tmp_path / "data", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(data), who, str(go)]) for who in ("a", "b")]
    go.touch()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    names = set(Renter(data, keys=KeyStore(data / "keys", use_keyring=False)).load().rentals)
    assert names == {f"{who}{i}" for who in "ab" for i in range(40)}  # 80: each read-modify-write locked
    assert (data / "rentals.json.lock").exists()
