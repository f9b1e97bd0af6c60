"""A multi-host TPU slice sold as Compute Engine machine types (TPU7x): a regional workload policy
(HIGH_THROUGHPUT, the slice's topology), a regional instance template and a zonal managed instance group of
one instance per host (compute/docs/tpus/create-tpu-mig-multi-host-slice). One worker per instance."""

from __future__ import annotations

from tpuctl import catalog as catalog_mod
from tpuctl.errors import BadInput
from tpuctl.provision import compute_tpu
from tpuctl.provision.resources import Resource
from tpuctl.provision.shapes.base import Listing
from tpuctl.provision.shapes.compute_tpu import ComputeTpu


class MigSlice(ComputeTpu):
    name = "mig-slice"
    tag = compute_tpu.API_MIG
    permissions = (*ComputeTpu.permissions,
                   "compute.instanceTemplates.create", "compute.instanceTemplates.get",
                   "compute.instanceTemplates.delete", "compute.instanceTemplates.useReadOnly",
                   "compute.instanceGroupManagers.create", "compute.instanceGroupManagers.get",
                   "compute.instanceGroupManagers.delete", "compute.resourcePolicies.create",
                   "compute.resourcePolicies.get", "compute.resourcePolicies.delete", "compute.resourcePolicies.use")
    multi_host = True

    def check(self, t, provisioning, catalog) -> None:
        if provisioning == "flex-start":
            # Flex-start slices come from MIG resize requests (tpu/docs/request-using-flex-start), not made here.
            single = next((o.name for o in catalog.accelerators() if o.generation == t.generation and not o.multi_host),
                          t.name)
            raise BadInput(f"{t.name} is a {t.hosts}-host Compute Engine slice; tpuctl makes flex-start TPU7x "
                           f"single-host only so far", field="provisioning",
                           hint=f"use {single} for flex-start, or on-demand or spot for {t.name}")

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        t = plan.accelerator
        return compute_tpu.create_slice(clients, self.request(plan, zone, service_account), hosts=t.hosts,
                                        topology=t.topology, catalog=catalog_mod.load(), deadline_s=deadline_s,
                                        cancel=cancel, progress=progress, on_issued=on_issued)

    def exists(self, clients, zone, name) -> bool:
        return compute_tpu.get_slice(clients, zone, name) is not None

    def listed(self, clients, listing: Listing) -> list[Resource]:
        catalog = catalog_mod.load()
        _, slices, _ = compute_tpu.split(listing.instances, catalog)
        return [compute_tpu.slice_to_resource(name, zone, members, project=clients.project, catalog=catalog)
                for (zone, name), members in slices.items()]

    def to_resource(self, clients, raw) -> Resource:
        """`raw`: ((zone, MIG name), its instances), as `compute_tpu.split` groups a listing."""
        (zone, name), members = raw
        return compute_tpu.slice_to_resource(name, zone, members, project=clients.project, catalog=catalog_mod.load())

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        compute_tpu.delete_slice(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


MIG_SLICE = MigSlice()
