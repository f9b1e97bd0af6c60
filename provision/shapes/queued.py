"""A Cloud TPU API node requested through a queued resource (tpu/docs/queued-resources): `provisioning:
queued`, and flex-start on Cloud TPU API types (a v2alpha1 queued resource with a max run duration,
tpu/docs/request-using-flex-start). The queued resource and its node share the run's name; deleting the
queued resource (force) takes the node along.

Multislice (`slices: N`, tpu/docs/multislice-introduction): one queued resource whose node spec carries
`multisliceParams {nodeCount: N, nodeIdPrefix: RUN}` makes the slices RUN-0 .. RUN-(N-1). The jobs layer sees
it as one TPU named RUN (`tpu.get_multislice`): every slice's workers, READY only when every slice is. Losing
one slice loses the job (its processes meet in one JAX cluster), and Google repairs the request itself
(tpu/docs/multislice-introduction, "Auto repair": "When a slice encounters a maintenance event, preemption, or
hardware failure, Cloud TPU will create a new slice. In the rare case that there are insufficient resources to
create a new slice, the creation won't complete until hardware becomes available. After the new slice is
created, all other slices in the Multislice environment will be restarted so training can continue."). Google
does not say which states the request and its nodes show meanwhile; tpuctl takes a queued resource still ACTIVE
with a slice not READY (gone, PREEMPTED, CREATING, RESTARTING) for one under repair and waits for every slice to
be READY (REPAIR_DEADLINE_S), then relaunches every host; one no longer ACTIVE (SUSPENDED: "no longer eligible
for further allocation", tpu/docs/queued-resources), or not whole by the deadline, is queued again whole."""

from __future__ import annotations

from dataclasses import replace

from tpuctl.errors import BadInput
from tpuctl.provision import labels as L
from tpuctl.provision import tpu
from tpuctl.provision.resources import Kind, Resource, State, Step, Worker
from tpuctl.provision.shapes.base import Listing, RecoveryAction, Requeue, Wait, run_ended
from tpuctl.provision.shapes.tpu_node import TpuNode

# "Multislice is only supported on Cloud TPU v4 and later TPU versions" (tpu/docs/multislice-introduction).
NO_MULTISLICE = ("v2", "v3")


class Queued(TpuNode):
    name = "queued"
    kind = Kind.QUEUED
    permissions = (*TpuNode.permissions, "tpu.queuedresources.create", "tpu.queuedresources.get",
                   "tpu.queuedresources.delete")
    queued = True

    def owns(self, r: Resource) -> bool:
        return r.kind is Kind.QUEUED or super().owns(r)

    def check_slices(self, t, slices: int, provisioning: str, framework: str) -> None:
        """Refuse a multislice Google does not make (BadInput naming the field): Google's rules are "only
        supported on Cloud TPU v4 and later", every slice of one type, topology, runtime and zone
        (tpu/docs/multislice-introduction: one request gives all of that), JAX or PyTorch ("Multislice supports
        JAX and PyTorch frameworks", GKE's multislice page), and TPU7x is a Compute Engine resource the Cloud
        TPU API does not make (tpu/docs/tpus-in-compute-engine), with no multislice path sourced there."""
        if slices < 2:
            return
        if t.api != self.catalog_api:
            raise BadInput(f"{t.name} is a Compute Engine TPU: the Cloud TPU API's multislice queued resources do "
                           "not make it, and no Compute Engine multislice path is supported yet", field="slices",
                           hint="use slices: 1 on TPU7x, or a v4, v5e, v5p or v6e type for multislice")
        if t.generation in NO_MULTISLICE:
            raise BadInput(f"Google's multislice is for TPU v4 and later, not {t.name}", field="slices",
                           hint="pick a v4, v5e, v5p or v6e type, or slices: 1")
        if framework == "tensorflow":
            raise BadInput("multislice runs JAX (or PyTorch) jobs, not TensorFlow", field="slices",
                           hint="set job.framework: jax, or slices: 1")
        if provisioning not in ("on-demand", "queued", "spot"):
            raise BadInput(f"a multislice is one queued resource: it cannot be provisioned {provisioning}",
                           field="slices", hint="use provisioning: queued (or spot) with slices")

    def plan_steps(self, spec, t, *, run, zones, runtime, framework, price_per_hour, catalog) -> tuple[Step, ...]:
        steps = super().plan_steps(spec, t, run=run, zones=zones, runtime=runtime, framework=framework,
                                   price_per_hour=price_per_hour, catalog=catalog)
        if spec.slices < 2:
            return steps
        # One queued resource bills its N slices: N times the slice's price.
        return tuple(replace(s, price_per_hour=s.price_per_hour * spec.slices,
                             detail=f"{spec.slices} slices {run}-0..{run}-{spec.slices - 1} of {s.detail}")
                     for s in steps)

    def request(self, plan, zone, service_account):
        return replace(super().request(plan, zone, service_account), slices=plan.slices)

    def create(self, clients, plan, name, zone, *, service_account, deadline_s, cancel=None, progress=None,
               on_issued=None) -> Resource:
        return tpu.create_queued(clients, self.request(plan, zone, service_account), deadline_s=deadline_s,
                                 cancel=cancel, progress=progress, on_issued=on_issued)

    def exists(self, clients, zone, name) -> bool:
        return tpu.get_queued(clients, zone, name) is not None

    def get(self, clients, zone, name) -> Resource | None:
        """The node `name`, else the multislice queued resource `name` as one TPU."""
        return super().get(clients, zone, name) or tpu.get_multislice(clients, zone, name)

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

    def _slices(self, clients, zone: str, name: str) -> list[str] | None:
        """The slice nodes of multislice queued resource `name`; None when `name` is not one."""
        r = None if tpu.get_node(clients, zone, name) is not None else tpu.get_multislice(clients, zone, name)
        return None if r is None else r.detail["slice_nodes"].split(",")

    def workers(self, clients, zone, name) -> tuple[Worker, ...]:
        slices = self._slices(clients, zone, name)
        if slices is None:
            return super().workers(clients, zone, name)
        out: list[Worker] = []
        for node in slices:
            out += [replace(w, index=len(out) + k) for k, w in enumerate(super().workers(clients, zone, node))]
        return tuple(out)

    def authorize(self, clients, zone, name, user, public_key, *, deadline_s=300.0) -> str:
        slices = self._slices(clients, zone, name)
        logins = {super(Queued, self).authorize(clients, zone, node, user, public_key, deadline_s=deadline_s)
                  for node in slices or [name]}
        return logins.pop()

    def delete(self, clients, zone, name, *, deadline_s=900.0, cancel=None, progress=None) -> None:
        qr = tpu.get_queued(clients, zone, name)
        tpu.delete_queued(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)
        # The force delete takes the slices along, but not necessarily before the queued resource is gone.
        for node in tpu.slice_names(name, tpu.slice_count(qr)) if qr is not None and tpu.slice_count(qr) > 1 else ():
            tpu.delete_node(clients, zone, node, deadline_s=deadline_s, cancel=cancel, progress=progress)

    def recovery_action(self, r: Resource) -> RecoveryAction:
        """A multislice whose request Google is repairing (REPAIRING: ACTIVE with a slice not READY, module
        docstring) is waited for, up to REPAIR_DEADLINE_S, then requeued whole; one whose request Google gave up
        (SUSPENDED) is requeued whole at once. A single node: as any queued node (requeued)."""
        if "slices" not in r.detail or r.state is State.DELETED or run_ended(r):
            return super().recovery_action(r)
        return Wait(r, otherwise=Requeue(r)) if r.state is State.REPAIRING else Requeue(r)

    def _again(self, r: Resource) -> RecoveryAction:
        return Requeue(r)

    def recreate(self, clients, zone, name, *, deadline_s, cancel=None, progress=None) -> Resource:
        qr = tpu.get_queued(clients, zone, name) if tpu.get_node(clients, zone, name) is None else None
        if qr is None or tpu.slice_count(qr) < 2:
            node = self._node(clients, zone, name)
            req = tpu.request_of(node)
            self.delete(clients, zone, node.queued_resource.rsplit("/", 1)[-1], deadline_s=deadline_s,
                        cancel=cancel, progress=progress)
            return tpu.create_queued(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)
        req = tpu.multislice_request(qr)
        self.delete(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)
        return tpu.create_queued(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)

    def wait_ready(self, clients, zone, name, *, deadline_s, cancel=None, progress=None) -> Resource:
        if self._slices(clients, zone, name) is None:
            return super().wait_ready(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)
        return tpu.wait_slices_ready(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)


QUEUED = Queued()
