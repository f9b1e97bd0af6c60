"""TPU VM nodes and queued resources through `tpu_v2` (REST). Protos stay in here; callers get `Resource`s.

Creates are idempotent (a node or queued resource with our run label is adopted), deletes treat NotFound as
done, and every wait goes through `waits.until` (deadline, backoff, progress) instead of the 900 s poller.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.protobuf import duration_pb2, field_mask_pb2, json_format

from tpuctl.errors import BadInput, CapacityError, TpuctlError, from_google, quota_violation
from tpuctl.provision import labels as L
from tpuctl.provision import states, waits
from tpuctl.provision.clients import Clients
from tpuctl.provision.network import Network
from tpuctl.provision.resources import Kind, Resource, State, Worker

Progress = Callable[[State, str], None]
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# How a create operation fails when the zone has no capacity for it, by gRPC code: 8 RESOURCE_EXHAUSTED
# ("There is no more capacity in the zone"), 9 FAILED_PRECONDITION ("Insufficient reserved capacity") and
# 13 INTERNAL, which spot stockouts also come as with no detail that sets them apart from other internal
# errors. Each moves on to the next zone; the zone list bounds it (localcloud/README.md, "Faults").
_STOCKOUTS = {gexc.ResourceExhausted: 8, gexc.FailedPrecondition: 9, gexc.InternalServerError: 13}
# Host keys are a convenience (the first connection records the key otherwise): never wait long for them.
HOST_KEYS_DEADLINE_S = 10.0
# A metadata update that met another one in flight (409) is re-read and re-applied until this many seconds
# passed: the other update holds the node for as long as its operation runs (seconds; localcloud takes 5).
METADATA_CONFLICT_S = 60.0


@dataclass(frozen=True)
class NodeRequest:
    """What to create: everything `create_node` sends, in our terms."""

    name: str
    zone: str
    accelerator: str
    runtime_version: str
    labels: Mapping[str, str]
    service_account: str  # resolved email; code on the TPU VM runs as it
    spot: bool = False
    preemptible: bool = False
    queued: bool = False
    valid_until_s: float | None = None
    network: Network = Network()
    metadata: Mapping[str, str] | None = None
    max_run_duration_s: float | None = None  # flex-start (a queued resource): Google deletes the TPU after this
    slices: int = 1  # > 1: one multislice queued resource of that many slices, NAME-0 .. NAME-(N-1)

    def in_zone(self, zone: str) -> NodeRequest:
        return NodeRequest(**{**self.__dict__, "zone": zone})


def parent(project: str, zone: str) -> str:
    return f"projects/{project}/locations/{zone}"


def node_path(project: str, zone: str, name: str) -> str:
    return f"{parent(project, zone)}/nodes/{name}"


def queued_path(project: str, zone: str, name: str) -> str:
    return f"{parent(project, zone)}/queuedResources/{name}"


def _node_proto(req: NodeRequest) -> tpu_v2.Node:
    return tpu_v2.Node(
        accelerator_type=req.accelerator, runtime_version=req.runtime_version, labels=dict(req.labels),
        scheduling_config=tpu_v2.SchedulingConfig(spot=req.spot, preemptible=req.preemptible),
        network_config=req.network.tpu_config(), tags=list(req.network.tags), metadata=dict(req.metadata or {}),
        service_account=tpu_v2.ServiceAccount(email=req.service_account, scope=list(SCOPES)))


# -- reading ----------------------------------------------------------------------------------------------------


def _created(ts) -> datetime | None:
    return ts if isinstance(ts, datetime) and ts.timestamp() > 0 else None


def to_resource(node: tpu_v2.Node, *, local: bool) -> Resource:
    _, project, _, zone, _, name = node.name.split("/")
    workers = tuple(
        # On GCP `port` is the TPU runtime's (8470); SSH is 22. The local cloud puts each worker's SSH port there.
        Worker(index=i, ip=(ep.access_config.external_ip or ep.ip_address) if not local else ep.ip_address,
               port=ep.port if local else 22, host_key_alias=f"tpu.{node.id}-{i}" if node.id else None)
        for i, ep in enumerate(node.network_endpoints))
    sched = node.scheduling_config
    return Resource(kind=Kind.TPU, name=name, project=project, location=zone, state=states.node_state(node),
                    labels=dict(node.labels), created=_created(node.create_time), run=node.labels.get(L.RUN),
                    accelerator=node.accelerator_type, spot=bool(sched.spot or sched.preemptible), workers=workers,
                    detail={"runtime_version": node.runtime_version, "service_account": node.service_account.email,
                            **({"queued_resource": node.queued_resource} if node.queued_resource else {})})


def queued_to_resource(qr: tpu_v2.QueuedResource) -> Resource:
    _, project, _, zone, _, name = qr.name.split("/")
    spec = qr.tpu.node_spec[0].node if qr.tpu.node_spec else tpu_v2.Node()
    return Resource(kind=Kind.QUEUED, name=name, project=project, location=zone,
                    state=states.queued_state(qr.state.state), labels=dict(spec.labels),
                    created=_created(qr.create_time), run=spec.labels.get(L.RUN), accelerator=spec.accelerator_type,
                    spot=bool(qr.spot), detail={"runtime_version": spec.runtime_version})


def get_node(clients: Clients, zone: str, name: str) -> tpu_v2.Node | None:
    """The node, or None when it does not exist. Retries 429/503."""
    return waits.get_or_none(lambda: clients.tpu.get_node(name=node_path(clients.project, zone, name)),
                             what=f"get TPU node {name} in {zone}")


def get_queued(clients: Clients, zone: str, name: str) -> tpu_v2.QueuedResource | None:
    return waits.get_or_none(lambda: clients.tpu.get_queued_resource(name=queued_path(clients.project, zone, name)),
                             what=f"get queued resource {name} in {zone}")


def list_nodes(clients: Clients, zones: Iterable[str] | None = None) -> list[tpu_v2.Node]:
    """Nodes in `zones`, or in every location (`locations/-`) when None."""
    out: list[tpu_v2.Node] = []
    for zone in (zones if zones is not None else ("-",)):
        out.extend(waits.call(lambda z=zone: list(clients.tpu.list_nodes(parent=parent(clients.project, z))),
                              what=f"list TPU nodes in {zone}"))
    return out


def list_queued(clients: Clients, zones: Iterable[str] | None = None) -> list[tpu_v2.QueuedResource]:
    out: list[tpu_v2.QueuedResource] = []
    for zone in (zones if zones is not None else ("-",)):
        out.extend(waits.call(
            lambda z=zone: list(clients.tpu.list_queued_resources(parent=parent(clients.project, z))),
            what=f"list queued resources in {zone}"))
    return out


def host_keys(clients: Clients, zone: str, name: str) -> list[str | None]:
    """Each worker's SSH host key (`TYPE BASE64`) from guest attributes; None where not yet published.

    Empty when guest attributes cannot be read within HOST_KEYS_DEADLINE_S: SSH then trusts each worker's
    key on first use and records it (jobs/ssh.py), rather than failing a run over a missing convenience."""
    try:
        resp = waits.call(lambda: clients.tpu.get_guest_attributes(
            request={"name": node_path(clients.project, zone, name), "query_path": "hostkeys/"}),
            what=f"read host keys of {name}", deadline_s=HOST_KEYS_DEADLINE_S)
    except TpuctlError as exc:
        if isinstance(exc.__cause__, gexc.NotFound):
            raise
        return []
    keys: list[str | None] = []
    for attrs in resp.guest_attributes:
        items = [e for e in attrs.query_value.items if e.namespace == "hostkeys"]
        preferred = sorted(items, key=lambda e: (e.key != "ssh-ed25519", e.key))
        keys.append(f"{preferred[0].key} {preferred[0].value}" if preferred else None)
    return keys


# -- operations -------------------------------------------------------------------------------------------------


def wait_operation(op, *, what: str, deadline_s: float, cancel: threading.Event | None,
                   progress: Progress | None, state: State, create: bool = False) -> None:
    """Poll a TPU long-running operation to completion; raise its error mapped by type. A `create` that
    failed with a stockout code (see _STOCKOUTS) raises CapacityError, so the caller tries the next zone."""

    def poll() -> tuple[bool, None]:
        done = waits.call(lambda: op.done(retry=None), what=what, cancel=cancel)
        return done, None

    waits.until(poll, what=what, deadline_s=deadline_s, cancel=cancel,
                on_poll=(lambda _v, t: progress(state, "")) if progress else None)
    exc = op.exception()
    if exc is not None:
        code = _STOCKOUTS.get(type(exc))
        if create and code is not None and quota_violation(exc) is None:
            raise CapacityError(f"{what}: no capacity (code {code}: {exc.message})") from exc
        raise from_google(exc, what=what) from exc


# -- create / delete --------------------------------------------------------------------------------------------


def create_node(clients: Clients, req: NodeRequest, *, deadline_s: float, cancel: threading.Event | None = None,
                progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Create (or adopt) one TPU VM node and block until READY. Idempotent by name + run label.

    `on_issued` runs just before the create request goes out, so a caller can record what to roll back.
    Capacity errors raise CapacityError; the caller fails over to another zone.
    """
    what = f"create TPU node {req.name} in {req.zone}"
    node = get_node(clients, req.zone, req.name)
    if node is not None:
        L.check_owned(node.labels, req.labels.get(L.RUN), what=f"TPU node {req.name} in {req.zone}",
                      owner=req.labels.get(L.OWNER))
        state = states.node_state(node)
        if state in states.SETTLED_BAD:
            delete_node(clients, req.zone, req.name, deadline_s=deadline_s, cancel=cancel, progress=progress)
            node = None
        else:
            sched = node.scheduling_config
            _check_same_tpu(req, node.accelerator_type, bool(sched.spot or sched.preemptible),
                            what=f"TPU node {req.name} in {req.zone}")
    watched = node is None or states.node_state(node) is not State.READY
    done_at = None
    if node is None:
        if on_issued is not None:
            on_issued()
        if progress:
            progress(State.CREATING, "requested")
        op = _create_or_adopt(lambda: clients.tpu.create_node(parent=parent(clients.project, req.zone),
                                                              node_id=req.name, node=_node_proto(req)),
                              lambda: _labels(get_node(clients, req.zone, req.name)), req, what=what,
                              thing=f"TPU node {req.name} in {req.zone}", cancel=cancel)
        if op is not None:
            try:
                wait_operation(op, what=what, deadline_s=deadline_s, cancel=cancel, progress=progress,
                               state=State.CREATING, create=True)
            except TpuctlError as exc:
                if _preempted_while_creating(clients, req, exc):
                    raise CapacityError(f"{what}: the Spot capacity was reclaimed while it was being created "
                                        f"(code 3: {exc.__cause__.message})") from exc
                raise
            done_at = _created(getattr(op.metadata, "end_time", None))
    return _seen_ready(wait_ready(clients, req.zone, req.name, deadline_s=deadline_s, cancel=cancel,
                                  progress=progress), watched, done_at)


def _seen_ready(r: Resource, watched: bool, at: datetime | None = None) -> Resource:
    """`r`, just seen READY. When this wait watched it become READY (it was not before), that is when it began
    billing (tpuctl.cost): the TPU API publishes no READY time on the node, so `at` (its create operation's
    `endTime`, when the node was created), else now (a poll interval late at most)."""
    if not watched:
        return r
    return replace(r, detail={**r.detail, "ready": (at or datetime.now(timezone.utc)).isoformat()})


def _preempted_while_creating(clients: Clients, req: NodeRequest, exc: TpuctlError) -> bool:
    """Whether a failed create is a Spot/preemptible node preempted before READY: Google fails its operation
    with code 3 INVALID_ARGUMENT, as for a bad request, but the node exists and is PREEMPTED (SkyPilot's GCP
    failover handler; localcloud/README.md "Faults"). Told apart from a bad spec by the node's state, never by
    the text; like a stockout, the caller moves on to the next zone."""
    if not (req.spot or req.preemptible) or not isinstance(exc.__cause__, gexc.InvalidArgument):
        return False
    node = get_node(clients, req.zone, req.name)
    return node is not None and states.node_state(node) is State.PREEMPTED


def wait_ready(clients: Clients, zone: str, name: str, *, deadline_s: float, cancel: threading.Event | None = None,
               progress: Progress | None = None) -> Resource:
    """Block until the node is READY (returns it) or settles in a state it cannot leave by itself (raises)."""

    def poll() -> tuple[bool, Resource | None]:
        node = get_node(clients, zone, name)
        if node is None:
            raise CapacityError(f"TPU node {name} in {zone} vanished while being created")
        r = to_resource(node, local=clients.local)
        if r.state in states.SETTLED_BAD:
            raise CapacityError(f"TPU node {name} in {zone} is {r.state.value} before becoming ready")
        return r.state is State.READY, r

    return waits.until(poll, what=f"TPU node {name} in {zone} to become ready", deadline_s=deadline_s,
                       cancel=cancel, on_poll=(lambda r, t: progress(r.state, "")) if progress else None)


def create_queued(clients: Clients, req: NodeRequest, *, deadline_s: float, cancel: threading.Event | None = None,
                  progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Create (or adopt) a queued resource for one node; block until the node is READY.

    A queued resource that FAILED (no capacity before valid_until) raises CapacityError.
    """
    what = f"create queued resource {req.name} in {req.zone}"
    qr = get_queued(clients, req.zone, req.name)
    if qr is not None:
        L.check_owned(_labels(qr), req.labels.get(L.RUN), what=f"queued resource {req.name} in {req.zone}",
                      owner=req.labels.get(L.OWNER))
        if states.queued_state(qr.state.state) in states.SETTLED_BAD:
            delete_queued(clients, req.zone, req.name, deadline_s=deadline_s, cancel=cancel, progress=progress)
            qr = None
        elif qr.tpu.node_spec:
            _check_same_tpu(req, qr.tpu.node_spec[0].node.accelerator_type, None,
                            what=f"queued resource {req.name} in {req.zone}")
    watched = qr is None or states.queued_state(qr.state.state) is not State.READY
    if qr is None and req.max_run_duration_s:
        _create_flex_start(clients, req, what=what, cancel=cancel, progress=progress, on_issued=on_issued)
    elif qr is None:
        policy = None
        if req.valid_until_s is not None:
            policy = tpu_v2.QueuedResource.QueueingPolicy(
                valid_until_duration=duration_pb2.Duration(seconds=int(req.valid_until_s)))
        body = tpu_v2.QueuedResource(
            tpu=tpu_v2.QueuedResource.Tpu(node_spec=[_node_spec(clients, req)]), queueing_policy=policy)
        if req.spot:
            body.spot = tpu_v2.QueuedResource.Spot()
        if on_issued is not None:
            on_issued()
        if progress:
            progress(State.PENDING, "queued")
        op = _create_or_adopt(lambda: clients.tpu.create_queued_resource(
            parent=parent(clients.project, req.zone), queued_resource_id=req.name, queued_resource=body),
            lambda: _labels(get_queued(clients, req.zone, req.name)), req, what=what,
            thing=f"queued resource {req.name} in {req.zone}", cancel=cancel)
        if op is not None:
            wait_operation(op, what=what, deadline_s=deadline_s, cancel=cancel, progress=progress,
                           state=State.PENDING, create=True)

    def poll() -> tuple[bool, Resource]:
        q = get_queued(clients, req.zone, req.name)
        if q is None:
            raise CapacityError(f"queued resource {req.name} in {req.zone} vanished while waiting")
        r = queued_to_resource(q)
        if r.state is State.FAILED:
            raise CapacityError(f"queued resource {req.name} in {req.zone} failed: no capacity before it expired")
        return r.state is State.READY, r

    waits.until(poll, what=f"queued resource {req.name} in {req.zone} to become active", deadline_s=deadline_s,
                cancel=cancel, on_poll=(lambda r, t: progress(r.state, "")) if progress else None)
    wait = wait_slices_ready if req.slices > 1 else wait_ready
    return _seen_ready(wait(clients, req.zone, req.name, deadline_s=deadline_s, cancel=cancel,
                            progress=progress), watched)


def _node_spec(clients: Clients, req: NodeRequest) -> tpu_v2.QueuedResource.Tpu.NodeSpec:
    """The queued resource's node spec: one node named `req.name`, or for several slices `multisliceParams`
    ("must be populated in case of multislice requests instead of node_id", tpu v2 discovery) whose
    `nodeIdPrefix` names the slices NAME-0 .. NAME-(N-1)."""
    if req.slices > 1:
        return tpu_v2.QueuedResource.Tpu.NodeSpec(
            parent=parent(clients.project, req.zone), node=_node_proto(req),
            multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
                node_count=req.slices, node_id_prefix=req.name))
    return tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent(clients.project, req.zone), node_id=req.name,
                                              node=_node_proto(req))


# -- multislice: one queued resource, N slices, seen by the jobs layer as one TPU -------------------------------


def slice_count(qr: tpu_v2.QueuedResource) -> int:
    """How many slices a queued resource requests: its `multisliceParams.nodeCount`, else 1."""
    spec = qr.tpu.node_spec[0] if qr.tpu.node_spec else None
    return max(spec.multislice_params.node_count, 1) if spec is not None else 1


def slice_names(name: str, slices: int) -> list[str]:
    """The nodes of multislice queued resource `name` (its `nodeIdPrefix` is its name): NAME-0 .. NAME-(N-1)."""
    return [f"{name}-{i}" for i in range(slices)]


def multislice_to_resource(qr: tpu_v2.QueuedResource, nodes: list[tpu_v2.Node | None], *,
                           local: bool) -> Resource:
    """A multislice queued resource as one TPU (Kind.TPU, the queued resource's name): every slice's workers in
    slice order, numbered on (worker i of slice s is s x hosts + i, the process id JAX gives it); READY only
    when every slice is, else the first slice's state that is not (PREEMPTED for one that is gone), REPAIRING while
    the queued resource stays ACTIVE meanwhile. Pure."""
    base = queued_to_resource(qr)
    seen = [None if n is None else to_resource(n, local=local) for n in nodes]
    workers: list[Worker] = []
    for r in seen:
        workers += [replace(w, index=len(workers) + k) for k, w in enumerate(r.workers if r is not None else ())]
    # A slice that is gone while its queued resource stays was lost (preempted, or deleted under it).
    states_ = [State.PREEMPTED if r is None else r.state for r in seen]
    state = next((s for s in states_ if s is not State.READY), State.READY)
    if state is not State.READY and base.state is State.READY:
        # The request is still ACTIVE: Google's auto repair is making the lost slice again and will restart the
        # others (provision/shapes/queued.py): REPAIRING, waited for, not requeued.
        state = State.REPAIRING
    first = next((r for r in seen if r is not None), None)
    return replace(base, kind=Kind.TPU, state=state, workers=tuple(workers),
                   detail={**base.detail, **(first.detail if first is not None else {}), "queued_resource": qr.name,
                           "slices": str(len(nodes)), "slice_nodes": ",".join(n.rsplit("/", 1)[-1] for n in
                                                                               _node_paths(qr, len(nodes)))})


def _node_paths(qr: tpu_v2.QueuedResource, slices: int) -> list[str]:
    _, project, _, zone, _, name = qr.name.split("/")
    return [node_path(project, zone, n) for n in slice_names(name, slices)]


def get_multislice(clients: Clients, zone: str, name: str) -> Resource | None:
    """The multislice queued resource `name` as one TPU (`multislice_to_resource`); None when there is no such
    queued resource or it requests one slice. Read-only."""
    qr = get_queued(clients, zone, name)
    if qr is None or slice_count(qr) < 2:
        return None
    nodes = [get_node(clients, zone, n) for n in slice_names(name, slice_count(qr))]
    return multislice_to_resource(qr, nodes, local=clients.local)


def wait_slices_ready(clients: Clients, zone: str, name: str, *, deadline_s: float,
                      cancel: threading.Event | None = None, progress: Progress | None = None) -> Resource:
    """Block until every slice of multislice queued resource `name` is READY (returns it as one TPU); raise
    CapacityError when the queued resource is gone or a slice settles PREEMPTED/FAILED first."""

    def poll() -> tuple[bool, Resource]:
        r = get_multislice(clients, zone, name)
        if r is None:
            raise CapacityError(f"multislice queued resource {name} in {zone} vanished while being created")
        if r.state in states.SETTLED_BAD:
            raise CapacityError(f"a slice of {name} in {zone} is {r.state.value} before becoming ready")
        return r.state is State.READY, r

    return waits.until(poll, what=f"every slice of {name} in {zone} to become ready", deadline_s=deadline_s,
                       cancel=cancel, on_poll=(lambda r, t: progress(r.state, "")) if progress else None)


# tpu/docs/request-using-flex-start: flex-start is a queued resource whose v2alpha1 `provisioningModel` is
# FLEX_START with `runDuration.maxRunDuration`; TPU v2 has neither field.
FLEX_START_API = "v2alpha1"


def _create_flex_start(clients: Clients, req: NodeRequest, *, what: str, cancel: threading.Event | None,
                       progress: Progress | None, on_issued: Callable[[], None] | None) -> None:
    """Request the flex-start queued resource (TPU v2alpha1 JSON; the node spec is the v2 node's). Returns once
    the request is accepted; the caller polls it like any queued resource. A retried request that got through
    (409) is adopted."""
    node = json.loads(json_format.MessageToJson(tpu_v2.Node.pb(_node_proto(req))))
    body = {"tpu": {"nodeSpec": [{"parent": parent(clients.project, req.zone), "nodeId": req.name, "node": node}]},
            "provisioningModel": "FLEX_START", "runDuration": {"maxRunDuration": f"{int(req.max_run_duration_s)}s"}}
    if req.valid_until_s is not None:  # the spec's bound on the wait for capacity, as for any queued resource
        body["queueingPolicy"] = {"validUntilDuration": f"{int(req.valid_until_s)}s"}
    if on_issued is not None:
        on_issued()
    if progress:
        progress(State.PENDING, "queued (flex-start)")
    path = f"{FLEX_START_API}/{parent(clients.project, req.zone)}/queuedResources?queuedResourceId={req.name}"
    try:
        waits.call(lambda: clients.post_json("tpu", path, body), what=what, cancel=cancel)
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.Conflict):
            raise


def flex_start_detail(clients: Clients, zone: str, name: str) -> dict[str, str]:
    """`{"provisioning": "flex-start", "ends": ISO time}` for a flex-start queued resource (`ends` once Google
    has set its termination time, when it became active); {} for any other. Read-only; one v2alpha1 GET."""
    try:
        qr = waits.call(lambda: clients.get_json("tpu", f"{FLEX_START_API}/{queued_path(clients.project, zone, name)}"),
                        what=f"get queued resource {name} in {zone}")
    except TpuctlError as exc:
        if isinstance(exc.__cause__, gexc.NotFound):
            return {}
        raise
    if qr.get("provisioningModel") != "FLEX_START":
        return {}
    ends = (qr.get("runDuration") or {}).get("terminationTime")
    try:
        ends = datetime.fromisoformat(ends.replace("Z", "+00:00")).isoformat() if ends else None
    except ValueError:
        ends = None
    return {"provisioning": "flex-start", **({"ends": ends} if ends else {})}


def _labels(found: tpu_v2.Node | tpu_v2.QueuedResource | None) -> Mapping[str, str] | None:
    """A node's labels, or those of a queued resource's node; None when it does not exist."""
    if isinstance(found, tpu_v2.QueuedResource):
        return found.tpu.node_spec[0].node.labels if found.tpu.node_spec else {}
    return None if found is None else found.labels


def _create_or_adopt(create: Callable[[], object], labels: Callable[[], Mapping[str, str] | None],
                     req: NodeRequest, *, what: str, thing: str, cancel: threading.Event | None):
    """Send a create, retried on 5xx like any call; returns its operation. A 409 means a retry whose first attempt
    Google had already committed (the generated client retries no create; tpuctl does, so the answer is
    ALREADY_EXISTS): the resource exists and None is returned, once `labels()` shows it is this run's. Anyone
    else's raises NameTaken, as an existing one found before the create does."""
    try:
        return waits.call(create, what=what, cancel=cancel)
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.Conflict):
            raise
        existing = labels()
        if existing is None:  # gone again meanwhile: nothing to adopt, the conflict stands
            raise
    L.check_owned(existing, req.labels.get(L.RUN), what=thing, owner=req.labels.get(L.OWNER))
    return None


def _check_same_tpu(req: NodeRequest, accelerator: str, spot: bool | None, *, what: str) -> None:
    """BadInput unless the run's existing TPU (`accelerator`; `spot` where known) is the one `req` asks for:
    adopting a v3-8 for a v2-8, or an on-demand TPU for a spot one, would bill and train on what the plan did
    not say."""
    asked_spot = req.spot or req.preemptible
    if accelerator == req.accelerator and spot in (None, asked_spot):
        return
    field = "accelerator" if accelerator != req.accelerator else "provisioning"
    has = accelerator + ("" if spot is None else " spot" if spot else " on demand")
    asked = req.accelerator + ("" if spot is None else " spot" if asked_spot else " on demand")
    raise BadInput(f"{what} already exists as a {has}, not the {asked} asked for", field=field,
                   hint=f"`tpuctl down {req.labels.get(L.RUN, req.name)}` first, or pick another run name with --name")


def delete_node(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
                cancel: threading.Event | None = None, progress: Progress | None = None) -> None:
    """Delete a node and block until it is gone. Idempotent: NotFound (before or during) is success."""
    what = f"delete TPU node {name} in {zone}"
    waits.delete(lambda: clients.tpu.delete_node(name=node_path(clients.project, zone, name)),
                 lambda op: wait_operation(op, what=what, deadline_s=deadline_s, cancel=cancel, progress=progress,
                                           state=State.DELETING),
                 what=what, cancel=cancel, progress=progress)


def delete_queued(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
                  cancel: threading.Event | None = None, progress: Progress | None = None) -> None:
    """Delete a queued resource and (force) its node; block until gone. NotFound is success."""
    what = f"delete queued resource {name} in {zone}"
    waits.delete(lambda: clients.tpu.delete_queued_resource(
                     request={"name": queued_path(clients.project, zone, name), "force": True}),
                 lambda op: wait_operation(op, what=what, deadline_s=deadline_s, cancel=cancel, progress=progress,
                                           state=State.DELETING),
                 what=what, cancel=cancel, progress=progress)
    # The force delete removes the node too, but not necessarily before the queued resource is gone.
    delete_node(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


def add_ssh_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                deadline_s: float = 300.0, cancel: threading.Event | None = None) -> bool:
    """Add `USER:KEY` to the node's `ssh-keys` metadata; False when it was already there (idempotent).

    A 409 (another metadata update in flight) re-reads the metadata and tries again, with backoff for up to
    METADATA_CONFLICT_S, so neither update is lost. A PREEMPTED node refuses updates: that raises CapacityError saying so."""
    what = f"add an SSH key to TPU node {name} in {zone}"
    line = f"{user}:{public_key.strip()}"
    start = time.monotonic()
    next_delay = waits.RETRY_BACKOFF.delays()
    while True:
        node = get_node(clients, zone, name)
        if node is None:
            raise from_google(gexc.NotFound(f"node {name}"), what=what)
        state = states.node_state(node)
        if state is State.PREEMPTED:
            raise CapacityError(f"TPU node {name} in {zone} is {state.value}: Google refuses metadata updates "
                                "of a preempted node", hint="a preempted Spot TPU must be deleted and recreated: "
                                f"`tpuctl run` does that itself; otherwise `tpuctl down` the run and `up` it again")
        current = [ln for ln in node.metadata.get("ssh-keys", "").splitlines() if ln.strip()]
        if line in current:
            return False
        metadata = {**dict(node.metadata), "ssh-keys": "\n".join([*current, line])}
        try:
            op = waits.call(lambda: clients.tpu.update_node(
                node=tpu_v2.Node(name=node.name, metadata=metadata),
                update_mask=field_mask_pb2.FieldMask(paths=["metadata"])), what=what, cancel=cancel)
        except TpuctlError as exc:
            elapsed = time.monotonic() - start
            if isinstance(exc.__cause__, gexc.Conflict) and elapsed < min(METADATA_CONFLICT_S, deadline_s):
                waits.pause(next_delay(elapsed), cancel)
                continue
            raise
        wait_operation(op, what=what, deadline_s=deadline_s, cancel=cancel, progress=None, state=State.READY)
        return True


def request_of(node: tpu_v2.Node) -> NodeRequest:
    """The request that re-creates `node` as it was (for preemption recovery)."""
    _, _, _, zone, _, name = node.name.split("/")
    sched = node.scheduling_config
    return NodeRequest(
        name=name, zone=zone, accelerator=node.accelerator_type, runtime_version=node.runtime_version,
        labels=dict(node.labels), service_account=node.service_account.email, spot=bool(sched.spot),
        preemptible=bool(sched.preemptible), network=Network.of_node(node), metadata=dict(node.metadata))


def multislice_request(qr: tpu_v2.QueuedResource) -> NodeRequest:
    """The request that queues multislice `qr` again as it was (its node spec, its slice count, spot)."""
    _, project, _, zone, _, name = qr.name.split("/")
    node = tpu_v2.Node(qr.tpu.node_spec[0].node)
    node.name = node_path(project, zone, name)
    return replace(request_of(node), queued=True, slices=slice_count(qr), spot=bool(node.scheduling_config.spot))
