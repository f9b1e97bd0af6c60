"""TPUs that Google sells as Compute Engine machine types (TPU7x and later): one instance per TPU VM host.

The Cloud TPU API does not offer TPU7x; Compute Engine does, as the accelerator-optimized machine type
`tpu7x-standard-4t` (4 chips per VM). A single-host slice is one instance of it
(compute/docs/tpus/create-tpu-vm-instance). Flex-start is the instance's own scheduling: provisioning model
FLEX_START with a max run duration, after which Compute deletes the instance (instanceTerminationAction
DELETE). A multi-host slice is, as compute/docs/tpus/create-tpu-mig-multi-host-slice makes it, a regional
workload policy (HIGH_THROUGHPUT, acceleratorTopology = the slice's topology), a regional instance template
and a zonal managed instance group (MIG) of N instances with that policy; the MIG names each instance in its
`created-by` metadata, which is how the slice is found again.

Everything else reads these as one `Kind.TPU` resource each, with `detail["api"]` "compute" (one instance) or
"compute-mig" (a slice: one worker per instance), which tells their shape drivers (provision/shapes/
compute_tpu.py, mig_slice.py) which of them owns the resource; status, down, gc, cost and the jobs layer reach
them through those drivers as they reach TPU API nodes. Raw protos stay in here.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from tpuctl.catalog import Catalog
from tpuctl.errors import TpuctlError
from tpuctl.provision import labels as L
from tpuctl.provision import vm, waits
from tpuctl.provision.clients import Clients
from tpuctl.provision.network import Network
from tpuctl.provision.resources import Kind, Resource, State, Worker

API = "compute"
API_MIG = "compute-mig"
MIG_WAIT_S = 5.0  # a MIG's instances appear after the MIG itself: poll its managed instances this often at most
# Google's TPU VM guides use hyperdisk-balanced boot disks for TPU7x; persistent-disk types are refused there.
BOOT_DISK_TYPE = "hyperdisk-balanced"
BOOT_DISK_GB = 100


@dataclass(frozen=True)
class TpuVmRequest:
    """One Compute Engine TPU VM (a single-host slice), in our terms."""

    name: str
    zone: str
    machine_type: str
    image: str
    labels: Mapping[str, str]
    service_account: str
    provisioning: str = "on-demand"  # on-demand | spot | flex-start
    max_run_duration_s: float | None = None  # flex-start: Compute deletes the instance after this long
    capacity_wait_s: float | None = None  # flex-start: how long the insert waits for capacity before it fails
    network: Network = Network()
    metadata: Mapping[str, str] | None = None

    def in_zone(self, zone: str) -> TpuVmRequest:
        return TpuVmRequest(**{**self.__dict__, "zone": zone})


def _scheduling(req: TpuVmRequest) -> compute_v1.Scheduling:
    # Accelerator VMs cannot live-migrate: host maintenance terminates them.
    sched = compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False)
    if req.provisioning == "spot":
        sched.provisioning_model = "SPOT"
        # DELETE, not the default STOP: a Spot TPU cannot be restarted, only recreated (tpu/docs/spot), so a
        # stopped one is only a billed boot disk and a name to delete first; Google frees both at preemption.
        sched.instance_termination_action = "DELETE"
    elif req.provisioning == "flex-start":
        sched.provisioning_model = "FLEX_START"
        sched.instance_termination_action = "DELETE"
        sched.max_run_duration = compute_v1.Duration(seconds=int(req.max_run_duration_s or 0))
    else:
        sched.provisioning_model = "STANDARD"
    return sched


def _params(req: TpuVmRequest) -> compute_v1.InstanceParams | None:
    """A flex-start insert's wait for capacity, `requestValidForDuration` ("Relative deadline for waiting for
    capacity", compute.v1 InstanceParams): Compute keeps the request until then instead of failing it at once."""
    if req.provisioning != "flex-start" or not req.capacity_wait_s:
        return None
    return compute_v1.InstanceParams(request_valid_for_duration=compute_v1.Duration(seconds=int(req.capacity_wait_s)))


GUEST_ATTRIBUTES_KEY = "enable-guest-attributes"


def instance_proto(req: TpuVmRequest) -> compute_v1.Instance:
    # The guest agent publishes the VM's SSH host keys as guest attributes only when `enable-guest-attributes`
    # is on, and gcloud reads them only then (ssh_utils.GetHostKeysFromGuestAttributes): without it every
    # worker's key would be trusted on first use. A value the user set is kept.
    metadata = {GUEST_ATTRIBUTES_KEY: "TRUE", **(req.metadata or {})}
    items = [compute_v1.Items(key=k, value=v) for k, v in metadata.items()]
    return compute_v1.Instance(
        name=req.name, machine_type=f"zones/{req.zone}/machineTypes/{req.machine_type}", labels=dict(req.labels),
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=req.image, disk_size_gb=BOOT_DISK_GB,
            disk_type=f"zones/{req.zone}/diskTypes/{BOOT_DISK_TYPE}"))],
        network_interfaces=[req.network.compute_interface()], tags=req.network.compute_tags(),
        metadata=compute_v1.Metadata(items=items),
        scheduling=_scheduling(req), params=_params(req),
        service_accounts=[compute_v1.ServiceAccount(email=req.service_account, scopes=list(vm.SCOPES))])


def is_tpu(inst: compute_v1.Instance, catalog: Catalog) -> bool:
    return catalog.for_machine_type(inst.machine_type.rsplit("/", 1)[-1]) is not None


def _timestamp(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def to_resource(inst: compute_v1.Instance, *, project: str, catalog: Catalog) -> Resource:
    base = vm.to_resource(inst, project=project)
    t = catalog.for_machine_type(base.machine_type or "")
    sched = inst.scheduling
    model = {"SPOT": "spot", "FLEX_START": "flex-start"}.get(sched.provisioning_model, "on-demand")
    detail = {**base.detail, "api": API, "provisioning": model}
    ends = _timestamp(inst.resource_status.scheduling.termination_timestamp)
    if ends is not None:
        detail["ends"] = ends.isoformat()
    workers = tuple(
        Worker(index=0, ip=(nic.access_configs[0].nat_i_p if nic.access_configs else "") or nic.network_i_p, port=22,
               host_key_alias=f"compute.{inst.id}" if inst.id else None)
        for nic in inst.network_interfaces[:1])
    return Resource(kind=Kind.TPU, name=base.name, project=project, location=base.location, state=base.state,
                    labels=base.labels, created=base.created, run=base.run,
                    accelerator=t.name if t else None, machine_type=base.machine_type, spot=base.spot,
                    workers=workers, detail=detail)


def create(clients: Clients, req: TpuVmRequest, *, catalog: Catalog, deadline_s: float,
           cancel: threading.Event | None = None, progress=None,
           on_issued: Callable[[], None] | None = None) -> Resource:
    """Create (or adopt, by name + run label) the TPU VM instance; block until RUNNING.

    Capacity errors (ZONE_RESOURCE_POOL_EXHAUSTED) raise CapacityError, so the caller fails over to the next
    zone as it does for TPU API nodes."""
    return vm.ensure_instance(clients, req.zone, req.name, req.labels, lambda: instance_proto(req),
                              lambda i: to_resource(i, project=clients.project, catalog=catalog),
                              what=f"TPU VM {req.name}", field="name", deadline_s=deadline_s, cancel=cancel,
                              progress=progress, on_issued=on_issued)


def delete(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
           cancel: threading.Event | None = None, progress=None) -> None:
    """Delete the TPU VM instance and block until gone. Idempotent: NotFound is success."""
    vm.delete(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


def split(instances: list[compute_v1.Instance],
          catalog: Catalog) -> tuple[list, dict[tuple[str, str], list], list]:
    """(single TPU VM instances, slice instances by their MIG's (zone, name), plain VMs) of a listing."""
    singles, slices, plain = [], {}, []
    for i in instances:
        mig = created_by(i)
        if not is_tpu(i, catalog):
            plain.append(i)
        elif mig:
            slices.setdefault(mig, []).append(i)
        else:
            singles.append(i)
    return singles, slices, plain


def created_by(inst: compute_v1.Instance) -> tuple[str, str] | None:
    """(zone, name) of the zonal MIG that made `inst`, or None. From Compute's `created-by` metadata,
    `projects/NUMBER/zones/ZONE/instanceGroupManagers/NAME`: the project is its number, which these clients
    (given the project's id) do not compare, so only the zone and the name are read."""
    value = next((i.value for i in inst.metadata.items if i.key == "created-by"), "")
    m = re.fullmatch(r"projects/[^/]+/zones/([^/]+)/instanceGroupManagers/([^/]+)", value)
    return (m.group(1), m.group(2)) if m else None


# -- multi-host slices: workload policy + instance template + MIG ---------------------------------------------


def policy_name(name: str) -> str:
    return f"{name}-wp"


def template_name(name: str) -> str:
    return f"{name}-tpl"


def slice_to_resource(name: str, zone: str, members: list[compute_v1.Instance], *, project: str,
                      catalog: Catalog) -> Resource:
    """One slice (the MIG `name` in `zone`) from its instances: workers in name order, the worst state of its
    hosts, the earliest create. A MIG with no live host (its instances gone, or not made yet) is CREATING."""
    from tpuctl.provision.inventory import worst

    if not members:
        return Resource(kind=Kind.TPU, name=name, project=project, location=zone, state=State.CREATING,
                        labels={}, created=None, run=None, accelerator=None, workers=(),
                        detail={"api": API_MIG, "instances": "0"})
    hosts = [to_resource(i, project=project, catalog=catalog) for i in sorted(members, key=lambda i: i.name)]
    first = hosts[0]
    t = catalog.for_machine_type(first.machine_type or "", hosts=len(hosts))
    workers = tuple(replace(h.workers[0], index=n) if h.workers else Worker(index=n, ip="", port=22)
                    for n, h in enumerate(hosts))
    created = min((h.created for h in hosts if h.created is not None), default=None)
    return Resource(kind=Kind.TPU, name=name, project=project, location=first.location,
                    state=worst(h.state for h in hosts), labels=first.labels, created=created, run=first.run,
                    accelerator=t.name if t else None, machine_type=first.machine_type, spot=first.spot,
                    workers=workers, detail={**first.detail, "api": API_MIG, "instances": str(len(hosts))})


def _region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _ensure(get, insert, wait, on_issued: Callable[[], None], *, what: str,
            cancel: threading.Event | None) -> None:
    """Create one part of a slice unless it exists (adopted: a retried `up` continues where it stopped)."""
    if waits.get_or_none(get, what=f"read {what}", cancel=cancel) is not None:
        return
    on_issued()
    try:
        op = waits.call(insert, what=f"create {what}", cancel=cancel)
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.Conflict):
            raise
        return
    wait(op, f"create {what}")


def _policy_description(run: str | None) -> str:
    """A resource policy has no labels (compute.v1 ResourcePolicy): its description says whose it is."""
    return f"{L.RUN}={run}" if run else ""


def _policy_labels(policy: compute_v1.ResourcePolicy) -> dict[str, str]:
    key, sep, value = policy.description.partition("=")
    return {key: value} if sep and key == L.RUN else {}


def _check_slice_ours(clients: Clients, zone: str, name: str, run: str | None, *,
                      cancel: threading.Event | None) -> None:
    """NameTaken when a slice part of `name` exists and is not `run`'s. The instance template carries the run's
    labels; a workload policy names the run in its description; a MIG has neither, so one is the run's only when
    it uses the run's template."""
    project, region = clients.project, _region_of(zone)
    policy = waits.get_or_none(lambda: clients.resource_policies.get(project=project, region=region,
                                                                      resource_policy=policy_name(name)),
                               what=f"read workload policy {policy_name(name)}", cancel=cancel)
    L.check_owned(None if policy is None else _policy_labels(policy), run, what=f"workload policy {policy_name(name)}")
    tpl = waits.get_or_none(lambda: clients.instance_templates.get(project=project, region=region,
                                                                   instance_template=template_name(name)),
                            what=f"read instance template {template_name(name)}", cancel=cancel)
    L.check_owned(None if tpl is None else tpl.properties.labels, run, what=f"instance template {template_name(name)}")
    mig = get_slice(clients, zone, name)
    if mig is not None and not mig.instance_template.endswith(f"/instanceTemplates/{template_name(name)}"):
        L.check_owned({}, run, what=f"managed instance group {name} in {zone}")  # no labels, another's template


def create_slice(clients: Clients, req: TpuVmRequest, *, hosts: int, topology: str, catalog: Catalog,
                 deadline_s: float, cancel: threading.Event | None = None, progress=None,
                 on_issued: Callable[[], None] | None = None) -> Resource:
    """Create (or adopt) the workload policy, instance template and MIG of a `hosts`-VM slice; block until every
    instance runs. A MIG whose last attempt failed for capacity raises CapacityError (the caller fails over).
    `on_issued` runs once, before the first create request. Parts of another run's slice raise NameTaken, before
    anything is created and again once every part exists (a create answered 409 adopts what it found)."""
    project, zone, region = clients.project, req.zone, _region_of(req.zone)
    base = f"projects/{project}/regions/{region}"
    issued = threading.Event()
    _check_slice_ours(clients, zone, req.name, req.labels.get(L.RUN), cancel=cancel)

    def once() -> None:
        if not issued.is_set() and on_issued is not None:
            on_issued()
        issued.set()

    def wait(op, what: str, *, regional: bool = True) -> None:
        vm.wait_zone_op(clients, zone, op, what=what, deadline_s=deadline_s, cancel=cancel, progress=progress,
                        state=State.CREATING, region=region if regional else None)

    policy = compute_v1.ResourcePolicy(
        name=policy_name(req.name), description=_policy_description(req.labels.get(L.RUN)),
        workload_policy=compute_v1.ResourcePolicyWorkloadPolicy(type_="HIGH_THROUGHPUT", accelerator_topology=topology))
    _ensure(lambda: clients.resource_policies.get(project=project, region=region, resource_policy=policy.name),
            lambda: clients.resource_policies.insert_unary(project=project, region=region,
                                                           resource_policy_resource=policy),
            wait, once, what=f"workload policy {policy.name}", cancel=cancel)
    inst = instance_proto(req)
    template = compute_v1.InstanceTemplate(name=template_name(req.name), properties=compute_v1.InstanceProperties(
        machine_type=req.machine_type, disks=inst.disks, network_interfaces=inst.network_interfaces,
        labels=inst.labels, metadata=inst.metadata, scheduling=inst.scheduling, tags=inst.tags,
        service_accounts=inst.service_accounts))
    _ensure(lambda: clients.instance_templates.get(project=project, region=region, instance_template=template.name),
            lambda: clients.instance_templates.insert_unary(project=project, region=region,
                                                            instance_template_resource=template),
            wait, once, what=f"instance template {template.name}", cancel=cancel)
    mig = compute_v1.InstanceGroupManager(
        name=req.name, base_instance_name=req.name, target_size=hosts,
        instance_template=f"{base}/instanceTemplates/{template.name}",
        resource_policies=compute_v1.InstanceGroupManagerResourcePolicies(
            workload_policy=f"{base}/resourcePolicies/{policy.name}"))
    _ensure(lambda: clients.instance_groups.get(project=project, zone=zone, instance_group_manager=req.name),
            lambda: clients.instance_groups.insert_unary(project=project, zone=zone,
                                                         instance_group_manager_resource=mig),
            lambda op, what: wait(op, what, regional=False), once, what=f"managed instance group {req.name}",
            cancel=cancel)
    _check_slice_ours(clients, zone, req.name, req.labels.get(L.RUN), cancel=cancel)

    members: list[compute_v1.Instance] = []

    def poll() -> tuple[bool, int]:
        managed = _managed(clients, zone, req.name, cancel=cancel)
        for m in managed:
            vm.raise_errors(list(m.last_attempt.errors.errors), what=f"create TPU slice {req.name} in {zone}")
        running = sum(m.instance_status == "RUNNING" for m in managed)
        if running < hosts or len(managed) != hosts:
            return False, running
        # The hosts are the MIG's own managed instances, read by name: their `created-by` names the project by
        # its number, not by the id these clients know (a host that went meanwhile is waited for again).
        members[:] = _members(clients, zone, managed)
        return len(members) == hosts, running

    waits.until(poll, what=f"TPU slice {req.name} to run", deadline_s=deadline_s, cancel=cancel,
                backoff=waits.Backoff(maximum=MIG_WAIT_S),
                on_poll=(lambda n, t: progress(State.CREATING, f"{n}/{hosts} hosts")) if progress else None)
    return slice_to_resource(req.name, zone, members, project=project, catalog=catalog)


def get_slice(clients: Clients, zone: str, name: str):
    """The slice's MIG, or None."""
    return waits.get_or_none(lambda: clients.instance_groups.get(project=clients.project, zone=zone,
                                                                 instance_group_manager=name),
                             what=f"get managed instance group {name} in {zone}")


def delete_slice(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
                 cancel: threading.Event | None = None, progress=None) -> None:
    """Delete the MIG (and with it every instance), then its template and workload policy; block until gone.
    Idempotent: each part that is already gone counts as deleted."""
    project, region = clients.project, _region_of(zone)
    parts = (
        (f"managed instance group {name}", None,
         lambda: clients.instance_groups.delete_unary(project=project, zone=zone, instance_group_manager=name)),
        (f"instance template {template_name(name)}", region,
         lambda: clients.instance_templates.delete_unary(project=project, region=region,
                                                         instance_template=template_name(name))),
        (f"workload policy {policy_name(name)}", region,
         lambda: clients.resource_policies.delete_unary(project=project, region=region,
                                                        resource_policy=policy_name(name))),
    )
    for what, in_region, request in parts:
        waits.delete(request, lambda op, what=what, in_region=in_region: vm.wait_zone_op(
                         clients, zone, op, what=f"delete {what}", deadline_s=deadline_s, cancel=cancel,
                         progress=progress, state=State.DELETING, region=in_region),
                     what=f"delete {what}", cancel=cancel, progress=progress)


# -- reaching a Compute Engine TPU's workers (the jobs layer's view, through `provision`) ----------------------

METADATA_ATTEMPTS = 5  # setMetadata is fingerprint-guarded: a concurrent update makes us re-read and retry


def instances_of(clients: Clients, zone: str, name: str, *,
                 catalog: Catalog) -> tuple[list[compute_v1.Instance], bool] | None:
    """The TPU VM instances of `name` in worker order and whether they form a MIG slice, or None when `name` is
    neither a TPU VM instance nor a slice's MIG. Read-only."""
    inst = vm.get(clients, zone, name)
    if inst is not None and is_tpu(inst, catalog) and created_by(inst) is None:
        return [inst], False
    if get_slice(clients, zone, name) is None:
        return None
    return _members(clients, zone, _managed(clients, zone, name)), True


def _managed(clients: Clients, zone: str, name: str, *,
             cancel: threading.Event | None = None) -> list[compute_v1.ManagedInstance]:
    """The MIG's managed instances (listManagedInstances: also those not made yet, without an `instance`)."""
    return waits.call(lambda: list(clients.instance_groups.list_managed_instances(
        project=clients.project, zone=zone, instance_group_manager=name)), what=f"list the instances of {name}",
        cancel=cancel)


def _members(clients: Clients, zone: str, managed: list[compute_v1.ManagedInstance]) -> list[compute_v1.Instance]:
    """The live instances of `managed`, in name order (the slice's worker order)."""
    found = (vm.get(clients, zone, m.instance.rsplit("/", 1)[-1]) for m in managed if m.instance)
    return sorted((i for i in found if i is not None), key=lambda i: i.name)


def get(clients: Clients, zone: str, name: str, *, catalog: Catalog) -> Resource | None:
    """The Compute Engine TPU `name` (one instance, or a MIG slice) as one Resource, or None. Read-only."""
    found = instances_of(clients, zone, name, catalog=catalog)
    if found is None:
        return None
    members, is_slice = found
    if not is_slice:
        return to_resource(members[0], project=clients.project, catalog=catalog)
    return slice_to_resource(name, zone, members, project=clients.project, catalog=catalog)


def _guest(clients: Clients, zone: str, inst: compute_v1.Instance) -> tuple[str | None, int | None]:
    """(SSH host key "TYPE BASE64", the local cloud's SSH port) from the instance's guest attributes; Nones where
    not published (SSH then trusts the key on first use, jobs/ssh.py)."""
    try:
        attrs = waits.call(lambda: clients.instances.get_guest_attributes(
            request={"project": clients.project, "zone": zone, "instance": inst.name, "query_path": ""}),
            what=f"read the guest attributes of {inst.name}", deadline_s=30.0)
    except TpuctlError:
        return None, None
    items = list(attrs.query_value.items)
    keys = sorted((e for e in items if e.namespace == "hostkeys"), key=lambda e: (e.key != "ssh-ed25519", e.key))
    port = next((int(e.value) for e in items if e.namespace == "localcloud" and e.key == "ssh-port"), None)
    return (f"{keys[0].key} {keys[0].value}" if keys else None), port


def workers(clients: Clients, zone: str, name: str, *, catalog: Catalog) -> tuple[Worker, ...] | None:
    """The TPU's workers in index order with host keys (and, on the local cloud, each worker's SSH port, which
    its guest publishes: every local worker is 127.0.0.1). None when `name` is no Compute Engine TPU."""
    found = instances_of(clients, zone, name, catalog=catalog)
    if found is None:
        return None
    out = []
    for index, inst in enumerate(found[0]):
        host = to_resource(inst, project=clients.project, catalog=catalog).workers
        key, port = _guest(clients, zone, inst)
        out.append(replace(host[0] if host else Worker(index=index, ip="", port=22), index=index,
                           port=port if clients.local and port else 22, host_key=key))
    return tuple(out)


def metadata_of(inst: compute_v1.Instance) -> dict[str, str]:
    return {i.key: i.value for i in inst.metadata.items}


def add_ssh_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *, catalog: Catalog,
                deadline_s: float = 300.0, cancel: threading.Event | None = None) -> bool:
    """Add `USER:KEY` to the `ssh-keys` metadata of every instance of the TPU; False when all had it (idempotent).
    Blocks for each setMetadata operation; a stale fingerprint (412: someone else updated it) re-reads and retries."""
    line = f"{user}:{public_key.strip()}"
    found = instances_of(clients, zone, name, catalog=catalog)
    if found is None:
        raise TpuctlError(f"TPU VM {name} does not exist in {zone}")
    changed = False
    for inst in found[0]:
        what = f"add an SSH key to TPU VM {inst.name} in {zone}"
        for attempt in range(1, METADATA_ATTEMPTS + 1):
            current = vm.get(clients, zone, inst.name) if attempt > 1 else inst
            if current is None:
                raise TpuctlError(f"{what}: the instance is gone")
            meta = metadata_of(current)
            keys = [ln for ln in meta.get("ssh-keys", "").splitlines() if ln.strip()]
            if line in keys:
                break
            meta["ssh-keys"] = "\n".join([*keys, line])
            body = compute_v1.Metadata(fingerprint=current.metadata.fingerprint,
                                       items=[compute_v1.Items(key=k, value=v) for k, v in meta.items()])
            try:
                op = waits.call(lambda n=current.name, b=body: clients.instances.set_metadata_unary(
                    project=clients.project, zone=zone, instance=n, metadata_resource=b), what=what, cancel=cancel)
            except TpuctlError as exc:
                if isinstance(exc.__cause__, (gexc.PreconditionFailed, gexc.FailedPrecondition)) \
                        and attempt < METADATA_ATTEMPTS:
                    waits.pause(0.2 * attempt, cancel)
                    continue
                raise
            vm.wait_zone_op(clients, zone, op, what=what, deadline_s=deadline_s, cancel=cancel, progress=None,
                            state=State.READY)
            changed = True
            break
    return changed
