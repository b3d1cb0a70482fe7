"""RunPod, through its REST API v1 (pods) and the v2 catalog (offers).

Written against the OpenAPI documents RunPod publishes in github.com/runpod/docs:
``api-reference/openapi.json`` ("Runpod API" 0.1.0, server ``https://rest.runpod.io/v1``;
the copy at commit 01242f8 of 2026-07-20) for ``/pods``, ``/pods/{podId}``,
``/pods/{podId}/stop|start`` and ``DELETE /pods/{podId}``, and
``api-reference-v2/openapi.json`` ("Runpod REST API" 2.0.0, server ``https://api.runpod.io``,
beta; commit 098c7fb of 2026-08-18) for ``GET /v2/catalog/gpus``, the only list of GPU types
with prices (v1 has none).  Both are vendored under ``tests/providers/``, where the local
test server validates every request and answer against them.

A pod's SSH address is ``publicIp`` and ``portMappings["22"]`` (both empty while it starts);
the public key goes in as the ``PUBLIC_KEY`` environment variable, which RunPod's images read
into ``authorized_keys`` (docs.runpod.io, "Connect to a Pod with SSH").  A stopped pod
(``desiredStatus: EXITED``) keeps its volume, billed at the stopped-volume rate
(:data:`STOPPED_VOLUME_GB_MONTH`); its port is assigned anew at each start.
"""

from __future__ import annotations

from typing import Any

from .base import (InsufficientBalance, Instance, NoOffer, Offer, Provider, RentError, SelfStop, offer_matches)
from .http import Api, NoAnswer

API_VERSION = "RunPod REST API v1 (openapi 0.1.0) + v2 catalog (2.0.0, beta)"
REST_URL = "https://rest.runpod.io/v1"
CATALOG_URL = "https://api.runpod.io"
#: USD per GB and month for the volume of a stopped pod (docs.runpod.io/pods/pricing:
#: "Pod volume ... $0.20/GB/month for stopped Pods").
STOPPED_VOLUME_GB_MONTH = 0.20
HOURS_A_MONTH = 730.0
DEFAULT_IMAGE = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
#: desiredStatus -> our state (a RUNNING pod without an address is still starting).
_STATES = {"RUNNING": "running", "EXITED": "stopped", "TERMINATED": "terminated"}


def _error_text(status: int, body: Any) -> tuple[str, str]:
    """v1 errors: ``{"error": "..."}`` or ``UnauthorizedError`` ``{"message"}``; v2:
    problem+json ``{"title", "status", "detail"}``."""
    if isinstance(body, dict):
        for k in ("detail", "message", "error"):
            if isinstance(body.get(k), str):
                return "", body[k]
    return "", str(body or "")[:300]


class RunPod(Provider):
    name = "runpod"
    can_stop = True
    api_version = API_VERSION
    # docs.runpod.io "Environment variables" (github.com/runpod/docs
    # pods/templates/environment-variables.mdx, commit e979ee42 of 2026-07-20): "RUNPOD_POD_ID:
    # Unique Pod identifier", "RUNPOD_API_KEY: Pod-scoped API key"; "Manage Pods" shows
    # `runpodctl stop pod $RUNPOD_POD_ID` run inside the pod.  RunPod's images export the
    # RUNPOD_ variables for SSH sessions to /etc/rp_environment (serverless/development/
    # dual-mode-worker.mdx shows the start script's `printenv | grep -E '^RUNPOD_' ... >>
    # /etc/rp_environment`).  The stop is REST v1's POST /pods/{podId}/stop with that key.
    instance_key_env = "RUNPOD_API_KEY"
    instance_id_env = "RUNPOD_POD_ID"
    instance_env_files = ("/etc/rp_environment",)

    def __init__(self, key: str, *, base_url: str = REST_URL, catalog_url: str = CATALOG_URL,
                 timeout: float = 30.0, user: str = "root", **api):
        self.api = Api(self.name, base_url, key, timeout=timeout, error_text=_error_text, **api)
        self.catalog_url = catalog_url
        self.user = user

    # -- offers ------------------------------------------------------------------------

    def offers(self, *, gpu=None, vram_gb=None, max_price=None, region=None, interruptible=None) -> list[Offer]:
        body = self.api.request("GET", "/v2/catalog/gpus", base_url=self.catalog_url)
        found = []
        for g in body.get("gpus", []):
            for cloud in ("secure", "community"):
                price = (g.get("price") or {}).get(cloud)
                if not g.get(cloud) or price is None:
                    continue
                o = Offer(self.name, f"{g['id']}/{cloud}", g.get("name") or g["id"], 1, g.get("memory"),
                          float(price), 50 * STOPPED_VOLUME_GB_MONTH / HOURS_A_MONTH, False, cloud)
                if offer_matches(o, gpu=gpu, vram_gb=vram_gb, max_price=max_price, region=region,
                                 interruptible=interruptible):
                    found.append(o)
        return sorted(found, key=lambda o: (o.price_hr, o.gpu))

    # -- one pod -----------------------------------------------------------------------

    def create(self, offer: Offer, *, name: str, public_key: str, disk_gb: int = 50,
               image: str | None = None) -> Instance:
        gpu_id, _, cloud = offer.id.rpartition("/")
        if not gpu_id or cloud not in ("secure", "community"):
            raise NoOffer(f"runpod: {offer.id!r} is not an offer", "pick one from `%gpu offers --provider runpod`")
        body = {"name": name, "imageName": image or DEFAULT_IMAGE, "gpuTypeIds": [gpu_id], "gpuCount": offer.gpus,
                "cloudType": cloud.upper(), "containerDiskInGb": 20, "volumeInGb": disk_gb,
                "volumeMountPath": "/workspace", "ports": ["22/tcp"], "supportPublicIp": True,
                "interruptible": offer.interruptible, "env": {"PUBLIC_KEY": public_key}}
        try:
            pod = self.api.request("POST", "/pods", json=body)
        except NoAnswer:
            return self._adopt(name)
        except RentError as e:
            raise _create_error(e, offer) from None
        return self._instance(pod)

    def _adopt(self, name: str) -> Instance:
        """After a create with no answer: the pod of that name if it was made, else an error
        (nothing is created twice)."""
        from .base import CreateTimeout

        pods = self.api.request("GET", "/pods", params={"name": name})
        mine = [p for p in pods or [] if p.get("name") == name and p.get("desiredStatus") != "TERMINATED"]
        if mine:
            return self._instance(mine[0])
        raise CreateTimeout(f"runpod: the create of {name} got no answer, and no pod of that name exists",
                            "nothing was rented; run `%gpu rent` again")

    def status(self, instance_id: str) -> Instance:
        return self._instance(self.api.request("GET", f"/pods/{instance_id}"))

    def instances(self) -> list[Instance]:
        return [self._instance(p) for p in self.api.request("GET", "/pods") or []
                if p.get("desiredStatus") != "TERMINATED"]

    def stop(self, instance_id: str) -> None:
        self.api.request("POST", f"/pods/{instance_id}/stop")

    def start(self, instance_id: str) -> None:
        try:
            self.api.request("POST", f"/pods/{instance_id}/start")
        except RentError as e:
            raise _create_error(e, None) from None

    def release(self, instance_id: str) -> None:
        self.api.request("DELETE", f"/pods/{instance_id}")

    def self_stop(self, instance_id: str, *, release: bool = False) -> SelfStop:
        """``POST /pods/{podId}/stop`` (or ``DELETE /pods/{podId}``), confirmed by the pod's
        ``desiredStatus``."""
        if release:
            return SelfStop("DELETE", f"/pods/{instance_id}", None, f"/pods/{instance_id}", ("desiredStatus",),
                            ("TERMINATED",), "release")
        return SelfStop("POST", f"/pods/{instance_id}/stop", None, f"/pods/{instance_id}", ("desiredStatus",),
                        ("EXITED", "TERMINATED"))

    def _instance(self, pod: dict) -> Instance:
        raw = pod.get("desiredStatus") or ""
        state = _STATES.get(raw, "pending")
        port = (pod.get("portMappings") or {}).get("22")
        host = pod.get("publicIp") or None
        if state == "running" and not (host and port):
            state = "pending"
        volume = pod.get("volumeInGb") or 0
        gpu = (pod.get("gpu") or {}).get("displayName") or ""
        # the volume's mount (/workspace) is what a stop keeps: docs.runpod.io/pods/storage/types,
        # "Container disk ... Lost on stop/restart", "Volume disk ... Retained until Pod deleted"
        workdir = (pod.get("volumeMountPath") or None) if volume or pod.get("networkVolume") else None
        return Instance(self.name, pod["id"], pod.get("name") or "", state, raw,
                        price_hr=pod.get("costPerHr"),
                        stopped_hr=volume * STOPPED_VOLUME_GB_MONTH / HOURS_A_MONTH,
                        host=host, port=int(port) if port else None, user=self.user, gpu=gpu,
                        workdir=workdir)


def _create_error(e: RentError, offer: Offer | None) -> RentError:
    """A refused create or start, read into the errors the magics explain."""
    text = e.message.lower()
    if "balance" in text or "credit" in text or "insufficient funds" in text:
        return InsufficientBalance(e.message, "add credit in the RunPod console (Billing), then run it again")
    if offer is not None and ("no longer any instances available" in text or "not available" in text):
        return NoOffer(e.message, "that GPU was taken meanwhile; pick another from `%gpu offers --provider runpod`")
    return e
