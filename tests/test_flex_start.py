"""Flex-start on Cloud TPU API types: a queued resource whose TPU v2alpha1 `provisioningModel` is FLEX_START with
`runDuration.maxRunDuration` (tpu/docs/request-using-flex-start), against strict localcloud."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
from google.api_core import exceptions as gexc

from tpuctl import catalog as catalog_mod
from tpuctl import cost, provision as prov, spec
from tpuctl.errors import BadInput
from tpuctl.ledger import entry_of
from tpuctl.provision import gc, tpu
from test_provision import everything

ZONE = "us-east5-a"  # where Google sells v6e flex-start


def make_plan(pc, **fields):
    raw = {"name": "f1", "accelerator": "v6e-8", "zone": ZONE, "ttl": "2h", "provisioning": "flex-start",
           "max_run_duration": "1h", **fields}
    return prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester")


def test_catalog_offers_flex_start_on_v5e_and_v6e_in_googles_zones_only(pc):
    cat = catalog_mod.load()
    for name, zones in (("v6e-8", ["asia-northeast1-b", "us-east5-a"]), ("v5litepod-8", ["us-west4-a", "us-central1-a"])):
        t = cat.accelerator(name)
        assert "flex-start" in t.provisioning and list(t.flex_start_zones) == zones
    assert "flex-start" not in cat.accelerator("v5p-8").provisioning
    assert "request-using-flex-start" in cat.source
    shown = catalog_mod.accelerator_json(cat.accelerator("v6e-8"), cat)
    assert shown["flex_start_zones"] == ["asia-northeast1-b", "us-east5-a"]
    with pytest.raises(BadInput) as exc:
        make_plan(pc, zone="us-east5-b")
    assert exc.value.field == "zone" and "us-east5-a" in exc.value.message
    plan = make_plan(pc)
    assert [s.kind for s in plan.steps if s.key == "tpu"] == [prov.Kind.QUEUED] and plan.max_run_duration_s == 3600


def test_flex_start_queued_resource_runs_until_its_end_then_google_deletes_the_tpu(pc, cloud):
    # 1 simulated hour at speed 1000 is 3.6 s of wall clock.
    result = prov.apply(pc, make_plan(pc), deadline_s=60.0)
    assert result.get(prov.Kind.TPU).state is prov.State.READY
    qr_path = f"projects/{pc.project}/locations/{ZONE}/queuedResources/f1"
    qr = pc.get_json("tpu", f"v2alpha1/{qr_path}")
    assert qr["provisioningModel"] == "FLEX_START" and qr["runDuration"]["maxRunDuration"] == "3600s"
    assert "spot" not in qr and "guaranteed" not in qr
    v2 = pc.tpu.get_queued_resource(name=qr_path)  # TPU v2 reads it too, without the fields it lacks
    assert v2.tpu.node_spec[0].node_id == "f1"
    # status: the queued resource and its node end when Google ends them; cost stops there.
    [run] = prov.status(pc, "f1")
    by_kind = {r.kind: r for r in run.resources}
    node = by_kind[prov.Kind.TPU]
    assert by_kind[prov.Kind.QUEUED].detail["provisioning"] == node.detail["provisioning"] == "flex-start"
    ends = datetime.fromisoformat(node.detail["ends"]).timestamp()
    assert time.time() < ends < time.time() + 10
    e = entry_of(node)
    cat = catalog_mod.load()
    assert cost.accrued(e, cat, now=ends + 3600) == pytest.approx(cost.hourly(e, cat) * (ends - e.created) / 3600)
    deadline = time.monotonic() + 30
    while tpu.get_node(pc, ZONE, "f1") is not None:
        assert time.monotonic() < deadline, "the flex-start TPU outlived its max run duration"
        time.sleep(0.1)
    assert tpu.get_queued(pc, ZONE, "f1").state.state.name == "SUSPENDED"
    # gc: the run is over.
    actions = gc.decide(gc.scan(pc), {}, {}, gc.Policy(now=time.time(), owner="tester"))
    assert any("ended" in a.reasons for a in actions if a.resource.kind is prov.Kind.QUEUED)
    prov.down(pc, "f1", delete_bucket=True)
    assert everything(pc) == []


@pytest.mark.parametrize("change, message", [
    ({"runDuration": None}, "maxRunDuration"),
    ({"runDuration": {"maxRunDuration": f"{8 * 86400}s"}}, "maxRunDuration"),
    ({"provisioningModel": None}, "only valid with provisioningModel FLEX_START"),
    ({"spot": {}}, "spot"),
    ({"zone": "us-east5-b"}, "not available"),
    ({"unknownField": 1}, "unknown field"),
])
def test_localcloud_refuses_flex_start_requests_google_would(pc, cloud, change, message):
    zone = change.pop("zone", ZONE)
    parent = f"projects/{pc.project}/locations/{zone}"
    body = {"tpu": {"nodeSpec": [{"parent": parent, "nodeId": "g1", "node": {
                "acceleratorType": "v6e-8", "runtimeVersion": "v2-alpha-tpuv6e"}}]},
            "provisioningModel": "FLEX_START", "runDuration": {"maxRunDuration": "3600s"}}
    for key, value in change.items():
        body.pop(key) if value is None else body.__setitem__(key, value)
    with pytest.raises(gexc.BadRequest) as exc:
        pc.post_json("tpu", f"v2alpha1/{parent}/queuedResources?queuedResourceId=g1", body)
    assert message in str(exc.value)
    assert everything(pc) == []


def test_valid_until_bounds_a_flex_start_queued_resources_wait(pc, cloud):
    # The spec's valid_until reaches the request as queueingPolicy.validUntilDuration: no capacity by then
    # fails the request (exit 3) and nothing is left.
    cloud.faults.add("capacity", service="tpu", method="queuedResources.create", zone=ZONE)
    with pytest.raises(prov.CapacityError, match="before it expired"):
        prov.apply(pc, make_plan(pc, valid_until="5m"), deadline_s=60.0)
    assert everything(pc) == []
