"""AutoDL, through its elastic-deployment API (弹性部署API).

Written against AutoDL's "弹性部署API文档", https://www.autodl.com/docs/esd_api_doc (host
``https://api.autodl.com``), and its English mirror on AutoDL's international brand,
https://docs.gpuhub.com/api-reference/api-elastic-deployment, both read on 2026-12-07 as
stored copies.  AutoDL publishes no OpenAPI document and no version number for it.  The
stored copies are cut after their first sections (authentication, the envelope, the image
list, the create's fields); the later sections (list deployments, list containers, stop a
container, delete a deployment, GPU stock per region, the regions of the appendix) were read
in public references that quote the same page (github.com/cyicz123/autodl-skills
``skills/autodl-elastic-deploy/api-reference.md``, and client code calling ``api.autodl.com``).
``tests/providers/autodl-esd-schema.json`` holds every field gpumagic sends and reads, with
where each came from; the local stand-in refuses any other.

What gpumagic uses, and how it maps the API onto :class:`~.base.Provider`:

* Every request carries ``Authorization: TOKEN`` (the developer token of 控制台 -> 设置 ->
  开发者Token, no ``Bearer``).  Every answer is ``{"code", "msg", "data"}``; ``code`` is
  ``"Success"`` on success, else ``msg`` says why.  The document lists no other codes, no
  HTTP statuses and no rate limit: any other code is an error, and one that reads as a
  refused or expired token (an HTTP 401/403, or 登录/token in ``msg``) is :class:`BadKey`.
  The API needs an **enterprise-certified** account (the page's first line): a personal
  account's token is refused on the deployment endpoints.
* **offers** -- ``POST /api/v1/dev/machine/region/gpu_stock`` with ``region_sign``, once per
  region of the appendix (:data:`REGIONS`); ``data`` is a list of ``{GPU model: {idle_gpu_num,
  total_gpu_num}}``.  An offer is one GPU model with idle GPUs in one region (``RTX
  4090@westDC2``).  The stock gives **no price and no GPU memory**: ``price_hr`` and
  ``vram_gb`` are ``None`` (shown as ``-``), and ``--max-price`` (CNY per hour: AutoDL bills
  in CNY) is sent with the create as ``price_to``, so AutoDL places the container only on a
  machine at or under it.  The price a container got is read from the container list
  (``price``, in 0.001 CNY per hour).
* **create** -- ``POST /api/v1/dev/deployment`` with ``deployment_type: "Container"`` (one
  container, no ``replica_num``) and a ``container_template`` of ``dc_list`` (the offer's
  region), ``gpu_name_set`` (its model), ``gpu_num``, ``cuda_v_from``/``cuda_v_to``, the
  ``cpu_num_*``/``memory_size_*`` ranges (wide: the machine's share of one GPU), ``price_from``
  /``price_to``, ``image_uuid`` (``--image``: an AutoDL image UUID, ``image-...`` from the
  account's saved images or ``base-image-...`` from the appendix; AutoDL imports no outside
  image) and ``cmd``.  A container lives as long as its ``cmd``, so the ``cmd`` installs the
  public key in ``/root/.ssh/authorized_keys`` and then runs ``sleep infinity``.  The answer's
  ``data.deployment_uuid`` is the instance id.  ``reuse_container`` is true, so AutoDL may
  give a new deployment a container this account stopped (with its files) -- the only way back
  to a stopped container's data.
* **status / instances** -- ``POST /api/v1/dev/deployment/container/list`` (by
  ``deployment_uuid``) and ``POST /api/v1/dev/deployment/list``.  A container's ``status`` is
  one of ``creating``, ``created``, ``starting``, ``oss_merged``, ``running``,
  ``shutting_down``, ``shutdown``; its ``info.ssh_command`` (``ssh -p PORT root@HOST``) gives
  the address.  The document gives SSH by password (``info.root_password``): gpumagic never
  reads, keeps or sends it -- the key the ``cmd`` installed is how it logs in.
* **stop** -- ``PUT /api/v1/dev/deployment/container/stop``: the container ends, and with it
  the running charge.  The document names no charge for a stopped container (gpumagic shows
  0), and **no way to start it again**: :meth:`start` refuses, and says to rent anew.
* **release** -- ``PUT /api/v1/dev/deployment/operate`` (``operate: "stop"``), then
  ``DELETE /api/v1/dev/deployment`` (a JSON body on a DELETE, as the document has it).
* **balance** -- not in this document (the wallet is in AutoDL's other API): ``None``.
"""

from __future__ import annotations

import datetime
import re
import shlex
from typing import Any

from .base import BadKey, CreateTimeout, Instance, NoOffer, NotSupported, Offer, Provider, RentError, offer_matches
from .http import Api, NoAnswer

API_VERSION = "AutoDL elastic-deployment API (www.autodl.com/docs/esd_api_doc, read 2026-12-07; no version given)"
BASE_URL = "https://api.autodl.com"
#: The appendix's regions: ``dc_list`` / ``region_sign`` value -> the console's name.
REGIONS = {"westDC2": "西北企业区", "westDC3": "西北B区", "beijingDC1": "北京A区", "beijingDC2": "北京B区",
           "beijingDC4": "L20专区", "beijingDC3": "V100专区", "neimengDC1": "内蒙A区", "neimengDC3": "内蒙B区",
           "foshanDC1": "佛山区", "chongqingDC1": "重庆A区", "yangzhouDC1": "3090专区"}
#: A public base image of the appendix: PyTorch 2.0.0, CUDA 11.8.
DEFAULT_IMAGE = "base-image-l2t43iu6uk"
#: CUDA versions a machine's driver must support (118 = 11.8; higher drivers run lower CUDA).
CUDA_FROM, CUDA_TO = 118, 128
#: The ranges of CPU cores and memory (GB) asked for: wide, as AutoDL gives a container the
#: machine's fixed share per GPU whatever the range (the document's example: 1-100, 1-256).
CPU_RANGE, MEMORY_GB_RANGE = (1, 256), (1, 2048)
#: ``price_to`` when no ``--max-price`` is given, CNY per hour (gpumagic's ceiling, not AutoDL's).
DEFAULT_PRICE_CAP = 50.0
#: Prices in the API are in 0.001 CNY per hour.
PRICE_UNIT = 1000
#: Days AutoDL keeps a stopped container for reuse (its elastic-deployment guide:
#: "复用已停止容器(系统保留最长7天)", as quoted by cyicz123/autodl-skills' SKILL.md).
KEEPS_STOPPED_DAYS = 7.0
_SSH = re.compile(r"-p\s+(\d+)\s+(?:(\S+)@)?(\S+)")
_PAGE = 100


def _error_text(status: int, body: Any) -> tuple[str, str]:
    """The envelope of an HTTP error, where there is one: ``{"code", "msg"}``."""
    if isinstance(body, dict):
        return str(body.get("code") or ""), str(body.get("msg") or "")
    return "", str(body or "")[:300]


def _epoch(stamp: str | None) -> float | None:
    """``2022-12-13T16:43:03+08:00`` -> epoch seconds."""
    if not stamp:
        return None
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def keep_alive_cmd(public_key: str) -> str:
    """The container's ``cmd``: install ``public_key`` for root, then live until stopped.

    Separated by ``;`` only (the document warns that ``&&`` with ``||`` keeps a container from
    ending when it should)."""
    key = public_key.strip()
    if len(key.split()) < 2 or "\n" in key:
        raise RentError("autodl: the public key is not one OpenSSH line (ssh-ed25519 AAAA... comment)",
                        "give -i a key whose .pub file is one line")
    return ("mkdir -p ~/.ssh ; chmod 700 ~/.ssh ; "
            f"echo {shlex.quote(key)} >> ~/.ssh/authorized_keys ; chmod 600 ~/.ssh/authorized_keys ; "
            f"sleep infinity & echo $! > {KEEP_ALIVE_PID} ; wait")


#: Where the ``cmd`` notes the pid of its ``sleep`` (relative to root's home): ending that
#: process ends the ``cmd``, and so the container and its bill (see :attr:`AutoDL.end_inside`).
KEEP_ALIVE_PID = "~/.gpumagic-keep-alive.pid"


class AutoDL(Provider):
    name = "autodl"
    can_stop = True
    can_start = False
    #: The document: "容器生命周期 = cmd 命令执行周期。cmd 结束则容器关机" (a container lives as
    #: long as its cmd; when the cmd ends, the container shuts down).  So the guard ends the bill
    #: from inside, with no key and no request: it ends the ``sleep`` the ``cmd`` waits on.
    end_inside = f"kill $(cat {KEEP_ALIVE_PID})"
    keeps_stopped_days = KEEPS_STOPPED_DAYS
    api_version = API_VERSION

    def __init__(self, key: str, *, base_url: str = BASE_URL, timeout: float = 30.0, user: str | None = None,
                 **api):
        self.api = Api(self.name, base_url, key, timeout=timeout, error_text=_error_text, auth_scheme="", **api)
        self.user = user

    # -- the envelope ------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request; ``data`` of a ``Success`` answer, else the error read from ``msg``."""
        try:
            answer = self.api.request(method, path, json=body)
        except BadKey as e:
            e.hint = _KEY_HINT
            raise
        if isinstance(answer, dict) and answer.get("code") == "Success":
            return answer.get("data")
        code, msg = _error_text(200, answer)
        msg = self.api.redact(msg)
        if "登录" in msg or "token" in msg.lower():
            raise BadKey(f"autodl refused the token ({code}: {msg})", _KEY_HINT)
        if "权限" in msg:
            raise RentError(f"autodl: {path} refused ({code}: {msg})",
                            "the elastic-deployment API needs an enterprise-certified AutoDL account "
                            "(控制台 -> 账号 -> 企业认证), and that account's developer token")
        err = RentError(f"autodl: {method} {path} failed ({code}: {msg})",
                        "see the message; `%gpu rentals` shows what exists now")
        err.code = code  # type: ignore[attr-defined]
        raise err

    def _pages(self, path: str, body: dict) -> list[dict]:
        out: list[dict] = []
        page = 1
        while True:
            data = self._call("POST", path, {**body, "page_index": page, "page_size": _PAGE}) or {}
            out += data.get("list") or []
            if page >= int(data.get("max_page") or 1):
                return out
            page += 1

    # -- offers ------------------------------------------------------------------------

    def offers(self, *, gpu=None, vram_gb=None, max_price=None, region=None, interruptible=None) -> list[Offer]:
        if interruptible:
            return []  # the elastic-deployment API has no interruptible containers
        found = []
        for sign, title in REGIONS.items():
            if region and region.lower() not in f"{sign} {title}".lower():
                continue
            for entry in self._call("POST", "/api/v1/dev/machine/region/gpu_stock", {"region_sign": sign}) or []:
                for model, stock in entry.items():
                    if int(stock.get("idle_gpu_num") or 0) <= 0:
                        continue
                    o = Offer(self.name, f"{model}@{sign}", model, 1, None, None, 0.0, False, sign,
                              currency="CNY", price_cap=max_price)
                    if offer_matches(o, gpu=gpu, vram_gb=vram_gb, max_price=max_price, region=None,
                                     interruptible=None):
                        found.append(o)
        return sorted(found, key=lambda o: (o.gpu, o.region))

    # -- one container -----------------------------------------------------------------

    def create(self, offer: Offer, *, name: str, public_key: str, disk_gb: int = 50,
               image: str | None = None) -> Instance:
        model, _, sign = offer.id.rpartition("@")
        if not model or sign not in REGIONS:
            raise NoOffer(f"autodl: {offer.id!r} is not an offer (GPU@REGION)",
                          "pick one from `%gpu offers --provider autodl`")
        image = image or DEFAULT_IMAGE
        if not image.startswith(("image-", "base-image-")):
            raise RentError(f"autodl: --image {image!r} is not an AutoDL image UUID",
                            "AutoDL runs only its own images: give an image-... UUID of your saved images, "
                            "or a base-image-... of its public ones (or leave --image out)")
        cap = offer.price_cap if offer.price_cap is not None else DEFAULT_PRICE_CAP
        template = {"dc_list": [sign], "gpu_name_set": [model], "gpu_num": offer.gpus,
                    "cuda_v_from": CUDA_FROM, "cuda_v_to": CUDA_TO,
                    "cpu_num_from": CPU_RANGE[0], "cpu_num_to": CPU_RANGE[1],
                    "memory_size_from": MEMORY_GB_RANGE[0], "memory_size_to": MEMORY_GB_RANGE[1],
                    "price_from": 1, "price_to": int(round(cap * PRICE_UNIT)),
                    "image_uuid": image, "cmd": keep_alive_cmd(public_key)}
        body = {"name": name, "deployment_type": "Container", "reuse_container": True,
                "container_template": template}
        try:
            data = self._call("POST", "/api/v1/dev/deployment", body)
        except NoAnswer:
            return self._adopt(name)
        return self.status(str(data["deployment_uuid"]))

    def _adopt(self, name: str) -> Instance:
        """After a create with no answer: the deployment of that name if it was made."""
        mine = [d for d in self._pages("/api/v1/dev/deployment/list", {}) if d.get("name") == name]
        if mine:
            return self.status(str(mine[0]["uuid"]))
        raise CreateTimeout(f"autodl: the create of {name} got no answer, and no deployment of that name exists",
                            "nothing was rented; run `%gpu rent` again")

    def _container(self, deployment_uuid: str) -> dict | None:
        """The deployment's newest container (``None`` before AutoDL has placed one)."""
        found = self._pages("/api/v1/dev/deployment/container/list", {"deployment_uuid": deployment_uuid})
        return max(found, key=lambda c: c.get("created_at") or "") if found else None

    def status(self, instance_id: str) -> Instance:
        return self._instance(instance_id, "", self._container(instance_id))

    def instances(self) -> list[Instance]:
        return [self._instance(str(d["uuid"]), d.get("name") or "", self._container(str(d["uuid"])))
                for d in self._pages("/api/v1/dev/deployment/list", {})]

    def stop(self, instance_id: str) -> None:
        c = self._container(instance_id)
        if c is None:
            raise RentError(f"autodl: deployment {instance_id} has no container yet",
                            "`%gpu release NAME` deletes the deployment")
        self._call("PUT", "/api/v1/dev/deployment/container/stop", {"deployment_container_uuid": c["uuid"]})

    def start(self, instance_id: str) -> None:
        raise NotSupported("autodl cannot start a stopped container (the elastic-deployment API has no start)",
                           "`%gpu release NAME`, then `%gpu rent` a new one; AutoDL may give it this "
                           f"container's files back (reuse_container) for up to {KEEPS_STOPPED_DAYS:g} days")

    def release(self, instance_id: str) -> None:
        self._call("PUT", "/api/v1/dev/deployment/operate", {"deployment_uuid": instance_id, "operate": "stop"})
        self._call("DELETE", "/api/v1/dev/deployment", {"deployment_uuid": instance_id})

    def _instance(self, deployment_uuid: str, name: str, c: dict | None) -> Instance:
        if c is None:
            return Instance(self.name, deployment_uuid, name, "pending", "scheduling", currency="CNY")
        raw = c.get("status") or ""
        info = c.get("info") or {}
        m = _SSH.search(info.get("ssh_command") or "")
        host, port, user = (m.group(3), int(m.group(1)), m.group(2) or "root") if m else (None, None, "root")
        # creating, created, starting, oss_merged, shutting_down: on the way (or a running
        # container whose SSH address is not given yet)
        state = "stopped" if raw == "shutdown" else "running" if raw == "running" and m else "pending"
        price = c.get("price")
        return Instance(self.name, deployment_uuid, name, state, raw,
                        price_hr=price / PRICE_UNIT if price is not None else None, stopped_hr=0.0,
                        host=host if state == "running" else None, port=port if state == "running" else None,
                        user=self.user or user, gpu=c.get("gpu_name") or "", currency="CNY",
                        stopped_at=_epoch(c.get("stopped_at")) if state == "stopped" else None)


_KEY_HINT = ("make a developer token (控制台 -> 设置 -> 开发者Token, on an enterprise-certified account) "
             "and run `%gpu provider login autodl`")
