"""The shape drivers' one contract (provision/shapes/base.py), checked on every driver against the strict local
cloud: a stockout makes `apply` fail over (or give up cleanly where the type has one zone), create adopts what
exists by name + run label and refuses another run's, the run's labels round-trip through create, get and the
inventory, delete of what is missing is done, and `recovery_action` answers per state.

A new driver must get a CASES entry: `test_every_driver_has_a_case` fails until it does."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

import pytest

from test_provision import default_sa, everything
from tpuctl import provision as prov
from tpuctl import spec
from tpuctl.errors import CapacityError, NameTaken
from tpuctl.provision import inventory, shapes
from tpuctl.provision import labels as L
from tpuctl.provision.resources import Kind, Resource, State

DEADLINE = 60.0


@dataclass(frozen=True)
class Case:
    spec: dict  # the run's spec fields (name and ttl added)
    zones: tuple[str, ...]  # the failover list; the stockout is injected in the first
    fault: dict  # where localcloud's "capacity" fault strikes this shape's create
    sample: dict = field(default_factory=dict)  # what a resource of the shape carries (for recovery_action)
    answers: dict = field(default_factory=dict)  # state -> the recovery answer's type (RebuildFromPlan otherwise)


_NODE = {State.REPAIRING: shapes.Wait, State.PREEMPTED: shapes.Recreate, State.READY: shapes.Recreate,
         State.FAILED: shapes.Recreate, State.STOPPED: shapes.Recreate}
CASES = {
    "tpu-node": Case({"accelerator": "v3-8", "provisioning": "spot"}, ("us-central1-a", "us-central1-b"),
                     {"service": "tpu", "method": "nodes.create"}, {"kind": Kind.TPU}, _NODE),
    # Without capacity a queued resource waits until its valid_until (1 h: 3.6 s at the tests' speed), then FAILED.
    "queued": Case({"accelerator": "v2-8", "provisioning": "queued", "valid_until": "1h"},
                   ("us-central1-b", "us-central1-c"), {"service": "tpu", "method": "queuedResources.create"},
                   {"kind": Kind.TPU, "detail": {"queued_resource": "projects/p/locations/z/queuedResources/r"}},
                   {**{s: shapes.Requeue for s in _NODE}, State.REPAIRING: shapes.Wait}),
    # TPU7x is sold in one zone only: a stockout there is a CapacityError with nothing left behind.
    "compute-tpu": Case({"accelerator": "tpu7x-8", "provisioning": "spot"}, ("us-central1-c",),
                        {"service": "compute", "method": "instances.insert"},
                        {"kind": Kind.TPU, "detail": {"api": "compute"}}),
    "mig-slice": Case({"accelerator": "tpu7x-16"}, ("us-central1-c",), {"service": "compute", "method": "instances.insert"},
                      {"kind": Kind.TPU, "detail": {"api": "compute-mig"}}),
    "vm": Case({"accelerator": "v3-8", "vms": [{"name": "d"}]}, ("us-central1-a", "us-central1-b"),
               {"service": "compute", "method": "instances.insert"}, {"kind": Kind.VM}),
}
DRIVERS = {d.name: d for d in shapes.DRIVERS}


def test_every_driver_has_a_case():
    assert set(DRIVERS) == set(CASES)


def _plan(pc, case: Case, run: str = "c1"):
    return prov.plan(spec.from_mapping({"name": run, "ttl": "2h", "zone": list(case.zones), **case.spec}),
                     project=pc.project, owner="tester")


def _name(driver: shapes.Shape, plan) -> str:
    return plan.vm_name(plan.vms[0]) if driver is shapes.VM else plan.run


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_picks_the_driver_and_it_owns_what_it_makes(pc, name):
    driver, plan = DRIVERS[name], _plan(pc, CASES[name])
    tpu_step = next(s for s in plan.steps if s.key == "tpu")
    if driver is not shapes.VM:
        assert shapes.for_tpu(plan.accelerator, plan.provisioning) is driver and tpu_step.kind is driver.kind
    sample = Resource(name="c1", project=pc.project, location=CASES[name].zones[0], state=State.READY, labels={},
                      created=None, run="c1", **CASES[name].sample)
    assert shapes.of(sample) is driver and [d for d in shapes.DRIVERS if d.owns(sample)] == [driver]


@pytest.mark.parametrize("name", sorted(CASES))
def test_recovery_action_answers_per_state(name):
    """Pure: what the driver answers for each state its TPU can be lost in, and Ended once Google's published
    end has come, whatever the state."""
    driver, case = DRIVERS[name], CASES[name]
    now = datetime.now(timezone.utc)
    for state in (State.DELETED, State.REPAIRING, State.PREEMPTED, State.READY, State.FAILED, State.STOPPED):
        r = Resource(name="c1", project="p", location=case.zones[0], state=state, labels={}, created=None, run="c1",
                     **case.sample)
        answer = driver.recovery_action(r)
        assert type(answer) is case.answers.get(state, shapes.RebuildFromPlan), (state, answer)
        assert answer.tpu == r
        if isinstance(answer, shapes.Wait):  # not back in time: what the driver does with any other loss
            assert type(answer.otherwise) is type(driver.recovery_action(replace(r, state=State.PREEMPTED)))
        later = replace(r, detail={**r.detail, "ends": (now + timedelta(hours=1)).isoformat()})
        assert type(driver.recovery_action(later)) is type(answer)  # an end still to come changes nothing
        ended = replace(r, detail={**r.detail, "ends": (now - timedelta(seconds=1)).isoformat()})
        assert driver.recovery_action(ended) == shapes.Ended(ended)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stockout_failover_adoption_labels_and_idempotent_delete(pc, cloud, name):
    driver, case = DRIVERS[name], CASES[name]
    plan = _plan(pc, case)
    name_ = _name(driver, plan)

    # A stockout in the first zone: apply moves on to the next, and what it tried there is gone.
    cloud.faults.add("capacity", zone=case.zones[0], **case.fault)
    if len(case.zones) == 1:
        with pytest.raises(CapacityError):
            prov.apply(pc, plan, deadline_s=DEADLINE)
        assert everything(pc) == []
        cloud.faults.clear()
        zone = case.zones[0]
        made = driver.create(pc, plan, name_, zone, service_account=default_sa(pc), deadline_s=DEADLINE)
    else:
        result = prov.apply(pc, plan, deadline_s=DEADLINE)
        cloud.faults.clear()
        made = next(r for r in result.resources if r.name == name_)
        zone = case.zones[1]
        assert made.location == zone and not driver.exists(pc, case.zones[0], name_)
    assert made.state is State.READY and shapes.of(made) is driver

    # Labels round-trip: what create returns, get reads and the inventory lists carry the plan's labels.
    got = driver.get(pc, zone, name_)
    listed = [r for r in inventory.resources(pc, plan.run) if r.name == name_ and driver.owns(r)]
    assert listed and all(dict(r.labels) == dict(plan.labels) for r in (made, got, *listed))
    assert driver.exists(pc, zone, name_)

    # Create again adopts (no request goes out, the same resource comes back); another run's name is refused.
    issued: list[str] = []
    again = driver.create(pc, plan, name_, zone, service_account=default_sa(pc), deadline_s=DEADLINE,
                          on_issued=lambda: issued.append("create"))
    assert issued == [] and (again.name, again.created, again.state) == (made.name, made.created, State.READY)
    theirs = replace(plan, labels={**plan.labels, L.RUN: "someone-else"})
    with pytest.raises(NameTaken):
        driver.create(pc, theirs, name_, zone, service_account=default_sa(pc), deadline_s=DEADLINE,
                      on_issued=lambda: issued.append("theirs"))
    assert issued == [] and driver.get(pc, zone, name_).created == made.created

    # Delete blocks until gone; deleting what is missing (again, or never made) is done, not an error.
    driver.delete(pc, zone, name_, deadline_s=DEADLINE)
    assert driver.get(pc, zone, name_) is None and not driver.exists(pc, zone, name_)
    driver.delete(pc, zone, name_, deadline_s=DEADLINE)
    driver.delete(pc, zone, "never-made", deadline_s=DEADLINE)
    # Gone, its driver says how the run gets it back from what the run last knew of it.
    assert isinstance(prov.recovery_action(pc, zone, name_, last=made), shapes.RebuildFromPlan)
    prov.down(pc, plan.run, delete_bucket=True)
    assert everything(pc) == []
