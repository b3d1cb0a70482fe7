"""vast.ai, through its REST API (``/api/v0``, ``/api/v1/instances``).

Written against vast.ai's OpenAPI document "Vast.ai API" 1.0.0 (OpenAPI 3.1, server
``https://console.vast.ai``) from github.com/vast-ai/docs ``api-reference/openapi.yaml``
(commit e758d35 of 2026-07-22; vast-cli's ``openapi/README.md`` points there), vendored in
``tests/providers/vast-openapi.yaml``, where the local test server validates every request and
answer against it; the calls follow vast-cli's ``vast.py`` (commit 5567983): ``POST
/api/v0/bundles`` to search offers, ``PUT /api/v0/asks/{id}`` to rent one, ``PUT
/api/v0/instances/{id}`` with ``state`` to stop and start, ``DELETE /api/v0/instances/{id}``
to destroy, ``POST /api/v0/ssh`` for the account's key (put on the instances it creates).

vast.ai is a market: an offer can be taken by someone else between the search and the rent
(410, :class:`NoOffer`).  A stopped instance keeps its disk, billed at the offer's
``storage_cost`` (USD per GB and month), and may not get its GPU back when started.  The
account's ``balance`` (``GET /api/v0/users/current``) is checked before a rent.
"""

from __future__ import annotations

import json
from typing import Any

from .base import (CreateTimeout, InsufficientBalance, Instance, NoOffer, Offer, Provider, RentError,
                   SelfStop, offer_matches)
from .http import Api, NoAnswer

API_VERSION = "vast.ai API (openapi 1.0.0, vast-ai/docs e758d35; vast-cli 5567983)"
BASE_URL = "https://console.vast.ai"
DEFAULT_IMAGE = "pytorch/pytorch:2.4.0-cuda12.4-cudnn9-devel"
HOURS_A_MONTH = 730.0


def _error_text(status: int, body: Any) -> tuple[str, str]:
    """``{"success": false, "error": CODE, "msg": TEXT}``, or ``{"detail": TEXT}`` (429)."""
    if isinstance(body, dict):
        text = body.get("msg") or body.get("detail") or body.get("error") or ""
        return str(body.get("error") or ""), str(text)
    return "", str(body or "")[:300]


class Vast(Provider):
    name = "vast"
    can_stop = True
    api_version = API_VERSION
    # docs.vast.ai "Docker Execution Environment" (github.com/vast-ai/docs
    # guides/instances/docker-environment.mdx, commit 1ee047d of 2026-04-28): every instance
    # gets CONTAINER_API_KEY ("per-instance API key for CLI commands from inside the
    # container") and CONTAINER_ID; `vastai stop instance $CONTAINER_ID --api-key
    # $CONTAINER_API_KEY` works from inside; SSH sessions see them where the image exports
    # them to /etc/environment ("handled automatically in the entrypoint of images published
    # by Vast.ai").  api-reference/hello-world.mdx: the key "can only start, stop, or destroy
    # that specific instance" (and read it: `vastai show instance`).
    instance_key_env = "CONTAINER_API_KEY"
    instance_id_env = "CONTAINER_ID"
    instance_env_files = ("/etc/environment",)

    def __init__(self, key: str, *, base_url: str = BASE_URL, timeout: float = 30.0, user: str = "root", **api):
        self.api = Api(self.name, base_url, key, timeout=timeout, error_text=_error_text, **api)
        self.user = user

    def offers(self, *, gpu=None, vram_gb=None, max_price=None, region=None, interruptible=None) -> list[Offer]:
        query: dict = {"limit": 64, "type": "bid" if interruptible else "ondemand", "verified": {"eq": True},
                       "rentable": {"eq": True}, "rented": {"eq": False}}
        if max_price is not None:
            query["dph_total"] = {"lte": max_price}
        found = []
        for o in self.api.request("POST", "/api/v0/bundles", json=query).get("offers", []):
            price = o.get("min_bid") if interruptible else o.get("dph_total")
            if price is None:
                continue
            disk = o.get("storage_cost")
            offer = Offer(self.name, str(o["id"]), o.get("gpu_name", "?"), int(o.get("num_gpus") or 1),
                          round(o["gpu_ram"] / 1024) if o.get("gpu_ram") else None, float(price),
                          50 * disk / HOURS_A_MONTH if disk is not None else None, bool(interruptible),
                          o.get("geolocation") or "")
            if offer_matches(offer, gpu=gpu, vram_gb=vram_gb, max_price=max_price, region=region,
                             interruptible=None):
                found.append(offer)
        return sorted(found, key=lambda o: (o.price_hr, o.gpu))

    def balance(self) -> float | None:
        return self.api.request("GET", "/api/v0/users/current").get("balance")

    def _ensure_key(self, public_key: str) -> None:
        blob = public_key.split()[1] if len(public_key.split()) > 1 else public_key
        if any(blob in (k.get("key") or "") for k in self.api.request("GET", "/api/v0/ssh") or []):
            return
        self.api.request("POST", "/api/v0/ssh", json={"ssh_key": public_key.strip()})

    def create(self, offer: Offer, *, name: str, public_key: str, disk_gb: int = 50,
               image: str | None = None) -> Instance:
        left = self.balance()
        if left is not None and left <= 0:
            raise InsufficientBalance(f"vast: the account's balance is {left:.2f} USD",
                                      "add credit in the vast.ai console (Billing), then run it again")
        self._ensure_key(public_key)
        body: dict = {"image": image or DEFAULT_IMAGE, "label": name, "disk": float(disk_gb), "runtype": "ssh"}
        if offer.interruptible and offer.price_hr is not None:
            body["price"] = round(offer.price_hr, 4)
        try:
            answer = self.api.request("PUT", f"/api/v0/asks/{offer.id}", json=body)
        except NoAnswer:
            return self._adopt(name)
        except RentError as e:
            if getattr(e, "status", None) in (404, 410):
                raise NoOffer(e.message, "someone else rented that offer meanwhile; pick another from "
                                         "`%gpu offers --provider vast`") from None
            raise
        return self.status(str(answer["new_contract"]))

    def _adopt(self, name: str) -> Instance:
        mine = [i for i in self.instances() if i.name == name]
        if mine:
            return mine[0]
        raise CreateTimeout(f"vast: the rent of {name} got no answer, and no instance of that name exists",
                            "nothing was rented; run `%gpu rent` again")

    def status(self, instance_id: str) -> Instance:
        return self._instance(self.api.request("GET", f"/api/v0/instances/{instance_id}")["instances"])

    def instances(self) -> list[Instance]:
        body = self.api.request("GET", "/api/v1/instances", params={"select_filters": json.dumps({})})
        return [self._instance(i) for i in body.get("instances", [])]

    def stop(self, instance_id: str) -> None:
        self.api.request("PUT", f"/api/v0/instances/{instance_id}", json={"state": "stopped"})

    def start(self, instance_id: str) -> None:
        self.api.request("PUT", f"/api/v0/instances/{instance_id}", json={"state": "running"})

    def release(self, instance_id: str) -> None:
        self.api.request("DELETE", f"/api/v0/instances/{instance_id}")

    def self_stop(self, instance_id: str, *, release: bool = False) -> SelfStop:
        """vast-cli's ``stop instance`` (``PUT /api/v0/instances/{id}`` with ``state``) or
        ``destroy instance`` (``DELETE``); confirmed by ``intended_status`` of ``GET``."""
        path = f"/api/v0/instances/{instance_id}"
        if release:
            return SelfStop("DELETE", path, None, path, ("instances", "intended_status"), (), "release")
        return SelfStop("PUT", path, {"state": "stopped"}, path, ("instances", "intended_status"), ("stopped",))

    def _instance(self, i: dict) -> Instance:
        actual, intended = i.get("actual_status") or "", i.get("intended_status") or ""
        if actual == "running" and intended == "running":
            state = "running"
        elif intended == "stopped" and actual in ("exited", "stopped", "offline", ""):
            state = "stopped"
        else:
            state = "pending"
        host, port = i.get("ssh_host") or None, i.get("ssh_port")
        return Instance(self.name, str(i["id"]), i.get("label") or "", state, actual or "scheduling",
                        price_hr=i.get("dph_total"), stopped_hr=i.get("storage_total_cost"),
                        host=host if state == "running" else None, port=int(port) if port and state == "running" else None,
                        user=self.user, gpu=i.get("gpu_name") or "")
