"""``%gpu budget``: price arithmetic, alerts, the ledger, and the remote guard.

The guard cases (4, 5) run on servers of their own with a stand-in ``shutdown`` that records
its calls; they are armed together at the start of the module and checked at its end, so
their real waiting (2 min for "idle 2 min") overlaps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpumagic
from gpumagic import budget
from gpumagic.budget import GuardSettings, Ledger, Prices
from gpumagic.errors import GpumagicError

from conftest import add_client_entry, make_server

RECORDINGS = Path(gpumagic.__file__).parent / "fake" / "recordings"
ROOT = Path(__file__).resolve().parents[1]


# -- case 1: billing granularity ---------------------------------------------------------


def test_hourly_billing_61_minutes_costs_two_started_hours_and_next_hour_in_59_min():
    p = Prices(rate=12, billing="hour")
    assert budget.spent(p, 61 * 60) == 24
    assert budget.next_boundary_in(61 * 60, "hour") == 59 * 60


def test_per_second_billing_61_minutes_at_12_per_hour_costs_12_2():
    p = Prices(rate=12, billing="second")
    assert budget.spent(p, 61 * 60) == pytest.approx(12.2, abs=1e-9)


def test_meter_reading_for_case_1_shows_spent_and_next_boundary():
    now = 1_800_000_000.0
    r = budget.meter("m", Prices(rate=12, billing="hour"), now - 61 * 60, now, limit=50)
    assert r.spent == 24 and r.next_boundary_s == 59 * 60
    # 50 allows 4 started hours: stop by 4 h after the start, 2 h 59 min from now
    assert r.limit_in_s == 4 * 3600 - 61 * 60
    from gpumagic import display

    text = display.meter_text(r)
    assert "24.00" in text and "stopping now costs the same as stopping in 59 min" in text


# -- case 2: storage in the hourly rate ---------------------------------------------------


def test_storage_100_gb_at_0_3_per_gb_month_adds_0_0417_per_hour():
    p = Prices(rate=3, storage_gb=100, storage_rate=0.3, storage_per="month")
    assert round(p.per_hour()["storage"], 4) == 0.0417
    assert round(p.hourly, 4) == 3.0417


# -- case 3: alerts -----------------------------------------------------------------------


def test_alerts_10_and_20_crossed_by_a_rising_meter_fire_exactly_twice_in_order():
    alerted: list[float] = []
    shown = []
    for spent_now in [0.5, 5, 9.99, 10.0, 12, 19.5, 20.01, 25, 30]:
        new = budget.new_alerts([10, 20], alerted, spent_now)
        shown += new
        alerted += new
    assert shown == [10.0, 20.0]


def test_alerts_through_the_ledger_fire_once_per_threshold(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    t0 = 1_800_000_000.0
    budget.set_prices(ledger, "m", Prices(rate=6, billing="second"), alerts=[10, 20], started_at=t0)
    with ledger.update() as data:
        budget.record_session(data["machines"]["m"], t0, t0, Prices(rate=6))
    fired = []
    for minutes in (30, 90, 110, 150, 210, 300):  # 3, 9, 11, 15, 21, 30 spent
        _, new = budget.check_alerts(ledger, "m", now=t0 + minutes * 60)
        fired += new
    assert fired == [10.0, 20.0]


# -- other arithmetic ---------------------------------------------------------------------


def test_limit_deadline_per_second_and_hourly():
    assert budget.limit_deadline(Prices(rate=60), 11) == 11 * 60
    # hourly at 12: 24 after 2 started hours, 36 after 3; a limit of 30 allows stopping by 2 h
    assert budget.limit_deadline(Prices(rate=12, billing="hour"), 30) == 7200
    assert budget.limit_deadline(Prices(rate=0), 10) is None


def test_guard_acts_a_minute_before_an_hour_boundary_at_the_limit():
    assert budget.guard_limit_in(Prices(rate=12, billing="hour"), 30, 600) == 7200 - 60 - 600


def test_estimate_on_demand_spot_and_buying():
    rows = {r.label: r for r in budget.estimate(200, 2.5, spot_rate=1.0, card_price=2000,
                                                power_w=350, kwh_price=0.2, resale=800)}
    assert rows["on-demand"].cost == 500
    assert rows["spot / preemptible"].cost == 200
    assert rows["buy the card"].cost == pytest.approx(2000 - 800 + 0.35 * 200 * 0.2)
    assert "494 GPU hours" in rows["break-even"].note  # 1200 / (2.5 - 0.07)


def test_durations_and_times_parse_or_say_what_to_write():
    assert budget.parse_duration("1h30m") == 5400
    assert budget.parse_duration("2m") == 120
    with pytest.raises(ValueError, match="30m, 2h"):
        budget.parse_duration("30 minutes")
    now = 1_800_000_000.0
    assert budget.parse_time("-61m", now, future=False) == now - 3660
    assert budget.parse_time("+2h", now, future=True) == now + 7200
    assert budget.parse_time("2027-01-01T00:00+00:00", now, future=True) == 1798761600


def test_history_spreads_a_session_over_the_days_it_covers(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    import datetime as dt

    midnight = dt.datetime(2027, 1, 2).astimezone().timestamp()
    budget.set_prices(ledger, "m", Prices(rate=10, currency="CNY"))
    with ledger.update() as data:
        s = budget.record_session(data["machines"]["m"], midnight - 3600, midnight - 3600, Prices(rate=10, currency="CNY"))
        s["last_seen"] = midnight + 2 * 3600
    rows = budget.history(ledger.read(), midnight + 5 * 3600)
    assert [(r[1], round(r[2], 6), r[3]) for r in rows] == [("2027-01-01", 10, "CNY"), ("2027-01-02", 20, "CNY")]


def test_platform_presets_name_billing_disk_and_how_to_stop_but_no_prices():
    presets = budget.platforms()
    assert {"generic", "autodl", "vastai", "runpod", "lambda"} <= set(presets)
    for name, p in presets.items():
        assert p["billing"] in budget.BILLING_UNITS, name
        assert p["stop"] and "data_disk" in p, name
        assert not any("price" in k or "rate" in k for k in p), name
    with pytest.raises(GpumagicError, match="no platform preset"):
        budget.platform("nosuchcloud")


# -- case 6: the ledger -------------------------------------------------------------------


def test_truncated_ledger_is_reported_moved_aside_kept_and_a_new_one_started(tmp_path):
    path = tmp_path / "ledger.json"
    good = Ledger(path)
    budget.set_prices(good, "m", Prices(rate=12, currency="CNY"), limit=50)
    full = path.read_bytes()
    truncated = full[: len(full) // 2]  # what a crash in the middle of a plain write leaves
    path.write_bytes(truncated)

    ledger = Ledger(path)
    data = ledger.read()
    assert data["machines"] == {}
    assert len(ledger.notes) == 1 and "could not be read" in ledger.notes[0]
    kept = list(tmp_path.glob("ledger.json.corrupt-*"))
    assert len(kept) == 1 and str(kept[0]) in ledger.notes[0]
    assert kept[0].read_bytes() == truncated
    budget.set_prices(ledger, "m2", Prices(rate=3))
    assert set(json.loads(path.read_text())["machines"]) == {"m2"}
    assert kept[0].read_bytes() == truncated  # never overwritten


def test_ledger_written_by_a_newer_gpumagic_is_left_alone(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"format": "gpumagic-ledger", "version": 99, "machines": {}}))
    with pytest.raises(GpumagicError, match="newer gpumagic"):
        Ledger(path).read()
    assert list(tmp_path.iterdir()) == [path]


def test_ledger_path_follows_GPUMAGIC_DATA_DIR(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "d"))
    assert Ledger().path == tmp_path / "d" / "ledger.json"
