"""`LocalCloud`: the whole emulator in one object, for tests (context manager) and for the daemon.

    with LocalCloud(speed=1000) as cloud:
        tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                               client_options=ClientOptions(api_endpoint=cloud.endpoint))

`endpoint` serves TPU, Compute, Resource Manager, Billing and the admin API on one port; Cloud Storage
runs on its own port (`storage_host`, for STORAGE_EMULATOR_HOST). `start()` returns once both listen
(and, after a restart from `state_dir`, once every READY node's workers listen again).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from . import facts, runtimes
from .accounts import AccountsService
from .compute import ComputeService
from .compute import _metadata_dict
from .compute_groups import ComputeGroupsService
from .core import Fault, Faults, Meter, World
from .projects import ProjectsService
from .schema import validator
from .server import Api, HttpServer
from .storage import StorageServer
from .runtimes import WorkerPython
from .tokens import Tokens
from .tpu import TpuService, ssh_keys_of
from .workers import WorkerPool

BUCKET_SAMPLE_S = 1.0


class LocalCloud:
    """See the module docstring. Not reusable after `stop()`."""

    def __init__(self, speed: float = 1.0, strict: bool = True, state_dir: str | Path | None = None, *,
                 port: int = 0, worker_python: str | None = None, runtime_cache: str | Path | None = None):
        """`worker_python`: "runtime" (default; `$TPUCTL_WORKER_PYTHON` overrides) runs a TPU node's jobs on
        its runtime image's software, a venv built once per image under `runtime_cache` (default
        `$TPUCTL_RUNTIME_CACHE`, else `STATE_DIR/runtimes`, else `$TPUCTL_HOME/localcloud/runtimes`);
        "host" runs them on this process's interpreter (see runtimes.py)."""
        self.speed = float(speed)
        self.strict = strict
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.port = port
        self.python = WorkerPython(worker_python, Path(runtime_cache) if runtime_cache is not None
                                   else runtimes.default_cache(self.state_dir))
        self._tmp: Path | None = None
        self._http: HttpServer | None = None
        self._storage = None
        self._workers = None
        self._sampler_stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._seen_buckets: set[str] = set()
        self.world: World | None = None
        # Service account tokens: issued to guests, checked by Cloud Storage against bucket IAM.
        self.tokens = Tokens()
        self.endpoint = ""
        self.storage_host = ""
        self.started = 0.0

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> "LocalCloud":
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            root = self.state_dir
        else:
            self._tmp = root = Path(tempfile.mkdtemp(prefix="localcloud-"))
        try:
            workers = self._workers = WorkerPool(root / "workers", self.python.bin_dir)
            self._storage = StorageServer(root / "storage" if self.state_dir is not None else None, validator,
                                          tokens=self.tokens)
            self.storage_host = self._storage.start()
            w = self.world = World(speed=self.speed, strict=self.strict, state_dir=self.state_dir,
                                   workers=workers, storage_host=self.storage_host, python=self.python)
            w.tokens = self.tokens
            self.tpu, self.compute, self.accounts = TpuService(w), ComputeService(w), AccountsService(w)
            self.projects = ProjectsService(w, self._refresh_keys)
            w.worker_keys = self.projects.authorized_keys
            self.compute.groups = self.groups = ComputeGroupsService(w, self.compute)
            w.services = {"tpu": self.tpu, "compute": self.compute, "projects": self.projects,
                          "compute_groups": self.groups}
            w.faults.on_add = self._apply_fault
            self._http = HttpServer(Api(w, self._handlers(), self._admin, guard=self.projects.guard), self.port)
            self.endpoint = f"http://127.0.0.1:{self._http.port}"
            loaded = w.load()
            self._http.start()
            w.scheduler.start()
            if loaded:
                self.tpu.restore_workers()
                self.compute.restore_workers()
            self._sampler = threading.Thread(target=self._sample_loop, name="localcloud-meter", daemon=True)
            self._sampler.start()
            self.started = time.time()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops servers, kills every worker process, writes a final snapshot. Idempotent."""
        self._sampler_stop.set()
        if self._sampler:
            self._sampler.join(timeout=5)
        if self._http:
            self._http.stop()
            self._http = None
        w = self.world
        if w is not None:
            w.scheduler.stop()
            if self.state_dir is not None:
                with w.lock:
                    w.save()
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self._storage is not None:
            self._storage.stop()
            self._storage = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def disown_state_dir(self) -> None:
        """Stop writing snapshots: the state dir was removed or replaced under this cloud, and what is there now
        (another daemon's, perhaps) must not be overwritten by this cloud's last snapshot. Idempotent."""
        if self.world is not None:
            with self.world.lock:
                self.world.state_dir = None
        self.state_dir = None

    def __enter__(self) -> "LocalCloud":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------- public API
    @property
    def faults(self) -> Faults:
        return self.world.faults

    @property
    def meter(self) -> Meter:
        return self.world.meter

    def preempt(self, node: str, at: datetime | float | None = None) -> None:
        """Preempt a spot/preemptible TPU node, or a Spot/preemptible Compute Engine instance (a TPU7x VM), now
        or at `at` (datetime or unix seconds). ValueError if there is no such node or instance, or it is on-demand."""
        when = at.timestamp() if isinstance(at, datetime) else at
        with self.world.lock:
            is_node = any(k == node or k.rsplit("/", 1)[-1] == node for k in self.tpu.nodes)
        (self.tpu if is_node else self.compute).preempt(node, when)

    def idle_s(self) -> float:
        """Seconds since the latest request to any API (storage included); 0.0 while a TPU node or VM is billed
        (its workers run jobs) or an operation is under way. What the daemon's idle stop waits for."""
        if self.world.meter.billing() or self.world.scheduler.pending():
            return 0.0
        last = max(self.world.last_request, self._storage.last_request if self._storage else 0.0)
        return max(0.0, time.time() - last)

    def shape_project(self, project: str, **options) -> dict:
        """Set up `project` otherwise than fully (see `projects.SHAPE_OPTIONS`): `disabled_services`,
        `default_network=False`, `networks`, `subnetworks` ("REGION/NAME/NETWORK"), `compute_sa=False`,
        `service_accounts` (the only others that exist), `metadata` (project-wide, e.g. enable-oslogin),
        `denied_permissions`, `external_ips_denied` (org policy constraints/compute.vmExternalIpAccess), `tpu_quotas`
        ({quota id: limit in every zone, or {zone: limit}, or {region: limit} for Compute Engine's}). Returns the project's shape. ValueError on unknown options."""
        return self.projects.shape(project, **options)

    def repair(self, node: str, state: str = "REPAIRING", seconds: float | None = None) -> None:
        """Host maintenance of a READY TPU node now: `state` (REPAIRING or RESTARTING) with health
        UNHEALTHY_MAINTENANCE for `seconds` of simulated time (default 120), then READY again with rebooted
        workers. ValueError if the node does not exist or is not READY."""
        self.tpu.repair(node, state, *(() if seconds is None else (seconds,)))

    def meter_report(self) -> dict:
        self._sample_buckets()
        return self.world.meter.report()

    def inventory(self) -> dict:
        """Every live resource across services, with per-worker SSH endpoints."""
        buckets = []
        for b in self._storage.buckets() if self._storage else []:
            row = {k: v for k, v in b.items() if k != "objects"}
            objs = b.get("objects")
            row["objects"] = len(objs) if isinstance(objs, (list, dict)) else objs
            buckets.append(row)
        return {**self.tpu.inventory(), **self.compute.inventory(), **self.groups.inventory(), "buckets": buckets}

    def status(self) -> dict:
        return {"endpoint": self.endpoint, "storage_host": self.storage_host, "speed": self.speed,
                "strict": self.strict, "started": self.started, "worker_python": self.python.mode,
                "runtime_cache": str(self.python.images.cache),
                "state_dir": str(self.state_dir) if self.state_dir else None,
                "resources": self.inventory(), "meter": self.meter_report(),
                "faults": self.faults.list(), "errors": list(self.world.errors), "idle_s": self.idle_s()}

    # ---------------------------------------------------------------------------------- internals
    def _handlers(self) -> dict:
        t, c, a, pr = self.tpu, self.compute, self.accounts, self.projects
        tp = "tpu.projects.locations."

        def tpu_create(p, q, body):
            pr.check_tpu_node(p["projectsId"], p["locationsId"], body, q.get("nodeId") or "")
            pr.check_tpu_quota(p["projectsId"], p["locationsId"], body, t.in_use(p["projectsId"], p["locationsId"]))
            return t.nodes_create(p, q, body)

        def queued_create(p, q, body):
            # Spot (as tpu.queued_create reads it) and flex-start requests draw on the preemptible quota
            # (tpu/docs/request-using-flex-start: "sufficient preemptible quota").
            spot = "spot" in (body or {}) or (body or {}).get("provisioningModel") == "FLEX_START"
            for spec in ((body or {}).get("tpu") or {}).get("nodeSpec") or []:
                node = spec.get("node") or {}
                pr.check_tpu_node(p["projectsId"], p["locationsId"], node, spec.get("nodeId") or "")
                pr.check_tpu_quota(p["projectsId"], p["locationsId"],
                                   {**node, "schedulingConfig": {"spot": True}} if spot else node,
                                   t.in_use(p["projectsId"], p["locationsId"]))
            return t.queued_create(p, q, body)

        def vm_insert(p, q, body):
            pr.check_instance(p["project"], p["zone"], body)
            return c.insert(p, q, body)

        return {
            f"{tp}nodes.create": tpu_create, f"{tp}nodes.get": t.nodes_get, f"{tp}nodes.list": t.nodes_list,
            f"{tp}nodes.delete": t.nodes_delete, f"{tp}nodes.stop": t.nodes_stop, f"{tp}nodes.start": t.nodes_start,
            f"{tp}nodes.patch": t.nodes_patch, f"{tp}nodes.getGuestAttributes": t.nodes_get_guest_attributes,
            f"{tp}generateServiceIdentity": t.generate_service_identity,
            "tpu.projects.locations.list": t.locations_list, "tpu.projects.locations.get": t.locations_get,
            f"{tp}acceleratorTypes.list": t.accelerator_types_list, f"{tp}acceleratorTypes.get": t.accelerator_types_get,
            f"{tp}runtimeVersions.list": t.runtime_versions_list, f"{tp}runtimeVersions.get": t.runtime_versions_get,
            f"{tp}operations.get": t.operations_get, f"{tp}operations.list": t.operations_list,
            f"{tp}queuedResources.create": queued_create, f"{tp}queuedResources.get": t.queued_get,
            f"{tp}queuedResources.list": t.queued_list, f"{tp}queuedResources.delete": t.queued_delete,
            "compute.instances.insert": vm_insert, "compute.instances.get": c.get, "compute.instances.list": c.list,
            "compute.instances.aggregatedList": c.aggregated_list, "compute.instances.delete": c.delete,
            "compute.instances.stop": c.stop, "compute.instances.start": c.start,
            "compute.instances.setLabels": c.set_labels, "compute.instances.setMetadata": c.set_metadata, "compute.instances.getGuestAttributes": c.get_guest_attributes,
            "compute.zoneOperations.get": c.operations_get, "compute.zoneOperations.list": c.operations_list, "compute.zoneOperations.wait": c.operations_wait,
            "compute.zones.list": c.zones_list, "compute.zones.get": c.zones_get,
            "compute.machineTypes.get": c.machine_types_get,
            **self._group_handlers(),
            "cloudresourcemanager.projects.get": a.projects_get,
            "cloudresourcemanager.projects.testIamPermissions": pr.test_iam_permissions,
            "compute.projects.get": pr.projects_get,
            "compute.projects.setCommonInstanceMetadata": pr.set_common_instance_metadata,
            "compute.globalOperations.get": pr.global_operations_get,
            "compute.globalOperations.wait": pr.global_operations_wait,
            "compute.networks.get": pr.networks_get, "compute.subnetworks.get": pr.subnetworks_get,
            "serviceusage.services.get": pr.services_get, "serviceusage.services.batchGet": pr.services_batch_get,
            "iam.projects.serviceAccounts.get": pr.service_accounts_get,
            "iam.projects.serviceAccounts.create": pr.service_accounts_create,
            "iam.projects.serviceAccounts.getIamPolicy": pr.service_account_get_iam_policy,
            "iam.projects.serviceAccounts.setIamPolicy": pr.service_account_set_iam_policy,
            "cloudresourcemanager.projects.getIamPolicy": pr.project_get_iam_policy,
            "cloudresourcemanager.projects.setIamPolicy": pr.project_set_iam_policy,
            "oslogin.users.getLoginProfile": pr.get_login_profile,
            "oslogin.users.importSshPublicKey": pr.import_ssh_public_key,
            "orgpolicy.projects.policies.getEffectivePolicy": pr.effective_policy,
            "cloudquotas.projects.locations.services.quotaInfos.get": pr.quota_info_get,
            "cloudbilling.services.list": a.services_list, "cloudbilling.services.skus.list": a.skus_list,
        }

    def _group_handlers(self) -> dict:
        g = self.groups
        return {
            "compute.resourcePolicies.insert": g.policies_insert, "compute.resourcePolicies.get": g.policies_get,
            "compute.resourcePolicies.list": g.policies_list, "compute.resourcePolicies.delete": g.policies_delete,
            "compute.regionInstanceTemplates.insert": g.templates_insert,
            "compute.regionInstanceTemplates.get": g.templates_get,
            "compute.regionInstanceTemplates.list": g.templates_list,
            "compute.regionInstanceTemplates.delete": g.templates_delete,
            "compute.instanceGroupManagers.insert": g.migs_insert, "compute.instanceGroupManagers.get": g.migs_get,
            "compute.instanceGroupManagers.list": g.migs_list, "compute.instanceGroupManagers.delete": g.migs_delete,
            "compute.instanceGroupManagers.listManagedInstances": g.migs_list_managed_instances,
            "compute.regionOperations.get": g.region_operations_get,
        }

    def _refresh_keys(self, project: str | None) -> None:
        """Project metadata or OS Login keys changed: every running worker of `project` (None: of every
        project) admits the keys it now should, at once (a real guest agent takes a few seconds)."""
        with self.world.lock:
            targets = [(r["worker_key"], r["project"], r["node"].get("metadata")) for r in self.tpu.nodes.values()
                       if r["endpoints"] and project in (None, r["project"])]
            targets += [(r["worker_key"], r["project"], _metadata_dict(r["instance"])) for r in self.compute.instances.values()
                        if r["endpoints"] and project in (None, r["project"])]
            for worker_key, owner, meta in targets:
                self.world.workers.update_keys(worker_key, self.world.worker_keys(owner, meta, ssh_keys_of(meta)))

    def _worker_key(self, node: str) -> str:
        try:
            return self.tpu.worker_key(node)
        except ValueError:
            with self.world.lock:
                hits = [r["worker_key"] for k, r in self.compute.instances.items()
                        if k == node or k.rsplit("/", 1)[-1] == node]
            if len(hits) != 1:
                raise ValueError(f"no TPU node or VM named {node!r}" if not hits else f"{node!r} is ambiguous: give the full name")
            return hits[0]

    def _apply_fault(self, fault: Fault) -> None:
        """Kinds that act on a resource fire at once and leave the registry; the rest wait for calls."""
        if fault.kind not in ("preempt", "kill-worker", "drop-ssh", "repair"):
            return
        self.faults.clear(fault.id)
        if not fault.node:
            raise ValueError(f"fault {fault.kind} needs node=")
        if fault.kind == "preempt":
            self.preempt(fault.node, fault.at)
        elif fault.kind == "repair":
            self.repair(fault.node, fault.state or "REPAIRING", fault.seconds)
        elif fault.kind == "kill-worker":
            self.world.workers.kill_worker(self._worker_key(fault.node), fault.worker or 0)
        else:
            self.world.workers.drop_connections(self._worker_key(fault.node))

    def _admin(self, verb: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        try:
            if verb == "GET" and path == "status":
                return 200, self.status()
            if verb == "GET" and path == "meter":
                return 200, self.meter_report()
            if path == "faults" and verb == "GET":
                return 200, {"faults": self.faults.list()}
            if path == "faults" and verb == "POST":
                opts = dict(body or {})
                kind = opts.pop("kind", None)
                fault = self.faults.add(kind, **opts)
                return 200, {"fault": fault.public()}
            if path == "faults" and verb == "DELETE":
                return 200, {"cleared": self.faults.clear()}
            if path.startswith("faults/") and verb == "DELETE":
                return 200, {"cleared": self.faults.clear(path.split("/", 1)[1])}
            if path.startswith("projects/") and verb in ("GET", "POST"):
                project = path.split("/", 1)[1]
                return 200, (self.shape_project(project, **body) if verb == "POST" else self.projects.describe(project))
            if path == "preempt" and verb == "POST":
                at = body.get("at")
                if body.get("after") is not None:
                    at = time.time() + float(body["after"])
                self.preempt(body.get("node") or "", at)
                return 200, {"preempted": body.get("node"), "at": at}
        except (ValueError, TypeError) as exc:
            return 400, {"error": str(exc)}
        return 404, {"error": f"no admin route {verb} /_localcloud/{path}; see localcloud/README.md"}

    def _sample_buckets(self) -> None:
        if self._storage is None:
            return
        now = time.time()
        live = set()
        for b in self._storage.buckets():
            region = str(b.get("location") or "US").lower()
            name = f"buckets/{b['name']}"
            live.add(name)
            self.world.meter.sample_bucket(name, f"bucket/{region}/standard", facts.STORAGE_PRICE_PER_GB_MONTH,
                                           float(b.get("bytes") or 0) / 1e9, now)
        # Soft-deleted bytes bill at the storage class's rate until their hard delete time, also after their
        # bucket is gone (cloud.google.com/storage/docs/soft-delete).
        for bucket, soft in self._storage.soft_deleted().items():
            name = f"buckets/{bucket}/soft-deleted"
            live.add(name)
            self.world.meter.sample_bucket(name, f"bucket/{soft['location'].lower()}/standard/soft-deleted",
                                           facts.STORAGE_PRICE_PER_GB_MONTH, soft["bytes"] / 1e9, now)
        for gone in self._seen_buckets - live:
            self.world.meter.sample_bucket(gone, "", 0.0, None, now)
        self._seen_buckets = live

    def _sample_loop(self) -> None:
        while not self._sampler_stop.wait(BUCKET_SAMPLE_S):
            try:
                self._sample_buckets()
            except Exception as exc:  # the storage emulator restarting must not kill the meter
                self.world.errors.append(f"bucket sampling: {type(exc).__name__}: {exc}")
