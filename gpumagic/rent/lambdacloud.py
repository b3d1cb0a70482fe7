"""Lambda Cloud (On-Demand), through its Cloud API v1.

Written against Lambda's OpenAPI document "Lambda Cloud API" 1.5.3 (servers
``https://cloud.lambdalabs.com/api/v1``), as mirrored by github.com/konfig-sdks/openapi-examples
``lambda/openapi.yaml`` (commit 2d2b1f3) and vendored in ``tests/providers/lambda-openapi.yaml``,
where the local test server validates every request and answer against it.  The rate limits are
from Lambda's documentation ("Requests to the Cloud API are generally limited to 1 request per
second.  Requests to the /instance-operations/launch endpoint are limited to 1 request every 10
seconds"), kept here on our side (:data:`SPACING`) so a 429 is the exception.

Lambda has no stop: an instance runs until it is terminated (``release``), and its disk goes
with it.  Its SSH address is ``ip`` on port 22 (user ``ubuntu``); the key is one of the
account's SSH keys, named in the launch (added once through ``POST /ssh-keys``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .base import (CreateTimeout, InsufficientBalance, Instance, NoOffer, Offer, Provider, RentError,
                   SelfStop, offer_matches)
from .http import Api, NoAnswer

API_VERSION = "Lambda Cloud API v1 (openapi 1.5.3)"
BASE_URL = "https://cloud.lambdalabs.com/api/v1"
#: Least seconds between requests: 1 for all, 10 between launches (Lambda's docs), and a tenth
#: more: the platform times a request when it arrives, not when it was sent.
SPACING = {"": 1.1, "/instance-operations/launch": 10.5}
_STATES = {"booting": "pending", "active": "running", "unhealthy": "pending",
           "terminating": "terminated", "terminated": "terminated"}
_GB = re.compile(r"\((\d+)\s*GB", re.IGNORECASE)


def _error_text(status: int, body: Any) -> tuple[str, str]:
    """``errorResponseBody``: ``{"error": {"code", "message", "suggestion"}}``."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        e = body["error"]
        text = e.get("message") or ""
        if e.get("suggestion"):
            text += f" ({e['suggestion']})"
        return e.get("code") or "", text
    return "", str(body or "")[:300]


class LambdaCloud(Provider):
    name = "lambda"
    can_stop = False
    api_version = API_VERSION

    def __init__(self, key: str, *, base_url: str = BASE_URL, timeout: float = 30.0, user: str = "ubuntu",
                 ssh_port: int = 22, spacing: dict[str, float] | None = None, **api):
        self.api = Api(self.name, base_url, key, timeout=timeout, error_text=_error_text,
                       spacing=SPACING if spacing is None else spacing, **api)
        self.user = user
        self.ssh_port = ssh_port

    def offers(self, *, gpu=None, vram_gb=None, max_price=None, region=None, interruptible=None) -> list[Offer]:
        data = self.api.request("GET", "/instance-types")["data"]
        found = []
        for name, entry in data.items():
            t = entry["instance_type"]
            m = _GB.search(t.get("gpu_description") or t.get("description") or "")
            for r in entry.get("regions_with_capacity_available", []):
                o = Offer(self.name, f"{name}@{r['name']}", t.get("gpu_description") or name,
                          int(t["specs"]["gpus"]), int(m.group(1)) if m else None,
                          t["price_cents_per_hour"] / 100, None, False, r["name"])
                if offer_matches(o, gpu=gpu, vram_gb=vram_gb, max_price=max_price, region=region,
                                 interruptible=interruptible):
                    found.append(o)
        return sorted(found, key=lambda o: (o.price_hr, o.gpu, o.region))

    def _key_name(self, public_key: str) -> str:
        """The name of ``public_key`` among the account's SSH keys, added if missing."""
        blob = public_key.split()[1] if len(public_key.split()) > 1 else public_key
        for k in self.api.request("GET", "/ssh-keys")["data"]:
            if blob in k.get("public_key", ""):
                return k["name"]
        name = "gpumagic-" + hashlib.sha256(blob.encode()).hexdigest()[:12]
        self.api.request("POST", "/ssh-keys", json={"name": name, "public_key": public_key.strip()})
        return name

    def create(self, offer: Offer, *, name: str, public_key: str, disk_gb: int = 50,
               image: str | None = None) -> Instance:
        type_name, _, region = offer.id.partition("@")
        if not region:
            raise NoOffer(f"lambda: {offer.id!r} is not an offer (TYPE@REGION)",
                          "pick one from `%gpu offers --provider lambda`")
        key = self._key_name(public_key)
        body = {"region_name": region, "instance_type_name": type_name, "ssh_key_names": [key],
                "quantity": 1, "name": name}
        try:
            ids = self.api.request("POST", "/instance-operations/launch", json=body)["data"]["instance_ids"]
        except NoAnswer:
            return self._adopt(name)
        except RentError as e:
            code = getattr(e, "code", "")
            if code == "instance-operations/launch/insufficient-capacity":
                raise NoOffer(e.message, "that offer was taken meanwhile; pick another from "
                                         "`%gpu offers --provider lambda`") from None
            if code in ("global/account-inactive", "global/quota-exceeded"):
                raise InsufficientBalance(e.message, "check the account's payment method and quota in the "
                                                     "Lambda console, then run it again") from None
            raise
        if not ids:
            raise NoOffer(f"lambda: no {type_name} was launched in {region}", "pick another offer")
        return self.status(ids[0])

    def _adopt(self, name: str) -> Instance:
        mine = [i for i in self.instances() if i.name == name]
        if mine:
            return mine[0]
        raise CreateTimeout(f"lambda: the launch of {name} got no answer, and no instance of that name exists",
                            "nothing was rented; run `%gpu rent` again")

    def status(self, instance_id: str) -> Instance:
        return self._instance(self.api.request("GET", f"/instances/{instance_id}")["data"])

    def instances(self) -> list[Instance]:
        return [self._instance(i) for i in self.api.request("GET", "/instances")["data"]
                if i.get("status") != "terminated"]

    def release(self, instance_id: str) -> None:
        self.api.request("POST", "/instance-operations/terminate", json={"instance_ids": [instance_id]})

    def self_stop(self, instance_id: str, *, release: bool = False) -> SelfStop:
        """Lambda has no stop, and puts no key on its machines (its Cloud API documentation
        names none): only a terminate, sent with the user's own key where they agreed to
        place it there; confirmed by ``status`` (``terminating``, ``terminated``)."""
        if not release:
            return super().self_stop(instance_id, release=release)
        return SelfStop("POST", "/instance-operations/terminate", {"instance_ids": [instance_id]},
                        f"/instances/{instance_id}", ("data", "status"), ("terminating", "terminated"), "release",
                        spacing_s=SPACING[""])

    def _instance(self, i: dict) -> Instance:
        state = _STATES.get(i.get("status", ""), "pending")
        t = i.get("instance_type") or {}
        price = t.get("price_cents_per_hour")
        return Instance(self.name, i["id"], i.get("name") or "", state, i.get("status", ""),
                        price_hr=price / 100 if price is not None else None, stopped_hr=None,
                        host=i.get("ip") or None, port=self.ssh_port, user=self.user,
                        gpu=t.get("gpu_description") or "")
