"""A plain Compute Engine VM of the run (`vms:` in the spec: a data loader, a parameter server, ...)."""

from __future__ import annotations

from tpuctl import catalog as catalog_mod
from tpuctl.catalog import region_of
from tpuctl.provision import compute_tpu, vm
from tpuctl.provision.network import Network
from tpuctl.provision.resources import Kind, Resource, Step
from tpuctl.provision.shapes.base import Listing, Shape


class Vm(Shape):
    name = "vm"
    kind = Kind.VM
    permissions = ("compute.instances.create", "compute.instances.delete", "compute.instances.get")

    def owns(self, r: Resource) -> bool:
        return r.kind is Kind.VM

    def plan_steps(self, spec, t, *, run, zones, runtime, framework, price_per_hour, catalog) -> tuple[Step, ...]:
        return tuple(Step(f"vm:{v.name}", Kind.VM, f"{run}-{v.name}", zones[0],
                          price_per_hour=catalog.vm_price_per_hour(v.machine_type, region_of(zones[0])),
                          detail=f"{v.machine_type}, {v.disk_gb} GB") for v in spec.vms)

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        spec = next(v for v in plan.vms if plan.vm_name(v) == name)
        req = vm.VmRequest(name=name, zone=zone, machine_type=spec.machine_type, disk_gb=spec.disk_gb,
                           image=spec.image, labels=plan.labels, service_account=service_account,
                           network=Network.of_plan(plan))
        return vm.create(clients, req, deadline_s=deadline_s, cancel=cancel, on_issued=on_issued, progress=progress)

    def read(self, clients, zone, name):
        return vm.get(clients, zone, name)

    def to_resource(self, clients, raw) -> Resource:
        return vm.to_resource(raw, project=clients.project)

    def listed(self, clients, listing: Listing) -> list[Resource]:
        _, _, plain = compute_tpu.split(listing.instances, catalog_mod.load())
        return [self.to_resource(clients, i) for i in plain]

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        vm.delete(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


VM = Vm()
