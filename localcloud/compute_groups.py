"""Compute v1 for multi-host TPU slices: regional workload policies, regional instance templates, zonal
managed instance groups (MIGs) and regional operations.

Google builds a multi-host TPU7x slice as a MIG of N `tpu7x-standard-4t` VMs whose
`resourcePolicies.workloadPolicy` names a HIGH_THROUGHPUT workload policy with the slice's
`acceleratorTopology` (compute/docs/tpus/create-tpu-mig-multi-host-slice). What is emulated:

- resourcePolicies insert/get/list/delete (regional). A policy in use by a MIG cannot be deleted (400).
- regionInstanceTemplates insert/get/list/delete. A template in use by a MIG cannot be deleted (400).
- instanceGroupManagers insert/get/list/delete/listManagedInstances (zonal). Insert checks that the template
  and the policy exist in the zone's region and, for a TPU machine type, that the policy carries an
  acceleratorTopology whose chips equal targetSize x chips per VM (400 otherwise). The MIG then inserts
  targetSize instances named `BASE-xxxx` from the template (metadata `instance-template` and `created-by` =
  the template and the MIG, under the project's number, as Compute does); an instance whose insert fails for
  capacity is retried every 30 simulated seconds and the MIG's managed instance shows `currentAction:
  CREATING` with the error in `lastAttempt`. Delete deletes every instance, then the MIG.
"""

from __future__ import annotations

import copy
import math
import random
import re
import string
import time
import uuid

from . import facts
from .compute import CREATING
from .core import ApiError, World, now_rfc3339

ROOT = "https://compute.googleapis.com/compute/v1/"
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
POLICY_S, TEMPLATE_S, MIG_S, RETRY_S = 2.0, 2.0, 5.0, 30.0


class ComputeGroupsService:
    def __init__(self, world: World, compute):
        self.w = world
        self.c = compute  # ComputeService: instances and the shared operations table
        self.policies: dict[str, dict] = {}   # "projects/P/regions/R/resourcePolicies/N" -> ResourcePolicy
        self.templates: dict[str, dict] = {}  # "projects/P/regions/R/instanceTemplates/N" -> InstanceTemplate
        self.migs: dict[str, dict] = {}       # "projects/P/zones/Z/instanceGroupManagers/N" -> record
        for action in ("op_done", "mig_fill", "mig_deleted"):
            world.actions[f"compute_groups.{action}"] = getattr(self, f"_{action}")

    def dump(self) -> dict:
        return {"policies": self.policies, "templates": self.templates, "migs": self.migs}

    def load(self, data: dict) -> None:
        self.policies = data.get("policies", {})
        self.templates = data.get("templates", {})
        self.migs = data.get("migs", {})

    def inventory(self) -> dict:
        """Live MIGs (with their instances' names), instance templates and resource policies: none of them is
        billed, but each is something a create left behind until a delete removes it."""
        def where(key: str) -> dict:
            parts = key.split("/")  # projects/P/{zones|regions}/L/collection/N
            return {"name": parts[5], "project": parts[1], "location": parts[3]}

        with self.w.lock:
            return {
                "instance_group_managers": [
                    {**where(k), "target_size": int(r["mig"].get("targetSize") or 0),
                     "instances": sorted(m.rsplit("/", 1)[-1] for m in r["members"])}
                    for k, r in self.migs.items()],
                "instance_templates": [where(k) for k in self.templates],
                "resource_policies": [where(k) for k in self.policies]}

    # ---------------------------------------------------------------------------------- operations
    def _region_op(self, project: str, region: str, op_type: str, target: str, target_id: str) -> dict:
        base = f"projects/{project}/regions/{region}"
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:13]}"
        op = {"kind": "compute#operation", "id": str(self.w.next_id()), "name": name, "region": f"{ROOT}{base}",
              "operationType": op_type, "targetLink": f"{ROOT}{target}", "targetId": target_id, "status": "RUNNING",
              "user": "localcloud@example.com", "progress": 0, "insertTime": now_rfc3339(),
              "startTime": now_rfc3339(), "selfLink": f"{ROOT}{base}/operations/{name}"}
        self.c.ops[f"{base}/operations/{name}"] = op
        return op

    def _op_done(self, op: str) -> None:
        with self.w.lock:
            self.c._finish_op(op)
            self.w.changed()

    def region_operations_get(self, p: dict, q: dict, body: None) -> dict:
        key = f"projects/{p['project']}/regions/{p['region']}/operations/{p['operation']}"
        with self.w.lock:
            op = self.c.ops.get(key)
            if op is None:
                raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
            return copy.deepcopy(op)

    def _region_ok(self, region: str) -> None:
        if region not in {facts.region_of(z) for z in facts.all_zones()}:
            raise ApiError("NOT_FOUND", f"The resource 'projects/-/regions/{region}' was not found")

    @staticmethod
    def _name(body: dict, what: str) -> str:
        name = body.get("name") or ""
        if not _NAME_RE.match(name):
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{what}.name': '{name}'. Must be a match of "
                           "regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'")
        return name

    def _insert_regional(self, table: dict, p: dict, body: dict, collection: str, kind: str, delay: float) -> dict:
        self._region_ok(p["region"])
        name = self._name(body, "resource")
        key = f"projects/{p['project']}/regions/{p['region']}/{collection}/{name}"
        with self.w.lock:
            if key in table:
                raise ApiError("ALREADY_EXISTS", f"The resource '{key}' already exists")
            item = copy.deepcopy(body)
            item.update(kind=kind, id=str(self.w.next_id()), creationTimestamp=now_rfc3339(),
                        region=f"{ROOT}projects/{p['project']}/regions/{p['region']}", selfLink=f"{ROOT}{key}")
            table[key] = item
            op = self._region_op(p["project"], p["region"], "insert", key, item["id"])
            self.w.later(delay, "compute_groups.op_done", op=self.c._op_key(op))
            self.w.changed()
            return copy.deepcopy(op)

    def _delete_regional(self, table: dict, p: dict, collection: str, ref: str, what: str) -> dict:
        key = f"projects/{p['project']}/regions/{p['region']}/{collection}/{p[ref]}"
        with self.w.lock:
            item = table.get(key)
            if item is None:
                raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
            users = [m["name"] for m in self.migs.values() if key in (m["template"], m["policy"])]
            if users:
                raise ApiError("INVALID_ARGUMENT", f"The {what} resource '{key}' is already being used by "
                               f"'{users[0]}'", http=400, reason="resourceInUseByAnotherResource")
            del table[key]
            op = self._region_op(p["project"], p["region"], "delete", key, item["id"])
            self.w.later(POLICY_S, "compute_groups.op_done", op=self.c._op_key(op))
            self.w.changed()
            return copy.deepcopy(op)

    def _get_regional(self, table: dict, p: dict, collection: str, ref: str) -> dict:
        key = f"projects/{p['project']}/regions/{p['region']}/{collection}/{p[ref]}"
        with self.w.lock:
            item = table.get(key)
            if item is None:
                raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
            return copy.deepcopy(item)

    def _list_regional(self, table: dict, p: dict, collection: str, kind: str) -> dict:
        prefix = f"projects/{p['project']}/regions/{p['region']}/{collection}/"
        with self.w.lock:
            items = [copy.deepcopy(v) for k, v in sorted(table.items()) if k.startswith(prefix)]
        return {"kind": kind, "id": prefix.rstrip("/"), "items": items, "selfLink": f"{ROOT}{prefix.rstrip('/')}"}

    # ---------------------------------------------------------------------------------- resource policies
    def policies_insert(self, p: dict, q: dict, body: dict) -> dict:
        wp = body.get("workloadPolicy")
        if wp is not None and not wp.get("type"):
            raise ApiError("INVALID_ARGUMENT", "Invalid value for field 'resource.workloadPolicy.type': ''.")
        return self._insert_regional(self.policies, p, body, "resourcePolicies", "compute#resourcePolicy", POLICY_S)

    def policies_get(self, p: dict, q: dict, body: None) -> dict:
        item = self._get_regional(self.policies, p, "resourcePolicies", "resourcePolicy")
        item["status"] = "READY"
        return item

    def policies_list(self, p: dict, q: dict, body: None) -> dict:
        return self._list_regional(self.policies, p, "resourcePolicies", "compute#resourcePolicyList")

    def policies_delete(self, p: dict, q: dict, body: None) -> dict:
        return self._delete_regional(self.policies, p, "resourcePolicies", "resourcePolicy", "resource policy")

    # ---------------------------------------------------------------------------------- instance templates
    def templates_insert(self, p: dict, q: dict, body: dict) -> dict:
        if not (body.get("properties") or {}).get("machineType"):
            raise ApiError("INVALID_ARGUMENT", "Invalid value for field 'resource.properties.machineType': ''.")
        return self._insert_regional(self.templates, p, body, "instanceTemplates", "compute#instanceTemplate",
                                     TEMPLATE_S)

    def templates_get(self, p: dict, q: dict, body: None) -> dict:
        return self._get_regional(self.templates, p, "instanceTemplates", "instanceTemplate")

    def templates_list(self, p: dict, q: dict, body: None) -> dict:
        return self._list_regional(self.templates, p, "instanceTemplates", "compute#instanceTemplateList")

    def templates_delete(self, p: dict, q: dict, body: None) -> dict:
        return self._delete_regional(self.templates, p, "instanceTemplates", "instanceTemplate", "instance template")

    # ---------------------------------------------------------------------------------- managed instance groups
    @staticmethod
    def _ref(url: str, zone: str, project: str, collection: str) -> str:
        m = re.search(rf"(?:^|/)(?:projects/[^/]+/)?regions/([^/]+)/{collection}/([^/]+)$", url or "")
        if not m:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value '{url}': must be a regional {collection} URL.")
        if m.group(1) != facts.region_of(zone):
            raise ApiError("INVALID_ARGUMENT", f"'{url}' is not in the region of zone {zone}.")
        return f"projects/{project}/regions/{m.group(1)}/{collection}/{m.group(2)}"

    def migs_insert(self, p: dict, q: dict, body: dict) -> dict:
        self.c._zone_ok(p["zone"])
        name = self._name(body, "resource")
        key = f"projects/{p['project']}/zones/{p['zone']}/instanceGroupManagers/{name}"
        size = int(body.get("targetSize") or 0)
        with self.w.lock:
            if key in self.migs:
                raise ApiError("ALREADY_EXISTS", f"The resource '{key}' already exists")
            tkey = self._ref(body.get("instanceTemplate"), p["zone"], p["project"], "instanceTemplates")
            template = self.templates.get(tkey)
            if template is None:
                raise ApiError("NOT_FOUND", f"The resource '{tkey}' was not found")
            policy_url = (body.get("resourcePolicies") or {}).get("workloadPolicy")
            pkey = self._ref(policy_url, p["zone"], p["project"], "resourcePolicies") if policy_url else None
            policy = self.policies.get(pkey) if pkey else None
            if pkey and policy is None:
                raise ApiError("NOT_FOUND", f"The resource '{pkey}' was not found")
            mt = template["properties"]["machineType"].rsplit("/", 1)[-1]
            tpu = facts.TPU_MACHINE_TYPES.get(mt)
            if tpu is not None and size > 1:
                topology = ((policy or {}).get("workloadPolicy") or {}).get("acceleratorTopology") or ""
                dims = [int(d) for d in topology.split("x") if d.isdigit()]
                if not dims or math.prod(dims) != size * tpu.chips:
                    raise ApiError("INVALID_ARGUMENT", f"A managed instance group of {size} {mt} instances needs a "
                                   f"workload policy whose acceleratorTopology has {size * tpu.chips} chips "
                                   f"(got '{topology}').")
            mig = copy.deepcopy(body)
            mig.update(kind="compute#instanceGroupManager", id=str(self.w.next_id()),
                       creationTimestamp=now_rfc3339(), zone=f"{ROOT}projects/{p['project']}/zones/{p['zone']}",
                       selfLink=f"{ROOT}{key}", fingerprint="AAAAAAAAAAA=",
                       instanceGroup=f"{ROOT}projects/{p['project']}/zones/{p['zone']}/instanceGroups/{name}")
            rec = {"mig": mig, "name": name, "project": p["project"], "zone": p["zone"], "template": tkey,
                   "policy": pkey, "members": {}, "deleting": False}
            self.migs[key] = rec
            op = self.c._new_op(p, "insert", key, mig["id"])
            self.w.later(MIG_S, "compute_groups.op_done", op=self.c._op_key(op))
            self.w.later(0.0, "compute_groups.mig_fill", key=key)
            self.w.changed()
            return copy.deepcopy(op)

    def _mig_fill(self, key: str) -> None:
        """Insert instances until the MIG has targetSize of them (retrying the ones capacity refused)."""
        with self.w.lock:
            rec = self.migs.get(key)
            if rec is None or rec["deleting"]:
                return
            self._reap(rec)
            missing = int(rec["mig"].get("targetSize") or 0) - len(rec["members"])
            props = copy.deepcopy(self.templates[rec["template"]]["properties"])
        for _ in range(max(0, missing)):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=4))
            body = copy.deepcopy(props)
            body["name"] = f"{rec['mig'].get('baseInstanceName') or rec['name']}-{suffix}"
            body["machineType"] = f"zones/{rec['zone']}/machineTypes/{props['machineType'].rsplit('/', 1)[-1]}"
            # Compute adds `instance-template` and `created-by` to each instance a MIG makes, naming the project
            # by its number, not its id (gcpdiag gce.py: "note how it uses a project number and not a project
            # id"; forseti-security's recorded instances.list responses).
            base = f"projects/{facts.project_number(rec['project'])}"
            added = {"instance-template": f"{base}/{rec['template'].split('/', 2)[2]}",
                     "created-by": f"{base}/{key.split('/', 2)[2]}"}
            items = [i for i in (body.get("metadata") or {}).get("items", []) if i.get("key") not in added]
            items += [{"key": k, "value": v} for k, v in added.items()]
            body["metadata"] = {"items": items}
            ikey = f"projects/{rec['project']}/zones/{rec['zone']}/instances/{body['name']}"
            with self.w.lock:  # re-entrant: the member is marked before its insert can fail
                try:
                    self.c.insert({"project": rec["project"], "zone": rec["zone"]}, {}, body)
                except ApiError as err:
                    # A quota refusal reads as Compute's operations name it (QUOTA_EXCEEDED), not as its HTTP 403.
                    code = "QUOTA_EXCEEDED" if err.reason == "quotaExceeded" else err.status
                    rec["last_error"] = {"code": code, "message": err.message}
                    continue
                rec["members"][ikey] = {"name": body["name"]}
                self.c.instances[ikey]["mig"] = key
        with self.w.lock:
            self.w.changed()

    def _reap(self, rec: dict) -> None:
        """Forget members whose insert failed (the instance is gone); remember why, and try again later."""
        gone = [k for k in rec["members"] if k not in self.c.instances]
        for k in gone:
            del rec["members"][k]
        if gone and not rec["deleting"]:
            rec["last_error"] = {"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                 "message": f"The zone 'projects/{rec['project']}/zones/{rec['zone']}' does not "
                                            "have enough resources available to fulfill the request."}

    def member_failed(self, mig_key: str) -> None:
        """Called by ComputeService when a member's insert failed: retry in RETRY_S simulated seconds."""
        rec = self.migs.get(mig_key)
        if rec is not None and not rec["deleting"]:
            self._reap(rec)
            self.w.later(RETRY_S, "compute_groups.mig_fill", key=mig_key)

    def _view(self, rec: dict) -> dict:
        mig = copy.deepcopy(rec["mig"])
        statuses = [self.c.instances[k]["instance"]["status"] for k in rec["members"] if k in self.c.instances]
        creating = len(rec["members"]) < int(mig.get("targetSize") or 0) or any(s in CREATING for s in statuses)
        mig["status"] = {"isStable": not creating and not rec["deleting"]}
        mig["currentActions"] = {"creating": sum(s in CREATING for s in statuses)
                                 + max(0, int(mig.get("targetSize") or 0) - len(rec["members"])),
                                 "none": sum(s == "RUNNING" for s in statuses),
                                 "deleting": len(statuses) if rec["deleting"] else 0}
        return mig

    def _mig(self, p: dict) -> tuple[str, dict]:
        key = f"projects/{p['project']}/zones/{p['zone']}/instanceGroupManagers/{p['instanceGroupManager']}"
        rec = self.migs.get(key)
        if rec is None:
            raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
        return key, rec

    def migs_get(self, p: dict, q: dict, body: None) -> dict:
        with self.w.lock:
            return self._view(self._mig(p)[1])

    def migs_list(self, p: dict, q: dict, body: None) -> dict:
        self.c._zone_ok(p["zone"])
        prefix = f"projects/{p['project']}/zones/{p['zone']}/instanceGroupManagers/"
        with self.w.lock:
            items = [self._view(r) for k, r in sorted(self.migs.items()) if k.startswith(prefix)]
        return {"kind": "compute#instanceGroupManagerList", "id": prefix.rstrip("/"), "items": items,
                "selfLink": f"{ROOT}{prefix.rstrip('/')}"}

    def migs_list_managed_instances(self, p: dict, q: dict, body: None) -> dict:
        with self.w.lock:
            _, rec = self._mig(p)
            out = []
            for k, member in sorted(rec["members"].items()):
                inst = self.c.instances.get(k)
                # instanceStatus: "This field is empty when the instance does not exist" (discovery document).
                status = inst["instance"]["status"] if inst else None
                action = ("DELETING" if rec["deleting"] else
                          "CREATING" if status is None or status in CREATING else "NONE")
                out.append({"instance": f"{ROOT}{k}", "name": member["name"], "currentAction": action,
                            **({"instanceStatus": status, "id": inst["instance"]["id"]} if inst else {})})
            for _ in range(max(0, int(rec["mig"].get("targetSize") or 0) - len(rec["members"]))):
                entry = {"currentAction": "CREATING"}
                if rec.get("last_error"):
                    entry["lastAttempt"] = {"errors": {"errors": [rec["last_error"]]}}
                out.append(entry)
        return {"managedInstances": out}

    def migs_delete(self, p: dict, q: dict, body: None) -> dict:
        with self.w.lock:
            key, rec = self._mig(p)
            op = self.c._new_op(p, "delete", key, rec["mig"]["id"])
            rec["deleting"] = True
            members = list(rec["members"])
            self.w.changed()
        for k in members:
            name = k.rsplit("/", 1)[-1]
            try:
                self.c.delete({"project": rec["project"], "zone": rec["zone"], "instance": name}, {}, None)
            except ApiError:
                pass  # already gone
        with self.w.lock:
            self.w.later(MIG_S, "compute_groups.mig_deleted", key=key, op=self.c._op_key(op))
            self.w.changed()
            return copy.deepcopy(op)

    def _mig_deleted(self, key: str, op: str) -> None:
        with self.w.lock:
            rec = self.migs.get(key)
            if rec is not None and any(k in self.c.instances for k in rec["members"]):
                self.w.later(MIG_S, "compute_groups.mig_deleted", key=key, op=op)  # members still deleting
                return
            self.migs.pop(key, None)
            self.c._finish_op(op)
            self.w.changed()
