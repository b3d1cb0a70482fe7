"""Opt-in live tests: rent the cheapest offer under a hard price cap on the real platform, run one
cell, release it, and print what it cost.  Skipped unless the platform's key is in the environment:

    GPUMAGIC_LIVE_RUNPOD=...  GPUMAGIC_LIVE_LAMBDA=...  GPUMAGIC_LIVE_VAST=...
    GPUMAGIC_LIVE_AUTODL=...  (a developer token of an enterprise-certified AutoDL account)
    GPUMAGIC_LIVE_MAX_PRICE=0.5   (USD per hour; the default cap)
    GPUMAGIC_LIVE_AUTODL_MAX_PRICE=2.5   (CNY per hour: AutoDL bills in CNY)

They spend real money (minutes at the cap's price at most) and reach the internet: never run in CI.
A real boot takes minutes, past the suite's 60 s budget: run them alone (`-k live -p no:xdist`).
"""

from __future__ import annotations

import os
import time

import pytest

import gpumagic
from gpumagic.keys import keygen
from gpumagic.rent import KeyStore, NoOffer, Renter

PLATFORMS = {"runpod": "GPUMAGIC_LIVE_RUNPOD", "lambda": "GPUMAGIC_LIVE_LAMBDA", "vast": "GPUMAGIC_LIVE_VAST",
             "autodl": "GPUMAGIC_LIVE_AUTODL"}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_live_rent_one_cell_release(platform, tmp_path):
    key = os.environ.get(PLATFORMS[platform])
    if not key:
        pytest.skip(f"set {PLATFORMS[platform]} to rent on {platform} for real")
    cap = (float(os.environ.get("GPUMAGIC_LIVE_AUTODL_MAX_PRICE", "2.5")) if platform == "autodl"
           else float(os.environ.get("GPUMAGIC_LIVE_MAX_PRICE", "0.5")))
    r = Renter(tmp_path / "data", keys=KeyStore(tmp_path / "keys", use_keyring=False), poll_s=10, wait_s=1200)
    r.keys.set(platform, key)
    try:
        offer = r.pick(None, provider=platform, max_price=cap)
    except NoOffer as e:
        pytest.skip(str(e))
    pair = tmp_path / "id_ed25519"
    keygen(pair)
    name = f"gpumagic-live-{int(time.time())}"
    start = time.time()
    inst = r.rent(offer, name=name, public_key=open(str(pair) + ".pub", encoding="utf-8").read().strip(),
                  key_path=str(pair), progress=print)
    try:
        m = gpumagic.connect(f"{inst.user}@{inst.host}:{inst.port}", key=str(pair), name=name, trust_new_host=True)
        try:
            assert m.run("echo live-ok", capture=True).stdout.strip() == "live-ok"
        finally:
            m.close()
    finally:
        r.release(name)
    hours = (time.time() - start) / 3600
    price = inst.price_hr if inst.price_hr is not None else offer.price_hr or cap  # AutoDL: the placed price
    print(f"{platform}: {offer.id} at {price:.3f} {inst.currency}/h for {hours * 60:.1f} min: "
          f"about {price * hours:.3f} {inst.currency}")
