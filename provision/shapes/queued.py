"""A Cloud TPU API node requested through a queued resource (tpu/docs/queued-resources): `provisioning:
queued`, and flex-start on Cloud TPU API types (a v2alpha1 queued resource with a max run duration,
tpu/docs/request-using-flex-start). The queued resource and its node share the run's name; deleting the
queued resource (force) takes the node along."""

from __future__ import annotations

from dataclasses import replace

from tpuctl.provision import labels as L
from tpuctl.provision import tpu
from tpuctl.provision.resources import Kind, Resource
from tpuctl.provision.shapes.base import Listing, RecoveryAction, Requeue
from tpuctl.provision.shapes.tpu_node import TpuNode


class Queued(TpuNode):
    name = "queued"
    kind = Kind.QUEUED
    permissions = (*TpuNode.permissions, "tpu.queuedresources.create", "tpu.queuedresources.get",
                   "tpu.queuedresources.delete")
    queued = True

    def owns(self, r: Resource) -> bool:
        return r.kind is Kind.QUEUED or super().owns(r)

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        return tpu.create_queued(clients, self.request(plan, zone, service_account), deadline_s=deadline_s,
                                 cancel=cancel, progress=progress, on_issued=on_issued)

    def exists(self, clients, zone, name) -> bool:
        return tpu.get_queued(clients, zone, name) is not None

    def listed(self, clients, listing: Listing) -> list[Resource]:
        """The queued resources and their nodes, marked flex-start with the time Google ends them
        (`detail["ends"]`), which only TPU v2alpha1 shows: one GET per queued resource listed."""
        found = [r for r in map(tpu.queued_to_resource, listing.queued) if L.matches(r.labels, listing.run)]
        found += super().listed(clients, listing)
        extra = {(r.location, r.name): tpu.flex_start_detail(clients, r.location, r.name)
                 for r in found if r.kind is Kind.QUEUED}
        out = []
        for r in found:
            qr = r.name if r.kind is Kind.QUEUED else r.detail["queued_resource"].rsplit("/", 1)[-1]
            detail = extra.get((r.location, qr))
            out.append(replace(r, detail={**r.detail, **detail}) if detail else r)
        return out

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        tpu.delete_queued(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)

    def _again(self, r: Resource) -> RecoveryAction:
        return Requeue(r)

    def recreate(self, clients, zone, name, *, deadline_s, cancel=None, progress=None) -> Resource:
        node = self._node(clients, zone, name)
        req = tpu.request_of(node)
        self.delete(clients, zone, node.queued_resource.rsplit("/", 1)[-1], deadline_s=deadline_s, cancel=cancel,
                    progress=progress)
        return tpu.create_queued(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)


QUEUED = Queued()
