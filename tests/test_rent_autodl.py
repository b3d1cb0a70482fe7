"""Renting on AutoDL through its elastic-deployment API, against a local stand-in that checks
every request and answer with a schema written from AutoDL's document
(tests/providers/autodl-esd-schema.json, autodl_server.py): each container runs the ``cmd``
gpumagic sent, for real, and a real sshd accepts the keys that ``cmd`` installed."""

from __future__ import annotations

import getpass
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "providers"))

import gpumagic  # noqa: E402
from gpumagic.errors import ReleaseRefused  # noqa: E402
from gpumagic.keys import keygen  # noqa: E402
from gpumagic.rent import BadKey, KeyStore, NoOffer, NotSupported, Renter, RentError, StuckPending  # noqa: E402
from gpumagic.rent import autodl as autodl_module  # noqa: E402
from gpumagic.rent.autodl import AutoDL  # noqa: E402

from autodl_server import AutoDLServer  # noqa: E402

KEY = "good-key"
USER = getpass.getuser()
CREATE = "POST /api/v1/dev/deployment"


@pytest.fixture
def autodl(tmp_path):
    s = AutoDLServer(tmp_path / "autodl", boot_reads=2)
    yield s
    s.close()
    assert s.violations == [], "requests or answers outside AutoDL's document"


@pytest.fixture
def sshkey(tmp_path):
    path = tmp_path / "id_ed25519"
    keygen(path)
    return path


def _renter(tmp_path, server, wait_s=20.0) -> Renter:
    r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False), poll_s=0.02,
               wait_s=wait_s)
    r.configure("autodl", base_url=server.url, user=USER)
    r.keys.set("autodl", KEY)
    return r


def _pub(path: Path) -> str:
    return Path(str(path) + ".pub").read_text(encoding="utf-8").strip()


def _cell(inst, sshkey, name):
    m = gpumagic.connect(f"{inst.user}@{inst.host}:{inst.port}", key=str(sshkey), name=name, trust_new_host=True)
    try:
        return m.run("echo hello from $((6*7)); echo $HOME", capture=True).stdout.split()
    finally:
        m.close()


def _sent(server, key):
    return [b for k, b in server.bodies if k == key]


def test_offers_are_the_idle_stock_per_region_with_no_price(tmp_path, autodl):
    r = _renter(tmp_path, autodl)
    offers = r.offers("autodl")
    assert [(o.id, o.price_hr, o.vram_gb, o.currency) for o in offers] == [
        ("RTX 3090@beijingDC1", None, None, "CNY"), ("RTX 4090@westDC2", None, None, "CNY")]  # no idle A800
    assert len(autodl.requests) == len(autodl_module.REGIONS)  # one stock request per region of the appendix
    capped = r.offers("autodl", gpu="4090", max_price=3)
    assert [(o.id, o.price_cap) for o in capped] == [("RTX 4090@westDC2", 3)]  # the cap goes with the create
    asked = len(autodl.requests)
    assert [o.id for o in r.offers("autodl", region="beijingDC1")] == ["RTX 3090@beijingDC1"]
    assert len(autodl.requests) == asked + 1  # a region filter asks that region only
    assert r.offers("autodl", vram_gb=24) == []  # the stock does not say a GPU's memory
    with pytest.raises(NoOffer) as e:
        r.pick(None, provider="autodl", gpu="A800")
    assert "\n" not in e.value.message and "ask for less" in e.value.hint


def test_rent_connect_a_cell_stop_no_start_release(tmp_path, autodl, sshkey):
    r = _renter(tmp_path, autodl)
    lines = []
    offer = r.pick(None, provider="autodl", gpu="4090", max_price=2.5)
    inst = r.rent(offer, name="ad", public_key=_pub(sshkey), key_path=str(sshkey), progress=lines.append)
    assert (inst.state, inst.price_hr, inst.currency, inst.gpu) == ("running", 1.98, "CNY", "RTX 4090")
    assert lines[0].startswith("ad: autodl instance ") and lines[1] == "ad: starting, waiting for running"
    (body,) = _sent(autodl, CREATE)
    t = body["container_template"]
    assert body["deployment_type"] == "Container" and "replica_num" not in body
    assert (t["dc_list"], t["gpu_name_set"], t["gpu_num"], t["price_to"]) == (["westDC2"], ["RTX 4090"], 1, 2500)
    assert t["image_uuid"] == autodl_module.DEFAULT_IMAGE and t["cmd"].endswith("; sleep infinity & echo $! > "
                                                                               "~/.gpumagic-keep-alive.pid ; wait")
    words = _cell(inst, sshkey, "ad")  # the key the cmd installed is the one the sshd takes
    assert words[:3] == ["hello", "from", "42"] and words[3].endswith("/home")
    assert autodl.stock["westDC2"]["RTX 4090"][0] == 2
    (c,) = autodl.containers.values()
    proc = autodl.procs[c["uuid"]]
    stopped = r.stop("ad")
    assert (stopped.state, stopped.raw_state, stopped.host, stopped.stopped_hr) == ("stopped", "shutdown", None, 0.0)
    assert stopped.stopped_at is not None and proc.poll() is not None  # the container's cmd is gone
    assert autodl.stock["westDC2"]["RTX 4090"][0] == 3
    with pytest.raises(NotSupported) as e:
        r.start("ad")
    assert "\n" not in e.value.message and "`%gpu rent`" in e.value.hint and "7 days" in e.value.hint
    r.release("ad")
    assert autodl.deployments == {} and r.load().rentals == {} and r.rentals() == []
    assert [k for k, _ in autodl.bodies[-3:]] == ["PUT /api/v1/dev/deployment/operate", "DELETE /api/v1/dev/deployment",
                                                    "POST /api/v1/dev/deployment/list"]
    assert len(_sent(autodl, CREATE)) == 1
    assert not any("pw-" in str(b) for _, b in autodl.bodies)  # the root password is never sent back


def test_a_container_lives_as_long_as_its_cmd(tmp_path, autodl, sshkey, monkeypatch):
    """The document's rule, which is why gpumagic's cmd ends in `sleep infinity`."""
    monkeypatch.setattr(autodl_module, "keep_alive_cmd", lambda key: "echo booted")
    p = AutoDL(KEY, base_url=autodl.url)
    offer = p.offers(gpu="3090")[0]
    inst = p.create(offer, name="short", public_key=_pub(sshkey))
    proc = autodl.procs[next(iter(autodl.containers))]
    proc.wait(10)
    assert p.status(inst.id).state == "stopped"
    p.release(inst.id)


def test_the_guard_ends_an_idle_container_from_inside_with_no_key_and_no_request(tmp_path, autodl, sshkey):
    """The document's rule again: the guard ends the cmd's sleep, so the container and its bill
    end, with the laptop's link cut, no key on the machine and no request from it."""
    from conftest import wait_until
    from gpumagic.budget import Ledger
    from gpumagic.errors import BudgetError
    from gpumagic.rent.billstop import RentalStop

    r = _renter(tmp_path, autodl)
    inst = r.rent(r.pick(None, provider="autodl", gpu="4090", max_price=2.5), name="ad", public_key=_pub(sshkey),
                  key_path=str(sshkey))
    m = gpumagic.connect(f"{inst.user}@{inst.host}:{inst.port}", key=str(sshkey), name="ad", trust_new_host=True)
    m.rental = RentalStop(r, "ad")
    try:
        r.guard_choice("ad", release=True)
        with pytest.raises(BudgetError) as e:
            m.budget.guard(idle=1, grace=0, poll=1, ledger=Ledger(tmp_path / "ledger.json"))
        assert "a release needs the API" in e.value.message and "%gpu release ad" in e.value.hint
        r.guard_choice("ad", release=False)
        asked = len(autodl.requests)
        status = m.budget.guard(idle=1, grace=0, poll=1, ledger=Ledger(tmp_path / "ledger.json"))
        assert status.state == "armed", status
    finally:
        m.close()  # the laptop's link is cut: the machine goes on alone
    (c,) = autodl.containers.values()
    assert wait_until(lambda: autodl.procs[c["uuid"]].poll() is not None, 90)  # the cmd ended
    assert len(autodl.requests) == asked  # not one request: no key was needed
    assert r.status("ad").state == "stopped"
    assert not (autodl.boxes[c["uuid"]].server.env["HOME"] and
                (Path(autodl.boxes[c["uuid"]].server.env["HOME"]) / ".gpumagic" / "bill" / "key").exists())
    r.release("ad")


def test_a_price_cap_under_every_machine_places_nothing_and_says_so(tmp_path, autodl, sshkey):
    r = _renter(tmp_path, autodl, wait_s=0.3)
    offer = r.pick("autodl:RTX 4090@westDC2", max_price=1.0)  # 4090s cost 1.98 CNY/h here
    assert offer.price_cap == 1.0
    with pytest.raises(StuckPending) as e:
        r.rent(offer, name="cheap", public_key=_pub(sshkey), key_path=str(sshkey))
    assert "stayed 'scheduling'" in e.value.message and "`%gpu release cheap`" in e.value.hint
    assert _sent(autodl, CREATE)[0]["container_template"]["price_to"] == 1000 and autodl.containers == {}
    r.release("cheap")
    assert autodl.deployments == {}


@pytest.mark.parametrize("http_status", [401, 200])
def test_a_bad_token_is_one_line_that_never_shows_it(tmp_path, autodl, http_status):
    secret = "eyJSECRET.0123456789"
    autodl.auth_status = http_status  # the document names no status for it: both are read as a bad key
    with pytest.raises(BadKey) as e:
        AutoDL(secret, base_url=autodl.url).instances()
    assert "\n" not in e.value.message and secret not in str(e.value)
    assert "开发者Token" in e.value.hint and "%gpu provider login autodl" in e.value.hint
    assert autodl.requests == [("POST", "/api/v1/dev/deployment/list")]


def test_a_personal_account_is_told_that_the_api_needs_an_enterprise_one(tmp_path, autodl):
    autodl.enterprise = False
    r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False))
    r.configure("autodl", base_url=autodl.url)
    with pytest.raises(RentError) as e:
        r.login("autodl", KEY)
    assert "无当前资源访问权限" in e.value.message and "enterprise-certified" in e.value.hint
    assert r.keys.get("autodl") is None
    assert AutoDL(KEY, base_url=autodl.url).offers(gpu="4090")  # the stock answers all the same


def test_an_image_that_is_not_an_autodl_uuid_is_refused_before_any_create(tmp_path, autodl, sshkey):
    p = AutoDL(KEY, base_url=autodl.url)
    offer = p.offers(gpu="4090")[0]
    with pytest.raises(RentError) as e:
        p.create(offer, name="img", public_key=_pub(sshkey), image="pytorch/pytorch:2.4.0")
    assert "\n" not in e.value.message and "base-image-" in e.value.hint
    assert _sent(autodl, CREATE) == []


def test_a_create_that_got_no_answer_is_found_by_name_not_made_twice(tmp_path, autodl, sshkey):
    autodl.delay = {CREATE: 1.5}
    p = AutoDL(KEY, base_url=autodl.url, timeout=0.5)
    inst = p.create(p.offers(gpu="4090")[0], name="slow", public_key=_pub(sshkey))
    assert len(autodl.deployments) == 1 and inst.id == next(iter(autodl.deployments))
    autodl.delay = {}
    p.release(inst.id)


# -- the magics ---------------------------------------------------------------------------------


@pytest.fixture
def shell(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ip._gpumagic.state.renter = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "data" / "keys", use_keyring=False),
                                       poll_s=0.02, wait_s=20)
    monkeypatch.setattr("gpumagic.rent.keystore.getpass.getpass", lambda prompt="": KEY)
    ip.sshkey = tmp_path / "id_ed25519"
    keygen(ip.sshkey)
    yield ip
    ip._gpumagic.state.renter = None
    ip._gpumagic.fleet.close_all()


def gpu(ip, line):
    return ip.run_line_magic("gpu", line)


def test_magics_offers_rent_cell_stop_rentals_warning_release(shell, autodl, capsys):
    gpu(shell, f"provider login autodl --base-url {autodl.url} --user {USER}")
    assert "autodl: the key works" in capsys.readouterr().out
    gpu(shell, "offers --provider autodl --gpu 4090")
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["autodl:RTX", "4090@westDC2", "RTX"] and " - " in out[1]
    gpu(shell, f"rent 'autodl:RTX 4090@westDC2' --max-price 2.5 --name ad1 -i {shell.sshkey} --trust-new-host")
    out = capsys.readouterr().out
    assert "renting autodl:RTX 4090@westDC2 (RTX 4090, priced when placed, at most 2.50 CNY/h) as ad1" in out
    assert "connected to ad1" in out
    shell.run_cell_magic("remote", "", "echo on-autodl")
    assert "on-autodl" in capsys.readouterr().out
    from gpumagic.budget import Ledger

    prices = Ledger().machine("ad1").prices
    assert (prices.rate, prices.currency) == (1.98, "CNY")  # the price AutoDL placed it at
    with pytest.raises(ReleaseRefused):
        gpu(shell, "release ad1")
    gpu(shell, "stop ad1")
    assert "ad1 is stopped, and no longer billed; autodl cannot start it again" in capsys.readouterr().out
    with pytest.raises(NotSupported) as e:
        gpu(shell, "start ad1")
    assert e.value.message.startswith("autodl cannot start a stopped container")
    (c,) = autodl.containers.values()
    import datetime

    c["stopped_at"] = (datetime.datetime.now(datetime.timezone.utc)
                       - datetime.timedelta(days=6, hours=12)).isoformat(timespec="seconds")
    gpu(shell, "rentals")
    out = capsys.readouterr().out.splitlines()
    assert "shutdown" in out[1] and "0.000 CNY" in out[1]
    assert out[-1].startswith("warning: ad1 (autodl ") and "stopped 6.5 days" in out[-1]
    assert "keeps a stopped one 7 days, so its data goes in 0.5 days" in out[-1]
    gpu(shell, "release ad1 --yes")
    assert "ad1 is released" in capsys.readouterr().out and autodl.deployments == {}
