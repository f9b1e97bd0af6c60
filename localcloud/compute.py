"""Compute Engine v1: instances, zone operations, zones, machine types.

Compute's conventions differ from the one-platform APIs: enums are strings, int64/uint64 are digit
strings, operations are `compute#operation` resources with numeric ids whose `status` goes
PENDING -> RUNNING -> DONE, and a failed operation carries `error.errors[]` plus `httpErrorStatusCode`.
Each VM gets one worker SSH server. Billing: a VM is metered from when it is RUNNING until it is TERMINATED or
deleted (README, "Billing meter").
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import time
import uuid

from . import facts
from . import metadata as guest
from .core import ApiError, World, check_labels, now_rfc3339
from .projects import guest_flag
from .tpu import CPU_REHEARSAL_VAR, paginate, ssh_keys_of

INSERT_S, DELETE_S, STOP_S, START_S, SET_LABELS_S, SET_METADATA_S = 25.0, 40.0, 30.0, 20.0, 2.0, 2.0
# A preempted VM gets a 30 s notice (ACPI G2 Soft Off) before Compute stops it hard (compute/docs/instances/spot,
# "Preemption process").
PREEMPT_NOTICE_S = 30.0
CAPACITY_FAIL_S = 10.0
# A flex-start insert waiting for capacity looks for it again this often (simulated seconds; inferred: Google
# does not say how often DWS retries).
CAPACITY_RETRY_S = 30.0
WAIT_MAX_S = 60.0

ROOT = "https://compute.googleapis.com/compute/v1/"
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _fingerprint(value) -> str:
    return base64.b64encode(hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()[:8]).decode()


def _metadata_dict(instance: dict) -> dict:
    return {i["key"]: i.get("value", "") for i in (instance.get("metadata") or {}).get("items", [])}


def _wait_s(body: dict) -> float | None:
    """The insert's `params.requestValidForDuration` ("Relative deadline for waiting for capacity. Relevant only
    for Instances.Insert API", compute.v1 `InstanceParams`) in seconds; None when not sent."""
    duration = (body.get("params") or {}).get("requestValidForDuration")
    if duration is None:
        return None
    return int(duration.get("seconds") or 0) + int(duration.get("nanos") or 0) / 1e9


# Statuses of an instance on its way to RUNNING (PENDING: a TPU instance acquiring its resources).
CREATING = ("PENDING", "PROVISIONING", "STAGING")

class ComputeService:
    name = "compute"

    def __init__(self, world: World):
        self.w = world
        self.instances: dict[str, dict] = {}   # "projects/P/zones/Z/instances/N" -> record
        self.ops: dict[str, dict] = {}         # "projects/P/{zones/Z,regions/R}/operations/NAME" -> Operation body
        self.groups = None  # ComputeGroupsService, told when a MIG member's insert fails
        for action in ("insert_done", "insert_failed", "capacity_retry", "delete_done", "stop_done", "set_labels_done", "set_metadata_done",
                       "expire", "preempt"):
            world.actions[f"compute.{action}"] = getattr(self, f"_{action}")

    def dump(self) -> dict:
        return {"instances": self.instances, "ops": self.ops}

    def load(self, data: dict) -> None:
        self.instances = data.get("instances", {})
        self.ops = data.get("ops", {})
        for rec in self.instances.values():
            rec["endpoints"] = []

    def restore_workers(self) -> None:
        with self.w.lock:
            running = [k for k, r in self.instances.items() if r["instance"]["status"] == "RUNNING"]
        for key in running:
            self._boot_worker(key)
        with self.w.lock:
            self.w.changed()

    # ---------------------------------------------------------------------------------- helpers
    @staticmethod
    def _key(p: dict, name: str) -> str:
        return f"projects/{p['project']}/zones/{p['zone']}/instances/{name}"

    def _get(self, key: str) -> dict:
        rec = self.instances.get(key)
        if rec is None:
            raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
        return rec

    def _zone_ok(self, zone: str) -> None:
        if zone not in facts.all_zones():
            raise ApiError("NOT_FOUND", f"The resource 'projects/-/zones/{zone}' was not found", reason="notFound")

    def view(self, rec: dict) -> dict:
        inst = copy.deepcopy(rec["instance"])
        for nic in inst.get("networkInterfaces", []):
            nic["networkIP"] = "127.0.0.1"
            for ac in nic.get("accessConfigs", []):
                ac["natIP"] = "127.0.0.1"
        return inst

    def _new_op(self, p: dict, op_type: str, target: str, target_id: str) -> dict:
        zone_url = f"{ROOT}projects/{p['project']}/zones/{p['zone']}"
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:8]}"
        op = {
            "kind": "compute#operation", "id": str(self.w.next_id()), "name": name, "zone": zone_url,
            "operationType": op_type, "targetLink": f"{ROOT}{target}", "targetId": target_id,
            "status": "RUNNING", "user": "localcloud@example.com", "progress": 0,
            "insertTime": now_rfc3339(), "startTime": now_rfc3339(),
            "selfLink": f"{zone_url}/operations/{name}",
        }
        self.ops[f"projects/{p['project']}/zones/{p['zone']}/operations/{name}"] = op
        return op

    def _op_key(self, op: dict) -> str:
        return op["selfLink"][len(ROOT):]

    def _finish_op(self, op_key: str, error: tuple[str, str, int] | None = None,
                   details: list[dict] | None = None) -> None:
        op = self.ops.get(op_key)
        if op is None or op["status"] == "DONE":
            return
        op.update(status="DONE", progress=100, endTime=now_rfc3339())
        if error:
            code, message, http = error
            op["error"] = {"errors": [{"code": code, "message": message, **({"errorDetails": details} if details else {})}]}
            op["httpErrorStatusCode"] = http
            op["httpErrorMessage"] = {503: "SERVICE UNAVAILABLE", 404: "NOT FOUND", 400: "BAD REQUEST",
                                      403: "FORBIDDEN"}.get(http, "ERROR")

    def _meter(self, rec: dict) -> None:
        mt = rec["machine_type"]
        tpu = facts.TPU_MACHINE_TYPES.get(mt)
        if tpu is None:
            self.w.meter.begin(rec["key"], "vm", f"vm/{mt}/{rec['zone']}", facts.MACHINE_TYPES[mt][3])
            return
        model = (rec["instance"].get("scheduling") or {}).get("provisioningModel") or "STANDARD"
        spot = model == "SPOT"
        per_chip = facts.tpu_price(tpu.generation, facts.region_of(rec["zone"]), spot)
        if per_chip is None:
            per_chip = facts.tpu_price(tpu.generation, facts.region_of(rec["zone"]), False) or 0.0
        kind = {"SPOT": "spot", "FLEX_START": "flex-start"}.get(model, "on-demand")
        self.w.meter.begin(rec["key"], "tpu", f"tpu/{mt}/{rec['zone']}/{kind}", tpu.chips * per_chip)

    def _check_machine_type(self, name: str, zone: str, body: dict, mt_url: str) -> None:
        """A general-purpose type exists everywhere localcloud serves; a TPU type only in its zones, with the
        provisioning models Compute accepts for it, and flex-start only with maxRunDuration and DELETE."""
        tpu = facts.TPU_MACHINE_TYPES.get(name)
        if tpu is None and name not in facts.MACHINE_TYPES or tpu is not None and zone not in tpu.zones:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.machineType': '{mt_url}'. Machine type with name '{name}' does not exist in zone '{zone}'.")
        sched = body.get("scheduling") or {}
        model = sched.get("provisioningModel") or "STANDARD"
        if tpu is not None and model not in tpu.provisioning_models:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.scheduling.provisioningModel': '{model}'. Not supported for machine type '{name}'.")
        if model == "FLEX_START":
            seconds = int((sched.get("maxRunDuration") or {}).get("seconds") or 0)
            low, high = facts.FLEX_START_MAX_RUN_S
            if not low <= seconds <= high:
                raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.scheduling.maxRunDuration': '{seconds}s'. Flex-start instances need a max run duration from {low}s to {high}s.")
        wait = _wait_s(body)
        if wait is not None and not 0 < wait <= facts.FLEX_START_MAX_WAIT_S:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.params.requestValidForDuration': '{wait:g}s'. "
                           f"It must be more than 0s and at most {facts.FLEX_START_MAX_WAIT_S}s.")

    def _boot_worker(self, key: str) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None:
                return
            meta = _metadata_dict(rec["instance"])
            if rec["machine_type"] in facts.TPU_MACHINE_TYPES:
                # A TPU VM's guest, as a TPU API node's: identity only from its metadata server (guest_metadata).
                env = {"STORAGE_EMULATOR_HOST": self.w.storage_host, CPU_REHEARSAL_VAR: "cpu"}
            else:
                env = {"GOOGLE_CLOUD_PROJECT": rec["project"], "STORAGE_EMULATOR_HOST": self.w.storage_host,
                       "TPUCTL_LOCALCLOUD": "1", "VM_NAME": rec["instance"]["name"], "VM_ZONE": rec["zone"]}
            keys = self.w.worker_keys(rec["project"], meta, ssh_keys_of(meta))
            script = meta.get("startup-script")
            worker_key = rec["worker_key"]
        endpoints = self.w.workers.start_node(worker_key, 1, env, keys, script,
                                              metadata=lambda index: self.guest_metadata(key))
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None or rec.get("deleting") or rec["instance"]["status"] not in ("PROVISIONING", "STAGING", "RUNNING"):
                self.w.workers.stop_node(worker_key)
                return
            rec["endpoints"] = [{"host": e.host, "port": e.port, "host_key": e.host_key} for e in endpoints]

    def guest_metadata(self, key: str) -> guest.Tree | None:
        """What the VM reads from its metadata server: its metadata items, identity and service account, and on
        a TPU machine type the TPU attributes (`_tpu_attributes`)."""
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None:
                return None
            inst, project, zone = rec["instance"], rec["project"], rec["zone"]
            accounts = inst.get("serviceAccounts") or []
            attributes = {**_metadata_dict(inst), **self._tpu_attributes(rec)}
            return guest.guest_tree(
                project=project, number=facts.project_number(project), zone=zone, name=inst["name"],
                instance_id=inst["id"], attributes=attributes,
                service_account=(accounts[0]["email"], list(accounts[0].get("scopes") or [])) if accounts else None,
                tokens=self.w.tokens, machine_type=rec["machine_type"])

    def _tpu_attributes(self, rec: dict) -> dict[str, str]:
        """A TPU VM instance's TPU attributes: only the keys JAX's `GceTpuCluster` reads on Compute Engine
        (`agent-worker-number`, `worker-network-endpoints` "hostname:uid:ip" in worker order). No source shows a
        Compute Engine TPU VM serving a TPU API node's `accelerator-type` or `tpu-env`, so none is served (README
        "TPU7x"). One instance is a one-worker slice; a MIG's instance is worker i of the MIG's slice (members in
        name order). Empty for a machine type without TPUs. Called under the lock."""
        if rec["machine_type"] not in facts.TPU_MACHINE_TYPES:
            return {}
        members = [rec]
        group = self.groups.migs.get(rec.get("mig") or "") if self.groups is not None else None
        if group is not None:
            members = sorted((self.instances[k] for k in group["members"] if k in self.instances),
                             key=lambda r: r["instance"]["name"])
        index = next(i for i, r in enumerate(members) if r["key"] == rec["key"])
        return {
            "agent-worker-number": str(index),
            "worker-network-endpoints": ",".join(
                f"{r['instance']['name']}:{r['instance']['id']}:127.0.0.1" for r in members),
        }

    def _stop_worker(self, rec: dict) -> None:
        rec["endpoints"] = []
        self.w.workers.stop_node(rec["worker_key"])

    # ---------------------------------------------------------------------------------- instances
    def insert(self, p: dict, q: dict, body: dict) -> dict:
        self._zone_ok(p["zone"])
        name = body.get("name") or ""
        if not _NAME_RE.match(name):
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{{0,61}}[a-z0-9])?)'")
        mt_url = body.get("machineType") or ""
        m = re.search(r"(?:^|/)zones/([^/]+)/machineTypes/([^/]+)$", mt_url)
        if not m:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.machineType': '{mt_url}'. Must be a URL to a valid Compute resource of the correct type.")
        if m.group(1) != p["zone"]:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field 'resource.machineType': '{mt_url}'. Machine type must be in zone {p['zone']}.")
        self._check_machine_type(m.group(2), p["zone"], body, mt_url)
        check_labels(body.get("labels"), "resource.labels")
        disks = body.get("disks") or []
        if not any(d.get("boot") for d in disks):
            raise ApiError("INVALID_ARGUMENT", "Invalid value for field 'resource.disks': ''. Boot disk must be specified.")
        key = self._key(p, name)
        with self.w.lock:
            if key in self.instances:
                raise ApiError("ALREADY_EXISTS", f"The resource '{key}' already exists")
            quota = self._tpu_quota(p["project"], p["zone"], m.group(2), body)
            inst = copy.deepcopy(body)
            inst.pop("params", None)  # "Input only ... not persisted as part of resource payload" (compute.v1)
            inst_id = str(self.w.next_id())
            flex = (body.get("scheduling") or {}).get("provisioningModel") == "FLEX_START"
            wait = _wait_s(body) if flex else None
            # compute/docs/instances/instance-lifecycle: "TPU instances start instead in the PENDING state", where
            # Compute Engine "attempts to acquire the necessary resources"; without them "you encounter an error
            # and Compute Engine deletes the compute instance" (the capacity fault below).
            # A flex-start instance is PENDING too: "For Flex Start provisioning instance is waiting for available
            # capacity from Dynamic Workload Scheduler" (compute.v1 `Instance.status` PENDING).
            first = "PENDING" if m.group(2) in facts.TPU_MACHINE_TYPES or flex else "PROVISIONING"
            inst.update(kind="compute#instance", id=inst_id, creationTimestamp=now_rfc3339(), status=first,
                        zone=f"{ROOT}projects/{p['project']}/zones/{p['zone']}",
                        selfLink=f"{ROOT}{key}", machineType=f"{ROOT}projects/{p['project']}/zones/{p['zone']}/machineTypes/{m.group(2)}",
                        labelFingerprint=_fingerprint(inst.get("labels", {})))
            inst.setdefault("metadata", {})
            inst["metadata"].update(kind="compute#metadata", fingerprint=_fingerprint(inst["metadata"].get("items", [])))
            for nic in inst.setdefault("networkInterfaces", [{"network": f"{ROOT}projects/{p['project']}/global/networks/default"}]):
                nic.setdefault("name", "nic0")
                nic["kind"] = "compute#networkInterface"
            for i, disk in enumerate(inst["disks"]):
                disk.update(kind="compute#attachedDisk", index=i, type=disk.get("type", "PERSISTENT"),
                            deviceName=disk.get("deviceName", name if i == 0 else f"{name}-{i}"))
                disk.pop("initializeParams", None)
            rec = {"instance": inst, "project": p["project"], "zone": p["zone"], "key": key,
                   "machine_type": m.group(2), "endpoints": [], "worker_key": f"vm-{p['project']}-{p['zone']}-{name}",
                   "delete_ops": [], "quota": quota}
            self.instances[key] = rec
            op = self._new_op(p, "insert", key, inst_id)
            op_key = self._op_key(op)
            if self.w.faults.take("stuck", "compute", "instances.insert", p["zone"]):
                pass
            elif wait is not None and self.w.faults.take("capacity", "compute", "instances.insert", p["zone"]):
                # A flex-start insert waits for capacity for as long as it asked (about-flex-start-vms: "VMs only
                # start if resources become available within your specified timeframe"); its operation runs.
                rec["wait_until"] = time.time() + self.w.latency(wait)
                self.w.later(CAPACITY_RETRY_S, "compute.capacity_retry", key=key, op=op_key)
            elif self.w.faults.take("capacity", "compute", "instances.insert", p["zone"]):
                self.w.later(CAPACITY_FAIL_S, "compute.insert_failed", key=key, op=op_key)
            elif quota := self.w.faults.take("quota", "compute", "instances.insert", p["zone"],
                                             where=lambda f: bool(f.in_operation)):
                self.w.later(CAPACITY_FAIL_S, "compute.insert_failed", key=key, op=op_key, quota=quota.quota or "CPUS")
            else:
                self.w.later(INSERT_S, "compute.insert_done", key=key, op=op_key)
            self.w.changed()
            return copy.deepcopy(op)

    def _tpu_quota(self, project: str, zone: str, machine_type: str, body: dict) -> str | None:
        """The Compute Engine TPU quota a TPU VM insert draws on, refused (403) past it (projects.py); None for
        a VM without TPUs. Counted from the chips the project's TPU VMs in the region hold. Under the lock."""
        tpu = facts.TPU_MACHINE_TYPES.get(machine_type)
        if tpu is None:
            return None
        region = facts.region_of(zone)
        in_use: dict[str, int] = {}
        for rec in self.instances.values():
            if rec["project"] == project and facts.region_of(rec["zone"]) == region and rec.get("quota"):
                in_use[rec["quota"]] = in_use.get(rec["quota"], 0) + facts.TPU_MACHINE_TYPES[rec["machine_type"]].chips
        model = (body.get("scheduling") or {}).get("provisioningModel") or "STANDARD"
        return self.w.services["projects"].check_compute_tpu_quota(project, zone, tpu, model, in_use)

    def _insert_done(self, key: str, op: str) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None or rec.get("deleting") or rec["instance"]["status"] not in CREATING:
                self._finish_op(op)
                return
            rec["instance"]["status"] = "STAGING"
        self._boot_worker(key)
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is not None and rec["instance"]["status"] == "STAGING":
                rec["instance"]["status"] = "RUNNING"
                rec["instance"]["lastStartTimestamp"] = now_rfc3339()
                # "Instance uptime is measured as the number of seconds between when you start an instance and
                # when you stop an instance" (compute/vm-instance-pricing): PENDING/PROVISIONING/STAGING bill nothing.
                self._meter(rec)
                self._schedule_expiry(rec)
            self._finish_op(op)
            self.w.changed()

    def _schedule_expiry(self, rec: dict) -> None:
        """maxRunDuration counts from when the instance runs; then Compute applies instanceTerminationAction
        (compute/docs/instances/limit-vm-runtime). Simulated seconds, like every latency; the timestamp
        published in resourceStatus is the wall-clock moment it will happen."""
        sched = rec["instance"].get("scheduling") or {}
        seconds = int((sched.get("maxRunDuration") or {}).get("seconds") or 0)
        if not seconds:
            return
        when = time.time() + self.w.latency(seconds)
        rec["instance"].setdefault("resourceStatus", {}).setdefault("scheduling", {})["terminationTimestamp"] = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}-00:00")
        self.w.later(seconds, "compute.expire", key=rec["key"])

    def _expire(self, key: str) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None or rec.get("deleting"):
                return
            if (rec["instance"].get("scheduling") or {}).get("instanceTerminationAction") == "DELETE":
                rec["deleting"] = True
                rec["instance"]["status"] = "STOPPING"
                self._stop_worker(rec)
                self.w.later(DELETE_S, "compute.delete_done", key=key)
            else:
                rec["instance"]["status"] = "TERMINATED"
                rec["instance"]["lastStopTimestamp"] = now_rfc3339()
                self._stop_worker(rec)
                self.w.meter.end(key)
            self.w.changed()

    def find(self, name: str) -> str:
        """The key of the instance named by its full name or, when unambiguous, its short name. ValueError if none."""
        with self.w.lock:
            if name in self.instances:
                return name
            hits = [k for k in self.instances if k.rsplit("/", 1)[-1] == name]
        if len(hits) != 1:
            raise ValueError(f"no instance named {name!r}" if not hits else f"instance name {name!r} is ambiguous: give the full name")
        return hits[0]

    def preempt(self, name: str, at: float | None = None) -> None:
        """Preempt a Spot (or legacy preemptible) instance now or at wall-clock time `at`, as Compute does
        (`_preempt`). ValueError if it is neither: Compute preempts only those."""
        key = self.find(name)
        with self.w.lock:
            sched = self.instances[key]["instance"].get("scheduling") or {}
            if sched.get("provisioningModel") != "SPOT" and not sched.get("preemptible"):
                raise ValueError(f"instance {key} is not a Spot or preemptible VM: it cannot be preempted")
        if at is None or at <= time.time():
            self._preempt(key)
        else:
            self.w.scheduler.at(at, "compute.preempt", key=key)

    def _preempt(self, key: str) -> None:
        """Compute's preemption of a running Spot VM: a `compute.instances.preempted` operation by `system`
        (zoneOperations, as Google's preemption-history sample lists them), the guest gone (its processes die;
        localcloud runs no shutdown script in the notice period), then the termination action: STOP (the
        default) -> STOPPING for the notice, then TERMINATED with lastStopTimestamp and the meter stopped;
        DELETE -> the instance is deleted (the meter stops when the delete finishes)."""
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None or rec.get("deleting") or rec["instance"]["status"] not in ("PROVISIONING", "STAGING", "RUNNING"):
                return
            p = {"project": rec["project"], "zone": rec["zone"]}
            op = self._new_op(p, "compute.instances.preempted", key, rec["instance"]["id"])
            op["user"] = "system"
            self._finish_op(self._op_key(op))
            self._stop_worker(rec)
            rec["instance"]["status"] = "STOPPING"
            if (rec["instance"].get("scheduling") or {}).get("instanceTerminationAction") == "DELETE":
                rec["deleting"] = True
                self.w.later(PREEMPT_NOTICE_S + DELETE_S, "compute.delete_done", key=key)
            else:
                self.w.later(PREEMPT_NOTICE_S, "compute.stop_done", key=key, op=self._op_key(op))
            self.w.changed()

    def _insert_failed(self, key: str, op: str, quota: str | None = None) -> None:
        with self.w.lock:
            rec = self.instances.pop(key, None)
            if rec is None:
                return
            self.w.meter.end(key)
            if rec.get("mig") and self.groups is not None:
                self.groups.member_failed(rec["mig"])
            zone = f"projects/{rec['project']}/zones/{rec['zone']}"
            if quota:
                region = rec["zone"].rsplit("-", 1)[0]
                message = f"Quota '{quota}' exceeded.  Limit: 0.0 in region {region}."
                # compute.v1 `errors[].errorDetails`: "QuotaExceededInfo will have details when the error code is
                # QUOTA_EXCEEDED"; a LocalizedMessage carries the user-facing text (AIP-193). The quotaInfo values
                # are inferred from the quota's name: no source shows a real one.
                self._finish_op(op, ("QUOTA_EXCEEDED", message, 403), details=[
                    {"quotaInfo": {"metricName": f"compute.googleapis.com/{quota.lower()}",
                                   "limitName": f"{quota}-per-project-region", "limit": 0.0,
                                   "dimensions": {"region": region}}},
                    {"localizedMessage": {"locale": "en-US", "message": message}}])
            else:
                self._finish_op(op, ("ZONE_RESOURCE_POOL_EXHAUSTED",
                                     f"The zone '{zone}' does not have enough resources available to fulfill the request.  "
                                     "Try a different zone, or try again later.", 503))
            self.w.changed()

    def _capacity_retry(self, key: str, op: str) -> None:
        """A waiting flex-start insert looks for capacity again: found, it goes on as any insert; still none
        past its requestValidForDuration, it fails as a stockout does."""
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is None or rec.get("deleting") or rec["instance"]["status"] != "PENDING":
                self._finish_op(op)
                return
            if not self.w.faults.take("capacity", "compute", "instances.insert", rec["zone"]):
                self.w.later(INSERT_S, "compute.insert_done", key=key, op=op)
            elif time.time() >= rec["wait_until"]:
                self.w.later(0, "compute.insert_failed", key=key, op=op)
            else:
                self.w.later(CAPACITY_RETRY_S, "compute.capacity_retry", key=key, op=op)

    def get(self, p: dict, q: dict, body: None) -> dict:
        with self.w.lock:
            return self.view(self._get(self._key(p, p["instance"])))

    def list(self, p: dict, q: dict, body: None) -> dict:
        self._zone_ok(p["zone"])
        prefix = f"projects/{p['project']}/zones/{p['zone']}/instances/"
        pred = parse_filter(q.get("filter") or "")
        with self.w.lock:
            items = [self.view(r) for k, r in sorted(self.instances.items()) if k.startswith(prefix)]
        items = [i for i in items if pred(i)]
        page, token = paginate(items, q.get("maxResults"), q.get("pageToken"))
        out = {"kind": "compute#instanceList", "id": prefix.rstrip("/"), "items": page,
               "selfLink": f"{ROOT}{prefix.rstrip('/')}"}
        if token:
            out["nextPageToken"] = token
        return out

    def aggregated_list(self, p: dict, q: dict, body: None) -> dict:
        prefix = f"projects/{p['project']}/zones/"
        pred = parse_filter(q.get("filter") or "")
        by_zone: dict[str, list] = {}
        with self.w.lock:
            for k, r in sorted(self.instances.items()):
                if k.startswith(prefix):
                    view = self.view(r)
                    if pred(view):
                        by_zone.setdefault(f"zones/{r['zone']}", []).append(view)
        return {"kind": "compute#instanceAggregatedList", "id": f"projects/{p['project']}/aggregated/instances",
                "items": {z: {"instances": v} for z, v in by_zone.items()},
                "selfLink": f"{ROOT}projects/{p['project']}/aggregated/instances"}

    def delete(self, p: dict, q: dict, body: None) -> dict:
        key = self._key(p, p["instance"])
        with self.w.lock:
            rec = self._get(key)
            op = self._new_op(p, "delete", key, rec["instance"]["id"])
            rec["delete_ops"].append(self._op_key(op))
            if not rec.get("deleting"):
                rec["deleting"] = True
                rec["instance"]["status"] = "STOPPING"
                self._stop_worker(rec)
            # A repeated delete finishes one that never did (a stuck fault, a daemon restart), as a retry does
            # on Google's side; a second completion is a no-op.
            if not self.w.faults.take("stuck", "compute", "instances.delete", p["zone"]):
                self.w.later(DELETE_S, "compute.delete_done", key=key)
            self.w.changed()
            return copy.deepcopy(op)

    def _delete_done(self, key: str) -> None:
        with self.w.lock:
            rec = self.instances.pop(key, None)
            if rec is None:
                return
            self.w.meter.end(key)
            for op in rec["delete_ops"]:
                self._finish_op(op)
            self.w.changed()

    def stop(self, p: dict, q: dict, body: None) -> dict:
        key = self._key(p, p["instance"])
        with self.w.lock:
            rec = self._get(key)
            op = self._new_op(p, "stop", key, rec["instance"]["id"])
            if rec["instance"]["status"] in ("TERMINATED", "STOPPING"):
                self._finish_op(self._op_key(op))
            else:
                rec["instance"]["status"] = "STOPPING"
                self._stop_worker(rec)
                if not self.w.faults.take("stuck", "compute", "instances.stop", p["zone"]):
                    self.w.later(STOP_S, "compute.stop_done", key=key, op=self._op_key(op))
            self.w.changed()
            return copy.deepcopy(op)

    def _stop_done(self, key: str, op: str) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is not None and not rec.get("deleting"):
                rec["instance"]["status"] = "TERMINATED"
                rec["instance"]["lastStopTimestamp"] = now_rfc3339()
                self.w.meter.end(key)
            self._finish_op(op)
            self.w.changed()

    def start(self, p: dict, q: dict, body: None) -> dict:
        key = self._key(p, p["instance"])
        with self.w.lock:
            rec = self._get(key)
            if rec["instance"]["status"] != "TERMINATED":
                if rec["instance"]["status"] == "RUNNING":
                    op = self._new_op(p, "start", key, rec["instance"]["id"])
                    self._finish_op(self._op_key(op))
                    return copy.deepcopy(self.ops[self._op_key(op)])
                raise ApiError("FAILED_PRECONDITION", f"The instance '{key}' is not ready to be started (status {rec['instance']['status']}).",
                               http=400, reason="resourceNotReady")
            op = self._new_op(p, "start", key, rec["instance"]["id"])
            rec["instance"]["status"] = "PROVISIONING"
            if self.w.faults.take("stuck", "compute", "instances.start", p["zone"]):
                pass
            elif self.w.faults.take("capacity", "compute", "instances.start", p["zone"]):
                rec["instance"]["status"] = "TERMINATED"
                self._finish_op(self._op_key(op), ("ZONE_RESOURCE_POOL_EXHAUSTED",
                                f"The zone 'projects/{p['project']}/zones/{p['zone']}' does not have enough resources available to fulfill the request.  Try a different zone, or try again later.", 503))
            else:
                self.w.later(START_S, "compute.insert_done", key=key, op=self._op_key(op))
            self.w.changed()
            return copy.deepcopy(op)

    def set_labels(self, p: dict, q: dict, body: dict) -> dict:
        key = self._key(p, p["instance"])
        check_labels(body.get("labels"), "labels")
        with self.w.lock:
            rec = self._get(key)
            current = rec["instance"].get("labelFingerprint")
            # A write accepted but not yet applied has already made `current` stale (optimistic locking: "You
            # must always provide an up-to-date fingerprint hash"), so a second writer cannot overwrite it.
            if body.get("labelFingerprint") != current or rec.get("labels_pending"):
                raise ApiError("FAILED_PRECONDITION", "Labels fingerprint either invalid or resource labels have changed",
                               http=412, reason="conditionNotMet")
            rec["labels_pending"] = True
            op = self._new_op(p, "setLabels", key, rec["instance"]["id"])
            self.w.later(SET_LABELS_S, "compute.set_labels_done", key=key, op=self._op_key(op), labels=body.get("labels") or {})
            self.w.changed()
            return copy.deepcopy(op)

    def _set_labels_done(self, key: str, op: str, labels: dict) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is not None:
                if labels:
                    rec["instance"]["labels"] = labels
                else:
                    rec["instance"].pop("labels", None)
                rec["instance"]["labelFingerprint"] = _fingerprint(labels)
                rec.pop("labels_pending", None)
            self._finish_op(op)
            self.w.changed()

    def set_metadata(self, p: dict, q: dict, body: dict) -> dict:
        """Replaces all metadata items; the fingerprint must match (as `gcloud compute ssh` relies on)."""
        key = self._key(p, p["instance"])
        with self.w.lock:
            rec = self._get(key)
            if body.get("fingerprint") != rec["instance"]["metadata"].get("fingerprint") or rec.get("metadata_pending"):
                raise ApiError("FAILED_PRECONDITION", "Supplied fingerprint does not match current metadata fingerprint.",
                               http=412, reason="conditionNotMet")
            rec["metadata_pending"] = True
            op = self._new_op(p, "setMetadata", key, rec["instance"]["id"])
            self.w.later(SET_METADATA_S, "compute.set_metadata_done", key=key, op=self._op_key(op),
                         items=body.get("items") or [])
            self.w.changed()
            return copy.deepcopy(op)

    def _set_metadata_done(self, key: str, op: str, items: list) -> None:
        with self.w.lock:
            rec = self.instances.get(key)
            if rec is not None:
                rec["instance"]["metadata"] = {"kind": "compute#metadata", "fingerprint": _fingerprint(items),
                                               **({"items": items} if items else {})}
                rec.pop("metadata_pending", None)
                if rec["endpoints"]:
                    meta = _metadata_dict(rec["instance"])
                    self.w.workers.update_keys(rec["worker_key"], self.w.worker_keys(rec["project"], meta, ssh_keys_of(meta)))
            self._finish_op(op)
            self.w.changed()

    def get_guest_attributes(self, p: dict, q: dict, body: None) -> dict:
        """What the guest published. Its host keys only with `enable-guest-attributes` on (instance metadata,
        else the project's), as Google's guest agent publishes them and gcloud looks for them
        (ssh_utils.GetHostKeysFromGuestAttributes); a namespace nobody wrote is 404 "The resource 'hostkeys/'
        of type 'Guest Attribute' was not found." (the text gcloud matches)."""
        key = self._key(p, p["instance"])
        path = q.get("queryPath") or ""
        projects = self.w.services.get("projects")
        with self.w.lock:
            rec = self._get(key)
            published = guest_flag("enable-guest-attributes", projects.project_metadata(rec["project"])
                                   if projects else {}, _metadata_dict(rec["instance"]))
            items = []
            for ep in rec["endpoints"]:
                key_type, _, data = ep["host_key"].partition(" ")
                if published and path in ("", "hostkeys/", f"hostkeys/{key_type}"):
                    items.append({"namespace": "hostkeys", "key": key_type, "value": data.split(" ")[0]})
                # Local stand-in for "sshd listens on 22": every worker is 127.0.0.1, so its guest publishes its
                # own port (as the TPU API's networkEndpoints[].port carries it for nodes; README "Workers").
                if path in ("", "localcloud/", "localcloud/ssh-port"):
                    items.append({"namespace": "localcloud", "key": "ssh-port", "value": str(ep["port"])})
        if not items:
            raise ApiError("NOT_FOUND", f"The resource '{path}' of type 'Guest Attribute' was not found.")
        return {"kind": "compute#guestAttributes", "queryPath": path, "queryValue": {"items": items},
                "selfLink": f"{ROOT}{key}/guestAttributes/{path}"}

    # ---------------------------------------------------------------------------------- operations
    def operations_get(self, p: dict, q: dict, body: None) -> dict:
        key = f"projects/{p['project']}/zones/{p['zone']}/operations/{p['operation']}"
        with self.w.lock:
            op = self.ops.get(key)
            if op is None:
                raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
            return copy.deepcopy(op)

    def operations_list(self, p: dict, q: dict, body: None) -> dict:
        """The zone's operations, oldest first, filtered: how Google's preemption-history sample finds
        preemptions (`operationType="compute.instances.preempted" AND targetLink:instances/NAME`)."""
        self._zone_ok(p["zone"])
        prefix = f"projects/{p['project']}/zones/{p['zone']}/operations/"
        pred = parse_filter(q.get("filter") or "")
        with self.w.lock:
            items = [copy.deepcopy(op) for k, op in self.ops.items() if k.startswith(prefix)]
        items = [op for op in items if pred(op)]
        page, token = paginate(items, q.get("maxResults"), q.get("pageToken"))
        return {"kind": "compute#operationList", "id": prefix.rstrip("/"), "items": page,
                "selfLink": f"{ROOT}{prefix.rstrip('/')}", **({"nextPageToken": token} if token else {})}

    def operations_wait(self, p: dict, q: dict, body: None) -> dict:
        """Blocks until the operation is DONE or WAIT_MAX_S pass (real: up to 2 minutes), then returns it."""
        key = f"projects/{p['project']}/zones/{p['zone']}/operations/{p['operation']}"
        deadline = time.monotonic() + WAIT_MAX_S
        with self.w.lock:
            while True:
                op = self.ops.get(key)
                if op is None:
                    raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
                left = deadline - time.monotonic()
                if op["status"] == "DONE" or left <= 0:
                    return copy.deepcopy(op)
                self.w.changed_cv.wait(timeout=min(left, 1.0))

    # ---------------------------------------------------------------------------------- zones, machine types
    def _zone_view(self, project: str, zone: str) -> dict:
        region = facts.region_of(zone)
        return {"kind": "compute#zone", "id": str(abs(hash(zone)) % 10**15), "name": zone, "status": "UP",
                "description": zone, "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
                "region": f"{ROOT}projects/{project}/regions/{region}",
                "selfLink": f"{ROOT}projects/{project}/zones/{zone}"}

    def zones_list(self, p: dict, q: dict, body: None) -> dict:
        items = [self._zone_view(p["project"], z) for z in facts.all_zones()]
        items = [z for z in items if parse_filter(q.get("filter") or "")(z)]
        page, token = paginate(items, q.get("maxResults"), q.get("pageToken"))
        return {"kind": "compute#zoneList", "id": f"projects/{p['project']}/zones", "items": page,
                "selfLink": f"{ROOT}projects/{p['project']}/zones", **({"nextPageToken": token} if token else {})}

    def zones_get(self, p: dict, q: dict, body: None) -> dict:
        self._zone_ok(p["zone"])
        return self._zone_view(p["project"], p["zone"])

    def machine_types_get(self, p: dict, q: dict, body: None) -> dict:
        self._zone_ok(p["zone"])
        mt = facts.MACHINE_TYPES.get(p["machineType"])
        tpu = facts.TPU_MACHINE_TYPES.get(p["machineType"])
        if tpu is not None and p["zone"] in tpu.zones:
            mt = (tpu.vcpus, tpu.memory_mb, False, 0.0)
        url = f"{ROOT}projects/{p['project']}/zones/{p['zone']}/machineTypes/{p['machineType']}"
        if mt is None:
            raise ApiError("NOT_FOUND", f"The resource '{url[len(ROOT):]}' was not found")
        cpus, mem, shared, _ = mt
        return {"kind": "compute#machineType", "id": str(abs(hash(p["machineType"])) % 10**12), "name": p["machineType"],
                "description": f"{cpus} vCPU, {mem / 1024:g} GB RAM", "guestCpus": cpus, "memoryMb": mem,
                "isSharedCpu": shared, "maximumPersistentDisks": 128, "maximumPersistentDisksSizeGb": "263168",
                "zone": p["zone"], "selfLink": url, "creationTimestamp": "1969-12-31T16:00:00.000-08:00"}

    def inventory(self) -> dict:
        with self.w.lock:
            return {"instances": [
                {"name": r["instance"]["name"], "project": r["project"], "zone": r["zone"],
                 "status": r["instance"]["status"], "machine_type": r["machine_type"],
                 "labels": r["instance"].get("labels", {}),
                 "workers": [dict(e, index=i) for i, e in enumerate(r["endpoints"])]}
                for r in self.instances.values()]}


# ------------------------------------------------------------------------------------------ filters
_TERM_RE = re.compile(r"""\(?\s*([A-Za-z_][\w.\-]*)\s*(=|!=|:|eq|ne)\s*("[^"]*"|'[^']*'|[^\s)]+)\s*\)?""")


def parse_filter(text: str):
    """A predicate for Compute's list `filter`: terms `field = value`, `field != value`, `field:*`
    (presence), `field:value` (contains), `labels.KEY = value`, joined by whitespace or AND. Values may end with `*` (prefix)."""
    text = text.strip()
    if not text:
        return lambda item: True
    terms = []
    rest = re.sub(r"\bAND\b", " ", text)
    pos = 0
    for m in _TERM_RE.finditer(rest):
        if rest[pos:m.start()].strip():
            raise ApiError("INVALID_ARGUMENT", f"Invalid list filter expression {text!r}.")
        pos = m.end()
        field, op, value = m.group(1), m.group(2), m.group(3).strip("'\"")
        terms.append((field.split("."), op, value))
    if rest[pos:].strip() or not terms:
        raise ApiError("INVALID_ARGUMENT", f"Invalid list filter expression {text!r}.")

    def lookup(item, path):
        for part in path:
            if not isinstance(item, dict) or part not in item:
                return None
            item = item[part]
        return item

    def pred(item) -> bool:
        for path, op, value in terms:
            actual = lookup(item, path)
            if op == ":":
                # `:` is "has": presence with `*`, else the value contained in the field (Google's
                # preemption-history sample: "it's `contains` not `equals`").
                ok = actual is not None if value == "*" else (actual is not None and value in str(actual))
            else:
                if value.endswith("*"):
                    eq = actual is not None and str(actual).startswith(value[:-1])
                else:
                    eq = actual is not None and str(actual) == value
                ok = eq if op in ("=", "eq") else not eq
            if not ok:
                return False
        return True

    return pred
