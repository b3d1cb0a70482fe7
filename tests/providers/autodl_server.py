"""A stand-in for AutoDL's elastic-deployment API (弹性部署API), built from its document.

AutoDL publishes no OpenAPI document, so every request and answer is checked against
``autodl-esd-schema.json``, a JSON schema written by hand from
https://www.autodl.com/docs/esd_api_doc (read 2026-12-07; see the schema's ``$comment`` for
which parts came from where): a path or method it does not have, a field it does not name, a
missing required one or a wrong type is recorded in :attr:`violations` (and answered with an
error), and so is an answer the stand-in shapes wrongly.

Each container is what the document says it is: its ``cmd`` is run, for real, as a process
whose ``HOME`` is the container's home (the container lives as long as that process; one that
ends is ``shutdown``), and a real sandbox sshd answers for it.  The keys the ``cmd`` put in
``~/.ssh/authorized_keys`` are the keys that sshd accepts, so a ``cmd`` that installs no key
gives a container nobody can log in to.

What the document does not say, and the stand-in decides (the tests name it):

* a refused token: HTTP :attr:`auth_status` (401) with ``code`` ``"Unauthorized"`` and the
  message reported from the live API for an expired token (登录超时，请重新登录); with
  ``auth_status = 200`` the same envelope comes with a 200;
* an account without enterprise certification (:attr:`enterprise` false): the deployment
  endpoints answer ``{"code": "BadRequest", "msg": "无当前资源访问权限"}``, as reported from the
  live API; the stock and image endpoints still answer;
* a container is ``creating`` on its first read, ``starting`` until ``boot_reads`` reads, then
  ``running`` with ``info.ssh_command``; its deployment's containers after a delete: none.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import secrets
import subprocess
import time
import uuid
from pathlib import Path

import jsonschema

from gpumagic.ssh.sandbox import _kill, _parent_death_signal, free_port

from platforms import _SPAWNER, _Box
from server import HERE, Reply, SpecServer

SCHEMA = json.loads((HERE / "autodl-esd-schema.json").read_text(encoding="utf-8"))
#: GPU stock per region: model -> [idle, total]; and each model's price, 0.001 CNY per hour.
STOCK = {"westDC2": {"RTX 4090": [3, 40], "A800-80GB": [0, 8]}, "beijingDC1": {"RTX 3090": [5, 20]}}
PRICES = {"RTX 4090": 1980, "RTX 3090": 1320, "A800-80GB": 5880}


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "$defs": SCHEMA["$defs"]})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone(datetime.timedelta(hours=8))).isoformat(timespec="seconds")


class AutoDLServer(SpecServer):
    """``/api/v1/dev/...`` as ``https://api.autodl.com`` answers it (by its document)."""

    def __init__(self, base: Path, *, boot_reads: int = 1, **kw):
        super().__init__([], **kw)
        self.base = Path(base)
        self.boot_reads = boot_reads
        self.auth_status = 401
        self.enterprise = True
        self.stock = {r: {g: list(n) for g, n in models.items()} for r, models in STOCK.items()}
        self.deployments: dict[str, dict] = {}
        self.containers: dict[str, dict] = {}
        self.boxes: dict[str, _Box] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.bodies: list[tuple[str, dict | None]] = []
        self._reads: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._checks = {k: (_validator(v["request"]), _validator(v["data"])) for k, v in SCHEMA["endpoints"].items()}
        self._envelope = _validator(SCHEMA["envelope"])

    # -- the HTTP side -------------------------------------------------------------------

    def _serve(self, h) -> None:
        path = h.path.split("?")[0]
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        key = f"{h.command} {path}"
        with self.lock:
            self.requests.append((h.command, path))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.bodies.append((key, body))
        status, answer = 200, None
        try:
            if key not in self._checks:
                self._violation(f"{key}: not in the document")
                raise Reply(404, {"code": "NotFound", "msg": f"no {key}", "data": None})
            errors = list(self._checks[key][0].iter_errors(body if body is not None else {}))
            if errors:
                self._violation(f"request {key}: " + "; ".join(
                    f"{'/'.join(map(str, e.absolute_path)) or '(body)'}: {e.message}" for e in errors))
                raise Reply(200, {"code": "InvalidParameter", "msg": errors[0].message, "data": None})
            token = h.headers.get("Authorization") or ""
            if token not in self.keys:  # the token alone, no "Bearer"
                raise Reply(self.auth_status, {"code": "Unauthorized", "msg": "登录超时，请重新登录", "data": None})
            if not self.enterprise and "/deployment" in path:
                raise Reply(200, {"code": "BadRequest", "msg": "无当前资源访问权限", "data": None})
            with self.lock:
                data = self.route(h.command, path, {}, body or {}, token)
            status, answer = 200, {"code": "Success", "msg": "", "data": data}
            errors = list(self._checks[key][1].iter_errors(data))
            if errors:
                self._violation(f"answer to {key}: {errors[0].message}")
        except Reply as r:
            status, answer = r.status, r.body
        errors = list(self._envelope.iter_errors(answer))
        if errors:
            self._violation(f"answer to {key}: envelope: {errors[0].message}")
        time.sleep(self.delay.get(key, 0))  # a slow answer ("METHOD path"): done, but late
        data_out = json.dumps(answer).encode()
        self._send(h, status, data_out, {}, "application/json")

    # -- the platform ------------------------------------------------------------------

    def route(self, method, path, query, body, token):
        if path == "/api/v1/dev/machine/region/gpu_stock":
            return [{g: {"idle_gpu_num": n[0], "total_gpu_num": n[1]}}
                    for g, n in self.stock.get(body["region_sign"], {}).items()]
        if path == "/api/v1/dev/image/private/list":
            return {"list": [], "page_index": body["page_index"], "page_size": body["page_size"], "max_page": 1}
        if path == "/api/v1/dev/deployment" and method == "POST":
            return self._create(body)
        if path == "/api/v1/dev/deployment/list":
            return self._page([self._deployment(d) for d in self.deployments.values()], body)
        if path == "/api/v1/dev/deployment/container/list":
            d = self.deployments.get(body["deployment_uuid"])
            found = [self._read(c) for c in self.containers.values()
                     if d is not None and c["deployment_uuid"] == d["uuid"]]
            return self._page(found, body)
        if path == "/api/v1/dev/deployment/container/stop":
            c = self.containers.get(body["deployment_container_uuid"])
            if c is None:
                raise Reply(200, {"code": "NotFound", "msg": "容器不存在", "data": None})
            self._shutdown(c)
            return None
        if path == "/api/v1/dev/deployment/operate":
            d = self._find(body["deployment_uuid"])
            for c in self.containers.values():
                if c["deployment_uuid"] == d["uuid"]:
                    self._shutdown(c)
            d["status"] = "stopped"
            return None
        if path == "/api/v1/dev/deployment" and method == "DELETE":
            d = self._find(body["deployment_uuid"])
            for c in list(self.containers.values()):
                if c["deployment_uuid"] == d["uuid"]:
                    self._shutdown(c)
            del self.deployments[d["uuid"]]
            return None
        raise Reply(404, {"code": "NotFound", "msg": path, "data": None})

    def _find(self, deployment_uuid):
        d = self.deployments.get(deployment_uuid)
        if d is None:
            raise Reply(200, {"code": "NotFound", "msg": "部署不存在", "data": None})
        return d

    @staticmethod
    def _page(items, body):
        size = body["page_size"]
        page = body["page_index"]
        return {"list": items[(page - 1) * size:page * size], "page_index": page, "page_size": size,
                "max_page": max(1, -(-len(items) // size)), "result_total": len(items)}

    def _create(self, body):
        t = body["container_template"]
        duuid = uuid.uuid4().hex[:15]
        self.deployments[duuid] = {"id": next(self._ids), "uuid": duuid, "name": body["name"],
                                   "deployment_type": body["deployment_type"], "status": "running",
                                   "image_uuid": t["image_uuid"], "reuse_container": body.get("reuse_container", False),
                                   "created_at": _now(), "template": t}
        for region in t["dc_list"]:  # placed where a fitting GPU is idle and within the price range
            for gpu in t["gpu_name_set"]:
                n = self.stock.get(region, {}).get(gpu)
                if n and n[0] >= t["gpu_num"] and t["price_from"] <= PRICES[gpu] * t["gpu_num"] <= t["price_to"]:
                    n[0] -= t["gpu_num"]
                    self._place(duuid, region, gpu, t)
                    return {"deployment_uuid": duuid}
        return {"deployment_uuid": duuid}  # nothing fits: no container (AutoDL keeps trying)

    def _place(self, duuid, region, gpu, t):
        cuuid = f"{duuid}-{secrets.token_hex(5)}-{secrets.token_hex(4)}"
        box = _Box(self.base, f"autodl-{cuuid[-8:]}")
        home = self.base / f"autodl-{cuuid[-8:]}" / "home"
        env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        self.procs[cuuid] = _SPAWNER.submit(lambda: subprocess.Popen(
            ["bash", "-c", t["cmd"]], cwd=home, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_parent_death_signal())).result()
        box.start(free_port())
        self.boxes[cuuid] = box
        self.containers[cuuid] = {"id": next(self._ids), "uuid": cuuid, "machine_id": cuuid.split("-")[1],
                                  "deployment_uuid": duuid, "status": "creating", "gpu_name": gpu,
                                  "gpu_num": t["gpu_num"], "cpu_num": 16, "memory_size": 90 * 2**30,
                                  "image_uuid": t["image_uuid"], "price": PRICES[gpu] * t["gpu_num"],
                                  "region": region, "started_at": None, "stopped_at": None, "created_at": _now()}
        self._reads[cuuid] = 0

    def _shutdown(self, c):
        if c["status"] == "shutdown":
            return
        _kill(self.procs.get(c["uuid"]))
        self.boxes[c["uuid"]].stop()
        c["status"], c["stopped_at"] = "shutdown", _now()
        self.stock[c["region"]][c["gpu_name"]][0] += c["gpu_num"]
        d = self.deployments.get(c["deployment_uuid"])
        if d is not None and d["deployment_type"] == "Container":
            d["status"] = "stopped"

    def _read(self, c):
        if c["status"] not in ("shutdown",) and self.procs[c["uuid"]].poll() is not None:
            self._shutdown(c)  # the cmd ended: so did the container
        if c["status"] != "shutdown":
            n = self._reads[c["uuid"]]
            self._reads[c["uuid"]] = n + 1
            if n >= self.boot_reads:
                c["status"], c["started_at"] = "running", c["started_at"] or _now()
            elif n > 0:
                c["status"] = "starting"
        out = {k: v for k, v in c.items() if k != "region"}
        out["info"] = {}
        if c["status"] == "running":
            box = self.boxes[c["uuid"]]
            self._sync_keys(c["uuid"], box)
            out["info"] = {"ssh_command": f"ssh -p {box.server.port} root@{box.server.host}",
                           "root_password": "pw-" + c["uuid"][-8:]}
        return out

    def _sync_keys(self, cuuid, box):
        """What the container's ``cmd`` put in ``~/.ssh/authorized_keys``, accepted by its sshd."""
        home = self.base / f"autodl-{cuuid[-8:]}" / "home"
        for _ in range(50):  # the cmd runs concurrently: give it a moment to have written
            f = home / ".ssh" / "authorized_keys"
            if f.exists() and f.read_text(encoding="utf-8").strip():
                for line in f.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        box.server.authorize(line)
                return
            if self.procs[cuuid].poll() is not None:
                return
            time.sleep(0.02)

    def _deployment(self, d):
        return {k: d[k] for k in ("id", "uuid", "name", "deployment_type", "status", "image_uuid",
                                  "reuse_container", "created_at")}

    def close(self):
        super().close()
        for cuuid, p in self.procs.items():
            _kill(p)
        for b in self.boxes.values():
            b.stop()
