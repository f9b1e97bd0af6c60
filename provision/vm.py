"""Compute Engine VMs via `insert_unary`/`delete_unary` and our own ZoneOperations polling loop.

The extended-operation poller of `insert()` builds its own client without our endpoint, so it is not used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from tpuctl.errors import CapacityError, CloudError, QuotaError, TpuctlError
from tpuctl.provision import labels as L
from tpuctl.provision import states, waits
from tpuctl.provision.resources import Kind, Resource, State
from tpuctl.provision.clients import Clients
from tpuctl.provision.network import Network

Progress = Callable[[State, str], None]
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# Compute operation error codes (structured `error.errors[].code`, not message text).
_CAPACITY_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                             "RESOURCE_POOL_EXHAUSTED", "STOCKOUT"})
_QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "RATE_LIMIT_EXCEEDED"})


@dataclass(frozen=True)
class VmRequest:
    name: str
    zone: str
    machine_type: str
    disk_gb: int
    image: str
    labels: Mapping[str, str]
    service_account: str
    network: Network = Network()
    metadata: Mapping[str, str] = field(default_factory=dict)  # instance metadata items (startup-script)


def _instance_proto(req: VmRequest) -> compute_v1.Instance:
    # Only when given: a VM of the spec's `vms:` is created as before (no metadata).
    metadata = {"metadata": compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in req.metadata.items()])} \
        if req.metadata else {}
    return compute_v1.Instance(
        name=req.name, machine_type=f"zones/{req.zone}/machineTypes/{req.machine_type}", labels=dict(req.labels),
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=req.image, disk_size_gb=req.disk_gb))],
        network_interfaces=[req.network.compute_interface()], tags=req.network.compute_tags(),
        service_accounts=[compute_v1.ServiceAccount(email=req.service_account, scopes=list(SCOPES))], **metadata)


def to_resource(inst: compute_v1.Instance, *, project: str) -> Resource:
    zone = inst.zone.rsplit("/", 1)[-1]
    created = None
    if inst.creation_timestamp:
        try:
            created = datetime.fromisoformat(inst.creation_timestamp.replace("Z", "+00:00"))
        except ValueError:
            created = None
    spot = inst.scheduling.provisioning_model == "SPOT" or bool(inst.scheduling.preemptible)
    # When it last began and stopped billing (tpuctl.cost): Compute bills an instance's uptime, RUNNING to TERMINATED.
    billed = {"ready": inst.last_start_timestamp, "stopped": inst.last_stop_timestamp}
    return Resource(kind=Kind.VM, name=inst.name, project=project, location=zone,
                    state=states.instance_state(inst.status, preemptible=spot), labels=dict(inst.labels),
                    created=created, run=inst.labels.get(L.RUN), machine_type=inst.machine_type.rsplit("/", 1)[-1],
                    spot=spot, detail={k: v for k, v in billed.items() if v})


def get(clients: Clients, zone: str, name: str) -> compute_v1.Instance | None:
    return waits.get_or_none(lambda: clients.instances.get(project=clients.project, zone=zone, instance=name),
                             what=f"get VM {name} in {zone}")


def list_all(clients: Clients, run: str | None = None) -> list[compute_v1.Instance]:
    """Every tpuctl-labelled instance in the project (of `run` when given), across zones."""
    request = {"project": clients.project}
    if run:
        request["filter"] = f'labels.{L.RUN} = "{run}"'

    def fetch() -> list[compute_v1.Instance]:
        out = []
        for _zone, scoped in clients.instances.aggregated_list(request=request):
            out.extend(scoped.instances)
        return out

    # The filter narrows the listing on GCP; labels are checked here again as the authority.
    return [i for i in waits.call(fetch, what="list VMs") if L.matches(i.labels, run)]


def wait_zone_op(clients: Clients, zone: str, op: compute_v1.Operation, *, what: str, deadline_s: float,
                 cancel: threading.Event | None, progress: Progress | None, state: State,
                 region: str | None = None) -> None:
    """Poll a zonal operation until DONE and raise its error by code.

    ZoneOperations.get, not .wait: a server-side wait holds the connection for up to two minutes, during
    which Ctrl-C could not be honoured; polling with proportional backoff overshoots by a few percent only.
    """
    name = op.name

    def poll() -> tuple[bool, compute_v1.Operation]:
        current = waits.call(
            lambda: clients.region_operations.get(project=clients.project, region=region, operation=name) if region
            else clients.zone_operations.get(project=clients.project, zone=zone, operation=name),
            what=what, cancel=cancel)
        return states.compute_op_done(current.status), current

    done = op if states.compute_op_done(op.status) else waits.until(
        poll, what=what, deadline_s=deadline_s, cancel=cancel,
        on_poll=(lambda _o, t: progress(state, "")) if progress else None)
    raise_errors(list(done.error.errors) if done.error else [], what=what)


def raise_errors(errors: list, *, what: str) -> None:
    """Raise Compute errors (`[{code, message}]`, from an operation or a MIG's last attempt) by code."""
    if errors:
        codes = {e.code for e in errors}
        text = "; ".join(f"{e.code}: {e.message}" for e in errors)
        if codes & _CAPACITY_CODES:
            raise CapacityError(f"{what}: no capacity ({text})")
        if codes & _QUOTA_CODES:
            quota = next((e.message for e in errors if e.code in _QUOTA_CODES), text)
            # The quota by name where Compute says it structurally (errorDetails[].quotaInfo, compute.v1).
            names = [d.quota_info.limit_name for e in errors for d in getattr(e, "error_details", ())
                     if d.quota_info.limit_name]
            raise QuotaError(f"{what}: quota {names[0] + ' ' if names else ''}exceeded ({quota})")
        if "RESOURCE_NOT_FOUND" in codes and "delete" in what:
            return
        raise CloudError(f"{what}: {text}")


def create(clients: Clients, req: VmRequest, *, deadline_s: float, cancel: threading.Event | None = None,
           progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Create (or adopt, by name + run label) a VM; block until RUNNING."""
    return ensure_instance(clients, req.zone, req.name, req.labels, lambda: _instance_proto(req),
                           lambda i: to_resource(i, project=clients.project), what=f"VM {req.name}",
                           field="vms", deadline_s=deadline_s, cancel=cancel, progress=progress, on_issued=on_issued)


def ensure_instance(clients: Clients, zone: str, name: str, labels: Mapping[str, str],
                    build: Callable[[], compute_v1.Instance], convert: Callable[[compute_v1.Instance], Resource], *,
                    what: str, field: str, deadline_s: float, cancel: threading.Event | None = None,
                    progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Insert the instance `build()` makes (or adopt one of the same name with the run label) and block until
    `convert` says it is READY. Shared by plain VMs and Compute Engine TPU VMs."""
    thing = f"{what} in {zone}"

    def check_ours(inst: compute_v1.Instance | None) -> None:
        L.check_owned(None if inst is None else inst.labels, labels.get(L.RUN), what=thing, field=field,
                      owner=labels.get(L.OWNER))

    inst = get(clients, zone, name)
    check_ours(inst)
    what = f"create {thing}"
    if inst is None:
        if on_issued is not None:
            on_issued()
        if progress:
            progress(State.CREATING, "requested")
        try:
            op = waits.call(lambda: clients.instances.insert_unary(
                project=clients.project, zone=zone, instance_resource=build()),
                what=what, cancel=cancel)
        except TpuctlError as exc:
            # A retried insert whose first attempt got through: adopt below, if it is this run's.
            if not isinstance(exc.__cause__, gexc.Conflict):
                raise
            check_ours(get(clients, zone, name))
        else:
            wait_zone_op(clients, zone, op, what=what, deadline_s=deadline_s, cancel=cancel,
                         progress=progress, state=State.CREATING)

    last: State | None = None  # the state the previous poll saw

    def poll() -> tuple[bool, Resource]:
        nonlocal last
        i = get(clients, zone, name)
        if i is None:
            if last is State.PENDING:
                # compute/docs/instances/instance-lifecycle: a PENDING instance that cannot get its resources
                # "encounter[s] an error and Compute Engine deletes the compute instance": a stockout.
                raise CapacityError(f"{thing}: Compute Engine deleted it while it waited for capacity (PENDING)")
            raise CloudError(f"instance {name} in {zone} vanished while being created")
        r = convert(i)
        last = r.state
        return r.state is State.READY, r

    return waits.until(poll, what=f"instance {name} to run", deadline_s=deadline_s, cancel=cancel,
                       on_poll=(lambda r, t: progress(r.state, "")) if progress else None)


def delete(clients: Clients, zone: str, name: str, *, deadline_s: float = 600.0,
           cancel: threading.Event | None = None, progress: Progress | None = None) -> None:
    """Delete a VM and block until gone. Idempotent: NotFound is success."""
    what = f"delete VM {name} in {zone}"
    waits.delete(lambda: clients.instances.delete_unary(project=clients.project, zone=zone, instance=name),
                 lambda op: wait_zone_op(clients, zone, op, what=what, deadline_s=deadline_s, cancel=cancel,
                                         progress=progress, state=State.DELETING),
                 what=what, cancel=cancel, progress=progress)
