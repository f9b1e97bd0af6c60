"""A Cloud TPU API node (`tpu_v2` nodes.create): v2 to v6e, on-demand, spot or preemptible."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from tpuctl.errors import NotFound
from tpuctl.provision import labels as L
from tpuctl.provision import oslogin, preflight, tpu
from tpuctl.provision.network import Network
from tpuctl.provision.resources import Kind, Resource, State, Worker
from tpuctl.provision.shapes.base import Ended, Listing, RebuildFromPlan, Recreate, RecoveryAction, Shape, Wait, \
    run_ended

API = "tpu-v2"  # the catalog's `api` of the types the Cloud TPU API provisions


class TpuNode(Shape):
    name = "tpu-node"
    kind = Kind.TPU
    catalog_api = API
    permissions = ("tpu.nodes.create", "tpu.nodes.get", "tpu.nodes.delete", "tpu.nodes.update",
                   "tpu.operations.get")
    queued = False  # whether the node comes from a queued resource (tpu/docs/queued-resources)

    def serves(self, api: str, hosts: int, provisioning: str) -> bool:
        return api == self.catalog_api and (provisioning in ("queued", "flex-start")) == self.queued

    def owns(self, r: Resource) -> bool:
        # A Compute Engine TPU says so in detail["api"]; a node made by a queued resource names it.
        return r.kind is Kind.TPU and "api" not in r.detail and ("queued_resource" in r.detail) == self.queued

    def quota_checks(self, t, provisioning, zones):
        return preflight.tpu_api_quota_checks(t, provisioning, zones)

    def request(self, plan, zone: str, service_account: str) -> tpu.NodeRequest:
        """What `create` sends for `plan`'s TPU in `zone`."""
        flex = plan.provisioning == "flex-start"
        return tpu.NodeRequest(
            name=plan.run, zone=zone, accelerator=plan.accelerator.name, runtime_version=plan.runtime_version,
            labels=plan.labels, service_account=service_account, spot=plan.provisioning == "spot",
            preemptible=plan.provisioning == "preemptible", queued=self.queued, valid_until_s=plan.valid_until_s,
            network=Network.of_plan(plan), max_run_duration_s=plan.max_run_duration_s if flex else None)

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        return tpu.create_node(clients, self.request(plan, zone, service_account), deadline_s=deadline_s,
                               cancel=cancel, progress=progress, on_issued=on_issued)

    def read(self, clients, zone, name):
        return tpu.get_node(clients, zone, name)

    def to_resource(self, clients, raw) -> Resource:
        return tpu.to_resource(raw, local=clients.local)

    def listed(self, clients, listing: Listing) -> list[Resource]:
        return [r for r in (self.to_resource(clients, n) for n in listing.nodes if L.matches(n.labels, listing.run))
                if self.owns(r)]

    def _node(self, clients, zone: str, name: str):
        node = self.read(clients, zone, name)
        if node is None:
            raise NotFound(f"TPU node {name} does not exist in {zone}", field="run")
        return node

    def workers(self, clients, zone, name) -> tuple[Worker, ...]:
        node = self._node(clients, zone, name)
        keys = tpu.host_keys(clients, zone, name)
        return tuple(replace(w, host_key=keys[w.index] if w.index < len(keys) else None)
                     for w in self.to_resource(clients, node).workers)

    def authorize(self, clients, zone, name, user, public_key, *, deadline_s=300.0) -> str:
        node = self._node(clients, zone, name)
        if oslogin.enabled(oslogin.project_metadata(clients), dict(node.metadata)):
            return oslogin.login_user(clients, public_key)
        tpu.add_ssh_key(clients, zone, name, user, public_key, deadline_s=deadline_s)
        return user

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        tpu.delete_node(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)

    def recovery_action(self, r: Resource) -> RecoveryAction:
        """Gone: its definition went with it, so the plan makes it again. Under maintenance: Google brings it
        back, and deleting it would throw an on-demand node (and its place in the zone) away: wait. Otherwise
        (preempted, failed, stopped, or READY with its workers lost): recreate it as it was."""
        if run_ended(r):
            return Ended(r)
        if r.state is State.DELETED:
            return RebuildFromPlan(r, f"TPU node {r.name} does not exist in {r.location}; nothing to recreate from")
        again = self._again(r)
        return Wait(r, otherwise=again) if r.state is State.REPAIRING else again

    def _again(self, r: Resource) -> RecoveryAction:
        return Recreate(r)

    def recreate(self, clients, zone, name, *, deadline_s, cancel=None, progress=None) -> Resource:
        req = tpu.request_of(self._node(clients, zone, name))
        self.delete(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)
        return tpu.create_node(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)

    def wait_ready(self, clients, zone, name, *, deadline_s, cancel: threading.Event | None = None,
                   progress: Callable | None = None) -> Resource:
        return tpu.wait_ready(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


TPU_NODE = TpuNode()
