"""Stand-ins for RunPod and Lambda Cloud built on :class:`server.SpecServer`.

RunPod: ``/v1/...`` validated against ``runpod-openapi.json`` (REST v1, server
``https://rest.runpod.io/v1``), ``/v2/catalog/gpus`` against ``runpod-v2-openapi.json``.
Lambda: ``/api/v1/...`` against ``lambda-openapi.yaml`` (1.5.3), with the limits of Lambda's
documentation (1 request/s, 1 launch per 10 s) unless a test sets others.

Each created instance starts a real sshd (``SshServer``) that accepts the public key the
request carried (RunPod: ``env.PUBLIC_KEY``; Lambda: the named SSH key), after ``boot_reads``
reads of its state.  A RunPod stop stops the sshd; a start starts it on a new port.  A pod's
volume is its sshd's home folder: ``volumeMountPath`` reads that folder, not the ``/workspace``
the create asked for (a folder at the root of this computer's file system needs root).
"""

from __future__ import annotations

import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpumagic.ssh.sandbox import SshServer, free_port

from server import Reply, SpecServer, load_spec

GPUS = [  # the v2 catalog's GpuType, as its example
    {"id": "NVIDIA GeForce RTX 4090", "name": "RTX 4090", "pool": "ADA_24", "manufacturer": "NVIDIA", "memory": 24,
     "secure": True, "community": True, "price": {"secure": 0.69, "community": 0.34},
     "maxCount": {"secure": 8, "community": 4}},
    {"id": "NVIDIA H100 80GB HBM3", "name": "H100 SXM", "pool": "HOPPER_80", "manufacturer": "NVIDIA", "memory": 80,
     "secure": True, "community": False, "price": {"secure": 2.99, "community": 0},
     "maxCount": {"secure": 8, "community": 0}},
]


#: sshd is started with a parent-death signal, which Linux sends when the *thread* that started
#: it ends: the HTTP server's request threads are short, so every sshd starts on this one.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stand-in-sshd")


class _Box:
    """One instance's sshd, with a GPU (the replaying nvidia-smi, idle) and the variables the
    platform injects into its instances (``env``).  A platform puts them in the container's
    environment and its images export them to SSH sessions (vast.ai: /etc/environment; RunPod:
    /etc/rp_environment); here sshd's ``SetEnv`` puts them in every session's environment."""

    def __init__(self, base: Path, name: str, host: str = "127.0.0.1", port: int = 0, env: dict | None = None):
        self.home = base / name / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.server = SshServer(base / name, env={"HOME": str(self.home), **(env or {})}, alias=name,
                                fake_gpu="h200-idle")
        self.server.host = host
        self.server.port = port

    def start(self, port: int = 0):
        self.server.port = port or self.server.port
        return _SPAWNER.submit(self.server.start).result()

    def stop(self):
        self.server.stop()


class _InstanceKeys:
    """A key per instance that the stand-in injects into it, good for that instance's own
    requests only (vast.ai's CONTAINER_API_KEY, RunPod's pod-scoped RUNPOD_API_KEY), and a count
    of the stops and releases each instance was sent, with which kind of key."""

    def _init_instance_keys(self):
        self.instance_keys: dict[str, str] = {}   # key -> instance id
        self.stops: list[tuple[str, str, str]] = []  # (instance id, "stop"|"release", "instance"|"account")

    def _new_instance_key(self, iid) -> str:
        key = f"inst-{uuid.uuid4().hex}"
        self.instance_keys[key] = str(iid)
        return key

    def _own(self, token, path, prefix) -> bool:
        iid = self.instance_keys.get(token)
        return iid is not None and (path == f"{prefix}{iid}" or path.startswith(f"{prefix}{iid}/"))

    def _count(self, iid, action, token) -> None:
        self.stops.append((str(iid), action, "instance" if token in self.instance_keys else "account"))


class RunPodServer(_InstanceKeys, SpecServer):
    allowed_undocumented = (401, 429)  # v1 lists 401 only for stop/start/delete; 429 nowhere

    def __init__(self, base: Path, *, boot_reads: int = 1, **kw):
        v1, v2 = load_spec("runpod-openapi.json"), load_spec("runpod-v2-openapi.json")
        super().__init__([("/v1", "https://rest.runpod.io", "/v1", v1), ("/v2", "https://api.runpod.io", "/v2", v2)],
                         **kw)
        self.base = Path(base)
        self.boot_reads = boot_reads
        self.pods: dict[str, dict] = {}
        self.boxes: dict[str, _Box] = {}
        self._reads: dict[str, int] = {}
        self.balance_left = True
        self.gpus = [dict(g) for g in GPUS]
        self._init_instance_keys()

    def authorized(self, token, method, path):
        return token in self.keys or self._own(token, path, "/pods/")

    @property
    def rest_url(self) -> str:
        return self.url + "/v1"

    def unauthorized(self, token: str) -> Reply:
        return Reply(401, {"message": f"invalid api key: {token}"})  # echoes the key: gpumagic must redact it

    def rate_limited(self) -> Reply:
        return Reply(429, {"title": "Too Many Requests", "status": 429, "detail": "rate limit exceeded"},
                     {"Retry-After": str(self.retry_after)}, "application/problem+json")

    def bad_request(self, text):
        return {"error": text}

    def route(self, method, path, query, body, token):
        if path == "/catalog/gpus" and method == "GET":
            return 200, {"gpus": self.gpus}
        if path == "/pods" and method == "POST":
            return self._create(body)
        if path == "/pods" and method == "GET":
            pods = [self._read(p) for p in self.pods.values()]
            if "name" in query:
                pods = [p for p in pods if p["name"] == query["name"]]
            return 200, pods
        parts = path.strip("/").split("/")
        if parts[0] == "pods" and len(parts) >= 2:
            pod = self.pods.get(parts[1])
            if pod is None or pod["desiredStatus"] == "TERMINATED":
                raise Reply(404 if method == "GET" else 400, None)
            if len(parts) == 2 and method == "GET":
                return 200, self._read(pod)
            if len(parts) == 2 and method == "DELETE":
                self._count(pod["id"], "release", token)
                pod["desiredStatus"] = "TERMINATED"
                self.boxes[pod["id"]].stop()
                return 204, None
            if parts[2:] == ["stop"]:
                self._count(pod["id"], "stop", token)
                pod["desiredStatus"] = "EXITED"
                pod["publicIp"], pod["portMappings"] = None, None
                self.boxes[pod["id"]].stop()
                return 200, None
            if parts[2:] == ["start"]:
                if not self.balance_left:
                    raise Reply(400, None)
                pod["desiredStatus"] = "RUNNING"
                self._reads[pod["id"]] = 0
                self.boxes[pod["id"]].server.port = 0  # a new port, as after every start
                self.boxes[pod["id"]].start(free_port())
                return 200, None
        raise Reply(404, None)

    def _create(self, body):
        if not self.balance_left:
            raise Reply(400, {"error": "create pod: insufficient balance to rent this pod"})
        gpu = next((g for g in self.gpus if g["id"] in body.get("gpuTypeIds", [])), None)
        if gpu is None:
            raise Reply(400, {"error": "create pod: There are no longer any instances available with the "
                                       "requested specifications."})
        pid = uuid.uuid4().hex[:14]
        cloud = body.get("cloudType", "SECURE").lower()
        box = _Box(self.base, f"pod-{pid}", env={"RUNPOD_POD_ID": pid, "RUNPOD_API_KEY": self._new_instance_key(pid)})
        box.server.authorize(body["env"]["PUBLIC_KEY"])
        box.start(free_port())
        self.boxes[pid] = box
        pod = {"id": pid, "name": body.get("name", ""), "desiredStatus": "RUNNING", "image": body.get("imageName"),
               "costPerHr": gpu["price"][cloud] * body.get("gpuCount", 1), "volumeInGb": body.get("volumeInGb", 20),
               "containerDiskInGb": body.get("containerDiskInGb", 50), "interruptible": body.get("interruptible", False),
               "gpu": {"id": gpu["id"], "count": body.get("gpuCount", 1), "displayName": gpu["name"]},
               "publicIp": None, "portMappings": None, "env": body.get("env", {}), "ports": body.get("ports", [])}
        if body.get("volumeMountPath"):
            pod["volumeMountPath"] = str(box.home)
        self.pods[pid] = pod
        self._reads[pid] = 0
        return 201, self._read(pod, count=False)

    def _read(self, pod, count=True):
        out = dict(pod)
        out["env"] = {k: v for k, v in pod["env"].items()}
        if pod["desiredStatus"] == "RUNNING":
            n = self._reads.get(pod["id"], 0)
            if n >= self.boot_reads:
                s = self.boxes[pod["id"]].server
                out["publicIp"], out["portMappings"] = s.host, {"22": s.port}
            if count:
                self._reads[pod["id"]] = n + 1
        return out

    def close(self):
        super().close()
        for b in self.boxes.values():
            b.stop()


class LambdaServer(_InstanceKeys, SpecServer):
    """Lambda injects no key into its instances: only account keys are accepted."""

    def __init__(self, base: Path, *, boot_reads: int = 1, limits=None, **kw):
        super().__init__([("/api/v1", "https://cloud.lambdalabs.com", "/api/v1", load_spec("lambda-openapi.yaml"))],
                         limits={"": 1.0, "/instance-operations/launch": 10.0} if limits is None else limits, **kw)
        self.base = Path(base)
        self.boot_reads = boot_reads
        self.ssh_port = free_port()  # every instance listens here, each on its own loopback address
        self._ips = (f"127.0.0.{n}" for n in itertools.count(2))
        self.keys_stored: list[dict] = []
        self.instances: dict[str, dict] = {}
        self.boxes: dict[str, _Box] = {}
        self._reads: dict[str, int] = {}
        self._init_instance_keys()
        self.capacity = {"gpu_1x_a10": ["us-east-1"], "gpu_1x_h100_pcie": ["us-west-1"], "gpu_8x_a100": []}
        self.account_active = True

    @property
    def api_url(self) -> str:
        return self.url + "/api/v1"

    def _err(self, status, code, message, suggestion=None):
        e = {"code": code, "message": message}
        if suggestion:
            e["suggestion"] = suggestion
        return Reply(status, {"error": e})

    def unauthorized(self, token):
        return self._err(401, "global/invalid-api-key", f"API key {token} is invalid, expired, or deleted.",
                         "Create a new API key and try again.")

    def rate_limited(self):
        return Reply(429, {"error": {"code": "global/unknown", "message": "Too many requests"}},
                     {"Retry-After": str(self.retry_after)})

    def bad_request(self, text):
        return {"error": {"code": "global/invalid-parameters", "message": text}}

    TYPES = {"gpu_1x_a10": ("1x A10 (24 GB PCIe)", "A10 (24 GB PCIe)", 75, 1),
             "gpu_1x_h100_pcie": ("1x H100 (80 GB PCIe)", "H100 (80 GB PCIe)", 249, 1),
             "gpu_8x_a100": ("8x A100 (40 GB SXM4)", "A100 (40 GB SXM4)", 1032, 8)}
    REGIONS = {"us-east-1": "Virginia, USA", "us-west-1": "California, USA"}

    def _type(self, name):
        desc, gpu, cents, n = self.TYPES[name]
        return {"name": name, "description": desc, "gpu_description": gpu, "price_cents_per_hour": cents,
                "specs": {"vcpus": 30 * n, "memory_gib": 200 * n, "storage_gib": 1400 * n, "gpus": n}}

    def route(self, method, path, query, body, token):
        if path == "/instance-types":
            return 200, {"data": {n: {"instance_type": self._type(n),
                                      "regions_with_capacity_available": [
                                          {"name": r, "description": self.REGIONS[r]} for r in self.capacity[n]]}
                                  for n in self.TYPES}}
        if path == "/ssh-keys" and method == "GET":
            return 200, {"data": self.keys_stored}
        if path == "/ssh-keys" and method == "POST":
            k = {"id": uuid.uuid4().hex, "name": body["name"], "public_key": body["public_key"]}
            self.keys_stored.append(k)
            return 200, {"data": k}
        if path == "/instances":
            return 200, {"data": [self._read(i) for i in self.instances.values() if i["status"] != "terminated"]}
        if path.startswith("/instances/"):
            i = self.instances.get(path.rsplit("/", 1)[1])
            if i is None:
                raise self._err(404, "global/object-does-not-exist", "Instance not found")
            return 200, {"data": self._read(i)}
        if path == "/instance-operations/launch":
            return self._launch(body)
        if path == "/instance-operations/terminate":
            done = []
            for iid in body["instance_ids"]:
                i = self.instances.get(iid)
                if i is None:
                    raise self._err(404, "global/object-does-not-exist", f"Instance {iid} not found")
                self._count(iid, "release", token)
                i["status"] = "terminated"
                self.boxes[iid].stop()
                done.append(self._read(i))
            return 200, {"data": {"terminated_instances": done}}
        raise Reply(404, {"error": {"code": "global/object-does-not-exist", "message": "no such path"}})

    def _launch(self, body):
        if not self.account_active:
            raise self._err(403, "global/account-inactive", "Your account is inactive.",
                            "Add a payment method.")
        t, region = body["instance_type_name"], body["region_name"]
        if region not in self.capacity.get(t, []):
            raise self._err(400, "instance-operations/launch/insufficient-capacity",
                            "Not enough capacity to fulfill launch request.")
        keys = [k for k in self.keys_stored if k["name"] in body["ssh_key_names"]]
        if len(keys) != len(body["ssh_key_names"]):
            raise self._err(400, "global/invalid-parameters", "Unknown SSH key name")
        iid = uuid.uuid4().hex
        box = _Box(self.base, f"lambda-{iid[:8]}", host=next(self._ips), port=self.ssh_port)
        for k in keys:
            box.server.authorize(k["public_key"])
        box.start()
        self.boxes[iid] = box
        self.instances[iid] = {"id": iid, "name": body.get("name"), "status": "booting",
                               "ssh_key_names": body["ssh_key_names"], "file_system_names": [],
                               "region": {"name": region, "description": self.REGIONS[region]},
                               "instance_type": self._type(t), "ip": None, "hostname": None}
        self._reads[iid] = 0
        return 200, {"data": {"instance_ids": [iid]}}

    def _read(self, i):
        out = dict(i)
        if i["status"] == "booting":
            n = self._reads[i["id"]]
            self._reads[i["id"]] = n + 1
            if n >= self.boot_reads:
                i["status"] = out["status"] = "active"
        if out["status"] == "active":
            out["ip"] = self.boxes[i["id"]].server.host
        return out

    def close(self):
        super().close()
        for b in self.boxes.values():
            b.stop()


class VastServer(_InstanceKeys, SpecServer):
    """vast.ai: ``/api/...`` validated against ``vast-openapi.yaml`` (server ``https://console.vast.ai``).

    An instance is ``scheduling`` (``actual_status`` null) for ``boot_reads`` reads, then
    ``running`` with ``ssh_host``/``ssh_port``; a stop stops its sshd, a start gives a new port."""

    def __init__(self, base: Path, *, boot_reads: int = 1, **kw):
        super().__init__([("/api", "https://console.vast.ai", "/api", load_spec("vast-openapi.yaml"))], **kw)
        self.base = Path(base)
        self.boot_reads = boot_reads
        self.balance = 12.5
        self.ssh_keys: list[dict] = []
        self.offers = [
            {"id": 4101, "gpu_name": "RTX 4090", "num_gpus": 1, "gpu_ram": 24564, "dph_total": 0.402, "min_bid": 0.21,
             "storage_cost": 0.15, "geolocation": "Sweden, SE", "verified": True, "rentable": True},
            {"id": 4102, "gpu_name": "RTX 3090", "num_gpus": 1, "gpu_ram": 24576, "dph_total": 0.221, "min_bid": 0.12,
             "storage_cost": 0.10, "geolocation": "Texas, US", "verified": True, "rentable": True},
        ]
        self.instances: dict[int, dict] = {}
        self.boxes: dict[int, _Box] = {}
        self._reads: dict[int, int] = {}
        self._ids = itertools.count(91001)
        self._init_instance_keys()

    def authorized(self, token, method, path):
        return token in self.keys or self._own(token, path, "/v0/instances/")

    def unauthorized(self, token):
        return Reply(401, {"success": False, "error": "invalid_api_key", "msg": f"Invalid api key {token}"})

    def rate_limited(self):
        return Reply(429, {"detail": "API requests too frequent"}, {"Retry-After": str(self.retry_after)})

    def bad_request(self, text):
        return {"success": False, "error": "invalid_args", "msg": text}

    def route(self, method, path, query, body, token):
        if path == "/v0/bundles":
            offers = [o for o in self.offers if o["rentable"]]
            if "dph_total" in body:
                offers = [o for o in offers if o["dph_total"] <= body["dph_total"]["lte"]]
            return 200, {"offers": offers}
        if path == "/v0/users/current":
            return 200, {"id": 7, "email": "student@example.com", "balance": self.balance}
        if path == "/v0/ssh" and method == "GET":
            return 200, [{"id": k["id"], "user_id": 7, "key": k["key"]} for k in self.ssh_keys]
        if path == "/v0/ssh" and method == "POST":
            k = {"id": len(self.ssh_keys) + 1, "key": body["ssh_key"]}
            self.ssh_keys.append(k)
            return 200, {"success": True, "key": {"id": k["id"], "user_id": 7, "public_key": k["key"]}}
        if path.startswith("/v0/asks/"):
            return self._rent(int(path.rsplit("/", 1)[1]), body)
        if path == "/v1/instances":
            return 200, {"success": True, "instances_found": len(self.instances),
                         "instances": [self._read(i) for i in self.instances.values()]}
        if path.startswith("/v0/instances/"):
            iid = int(path.rsplit("/", 1)[1])
            inst = self.instances.get(iid)
            if inst is None:
                raise Reply(404 if method != "GET" else 400, {"success": False, "error": "no_such_instance",
                                                               "msg": f"instance {iid} not found"})
            if method == "GET":
                return 200, {"instances": self._read(inst)}
            if method == "DELETE":
                self._count(iid, "release", token)
                del self.instances[iid]
                self.boxes[iid].stop()
                return 200, {"success": True}
            if body.get("state") == "stopped":
                self._count(iid, "stop", token)
                inst["intended_status"], inst["actual_status"] = "stopped", "exited"
                self.boxes[iid].stop()
            elif body.get("state") == "running":
                inst["intended_status"], inst["actual_status"] = "running", None
                self._reads[iid] = 0
                self.boxes[iid].server.port = 0
                self.boxes[iid].start(free_port())
            return 200, {"success": True}
        raise Reply(404, None)

    def _rent(self, ask, body):
        offer = next((o for o in self.offers if o["id"] == ask), None)
        if offer is None or not offer["rentable"]:
            raise Reply(410, {"success": False, "error": "no_such_ask", "msg": f"ask {ask} is no longer available",
                              "ask_id": ask})
        iid = next(self._ids)
        box = _Box(self.base, f"vast-{iid}", env={"CONTAINER_ID": str(iid), "CONTAINER_API_KEY": self._new_instance_key(iid)})
        for k in self.ssh_keys:
            box.server.authorize(k["key"])
        box.start(free_port())
        self.boxes[iid] = box
        offer["rentable"] = False
        self.instances[iid] = {"id": iid, "label": body.get("label"), "actual_status": None,
                               "intended_status": "running", "gpu_name": offer["gpu_name"],
                               "dph_total": offer["dph_total"], "num_gpus": offer["num_gpus"],
                               "storage_total_cost": round(offer["storage_cost"] * body.get("disk", 10) / 730, 5),
                               "image_uuid": body["image"]}
        self._reads[iid] = 0
        return 200, {"success": True, "new_contract": iid}

    def _read(self, inst):
        out = dict(inst)
        if inst["intended_status"] == "running" and inst["actual_status"] is None:
            n = self._reads[inst["id"]]
            self._reads[inst["id"]] = n + 1
            if n >= self.boot_reads:
                inst["actual_status"] = out["actual_status"] = "running"
        if out["actual_status"] == "running":
            s = self.boxes[inst["id"]].server
            out["ssh_host"], out["ssh_port"] = s.host, s.port
        return out

    def close(self):
        super().close()
        for b in self.boxes.values():
            b.stop()
