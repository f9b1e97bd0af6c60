"""A TPU sold as a Compute Engine machine type (TPU7x and later), single host: one instance
(compute/docs/tpus/create-tpu-vm-instance). On-demand, spot, or flex-start (the instance's own scheduling)."""

from __future__ import annotations

from tpuctl import catalog as catalog_mod
from tpuctl.errors import NotFound
from tpuctl.provision import compute_tpu, oslogin, preflight, vm
from tpuctl.provision.network import Network
from tpuctl.provision.resources import Kind, Resource
from tpuctl.provision.shapes.base import Listing, Shape
from tpuctl.spec import FLEX_START_WAIT_S

API = "compute"  # the catalog's `api` of the types Compute Engine provisions


class ComputeTpu(Shape):
    name = "compute-tpu"
    kind = Kind.TPU
    catalog_api = API
    tag = compute_tpu.API  # its resources' detail["api"]
    # An instance tpuctl writes ssh-keys metadata to; these replace the tpu.* permissions.
    permissions = ("compute.instances.create", "compute.instances.delete", "compute.instances.get",
                   "compute.instances.setMetadata")
    multi_host = False

    def serves(self, api: str, hosts: int, provisioning: str) -> bool:
        return api == self.catalog_api and (hosts > 1) == self.multi_host

    def owns(self, r: Resource) -> bool:
        return r.kind is Kind.TPU and r.detail.get("api") == self.tag

    def via(self, t) -> str:
        return f", Compute Engine {t.machine_type}"

    def quota_checks(self, t, provisioning, zones):
        return preflight.compute_quota_checks(t, provisioning, zones)

    def request(self, plan, zone: str, service_account: str) -> compute_tpu.TpuVmRequest:
        return compute_tpu.TpuVmRequest(
            name=plan.run, zone=zone, machine_type=plan.accelerator.machine_type or "", image=plan.runtime_version,
            labels=plan.labels, service_account=service_account, provisioning=plan.provisioning,
            max_run_duration_s=plan.max_run_duration_s, network=Network.of_plan(plan),
            capacity_wait_s=plan.valid_until_s or FLEX_START_WAIT_S)

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        return compute_tpu.create(clients, self.request(plan, zone, service_account), catalog=catalog_mod.load(),
                                  deadline_s=deadline_s, cancel=cancel, progress=progress, on_issued=on_issued)

    def exists(self, clients, zone, name) -> bool:
        return vm.get(clients, zone, name) is not None

    def get(self, clients, zone, name) -> Resource | None:
        return compute_tpu.get(clients, zone, name, catalog=catalog_mod.load())

    def to_resource(self, clients, raw) -> Resource:
        return compute_tpu.to_resource(raw, project=clients.project, catalog=catalog_mod.load())

    def listed(self, clients, listing: Listing) -> list[Resource]:
        singles, _, _ = compute_tpu.split(listing.instances, catalog_mod.load())
        return [self.to_resource(clients, i) for i in singles]

    def workers(self, clients, zone, name):
        found = compute_tpu.workers(clients, zone, name, catalog=catalog_mod.load())
        if found is None:
            raise NotFound(f"TPU node {name} does not exist in {zone}", field="run")
        return found

    def authorize(self, clients, zone, name, user, public_key, *, deadline_s=300.0) -> str:
        catalog = catalog_mod.load()
        found = compute_tpu.instances_of(clients, zone, name, catalog=catalog)
        if found is None or not found[0]:
            raise NotFound(f"TPU node {name} does not exist in {zone}", field="run")
        if oslogin.enabled(oslogin.project_metadata(clients), compute_tpu.metadata_of(found[0][0])):
            return oslogin.login_user(clients, public_key)
        compute_tpu.add_ssh_key(clients, zone, name, user, public_key, catalog=catalog, deadline_s=deadline_s)
        return user

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        compute_tpu.delete(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)

    # recovery_action: the base's. A Compute Engine TPU is made again from the run's plan (`tpuctl run` deletes
    # it and runs `up`): a Spot one is deleted by Google at preemption (termination action DELETE), and the
    # plan's zone failover is what finds capacity again.


COMPUTE_TPU = ComputeTpu()
