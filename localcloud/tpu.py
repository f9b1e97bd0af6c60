"""Cloud TPU v2: nodes, queued resources, operations, accelerator types, runtime versions.

Bodies here are in discovery form (enums as names); the server converts the client's integer enums at
the edge. Every transition that takes time is a named action on the world's scheduler. Billing: a node
is metered from when it is READY until its deletion finishes, except while STOPPED or PREEMPTED; a Spot or
preemptible node preempted in the first minute after its creation is not charged (README, "Billing meter").
"""

from __future__ import annotations

import copy
import hashlib
import re
import time
import uuid

from . import facts
from . import metadata as guest
from .core import CODE_OF, ApiError, World, check_labels, now_rfc3339, parse_duration, parse_time
from .workers import TERM_GRACE_S

# Simulated latencies in seconds (divided by the world's speed).
CREATE_S, DELETE_S, STOP_S, START_S, UPDATE_S = 180.0, 90.0, 60.0, 90.0, 5.0
REPAIR_S = 120.0
CAPACITY_FAIL_S = 20.0
IMAGE_POLL_S = 1.0  # real seconds between looks at a runtime image that is still building
QR_ACCEPT_S, QR_TICK_S, QR_DELETE_S = 2.0, 10.0, 5.0
# "You are not charged for TPUs if they are preempted in the first minute after you create them"
# (tpu/docs/preemptible): wall-clock seconds, like every billed time.
PREEMPT_FREE_S = 60.0
# A preempted guest gets an ACPI G2 Soft Off (its OS shuts down: SIGTERM to its processes) and 30 s before the
# G3 Mechanical Off on a Spot VM (compute.v1 `Scheduling.skipGuestOsShutdown`; a TPU VM is a Compute Engine
# VM, tpu/docs/prepare-for-maintenance), its metadata server's `instance/preempted` TRUE meanwhile
# (compute/docs/instances/create-use-spot, "Detect preemption"). Simulated seconds, but never shorter than the
# real seconds a process gets to end on any stop (workers.TERM_GRACE_S): a save takes real time at any speed.
PREEMPT_NOTICE_S = 30.0
# Multislice auto repair (tpu/docs/multislice-introduction, "Auto repair": "When a slice encounters a maintenance
# event, preemption, or hardware failure, Cloud TPU will create a new slice ... After the new slice is created,
# all other slices in the Multislice environment will be restarted so training can continue"). Inferred, as
# Google documents none of them: the seconds from the lost slice's power-off to its re-creation, the queued
# resource staying ACTIVE throughout (SUSPENDED is "no longer eligible for further allocation", which a repair
# contradicts), the new slice being a node of the same name CREATING -> READY, and the others' restart showing
# as RESTARTING with health UNHEALTHY_MAINTENANCE for REPAIR_S.
SLICE_REPAIR_S = 30.0

_ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# queuedResourceId and nodeSpec.nodeId "Should follow the `^[A-Za-z0-9_.~+%-]+$` regex format" (tpu v2 discovery).
_QR_ID_RE = re.compile(r"^[A-Za-z0-9_.~+%-]+$")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
# nodes.patch updateMask: "Supported fields: [description, tags, labels, metadata,
# network_config.enable_external_ips]" (tpu v2 discovery document).
_UPDATABLE = {"labels", "metadata", "description", "tags", "networkConfig.enableExternalIps"}
NODE_TYPE = "type.googleapis.com/google.cloud.tpu.v2.Node"
QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
# What the local cloud tells a TPU VM worker instead of giving it chips: "rehearse this job on the CPU". A
# job that finds a TPU VM (by its metadata) but no chips and no such flag must fail, as on a broken real VM.
CPU_REHEARSAL_VAR = "LOCALCLOUD_TPU_REHEARSAL"
DEFAULT_SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]


def not_found(name: str) -> ApiError:
    """Google's 404 for a resource: its name in the message and in a google.rpc.ResourceInfo detail, as gcloud
    prints the TPU API's answer ("NOT_FOUND: Resource '...' was not found" then "- '@type':
    type.googleapis.com/google.rpc.ResourceInfo resourceName: ...")."""
    return ApiError("NOT_FOUND", f"Resource '{name}' was not found", details=[_resource_info(name)])


def already_exists(name: str) -> ApiError:
    """Google's 409 for a name taken, shaped as `not_found` (gcloud: "ALREADY_EXISTS: Resource '...' already
    exists" then the ResourceInfo, skypilot-org/skypilot#129)."""
    return ApiError("ALREADY_EXISTS", f"Resource '{name}' already exists", details=[_resource_info(name)])


def _resource_info(name: str) -> dict:
    return {"@type": "type.googleapis.com/google.rpc.ResourceInfo", "resourceName": name}


def _at_path(body: dict, path: str):
    """The value at an updateMask path ("networkConfig.enableExternalIps") of a request body; None if absent."""
    for part in path.split("."):
        body = body.get(part) if isinstance(body, dict) else None
    return body


def capacity_message(zone: str) -> str:
    return (f'There is no more capacity in the zone "{zone}"; you can try in another zone where Cloud TPU '
            "Nodes are offered (see https://cloud.google.com/tpu/docs/regions) [EID: 0x1d2c3b4a5f6e7d8c]")


# A stockout's operation error, by code, as Google words each (README "Faults" cites the sources). Code 13
# carries no structured detail: only the text tells a stockout from any other internal error.
STOCKOUT = {
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    13: "INTERNAL",
}


def stockout_message(code: int, zone: str) -> str:
    if code == 9:
        return "Insufficient reserved capacity. Contact customer support to increase your reservation. [EID: 0x2f8bc266e74261a]"
    if code == 13:
        return "An internal error has occurred. [EID: 0x4c1d3e5f6a7b8c9d]"
    return capacity_message(zone)


# Google's code-3 answer to an update of a PREEMPTED node, which is also how the create operation of a Spot
# TPU preempted while CREATING fails (README "Faults").
PREEMPTED_UPDATE = "Cloud TPU received a bad request. update is not supported while in state PREEMPTED"


def ssh_keys_of(metadata: dict | None) -> list[str]:
    """The `ssh-keys` metadata lines "USER:KEY [COMMENT]" a guest admits, each for its USER only, as Google's
    guest agent writes every key into that user's authorized_keys alone (guest-agent `non_windows_accounts.go`);
    a line without a user is "invalid ssh key entry - unrecognized format. Expecting user:ssh-key" (its
    `GetUserKey`) and admits nobody."""
    lines = []
    for line in (metadata or {}).get("ssh-keys", "").splitlines():
        user, sep, key = line.strip().partition(":")
        if sep and user and key.strip():
            lines.append(f"{user}:{key.strip()}")
    return lines


def paginate(items: list, size: str | None, token: str | None) -> tuple[list, str]:
    start = int(token) if token and token.isdigit() else 0
    n = int(size) if size and str(size).isdigit() and int(size) > 0 else len(items) or 1
    page = items[start:start + n]
    return page, (str(start + n) if start + n < len(items) else "")


class TpuService:
    name = "tpu"

    def __init__(self, world: World):
        self.w = world
        self.nodes: dict[str, dict] = {}       # full node name -> record
        self.queued: dict[str, dict] = {}      # full QR name -> record
        self.ops: dict[str, dict] = {}         # full operation name -> Operation body
        for action in ("create_done", "create_failed", "delete_done", "stop_done", "start_done", "update_done",
                       "preempt", "power_off", "repair_done", "qr_accept", "qr_tick", "qr_delete_done", "qr_expire",
                       "slice_repair"):
            world.actions[f"tpu.{action}"] = getattr(self, f"_{action}")

    # ---------------------------------------------------------------------------------- persistence
    def dump(self) -> dict:
        return {"nodes": self.nodes, "queued": self.queued, "ops": self.ops}

    def load(self, data: dict) -> None:
        self.nodes = data.get("nodes", {})
        self.queued = data.get("queued", {})
        self.ops = data.get("ops", {})
        for rec in self.nodes.values():
            rec["endpoints"] = []  # the old SSH servers died with the old process

    def restore_workers(self) -> None:
        """After a restart: start worker SSH servers again for every node that should have them."""
        with self.w.lock:
            running = [name for name, rec in self.nodes.items() if rec["node"]["state"] == "READY"]
        for name in running:
            self._boot_workers(name)
        with self.w.lock:
            self.w.changed()

    # ---------------------------------------------------------------------------------- helpers
    def _parent(self, p: dict) -> str:
        return f"projects/{p['projectsId']}/locations/{p['locationsId']}"

    def _zone_ok(self, zone: str, parent: str) -> None:
        if not _ZONE_RE.match(zone):
            raise ApiError("NOT_FOUND", f"Location {parent} not found.")

    def _node(self, name: str) -> dict:
        rec = self.nodes.get(name)
        if rec is None:
            raise not_found(name)
        return rec

    def in_use(self, project: str, zone: str) -> list[tuple[str, bool]]:
        """(accelerator type, draws on the preemptible quota) of every node `project` holds in `zone`, for the
        quota check: spot and preemptible nodes, and those of a flex-start queued resource."""
        with self.w.lock:
            return [(rec["type"], rec["spot"] or self._flex_start(rec)) for rec in self.nodes.values()
                    if rec["project"] == project and rec["zone"] == zone]

    def _flex_start(self, rec: dict) -> bool:
        qr = self.queued.get(rec["node"].get("queuedResource") or "")
        return qr is not None and qr["qr"].get("provisioningModel") == "FLEX_START"

    def view(self, rec: dict) -> dict:
        """The Node body a GET returns."""
        node = copy.deepcopy(rec["node"])
        external = (node.get("networkConfig") or {}).get("enableExternalIps", False)
        eps = []
        for i in range(rec["hosts"]):
            ep: dict = {"ipAddress": "127.0.0.1"}
            if i < len(rec["endpoints"]):
                ep["port"] = rec["endpoints"][i]["port"]
            if external:
                ep["accessConfig"] = {"externalIp": "127.0.0.1"}
            eps.append(ep)
        node["networkEndpoints"] = eps
        return node

    def _new_op(self, parent: str, target: str, verb: str) -> dict:
        """A new pending operation, stored. A handler answers with a copy: the clock thread may finish the stored
        one while the server still encodes the answer (Google answers with the operation as it was then)."""
        op_id = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}"
        op = {
            "name": f"{parent}/operations/{op_id}",
            "metadata": {"@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata",
                         "createTime": now_rfc3339(), "target": target, "verb": verb,
                         "cancelRequested": False, "apiVersion": "v2"},
            "done": False,
        }
        self.ops[op["name"]] = op
        return op

    def _finish_op(self, op_name: str | None, *, response: dict | None = None, type_url: str = NODE_TYPE,
                   error: tuple[str, str] | None = None) -> None:
        op = self.ops.get(op_name or "")
        if op is None or op["done"]:
            return
        op["done"] = True
        op["metadata"]["endTime"] = now_rfc3339()
        if error:
            op["error"] = {"code": CODE_OF[error[0]], "message": error[1]}
        else:
            op["response"] = {"@type": type_url, **(response or {})}

    def _meter(self, rec: dict) -> None:
        node = rec["node"]
        spot = rec["spot"]
        t = facts.TPU_TYPES[rec["type"]]
        region = facts.region_of(rec["zone"])
        # Where no spot price is published (v2 outside us-central1) the on-demand price bounds the bill.
        pod = t.hosts > 1
        price = (facts.tpu_price(t.generation, region, spot, pod=pod)
                 or facts.tpu_price(t.generation, region, False, pod=pod) or 0.0)
        sku = f"tpu/{t.name}/{rec['zone']}/{'spot' if spot else 'on-demand'}"
        self.w.meter.begin(node["name"], "tpu", sku, price * t.chips)

    def resolve_type(self, node: dict, zone: str) -> facts.TpuType:
        """Check accelerator, zone and runtime as the real API does; returns the type."""
        name, config = node.get("acceleratorType"), node.get("acceleratorConfig")
        if name and config:
            raise ApiError("INVALID_ARGUMENT", "Only one of acceleratorType and acceleratorConfig may be set.")
        if config:
            t = facts.tpu_type_for_config(config.get("type", ""), config.get("topology", ""))
            if t is None:
                raise ApiError("INVALID_ARGUMENT", f"Invalid acceleratorConfig: type {config.get('type')} "
                               f"with topology {config.get('topology')!r} is not a supported configuration.")
        elif name:
            t = facts.TPU_TYPES.get(name)
            if t is None:
                raise ApiError("INVALID_ARGUMENT", f'Accelerator type "{name}" is not a valid accelerator type.')
        else:
            raise ApiError("INVALID_ARGUMENT", "One of acceleratorType or acceleratorConfig must be set.")
        if zone not in t.zones:
            raise ApiError("INVALID_ARGUMENT", "Cloud TPU received a bad request. The requested accelerator "
                           f'configuration for accelerator type, "{t.name}", could not be found in the zonal '
                           f'accelerator configurations for "{zone}".; the accelerator {t.name} was not found in '
                           f"zone {zone}")
        runtime = node.get("runtimeVersion")
        if not runtime:
            raise ApiError("INVALID_ARGUMENT", "runtimeVersion is required.")
        if runtime not in t.runtimes:
            raise ApiError("INVALID_ARGUMENT", f'Runtime version "{runtime}" is not supported for accelerator '
                           f'type "{t.name}" (generation {t.generation}).')
        check_labels(node.get("labels"), "node.labels")
        sched = node.get("schedulingConfig") or {}
        if sched.get("spot") and sched.get("preemptible"):
            raise ApiError("INVALID_ARGUMENT", "schedulingConfig: spot and preemptible are mutually exclusive.")
        return t

    def _new_node(self, parent: str, project: str, zone: str, node_id: str, body: dict, t: facts.TpuType,
                  queued: str | None = None) -> dict:
        name = f"{parent}/nodes/{node_id}"
        node = copy.deepcopy(body)
        node.update(name=name, state="CREATING", createTime=now_rfc3339(), id=str(self.w.next_id()),
                    apiVersion="V2", acceleratorType=t.name,
                    acceleratorConfig={"type": t.api_type, "topology": t.topology})
        node.setdefault("networkConfig", {"network": f"projects/{project}/global/networks/default",
                                          "subnetwork": f"projects/{project}/regions/{facts.region_of(zone)}/subnetworks/default",
                                          "enableExternalIps": False})
        if queued:
            node["queuedResource"] = queued
        sched = node.get("schedulingConfig") or {}
        rec = {"node": node, "project": project, "zone": zone, "type": t.name, "hosts": t.hosts,
               "spot": bool(sched.get("spot") or sched.get("preemptible")), "endpoints": [],
               "worker_key": f"tpu-{project}-{zone}-{node_id}", "create_op": None, "delete_ops": []}
        self.nodes[name] = rec
        return rec

    def _start_create(self, rec: dict, method: str) -> None:
        zone = rec["zone"]
        name = rec["node"]["name"]
        if self.w.faults.take("stuck", "tpu", method, zone):
            return
        if rec["spot"] and self.w.faults.take("preempt-creating", "tpu", method, zone):
            # The capacity is reclaimed before the node is READY: the node is PREEMPTED and its create
            # operation fails with code 3 (see `_preempt`).
            self.w.later(min(CREATE_S, CAPACITY_FAIL_S), "tpu.preempt", node=name)
            return
        fault = self.w.faults.take("capacity", "tpu", method, zone)
        if fault:
            code = fault.code or 8
            self.w.later(min(CREATE_S, CAPACITY_FAIL_S), "tpu.create_failed", node=name,
                         message=stockout_message(code, zone), code=code)
            return
        self.w.later(CREATE_S, "tpu.create_done", node=name)

    # ---------------------------------------------------------------------------------- workers
    def _boot_workers(self, name: str) -> None:
        """Start the node's worker SSH servers (blocking, outside the lock) and record their endpoints.

        The environment carries no node identity (no TPU_NAME, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES: real TPU
        VMs set none); workers read it from their metadata server (`guest_metadata`).
        """
        with self.w.lock:
            rec = self.nodes.get(name)
            if rec is None:
                return
            node = rec["node"]
            key, count = rec["worker_key"], rec["hosts"]
            env = {"STORAGE_EMULATOR_HOST": self.w.storage_host, CPU_REHEARSAL_VAR: "cpu"}
            keys = self.w.worker_keys(rec["project"], node.get("metadata"), ssh_keys_of(node.get("metadata")))
            script = (node.get("metadata") or {}).get("startup-script")
            runtime = node.get("runtimeVersion")
        endpoints = self.w.workers.start_node(key, count, env, keys, script, runtime,
                                              metadata=lambda index: self.guest_metadata(name, index))
        with self.w.lock:
            rec = self.nodes.get(name)
            if rec is None or rec["node"]["state"] in ("DELETING", "STOPPING", "STOPPED", "PREEMPTED"):
                self.w.workers.stop_node(key)
                return
            rec["endpoints"] = [{"host": e.host, "port": e.port, "host_key": e.host_key} for e in endpoints]

    def guest_metadata(self, name: str, index: int) -> guest.Tree | None:
        """What worker `index` of node `name` reads from its metadata server, from the node as it is now.

        The TPU attributes (`accelerator-type`, `agent-worker-number`, `worker-network-endpoints` as
        "hostname:uid:ip" triples, `tpu-env` as `KEY: 'value'` lines) are the ones JAX's and PyTorch/XLA's
        TPU detection read; the node's own metadata (ssh-keys, startup-script, enable-oslogin, ...) is there too.
        """
        with self.w.lock:
            rec = self.nodes.get(name)
            if rec is None:
                return None
            node, project, zone = rec["node"], rec["project"], rec["zone"]
            t = facts.TPU_TYPES[rec["type"]]
            number = facts.project_number(project)
            node_id = name.rsplit("/", 1)[-1]
            # TPU VM hosts are named t1v-n-<hex>-w-<worker>, not after the node; the node's name is NODE_ID.
            hosts = [f"t1v-n-{hashlib.sha256(name.encode()).hexdigest()[:8]}-w-{i}" for i in range(rec["hosts"])]
            tpu_env = {
                "ACCELERATOR_TYPE": t.name, "CONSUMER_PROJECT_ID": project, "CONSUMER_PROJECT_NUMBER": number,
                "NODE_ID": node_id, "PREEMPTIBLE": str(rec["spot"]).lower(), "SERVICE_NAME": "tpu.googleapis.com",
                "TOPOLOGY": t.topology, "TYPE": t.api_type, "UID": node["id"], "WORKER_ID": str(index), "ZONE": zone,
            }
            if rec.get("slice"):
                tpu_env.update(self._megascale(rec["slice"]))
            attributes = {
                **(node.get("metadata") or {}),
                "accelerator-type": t.name,
                "agent-worker-number": str(index),
                "worker-network-endpoints": ",".join(f"{h}:{node['id']}:127.0.0.1" for h in hosts),
                "tpu-env": "".join(f"{k}: '{v}'\n" for k, v in sorted(tpu_env.items())),
            }
            account = node.get("serviceAccount") or {}
            email = account.get("email") or f"{number}-compute@developer.gserviceaccount.com"
            return guest.guest_tree(
                project=project, number=number, zone=zone, name=hosts[index], instance_id=f"{node['id']}{index}",
                attributes=attributes, service_account=(email, list(account.get("scope") or DEFAULT_SCOPES)),
                tokens=self.w.tokens, preempted=bool(rec.get("preempted")))

    def _megascale(self, sl: dict) -> dict[str, str]:
        """The multislice keys of a slice's `tpu-env`, which JAX reads there on a queued resource's TPU VMs
        (`jax/_src/clusters/cloud_tpu_cluster.py`: "For both GCE via QueuedResources and GKE via JobSet, the
        Megascale coordinator address is set as the host with process id = 0"): the first slice's worker 0,
        the number of slices and this slice's index. The value's form (an address, as a node's endpoints
        give it) is inferred: JAX keeps what precedes a ':'."""
        first = self.nodes.get(sl["coordinator"])
        address = self.view(first)["networkEndpoints"][0]["ipAddress"] if first else "127.0.0.1"
        return {"MEGASCALE_COORDINATOR_ADDRESS": address, "MEGASCALE_NUM_SLICES": str(sl["count"]),
                "MEGASCALE_SLICE_ID": str(sl["id"])}

    def _stop_workers(self, rec: dict) -> None:
        rec["endpoints"] = []
        self.w.workers.stop_node(rec["worker_key"])

    # ---------------------------------------------------------------------------------- nodes
    def nodes_create(self, p: dict, q: dict, body: dict) -> dict:
        parent = self._parent(p)
        zone = p["locationsId"]
        self._zone_ok(zone, parent)
        node_id = q.get("nodeId") or ""
        if not _ID_RE.match(node_id):
            raise ApiError("INVALID_ARGUMENT", f"Invalid nodeId {node_id!r}: must match [a-z]([-a-z0-9]*[a-z0-9])?, at most 63 characters.")
        t = self.resolve_type(body, zone)
        with self.w.lock:
            if f"{parent}/nodes/{node_id}" in self.nodes:
                raise already_exists(f"{parent}/nodes/{node_id}")
            rec = self._new_node(parent, p["projectsId"], zone, node_id, body, t)
            op = self._new_op(parent, rec["node"]["name"], "create")
            rec["create_op"] = op["name"]
            self._start_create(rec, "nodes.create")
            self.w.changed()
            return copy.deepcopy(op)

    def _create_done(self, node: str) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != "CREATING":
                return
            runtime = rec["node"].get("runtimeVersion")
        if self.w.python is not None:
            # The node boots once its runtime image exists: the first node of a runtime waits for the
            # image venv's build (minutes), as a VM waits for its boot disk.
            state, detail = self.w.python.prepare(runtime)
            if state == "building":
                self.w.later(IMAGE_POLL_S * self.w.speed, "tpu.create_done", node=node)
                return
            if state == "failed":
                self._create_failed(node, f"localcloud could not build the {runtime} image: {detail}", code=13)
                return
        self._boot_workers(node)
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != "CREATING":
                return
            rec["node"]["state"] = "READY"
            rec["node"]["health"] = "HEALTHY"
            self._meter(rec)  # "Charges for Cloud TPU accrue while your TPU node is in a READY state"
            self._finish_op(rec["create_op"], response=self.view(rec))
            qr = self.queued.get(rec["node"].get("queuedResource", ""))
            if qr and qr["qr"]["state"]["state"] == "PROVISIONING" and all(
                    self.nodes.get(n, {}).get("node", {}).get("state") == "READY" for n in qr["nodes"]):
                self._qr_state(qr, "ACTIVE")
                self._schedule_flex_end(qr)
            if rec.pop("restart_others", False) and qr:  # a repaired slice: "all other slices ... restarted"
                for other in qr["nodes"]:
                    if other != node and self.nodes.get(other, {}).get("node", {}).get("state") == "READY":
                        self.repair(other, "RESTARTING")
            self.w.changed()

    def _create_failed(self, node: str, message: str, code: int = 8) -> None:
        with self.w.lock:
            rec = self.nodes.pop(node, None)
            if rec is None:
                return
            self.w.meter.end(node)
            self._finish_op(rec["create_op"], error=(STOCKOUT[code], message))
            self.w.changed()

    def nodes_get(self, p: dict, q: dict, body: None) -> dict:
        with self.w.lock:
            return self.view(self._node(f"{self._parent(p)}/nodes/{p['nodesId']}"))

    def nodes_list(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        with self.w.lock:
            prefix = f"projects/{p['projectsId']}/locations/" if p["locationsId"] == "-" else f"{parent}/nodes/"
            nodes = [self.view(r) for n, r in sorted(self.nodes.items()) if n.startswith(prefix)]
        page, token = paginate(nodes, q.get("pageSize"), q.get("pageToken"))
        out: dict = {"nodes": page}
        if token:
            out["nextPageToken"] = token
        return out

    def nodes_delete(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        name = f"{parent}/nodes/{p['nodesId']}"
        with self.w.lock:
            rec = self._node(name)
            op = self._new_op(parent, name, "delete")
            rec["delete_ops"].append(op["name"])
            if rec["node"]["state"] != "DELETING":
                self._begin_delete(rec, "nodes.delete")
            elif not self.w.faults.take("stuck", "tpu", "nodes.delete", rec["zone"]):
                # A repeated delete of a node whose delete never finished (a stuck fault, a daemon restart)
                # finishes it, as a retry does on Google's side; a second completion is a no-op.
                self.w.later(DELETE_S, "tpu.delete_done", node=name)
            self.w.changed()
            return copy.deepcopy(op)

    def _begin_delete(self, rec: dict, method: str) -> None:
        name = rec["node"]["name"]
        qr = self.queued.get(rec["node"].get("queuedResource", ""))
        if qr and qr["qr"]["state"]["state"] == "ACTIVE" and method == "nodes.delete":
            self._qr_state(qr, "SUSPENDING", initiator="USER")
        if rec["node"]["state"] == "CREATING":
            self._finish_op(rec["create_op"], error=("ABORTED", f"Node {name} was deleted while it was being created."))
        rec["node"]["state"] = "DELETING"
        self._stop_workers(rec)
        if not self.w.faults.take("stuck", "tpu", method, rec["zone"]):
            self.w.later(DELETE_S, "tpu.delete_done", node=name)

    def _delete_done(self, node: str) -> None:
        with self.w.lock:
            rec = self.nodes.pop(node, None)
            if rec is None:
                return
            self.w.meter.end(node)
            for op in rec["delete_ops"]:
                self._finish_op(op, type_url=EMPTY_TYPE)
            qr = self.queued.get(rec["node"].get("queuedResource", ""))
            if qr and qr["qr"]["state"]["state"] in ("ACTIVE", "SUSPENDING") and not any(n in self.nodes for n in qr["nodes"]):
                # Its resources are gone: the queued resource is SUSPENDED, as Google's state table says.
                self._qr_state(qr, "SUSPENDED", initiator=qr["qr"]["state"].get("stateInitiator", "SERVICE"))
            self.w.changed()

    def nodes_stop(self, p: dict, q: dict, body: dict) -> dict:
        parent = self._parent(p)
        name = f"{parent}/nodes/{p['nodesId']}"
        with self.w.lock:
            rec = self._node(name)
            state = rec["node"]["state"]
            if rec["spot"]:
                # Spot and preemptible TPUs cannot be stopped or restarted, only deleted and recreated.
                raise ApiError("FAILED_PRECONDITION", f"Node {name} is a Spot (or preemptible) TPU: it cannot be "
                               "stopped; delete it and create it again.")
            if state != "READY":
                raise ApiError("FAILED_PRECONDITION", f"Node {name} cannot be stopped in state {state}; it must be READY.")
            op = self._new_op(parent, name, "stop")
            rec["node"]["state"] = "STOPPING"
            self._stop_workers(rec)
            if not self.w.faults.take("stuck", "tpu", "nodes.stop", rec["zone"]):
                self.w.later(STOP_S, "tpu.stop_done", node=name, op=op["name"])
            self.w.changed()
            return copy.deepcopy(op)

    def _stop_done(self, node: str, op: str) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != "STOPPING":
                return
            rec["node"]["state"] = "STOPPED"
            rec["node"].pop("health", None)
            self.w.meter.end(node)
            self._finish_op(op, response=self.view(rec))
            self.w.changed()

    def nodes_start(self, p: dict, q: dict, body: dict) -> dict:
        parent = self._parent(p)
        name = f"{parent}/nodes/{p['nodesId']}"
        with self.w.lock:
            rec = self._node(name)
            state = rec["node"]["state"]
            if state != "STOPPED":
                raise ApiError("FAILED_PRECONDITION", f"Node {name} cannot be started in state {state}; it must be STOPPED.")
            op = self._new_op(parent, name, "start")
            rec["node"]["state"] = "STARTING"
            if not self.w.faults.take("stuck", "tpu", "nodes.start", rec["zone"]):
                self.w.later(START_S, "tpu.start_done", node=name, op=op["name"])
            self.w.changed()
            return copy.deepcopy(op)

    def _start_done(self, node: str, op: str) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != "STARTING":
                return
        self._boot_workers(node)
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != "STARTING":
                return
            rec["node"]["state"] = "READY"
            rec["node"]["health"] = "HEALTHY"
            self._meter(rec)
            self._finish_op(op, response=self.view(rec))
            self.w.changed()

    def nodes_patch(self, p: dict, q: dict, body: dict) -> dict:
        parent = self._parent(p)
        name = f"{parent}/nodes/{p['nodesId']}"
        mask = [re.sub(r"_([a-z])", lambda m: m.group(1).upper(), f.strip())
                for f in (q.get("updateMask") or "").split(",") if f.strip()]
        if not mask:
            raise ApiError("INVALID_ARGUMENT", "updateMask is required.")
        bad = [f for f in mask if f not in _UPDATABLE]
        if bad:
            raise ApiError("INVALID_ARGUMENT", f"updateMask field(s) {', '.join(bad)} cannot be updated; "
                           f"updatable: {', '.join(sorted(_UPDATABLE))}.")
        if "labels" in mask:
            check_labels(body.get("labels"), "node.labels")
        with self.w.lock:
            rec = self._node(name)
            state = rec["node"]["state"]
            if state == "CREATING" and "labels" in mask:
                raise ApiError("FAILED_PRECONDITION", f"Cannot update labels of node {name} while it is being created (state CREATING).")
            if state == "DELETING":
                raise ApiError("FAILED_PRECONDITION", f"Node {name} is being deleted.")
            if state == "PREEMPTED":
                # Google's words and code (3) as SkyPilot's GCP failover handler quotes them (README "Faults"); no
                # source shows a STOPPED node refusing an update, so a STOPPED node takes it.
                raise ApiError("INVALID_ARGUMENT", PREEMPTED_UPDATE)
            if "metadata" in mask and rec.get("metadata_op") in self.ops and not self.ops[rec["metadata_op"]]["done"]:
                raise ApiError("ABORTED", f"Node {name} has a metadata update in progress "
                               f"({rec['metadata_op'].rsplit('/', 1)[-1]}); retry after it finishes.")
            op = self._new_op(parent, name, "update")
            if "metadata" in mask:
                rec["metadata_op"] = op["name"]
            changes = {f: copy.deepcopy(_at_path(body, f)) for f in mask}
            if not self.w.faults.take("stuck", "tpu", "nodes.patch", rec["zone"]):
                self.w.later(UPDATE_S, "tpu.update_done", node=name, op=op["name"], changes=changes)
            self.w.changed()
            return copy.deepcopy(op)

    def _update_done(self, node: str, op: str, changes: dict) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None:
                self._finish_op(op, error=("NOT_FOUND", f"Node {node} no longer exists."))
                return
            for field, value in changes.items():
                *outer, key = field.split(".")
                target = rec["node"]
                for part in outer:
                    target = target.setdefault(part, {})
                if value in (None, {}, []):
                    target.pop(key, None)
                else:
                    target[key] = value
            if "metadata" in changes and rec["endpoints"]:
                meta = rec["node"].get("metadata")
                self.w.workers.update_keys(rec["worker_key"], self.w.worker_keys(rec["project"], meta, ssh_keys_of(meta)))
            self._finish_op(op, response=self.view(rec))
            self.w.changed()

    def nodes_get_guest_attributes(self, p: dict, q: dict, body: dict) -> dict:
        name = f"{self._parent(p)}/nodes/{p['nodesId']}"
        path = (body or {}).get("queryPath", "")
        wanted = set((body or {}).get("workerIds") or [])
        if self.w.faults.take("no-guest-attributes", "tpu", "nodes.getGuestAttributes", p["locationsId"]):
            return {}  # the guest agent has published nothing (yet)
        with self.w.lock:
            rec = self._node(name)
            out = []
            for i, ep in enumerate(rec["endpoints"]):
                if wanted and str(i) not in wanted:
                    continue
                items = []
                key_type, _, key_data = ep["host_key"].partition(" ")
                if path in ("", "hostkeys", "hostkeys/", f"hostkeys/{key_type}"):
                    items.append({"namespace": "hostkeys", "key": key_type, "value": key_data.split(" ")[0]})
                out.append({"queryPath": path, "queryValue": {"items": items}})
        return {"guestAttributes": out}

    def preempt(self, node: str, at: float | None = None) -> None:
        """Preempt a spot/preemptible node now or at wall-clock time `at`. ValueError if it is neither."""
        with self.w.lock:
            rec = self._find(node)
            if not rec["spot"]:
                raise ValueError(f"node {rec['node']['name']} is not spot or preemptible: it cannot be preempted")
            name = rec["node"]["name"]
        if at is None or at <= time.time():
            self._preempt(name)
        else:
            self.w.scheduler.at(at, "tpu.preempt", node=name)

    def _find(self, node: str) -> dict:
        if node in self.nodes:
            return self.nodes[node]
        hits = [r for n, r in self.nodes.items() if n.rsplit("/", 1)[-1] == node]
        if len(hits) != 1:
            raise ValueError(f"no node named {node!r}" if not hits else f"node name {node!r} is ambiguous: give the full name")
        return hits[0]

    def _preempt(self, node: str) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] not in ("READY", "CREATING", "STARTING"):
                return
            if rec["node"]["state"] == "CREATING":
                # Google fails the create operation of a Spot TPU preempted while CREATING with code 3 and
                # this text (SkyPilot's GCP failover handler quotes it; README "Faults"); the node stays PREEMPTED.
                self._finish_op(rec["create_op"],
                                error=("INVALID_ARGUMENT", f"{PREEMPTED_UPDATE} [EID: 0x73013519f5b7feb2]"))
            rec["node"]["state"] = "PREEMPTED"
            rec["node"].pop("health", None)
            # The notice: the guests read preempted=TRUE and their processes get SIGTERM; they run on (no SSH)
            # until the power goes off (`_power_off`).
            rec["preempted"] = True
            rec["endpoints"] = []
            self.w.workers.shut_down_guests(rec["worker_key"])
            grace = max(self.w.latency(PREEMPT_NOTICE_S), TERM_GRACE_S)
            self.w.scheduler.at(time.time() + grace, "tpu.power_off", node=node)
            self.w.meter.end(node)
            if time.time() - parse_time(rec["node"]["createTime"]) <= PREEMPT_FREE_S:
                self.w.meter.forgive(node)
            qr = self.queued.get(rec["node"].get("queuedResource", ""))
            # A multislice's lost slice is repaired (SLICE_REPAIR_S), its queued resource stays ACTIVE.
            if qr and qr["qr"]["state"]["state"] == "ACTIVE" and not self._multislice(rec):
                self._qr_state(qr, "SUSPENDED", initiator=qr["qr"]["state"].get("stateInitiator", "SERVICE"))
            self.w.changed()

    @staticmethod
    def _multislice(rec: dict) -> bool:
        return rec.get("slice", {}).get("count", 1) > 1

    def _power_off(self, node: str) -> None:
        """The end of a preemption's notice: whatever still runs on the guests dies."""
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is not None and rec["node"]["state"] == "PREEMPTED":
                self._stop_workers(rec)
                if self._multislice(rec):
                    self.w.later(SLICE_REPAIR_S, "tpu.slice_repair", node=node)

    def _slice_repair(self, node: str) -> None:
        """Cloud TPU creates a new slice in place of a multislice's lost one (SLICE_REPAIR_S): a node of the
        same name and request, CREATING; once it is READY (`_create_done`) the other slices restart."""
        with self.w.lock:
            rec = self.nodes.get(node)
            qr = self.queued.get((rec or {}).get("node", {}).get("queuedResource", ""))
            if rec is None or rec["node"]["state"] != "PREEMPTED" or not qr or qr["qr"]["state"]["state"] != "ACTIVE":
                return  # deleted (or its request deleted) meanwhile: nothing to repair
            del self.nodes[node]
            body = {k: v for k, v in rec["node"].items() if k not in ("state", "health", "healthDescription")}
            new = self._new_node(node.rsplit("/nodes/", 1)[0], rec["project"], rec["zone"], node.rsplit("/", 1)[-1],
                                 body, facts.TPU_TYPES[rec["type"]], queued=qr["qr"]["name"])
            new.update(slice=rec["slice"], restart_others=True)
            self._start_create(new, "queuedResources.repair")
            self.w.changed()

    def repair(self, node: str, state: str = "REPAIRING", sim_seconds: float = REPAIR_S) -> None:
        """Put a READY node through host maintenance now: REPAIRING (or RESTARTING) with health
        UNHEALTHY_MAINTENANCE, its workers down, then READY/HEALTHY again after `sim_seconds` with fresh
        workers (the startup script runs again). ValueError if the node is not READY."""
        with self.w.lock:
            rec = self._find(node)
            if rec["node"]["state"] != "READY":
                raise ValueError(f"node {rec['node']['name']} is {rec['node']['state']}: only a READY node is repaired")
            rec["node"]["state"] = state
            rec["node"]["health"] = "UNHEALTHY_MAINTENANCE"
            rec["node"]["healthDescription"] = "The node is under maintenance and will resume running once rescheduled."
            self._stop_workers(rec)
            self.w.later(sim_seconds, "tpu.repair_done", node=rec["node"]["name"])
            self.w.changed()

    def _repair_done(self, node: str) -> None:
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] not in ("REPAIRING", "RESTARTING"):
                return
            state = rec["node"]["state"]
        self._boot_workers(node)
        with self.w.lock:
            rec = self.nodes.get(node)
            if rec is None or rec["node"]["state"] != state:
                return
            rec["node"]["state"] = "READY"
            rec["node"]["health"] = "HEALTHY"
            rec["node"].pop("healthDescription", None)
            self.w.changed()

    def worker_key(self, node: str) -> str:
        with self.w.lock:
            return self._find(node)["worker_key"]

    # ---------------------------------------------------------------------------------- operations
    def operations_get(self, p: dict, q: dict, body: None) -> dict:
        name = f"{self._parent(p)}/operations/{p['operationsId']}"
        with self.w.lock:
            op = self.ops.get(name)
            if op is None:
                raise ApiError("NOT_FOUND", f"Operation '{name}' was not found")
            return copy.deepcopy(op)

    def operations_list(self, p: dict, q: dict, body: None) -> dict:
        prefix = f"{self._parent(p)}/operations/"
        with self.w.lock:
            ops = [copy.deepcopy(o) for n, o in self.ops.items() if n.startswith(prefix)]
        page, token = paginate(ops, q.get("pageSize"), q.get("pageToken"))
        return {"operations": page, **({"nextPageToken": token} if token else {})}

    # ---------------------------------------------------------------------------------- catalog
    def accelerator_types_list(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        self._zone_ok(p["locationsId"], parent)
        types = [self._accel_view(parent, t) for t in facts.TPU_TYPES.values() if p["locationsId"] in t.zones]
        page, token = paginate(types, q.get("pageSize"), q.get("pageToken"))
        return {"acceleratorTypes": page, **({"nextPageToken": token} if token else {})}

    def accelerator_types_get(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        t = facts.TPU_TYPES.get(p["acceleratorTypesId"])
        if t is None or p["locationsId"] not in t.zones:
            raise not_found(f"{parent}/acceleratorTypes/{p['acceleratorTypesId']}")
        return self._accel_view(parent, t)

    @staticmethod
    def _accel_view(parent: str, t: facts.TpuType) -> dict:
        return {"name": f"{parent}/acceleratorTypes/{t.name}", "type": t.name,
                "acceleratorConfigs": [{"type": t.api_type, "topology": t.topology}]}

    @staticmethod
    def _runtimes(zone: str) -> list[str]:
        return facts.runtimes_in_zone(zone)

    def runtime_versions_list(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        self._zone_ok(p["locationsId"], parent)
        rvs = [{"name": f"{parent}/runtimeVersions/{r}", "version": r} for r in self._runtimes(p["locationsId"])]
        page, token = paginate(rvs, q.get("pageSize"), q.get("pageToken"))
        return {"runtimeVersions": page, **({"nextPageToken": token} if token else {})}

    def runtime_versions_get(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        r = p["runtimeVersionsId"]
        if r not in self._runtimes(p["locationsId"]):
            raise not_found(f"{parent}/runtimeVersions/{r}")
        return {"name": f"{parent}/runtimeVersions/{r}", "version": r}

    def _location_view(self, project: str, zone: str) -> dict:
        return {"name": f"projects/{project}/locations/{zone}", "locationId": zone, "displayName": zone}

    def locations_list(self, p: dict, q: dict, body: None) -> dict:
        items = [self._location_view(p["projectsId"], z) for z in facts.all_zones()]
        page, token = paginate(items, q.get("pageSize"), q.get("pageToken"))
        return {"locations": page, **({"nextPageToken": token} if token else {})}

    def locations_get(self, p: dict, q: dict, body: None) -> dict:
        if p["locationsId"] not in facts.all_zones():
            raise ApiError("NOT_FOUND", f"Location projects/{p['projectsId']}/locations/{p['locationsId']} not found.")
        return self._location_view(p["projectsId"], p["locationsId"])

    def generate_service_identity(self, p: dict, q: dict, body: dict) -> dict:
        number = facts.project_number(p["projectsId"])
        return {"identity": {"email": f"service-{number}@cloud-tpu.iam.gserviceaccount.com"}}

    # ---------------------------------------------------------------------------------- queued resources
    def _qr_state(self, qr: dict, state: str, initiator: str = "SERVICE", **data) -> None:
        key = {"WAITING_FOR_RESOURCES": None}.get(state, _camel(state.lower()) + "Data")
        qr["qr"]["state"] = {"state": state, "stateInitiator": initiator, **({key: data} if key else {})}

    def queued_create(self, p: dict, q: dict, body: dict) -> dict:
        parent = self._parent(p)
        zone = p["locationsId"]
        self._zone_ok(zone, parent)
        # queuedResourceId is "Optional" (tpu v2 discovery): without one the server names the request; a UUID
        # here, as no source shows the names Google picks (inferred).
        qr_id = q.get("queuedResourceId") or str(uuid.uuid4())
        if not _QR_ID_RE.match(qr_id):
            raise ApiError("INVALID_ARGUMENT", f"Invalid queuedResourceId {qr_id!r}.")
        specs = ((body.get("tpu") or {}).get("nodeSpec")) or []
        if not specs:
            raise ApiError("INVALID_ARGUMENT", "tpu.nodeSpec must contain at least one node.")
        for spec in specs:
            if spec.get("parent") != parent:
                raise ApiError("INVALID_ARGUMENT", f"nodeSpec.parent must be {parent!r}, got {spec.get('parent')!r}.")
            t = self.resolve_type(spec.get("node") or {}, zone)
            _slice_ids(spec, qr_id, t)
            self._check_flex_start(body, t, zone)
        policy = body.get("queueingPolicy") or {}
        deadline = None
        if policy.get("validUntilDuration"):
            deadline = time.time() + self.w.latency(parse_duration(policy["validUntilDuration"]))
        elif policy.get("validUntilTime"):
            deadline = parse_time(policy["validUntilTime"])
        name = f"{parent}/queuedResources/{qr_id}"
        with self.w.lock:
            if name in self.queued:
                raise already_exists(name)
            for spec in specs:
                for node_id in _slice_ids(spec, qr_id):
                    if f"{parent}/nodes/{node_id}" in self.nodes:
                        raise already_exists(f"{parent}/nodes/{node_id}")
            qr = copy.deepcopy(body)
            qr.update(name=name, createTime=now_rfc3339())
            if deadline is not None and "validUntilDuration" in policy:
                # Google stores the absolute time: a GET shows validUntilTime, not the duration that was sent.
                qr["queueingPolicy"] = {k: v for k, v in policy.items() if k != "validUntilDuration"}
                qr["queueingPolicy"]["validUntilTime"] = now_rfc3339(deadline)
            rec = {"qr": qr, "project": p["projectsId"], "zone": zone, "deadline": deadline, "nodes": []}
            self._qr_state(rec, "CREATING")
            self.queued[name] = rec
            op = self._new_op(parent, name, "create")
            if not self.w.faults.take("stuck", "tpu", "queuedResources.create", zone):
                self.w.later(QR_ACCEPT_S, "tpu.qr_accept", qr=name, op=op["name"])
            self.w.changed()
            return copy.deepcopy(op)

    @staticmethod
    def _check_flex_start(body: dict, t: facts.TpuType, zone: str) -> None:
        """FLEX_START (v2alpha1 `provisioningModel`) needs `runDuration.maxRunDuration` within Google's limits and
        a generation and zone that offer it (facts.TPU_FLEX_START_ZONES); a run duration needs FLEX_START."""
        seconds = parse_duration((body.get("runDuration") or {}).get("maxRunDuration") or "0s")
        if body.get("provisioningModel") != "FLEX_START":
            if seconds:
                raise ApiError("INVALID_ARGUMENT", "runDuration.maxRunDuration is only valid with provisioningModel FLEX_START.")
            return
        low, high = facts.FLEX_START_MAX_RUN_S
        if not low <= seconds <= high:
            raise ApiError("INVALID_ARGUMENT", f"runDuration.maxRunDuration must be from {low}s to {high}s for "
                           f"FLEX_START, got {int(seconds)}s.")
        if zone not in facts.TPU_FLEX_START_ZONES.get(t.generation, ()):
            raise ApiError("INVALID_ARGUMENT", f"Flex-start is not available for {t.name} in zone {zone}.")
        if "spot" in body or "guaranteed" in body:
            raise ApiError("INVALID_ARGUMENT", "provisioningModel FLEX_START cannot be combined with a spot or guaranteed tier.")

    def _qr_accept(self, qr: str, op: str) -> None:
        with self.w.lock:
            rec = self.queued.get(qr)
            if rec is None:
                return
            self._qr_state(rec, "WAITING_FOR_RESOURCES")
            self._finish_op(op, response=copy.deepcopy(rec["qr"]), type_url=QR_TYPE)
            self.w.later(QR_TICK_S, "tpu.qr_tick", qr=qr)
            self.w.changed()

    def _qr_tick(self, qr: str) -> None:
        with self.w.lock:
            rec = self.queued.get(qr)
            if rec is None or rec["qr"]["state"]["state"] != "WAITING_FOR_RESOURCES":
                return
            if rec["deadline"] is not None and time.time() >= rec["deadline"]:
                self._qr_state(rec, "FAILED", error={"code": CODE_OF["DEADLINE_EXCEEDED"], "message":
                               "The queued resource could not be provisioned before its valid-until time."})
            elif self.w.faults.take("capacity", "tpu", "queuedResources.create", rec["zone"]):
                self._qr_state(rec, "WAITING_FOR_RESOURCES")
                self.w.later(QR_TICK_S, "tpu.qr_tick", qr=qr)
            else:
                self._qr_state(rec, "PROVISIONING")
                spot = "spot" in rec["qr"]
                for spec in rec["qr"]["tpu"]["nodeSpec"]:
                    body = copy.deepcopy(spec["node"])
                    if spot:
                        body.setdefault("schedulingConfig", {})["spot"] = True
                    t = self.resolve_type(body, rec["zone"])
                    ids = _slice_ids(spec, qr.rsplit("/", 1)[-1])
                    for index, node_id in enumerate(ids):
                        node = self._new_node(spec["parent"], rec["project"], rec["zone"], node_id, body, t, queued=qr)
                        if "multisliceParams" in spec:
                            node["slice"] = {"id": index, "count": len(ids),
                                             "coordinator": f"{spec['parent']}/nodes/{ids[0]}"}
                        rec["nodes"].append(node["node"]["name"])
                        if not self.w.faults.take("stuck", "tpu", "queuedResources.create", rec["zone"]):
                            self.w.later(CREATE_S, "tpu.create_done", node=node["node"]["name"])
            self.w.changed()

    def _schedule_flex_end(self, rec: dict) -> None:
        """A flex-start request runs for maxRunDuration from when it is ACTIVE (simulated seconds, like every
        latency); its end is published as runDuration.terminationTime (wall clock). Then Google deletes its
        TPUs and the request is SUSPENDED (tpu/docs/request-using-flex-start)."""
        seconds = parse_duration((rec["qr"].get("runDuration") or {}).get("maxRunDuration") or "0s")
        if rec["qr"].get("provisioningModel") != "FLEX_START" or not seconds:
            return
        rec["qr"]["runDuration"]["terminationTime"] = now_rfc3339(time.time() + self.w.latency(seconds))
        self.w.later(seconds, "tpu.qr_expire", qr=rec["qr"]["name"])

    def _qr_expire(self, qr: str) -> None:
        with self.w.lock:
            rec = self.queued.get(qr)
            if rec is None or rec["qr"]["state"]["state"] != "ACTIVE":
                return
            self._qr_state(rec, "SUSPENDING")
            for n in rec["nodes"]:
                if n in self.nodes and self.nodes[n]["node"]["state"] != "DELETING":
                    self._begin_delete(self.nodes[n], "queuedResources.expire")
            self.w.changed()

    def queued_get(self, p: dict, q: dict, body: None) -> dict:
        name = f"{self._parent(p)}/queuedResources/{p['queuedResourcesId']}"
        with self.w.lock:
            rec = self.queued.get(name)
            if rec is None:
                raise not_found(name)
            return copy.deepcopy(rec["qr"])

    def queued_list(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        with self.w.lock:
            prefix = f"projects/{p['projectsId']}/locations/" if p["locationsId"] == "-" else f"{parent}/queuedResources/"
            items = [copy.deepcopy(r["qr"]) for n, r in sorted(self.queued.items()) if n.startswith(prefix)]
        page, token = paginate(items, q.get("pageSize"), q.get("pageToken"))
        return {"queuedResources": page, **({"nextPageToken": token} if token else {})}

    def queued_delete(self, p: dict, q: dict, body: None) -> dict:
        parent = self._parent(p)
        name = f"{parent}/queuedResources/{p['queuedResourcesId']}"
        force = str(q.get("force", "")).lower() == "true"
        with self.w.lock:
            rec = self.queued.get(name)
            if rec is None:
                raise not_found(name)
            live = [n for n in rec["nodes"] if n in self.nodes]
            # Without force, Google deletes a queued resource only if its nodes are gone already or it is
            # ACCEPTED, FAILED or SUSPENDED (DeleteQueuedResourceRequest.force).
            if live and not force and rec["qr"]["state"]["state"] not in ("ACCEPTED", "FAILED", "SUSPENDED"):
                raise ApiError("FAILED_PRECONDITION", f"Queued resource {name} has nodes ({', '.join(n.rsplit('/', 1)[-1] for n in live)}); "
                               "delete it with force=true to delete them too.")
            op = self._new_op(parent, name, "delete")
            for n in live:
                if self.nodes[n]["node"]["state"] != "DELETING":
                    self._begin_delete(self.nodes[n], "queuedResources.delete")
            self._qr_state(rec, "DELETING")
            if not self.w.faults.take("stuck", "tpu", "queuedResources.delete", rec["zone"]):
                self.w.later(DELETE_S if live else QR_DELETE_S, "tpu.qr_delete_done", qr=name, op=op["name"])
            self.w.changed()
            return copy.deepcopy(op)

    def _qr_delete_done(self, qr: str, op: str) -> None:
        with self.w.lock:
            if self.queued.pop(qr, None) is None:
                return
            self._finish_op(op, type_url=EMPTY_TYPE)
            self.w.changed()

    # ---------------------------------------------------------------------------------- inventory
    def inventory(self) -> dict:
        with self.w.lock:
            nodes = []
            for rec in self.nodes.values():
                n = rec["node"]
                nodes.append({"name": n["name"], "project": rec["project"], "zone": rec["zone"], "state": n["state"],
                              "accelerator": rec["type"], "spot": rec["spot"], "labels": n.get("labels", {}),
                              "queued_resource": n.get("queuedResource"),
                              "workers": [dict(e, index=i) for i, e in enumerate(rec["endpoints"])]})
            queued = [{"name": r["qr"]["name"], "zone": r["zone"], "state": r["qr"]["state"]["state"], "nodes": r["nodes"]}
                      for r in self.queued.values()]
            pending = sum(1 for o in self.ops.values() if not o["done"])
        return {"nodes": nodes, "queued_resources": queued, "pending_operations": pending}


# "Multislice is only supported on Cloud TPU v4 and later TPU versions" (tpu/docs/multislice-introduction).
_NO_MULTISLICE = ("v2", "v3")


def _slice_ids(spec: dict, qr_id: str, t: facts.TpuType | None = None) -> list[str]:
    """The node ids a nodeSpec makes: its `nodeId`, or with `multisliceParams` ("must be populated in case of
    multislice requests instead of node_id") `nodeCount` ("This needs to be > 1") nodes PREFIX-0 ..
    PREFIX-(N-1), the prefix defaulting to the queued resource's id (tpu v2 discovery, MultisliceParams).
    With `t`, the request is checked: a generation without multislice is refused (the code is inferred)."""
    params = spec.get("multisliceParams")
    if params is None:
        if not _QR_ID_RE.match(spec.get("nodeId") or ""):
            raise ApiError("INVALID_ARGUMENT", "nodeSpec.nodeId is required (or multisliceParams).")
        return [spec["nodeId"]]
    if spec.get("nodeId"):
        raise ApiError("INVALID_ARGUMENT", "nodeSpec: set either nodeId or multisliceParams, not both.")
    count, prefix = int(params.get("nodeCount") or 0), params.get("nodeIdPrefix") or qr_id
    if count < 2:
        raise ApiError("INVALID_ARGUMENT", f"multisliceParams.nodeCount must be > 1, got {count}.")
    if not _QR_ID_RE.match(prefix):
        raise ApiError("INVALID_ARGUMENT", f"Invalid multisliceParams.nodeIdPrefix {prefix!r}.")
    if t is not None and t.generation in _NO_MULTISLICE:
        raise ApiError("INVALID_ARGUMENT", f"Multislice is only supported on TPU v4 and later, not {t.name}.")
    return [f"{prefix}-{i}" for i in range(count)]


# Where TPU v2 and v2alpha1 spell one field differently: v2's MultisliceParams is v2alpha1's MultiNodeParams
# ("This field must be populated in case of multi-node requests instead of node_id", tpu v2alpha1 discovery).
_ALPHA_NAMES = {"multisliceParams": "multiNodeParams"}


def tpu_spelling(body, *, alpha: bool):
    """`body` with v2's field names (stored) in v2alpha1's (`alpha`: an answer to a v2alpha1 client), or a
    v2alpha1 request's in v2's."""
    names = _ALPHA_NAMES if alpha else {v: k for k, v in _ALPHA_NAMES.items()}
    if isinstance(body, dict):
        return {names.get(k, k): tpu_spelling(v, alpha=alpha) for k, v in body.items()}
    if isinstance(body, list):
        return [tpu_spelling(v, alpha=alpha) for v in body]
    return body


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(x.title() for x in rest)
