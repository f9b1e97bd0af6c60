"""Cost arithmetic, estimates, the report, durations and the ledger (no cloud needed)."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from tpuctl import catalog, cost
from tpuctl.errors import BadInput
from tpuctl.ledger import Entry, Ledger, entry_of, key_of
from tpuctl.provision.resources import Kind, Resource, State

H = 3600.0


@pytest.fixture
def cat(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    return catalog.load()


def tpu(name, run, owner="ann", created=0.0, deleted=None, acc="v3-8", zone="europe-west4-a", spot=False):
    return Entry(kind="tpu", name=name, project="p", location=zone, run=run, owner=owner, created=created,
                 deleted=deleted, accelerator=acc, spot=spot)


def vm(name, run, owner="ann", created=0.0, deleted=None, mt="e2-standard-2", disk=0):
    return Entry(kind="vm", name=name, project="p", location="us-central1-a", run=run, owner=owner,
                 created=created, deleted=deleted, machine_type=mt, disk_gb=disk)


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400),
                                          ("7d", 7 * 86400), ("1.5h", 5400), ("1w", 604800), ("3600", 3600)])
def test_parse_duration(text, seconds):
    assert cost.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "h", "2x", "2h bogus", "-1h"])
def test_parse_duration_rejects(text):
    with pytest.raises(BadInput) as err:
        cost.parse_duration(text, field="ttl")
    assert err.value.field == "ttl"


def test_accrued_runs_from_creation_to_deletion_or_now(cat):
    live = tpu("a", "r1", created=0.0)
    gone = tpu("b", "r1", created=0.0, deleted=0.5 * H)
    assert cost.accrued(live, cat, now=2 * H) == pytest.approx(2 * 8.8)
    assert cost.accrued(gone, cat, now=2 * H) == pytest.approx(0.5 * 8.8)
    assert cost.accrued(gone, cat, now=2 * H, since=1 * H) == 0.0
    assert cost.accrued(replace(live, kind="queued-resource"), cat, now=H) == 0.0
    assert cost.accrued(vm("v", "r1", disk=730), cat, now=H) == pytest.approx(0.067 + 730 * 0.04 / 730)
    assert cost.accrued_by_run([live, gone, vm("v", "r2")], cat, now=H) == pytest.approx(
        {"r1": 8.8 + 0.5 * 8.8, "r2": 0.067})


def test_spot_is_cheaper(cat):
    assert cost.hourly(tpu("s", "r", spot=True), cat) == pytest.approx(4 * 0.561)


def test_report_groups_windows_and_sorts(cat):
    entries = [tpu("a", "r1", owner="ann", created=0), tpu("b", "r2", owner="bob", created=0, deleted=H),
               vm("v", "r1", owner="ann", created=0), tpu("old", "r0", created=-10 * H, deleted=-5 * H)]
    rep = cost.report(entries, cat, since=0, now=2 * H, by="run")
    assert [r.key for r in rep.rows] == ["r1", "r2"]
    r1, r2 = rep.rows
    assert r1.usd == pytest.approx(2 * 8.8 + 2 * 0.067) and r1.live == 2 and r1.resources == 2
    assert r2.usd == pytest.approx(8.8) and r2.live == 0 and r2.usd_per_hour_now == 0
    assert rep.total_usd == pytest.approx(r1.usd + r2.usd)
    assert rep.usd_per_hour_now == pytest.approx(8.8 + 0.067)
    by_owner = cost.report(entries, cat, since=0, now=2 * H, by="owner")
    assert {r.key for r in by_owner.rows} == {"ann", "bob"}
    by_type = cost.report(entries, cat, since=-100 * H, now=2 * H, by="type")
    assert {r.key for r in by_type.rows} == {"v3-8", "e2-standard-2"}
    assert rep.to_json()["rows"][0]["key"] == "r1"
    with pytest.raises(BadInput) as err:
        cost.report(entries, cat, since=0, now=H, by="zone")
    assert err.value.field == "by"


def test_rolled_back_resources_cost_like_others_and_are_counted_apart(cat):
    entries = [tpu("a", "r1", created=0, deleted=H), replace(tpu("a", "r1", zone="europe-west4-b", created=0,
                                                                  deleted=0.25 * H), rolled_back=True)]
    [row] = cost.report(entries, cat, since=0, now=2 * H, by="run").rows
    assert (row.resources, row.rolled_back) == (2, 1)
    assert row.usd == pytest.approx(1.25 * 8.8) and row.rolled_back_usd == pytest.approx(0.25 * 8.8)
    assert cost.report(entries, cat, since=0, now=2 * H).to_json()["rows"][0]["rolled_back"] == 1


def test_a_rolled_back_entry_keeps_its_end_when_a_scan_saw_it_alive(tmp_path):
    book = Ledger(tmp_path / "ledger.json")
    seen_alive = tpu("a", "r1", created=10.0)
    book.record([seen_alive])
    book.record([replace(seen_alive, created=9.5, deleted=20.0, rolled_back=True)])
    [e] = book.entries()
    assert (e.created, e.deleted, e.rolled_back) == (9.5, 20.0, True)


def test_estimate_with_and_without_a_bound(cat):
    e = cost.estimate(cat, accelerator="v3-8", zone="europe-west4-a", spot=False,
                      vms=[cost.VmPlan("driver", "e2-standard-2", 0)], bucket_gb=730)
    assert e.usd_per_hour == pytest.approx(8.8 + 0.067 * 1.101 + 730 * 0.020 / 730)
    assert e.total_usd is None and len(e.items) == 3
    hours, bound = cost.run_bound(steps=7200, step_seconds=0.5, ttl="4h")
    assert (hours, bound) == (1.0, "7200 steps x 0.5 s")
    assert cost.run_bound(steps=7200, step_seconds=0.5, ttl="30m") == (0.5, "ttl 30m")
    assert cost.run_bound() == (None, None)
    assert cost.run_bound(ttl="1d", max_run_duration="2h") == (2.0, "flex-start max run duration 2h")


def test_estimate_spec_reads_a_run_spec_shape(cat):
    spec = SimpleNamespace(zones=["us-central1-b", "us-central1-c"], accelerator="v2-8", provisioning="spot",
                           vms=[SimpleNamespace(name="d", machine_type="n1-standard-1", disk_gb=10)], ttl="2h",
                           job=SimpleNamespace(config={"train_steps": 100}))
    e = cost.estimate_spec(spec, cat)
    assert e.hours == 2.0 and e.bound == "ttl 2h"
    assert e.usd_per_hour == pytest.approx(4 * 0.3375 + 0.0475 + 10 * 0.04 / 730)
    assert e.total_usd == pytest.approx(2 * e.usd_per_hour)
    assert cost.estimate_spec(spec, cat, step_seconds=36).hours == 1.0


def test_entry_of_a_resource_prefers_api_create_time_then_label():
    created = datetime(2026, 11, 23, tzinfo=timezone.utc)
    r = Resource(kind=Kind.TPU, name="n", project="p", location="europe-west4-a", state=State.READY,
                 labels={"tpuctl-owner": "ann", "tpuctl-created": "100"}, created=created, run="r1",
                 accelerator="v3-8", spot=True)
    e = entry_of(r)
    assert (e.created, e.owner, e.run, e.spot, e.key) == (created.timestamp(), "ann", "r1", True, key_of(r))
    r2 = Resource(kind=Kind.VM, name="v", project="p", location="z", state=State.READY,
                  labels={"tpuctl-created": "100"}, created=None, run=None, detail={"disk_gb": "20"})
    assert entry_of(r2).created == 100.0 and entry_of(r2).disk_gb == 20


def test_ledger_record_delete_reconcile(tmp_path):
    led = Ledger(tmp_path / "ledger.json")
    a, b = tpu("a", "r1", created=10), vm("b", "r1", created=20)
    led.record([a, b])
    led.record([tpu("a", "r1", created=50)])  # seen again later: keeps the first creation time
    assert [e.created for e in led.entries()] == [10, 20]
    led.mark_deleted([a.key], at=30)
    led.mark_deleted([a.key], at=99)  # idempotent: first deletion time stands
    led.record([a])  # re-seen in a stale scan: stays deleted
    led.reconcile(live_keys=[], scanned_projects=["other"], at=40)
    assert {e.name: e.deleted for e in led.entries()} == {"a": 30, "b": None}
    led.reconcile(live_keys=[], scanned_projects=["p"], at=40)
    assert {e.name: e.deleted for e in led.entries()} == {"a": 30, "b": 40}


def test_a_run_started_again_under_the_same_name_costs_both_lifetimes(tmp_path, cat):
    led = Ledger(tmp_path / "ledger.json")
    first = tpu("bert-tiny", "bert-tiny", created=0)
    led.record([first])
    led.mark_deleted([first.key], at=H)
    led.record([tpu("bert-tiny", "bert-tiny", created=2 * H)])  # `tpuctl run` again, same node name
    led.mark_deleted([first.key], at=4 * H)
    lives = sorted((e.created, e.deleted) for e in led.entries())
    assert lives == [(0, H), (2 * H, 4 * H)]
    hourly = cost.hourly(first, cat)
    assert cost.accrued_by_run(led.entries(), cat, now=10 * H) == {"bert-tiny": pytest.approx(3 * hourly)}


def test_corrupt_ledger_is_set_aside(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{oops")
    assert Ledger(path).entries() == []
    assert list(tmp_path.glob("ledger.json.corrupt-*"))


def _writer(path, prefix):
    led = Ledger(path)
    for i in range(25):
        led.record([tpu(f"{prefix}{i}", "r", created=i)])


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "ledger.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, p)) for p in "xyz"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert len(Ledger(path).entries()) == 75


def test_a_tpu_bills_only_its_billed_window_and_a_spot_one_preempted_in_its_first_minute_nothing(cat):
    """tpu/pricing: a node bills while READY; tpu/docs/preemptible: a preemptible/Spot TPU preempted in the first
    minute after its creation is not charged (a TPU API node: Compute's TPU VMs carry a machine type)."""
    rate = cost.hourly(tpu("a", "r"), cat)
    ready_at_1h = replace(tpu("a", "r", created=0.0), billed_from=H)
    assert cost.accrued(ready_at_1h, cat, now=3 * H) == pytest.approx(2 * rate)
    assert cost.accrued(replace(ready_at_1h, billed_until=2 * H), cat, now=3 * H) == pytest.approx(rate)
    never_ready = replace(tpu("b", "r", created=0.0, deleted=H), billed_from=H, rolled_back=True)
    assert cost.accrued(never_ready, cat, now=3 * H) == 0
    spot = replace(tpu("s", "r", created=0.0, spot=True), billed_from=20.0)
    assert cost.accrued(replace(spot, billed_until=60.0), cat, now=H) == 0
    assert cost.accrued(replace(spot, billed_until=61.0), cat, now=H) == pytest.approx(41 / H * cost.hourly(spot, cat))
    compute_spot = replace(spot, billed_until=60.0, machine_type="tpu7x-standard-4t")
    assert cost.accrued(compute_spot, cat, now=H) > 0
    rep = cost.report([replace(spot, billed_until=60.0), ready_at_1h], cat, since=0, now=3 * H)
    assert rep.usd_per_hour_now == pytest.approx(rate)  # a preempted node bills nothing now


def test_entry_of_bills_from_what_the_api_or_a_wait_saw():
    created = datetime(2026, 11, 23, tzinfo=timezone.utc)

    def seen(state, **detail):
        return entry_of(Resource(kind=Kind.VM, name="v", project="p", location="z", state=state, labels={},
                                 created=created, run="r", detail=detail), now=created.timestamp() + 500)

    t0 = created.timestamp()
    assert (seen(State.READY).billed_from, seen(State.READY).billed_until) == (t0, None)  # assumed: created
    assert seen(State.READY, ready="2026-11-23T00:01:40Z").billed_from == t0 + 100
    assert (seen(State.CREATING).billed_from, seen(State.CREATING).billed_until) == (t0 + 500, t0 + 500)
    stopped = seen(State.STOPPED, ready="2026-11-23T00:01:40Z", stopped="2026-11-23T00:03:20Z")
    assert (stopped.billed_from, stopped.billed_until) == (t0 + 100, t0 + 200)
    assert seen(State.PREEMPTED).billed_until == t0 + 500  # no stop time from the API: when first seen so


def test_the_ledger_merges_what_each_sighting_knew_of_billing(tmp_path):
    book = Ledger(tmp_path / "ledger.json")
    creating = replace(tpu("a", "r", created=0.0), billed_from=50.0, billed_until=50.0)  # a scan while CREATING
    book.record([creating])
    book.record([replace(creating, billed_from=80.0, billed_until=None)])  # `up` saw it turn READY at 80
    book.record([replace(creating, billed_from=0.0, billed_until=None)])  # a later scan can only assume createTime
    [e] = book.entries()
    assert (e.billed_from, e.billed_until) == (80.0, None)
    book.record([replace(creating, billed_from=0.0, billed_until=300.0)])  # first seen PREEMPTED at 300
    book.record([replace(creating, billed_from=0.0, billed_until=900.0)])
    [e] = book.entries()
    assert (e.billed_from, e.billed_until) == (80.0, 300.0)
    old_row = tpu("old", "r", created=10.0)  # written before the billed window existed: from its creation
    book.record([old_row])
    assert cost.lifetime_hours(next(x for x in book.entries() if x.name == "old"), since=0, now=H + 10) == 1.0


def test_a_rolled_back_create_bills_from_ready_and_a_queued_one_as_its_node(cat):
    """What an `up` created and deleted again billed from when it became READY (its create's Resource says when)
    to its deletion, or nothing if it never got there; a queued resource's cost is its node's."""
    from tpuctl.provision.apply import Undo, _Created

    plan = SimpleNamespace(run="r1", labels={"tpuctl-owner": "ann"}, vms=(), spot=False,
                           accelerator=SimpleNamespace(name="v3-8"))
    created = _Created(SimpleNamespace(project="p"), plan)
    queued = Undo(Kind.QUEUED, "r1", "europe-west4-a")
    never = Undo(Kind.TPU, "r1", "europe-west4-b")
    for undo in (queued, never):
        created.add(undo)
    node = Resource(kind=Kind.TPU, name="r1", project="p", location="europe-west4-a", state=State.READY, labels={},
                    created=datetime.fromtimestamp(1000.0, timezone.utc), run="r1", accelerator="v3-8",
                    detail={"ready": datetime.fromtimestamp(1600.0, timezone.utc).isoformat()})
    created.ready(queued, node)
    created.retire(queued, ended=1600.0 + H)
    created.retire(never, ended=2000.0)  # stocked out while CREATING
    by_zone = {e.location: e for e in created.gone()}
    assert by_zone["europe-west4-a"].kind == "tpu" and by_zone["europe-west4-a"].rolled_back
    assert cost.accrued(by_zone["europe-west4-a"], cat, now=10 * H) == pytest.approx(cost.hourly(tpu("a", "r"), cat))
    assert cost.accrued(by_zone["europe-west4-b"], cat, now=10 * H) == 0


def test_a_run_that_saw_its_spot_node_preempted_in_the_first_minute_records_it_free(cat):
    """`tpuctl run` remembers a preempted node as deleted (`ledger.remember(..., deleted=True)`): what it last
    saw of it (PREEMPTED, 10 s after its creation) is recorded too, so it costs nothing, as on Google."""
    import time

    from tpuctl import ledger

    t0 = time.time() - 10
    node = Resource(kind=Kind.TPU, name="n", project="p", location="us-central1-b", state=State.PREEMPTED,
                    labels={}, created=datetime.fromtimestamp(t0, timezone.utc), run="r", accelerator="v2-8",
                    spot=True)
    ledger.remember([node], deleted=True)
    [e] = Ledger().entries()
    assert e.deleted is not None and e.billed_until is not None
    assert cost.accrued(e, cat, now=t0 + 10 * H) == 0


def test_a_scan_closes_what_went_unseen_at_most_then_and_settle_puts_its_runs_time_once(tmp_path):
    """A detached run's supervisor deletes its TPU while this machine sleeps: the next scan closes the entry at the
    scan, marked, and `settle` moves it back to when the run's record says it went, once."""
    led = Ledger(tmp_path / "ledger.json")
    node, loader, seen = tpu("n", "r1", created=10), vm("v", "r1", created=10), tpu("m", "r2", created=10)
    led.record([node, loader, seen])
    led.mark_deleted([seen.key], at=50)  # this machine deleted it: it knows when
    led.reconcile(live_keys=[], scanned_projects=["p"], at=1000)
    assert {e.name: (e.deleted, e.closed_by_scan) for e in led.entries()} == {
        "n": (1000, True), "v": (1000, True), "m": (50, False)}
    led.record([tpu("n", "r1", created=10)])  # a stale listing that still shows it changes neither
    asked: list[str] = []

    def when(e: Entry) -> float | None:
        asked.append(e.name)
        return {"n": 40.0, "v": 5.0}.get(e.name)  # 5: before it existed, the record is of another life

    led.settle(when)
    assert sorted(asked) == ["n", "v"]
    assert {e.name: (e.deleted, e.closed_by_scan) for e in led.entries()} == {
        "n": (40.0, False), "v": (1000, False), "m": (50, False)}
    led.settle(when)  # settled once: not asked again
    assert sorted(asked) == ["n", "v"]


def test_an_unknown_time_is_asked_again_and_old_ledgers_read_as_before(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text('{"version": 1, "resources": {"p/tpu/z/old": {"kind": "tpu", "name": "old", "project": "p", '
                    '"location": "z", "run": "r", "owner": "ann", "created": 1.0, "deleted": 9.0}}}')
    led = Ledger(path)
    led.record([tpu("n", "r", created=10)])
    led.reconcile(live_keys=[], scanned_projects=["p"], at=100)
    led.settle(lambda e: None)  # the run has not ended: its TPU may be made again
    assert {e.name: (e.deleted, e.closed_by_scan) for e in led.entries()} == {"old": (9.0, False), "n": (100, True)}
