"""TPUs that Google sells as Compute Engine machine types (TPU7x and later): one instance per TPU VM host.

The Cloud TPU API does not offer TPU7x; Compute Engine does, as the accelerator-optimized machine type
`tpu7x-standard-4t` (4 chips per VM). A single-host slice is one instance of it
(compute/docs/tpus/create-tpu-vm-instance). Flex-start is the instance's own scheduling: provisioning model
FLEX_START with a max run duration, after which Compute deletes the instance (instanceTerminationAction
DELETE). Multi-host slices (a managed instance group with a HIGH_THROUGHPUT workload policy,
compute/docs/tpus/create-tpu-mig-multi-host-slice) are not made here yet: `plan` refuses them.

Everything else reads these instances as `Kind.TPU` resources with `detail["api"] == "compute"`, so status,
down, gc and cost treat them as TPU API nodes; raw protos stay in here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from google.cloud import compute_v1

from tpuctl.catalog import Catalog
from tpuctl.provision import vm
from tpuctl.provision.clients import Clients
from tpuctl.provision.resources import Kind, Resource, Worker

API = "compute"
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
    network: str = "default"
    subnet: str | None = None
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, str] | None = None

    def in_zone(self, zone: str) -> TpuVmRequest:
        return TpuVmRequest(**{**self.__dict__, "zone": zone})


def _scheduling(req: TpuVmRequest) -> compute_v1.Scheduling:
    # Accelerator VMs cannot live-migrate: host maintenance terminates them.
    sched = compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False)
    if req.provisioning == "spot":
        sched.provisioning_model = "SPOT"
    elif req.provisioning == "flex-start":
        sched.provisioning_model = "FLEX_START"
        sched.instance_termination_action = "DELETE"
        sched.max_run_duration = compute_v1.Duration(seconds=int(req.max_run_duration_s or 0))
    else:
        sched.provisioning_model = "STANDARD"
    return sched


def instance_proto(req: TpuVmRequest) -> compute_v1.Instance:
    nic = compute_v1.NetworkInterface(
        network=req.network if "/" in req.network else f"global/networks/{req.network}",
        access_configs=[compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])
    if req.subnet:
        nic.subnetwork = req.subnet
    items = [compute_v1.Items(key=k, value=v) for k, v in (req.metadata or {}).items()]
    return compute_v1.Instance(
        name=req.name, machine_type=f"zones/{req.zone}/machineTypes/{req.machine_type}", labels=dict(req.labels),
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=req.image, disk_size_gb=BOOT_DISK_GB,
            disk_type=f"zones/{req.zone}/diskTypes/{BOOT_DISK_TYPE}"))],
        network_interfaces=[nic], tags=compute_v1.Tags(items=list(req.tags)),
        metadata=compute_v1.Metadata(items=items),
        scheduling=_scheduling(req),
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
    detail = {"api": API, "provisioning": model, "runtime_version": inst.disks[0].initialize_params.source_image
              if inst.disks else ""}
    ends = _timestamp(inst.resource_status.scheduling.termination_timestamp)
    if ends is not None:
        detail["ends"] = ends.isoformat()
    workers = tuple(
        Worker(index=0, ip=(nic.access_configs[0].nat_i_p if nic.access_configs else "") or nic.network_i_p, port=22)
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


def split(instances: list[compute_v1.Instance], catalog: Catalog) -> tuple[list, list]:
    """(TPU VM instances, plain VMs) of a listing."""
    tpus = [i for i in instances if is_tpu(i, catalog)]
    return tpus, [i for i in instances if not is_tpu(i, catalog)]

