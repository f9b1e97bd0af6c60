"""`tpuctl gc` against the session's local cloud (conftest `cloud`): official clients over real HTTP, strict.

One world holds every kind of run side by side in the same zone, so each rule is shown to pick exactly its
run and nothing else: unlabelled resources and unexpired runs in the same zone survive.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from click.testing import CliRunner
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, tpu_v2

from tpuctl import catalog
from tpuctl.cli import cli
from tpuctl.jobs import timeline
from tpuctl.ledger import Entry, Ledger
from tpuctl.provision import bucket, gc, tpu, vm
from tpuctl.provision import labels as L
from tpuctl.provision.clients import build

pytestmark = pytest.mark.timeout(180)

ZONE = "us-central1-b"
RUNTIME = "tpu-vm-tf-2.17.0-pjrt"


@pytest.fixture
def clients(cloud):
    """tpuctl's own `Clients` in a fresh project: other tests' resources are invisible to it."""
    return build(project=f"gc-test-{uuid.uuid4().hex[:10]}", credentials=AnonymousCredentials(),
                 endpoint=cloud.endpoint, storage_host=cloud.storage_host, local=True)


@pytest.fixture
def home(tmp_path, monkeypatch, cloud):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TPUCTL_API_ENDPOINT", cloud.endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", cloud.storage_host)
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"


def run_labels(run, owner="ann", ttl_s=3600.0):
    return L.run_labels(run, owner_name=owner, ttl_s=ttl_s)


def make_tpu(clients, name, labels, *, spot=False, accelerator="v2-8", zone=ZONE):
    """A node created with the raw official client (labelled or not), then waited on until READY."""
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version=RUNTIME, labels=dict(labels),
                       scheduling_config=tpu_v2.SchedulingConfig(spot=spot))
    clients.tpu.create_node(parent=tpu.parent(clients.project, zone), node_id=name, node=node)
    tpu.wait_ready(clients, zone, name, deadline_s=30)


def make_vm(clients, name, labels):
    inst = compute_v1.Instance(
        name=name, machine_type=f"zones/{ZONE}/machineTypes/e2-small", labels=dict(labels),
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image="projects/debian-cloud/global/images/family/debian-12", disk_size_gb=10))],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")])
    op = clients.instances.insert_unary(project=clients.project, zone=ZONE, instance_resource=inst)
    vm.wait_zone_op(clients, ZONE, op, what=f"create VM {name}", deadline_s=30, cancel=None, progress=None,
                    state=None)


def write_status(clients, run, state, heartbeat, recovering=False, owner="ann"):
    name = L.auto_bucket(clients.project, run)
    bucket.ensure(clients, name, "us-central1", run_labels(run, owner, ttl_s=30 * 86400))
    clients.storage.bucket(name).blob(gc.status_object(run)).upload_from_string(
        json.dumps({"state": state, "heartbeat": heartbeat, "recovering": recovering}),
        content_type="application/json")


def node_names(clients):
    return sorted(n.name.rsplit("/", 1)[-1] for n in tpu.list_nodes(clients))


def vm_names(clients):
    return sorted(i.name for _, scoped in clients.instances.aggregated_list(project=clients.project)
                  for i in scoped.instances)


def gc_cli(clients, *args):
    owner = () if "--all-owners" in args else ("--owner", "ann")  # together an error: the owner would do nothing
    result = CliRunner().invoke(cli, ["gc", "--project", clients.project, *owner, "--json", "--yes", *args])
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result, records


def test_each_rule_removes_its_run_and_nothing_else(cloud, clients, home):
    now = time.time()
    make_tpu(clients, "expired-tpu", run_labels("expired", ttl_s=-10))
    make_vm(clients, "expired-vm", run_labels("expired", ttl_s=3600))  # same run: goes with it
    make_tpu(clients, "finished-tpu", run_labels("finished"))
    write_status(clients, "finished", "succeeded", time.time())
    make_tpu(clients, "failed-tpu", run_labels("failed"))
    write_status(clients, "failed", "failed", time.time())
    make_tpu(clients, "idle-tpu", run_labels("idle"))
    write_status(clients, "idle", "running", now - 7200)
    make_tpu(clients, "preempted-tpu", run_labels("preempted"), spot=True)
    make_tpu(clients, "recovering-tpu", run_labels("recovering"), spot=True)
    write_status(clients, "recovering", "running", now - 7200, recovering=True)
    make_tpu(clients, "pricey-tpu", run_labels("pricey"))
    # The run's earlier slice, deleted yesterday after 20 h, cost $90: only the ledger remembers it.
    Ledger(home / "ledger.json").record([Entry(kind="tpu", name="pricey-old", project=clients.project, location=ZONE,
                                               run="pricey", owner="ann", created=now - 86400 - 72000,
                                               deleted=now - 86400, accelerator="v2-8")])
    make_tpu(clients, "young-tpu", run_labels("young"))
    write_status(clients, "young", "running", now)
    make_tpu(clients, "bobs-tpu", run_labels("bobs", owner="bob", ttl_s=-10))
    make_tpu(clients, "stranger-tpu", {"team": "research"}, spot=True)  # no tpuctl labels at all
    make_vm(clients, "stranger-vm", {})
    for node in ("preempted-tpu", "recovering-tpu", "stranger-tpu"):
        cloud.preempt(tpu.node_path(clients.project, ZONE, node))

    dry, dry_records = gc_cli(clients, "--dry-run", "--budget", "50", "--idle", "30m")
    assert dry.exit_code == 0, dry.output
    assert {r["status"] for r in dry_records} == {"would-delete", "skipped"}
    assert len(node_names(clients)) == 10 and len(vm_names(clients)) == 2

    result, records = gc_cli(clients, "--budget", "50", "--idle", "30m")
    assert result.exit_code == 0, result.output
    got = {(r["name"], r["status"]): r["reasons"] for r in records}
    assert got == {
        ("expired-tpu", "deleted"): ["expired"], ("expired-vm", "deleted"): ["expired"],
        ("finished-tpu", "deleted"): ["finished"], ("failed-tpu", "deleted"): ["failed"],
        ("idle-tpu", "deleted"): ["idle"], ("preempted-tpu", "deleted"): ["preempted"],
        ("pricey-tpu", "deleted"): ["over-budget"], ("bobs-tpu", "skipped"): ["expired"],
    }
    assert node_names(clients) == ["bobs-tpu", "recovering-tpu", "stranger-tpu", "young-tpu"]
    assert vm_names(clients) == ["stranger-vm"]
    # Buckets hold models: none went without --buckets.
    assert len(bucket.list_labelled(clients)) == 5

    again, again_records = gc_cli(clients, "--budget", "50", "--idle", "30m", "--all-owners")
    assert again.exit_code == 0 and [(r["name"], r["status"]) for r in again_records] == [("bobs-tpu", "deleted")]

    ledger = {e.name: e for e in Ledger(home / "ledger.json").entries()}
    assert ledger["expired-tpu"].deleted is not None and ledger["young-tpu"].deleted is None


def test_buckets_go_only_with_the_flag_and_their_own_ttl(clients, home):
    old, new = f"{clients.project}-old", f"{clients.project}-new"
    bucket.ensure(clients, old, "us-central1", run_labels("old", ttl_s=-10))
    clients.storage.bucket(old).blob("model/ckpt-1").upload_from_string(b"weights")
    bucket.ensure(clients, new, "us-central1", run_labels("new", ttl_s=3600))
    assert gc_cli(clients)[1] == []
    result, records = gc_cli(clients, "--buckets")
    assert result.exit_code == 0, result.output
    assert [(r["kind"], r["name"], r["status"]) for r in records] == [("bucket", old, "deleted")]
    assert [b.name for b in bucket.list_labelled(clients)] == [new]


def test_concurrent_gc_runs_do_not_double_delete(clients, home):
    for i in range(3):
        make_tpu(clients, f"old-{i}", run_labels(f"old{i}", ttl_s=-10))
    policy = gc.Policy(now=time.time(), owner="ann")
    cat = catalog.load()
    results: list[gc.GcResult] = []

    def one() -> None:
        results.append(gc.run(clients, policy, dry_run=False, catalog=cat, ledger=Ledger(), lock=home / "gc.lock",
                              lock_wait_s=60))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deleted = sorted(o.action.resource.name for r in results for o in r.outcomes)
    assert deleted == ["old-0", "old-1", "old-2"]  # each once, by whichever run held the lock first
    assert all(o.ok for r in results for o in r.outcomes)
    assert node_names(clients) == []


def test_a_held_lock_skips_the_run(clients, home):
    make_tpu(clients, "old", run_labels("old", ttl_s=-10))
    with gc.exclusive(home / "gc.lock") as held:
        assert held
        result = gc.run(clients, gc.Policy(now=time.time(), owner="ann"), dry_run=False, catalog=catalog.load(),
                        ledger=Ledger(), lock=home / "gc.lock")
    assert result.locked_out and result.outcomes == ()
    assert node_names(clients) == ["old"]


def test_a_failed_delete_is_reported_and_exits_1(cloud, clients, home):
    make_tpu(clients, "stuck", run_labels("stuck", ttl_s=-10))
    make_tpu(clients, "fine", run_labels("fine", ttl_s=-10))
    make_vm(clients, "fine-vm", run_labels("fine", ttl_s=-10))
    cloud.faults.add("stuck", service="tpu", method="nodes.delete", count=1)  # the first node delete hangs
    result, records = gc_cli(clients, "--timeout", "2s")
    assert result.exit_code == 1, result.output
    status = sorted(r["status"] for r in records)
    assert status == ["deleted", "deleted", "failed"]
    failed = next(r for r in records if r["status"] == "failed")
    assert failed["kind"] == "tpu" and failed["name"] in failed["error"]


def test_bad_input_exits_2_and_touches_nothing(clients, home):
    make_tpu(clients, "old", run_labels("old", ttl_s=-10))
    for args in (["--idle", "soon"], ["--budget", "-5"], ["--budget-per", "zone"]):
        result, _ = gc_cli(clients, *args)
        assert result.exit_code == 2, (args, result.output)
    assert node_names(clients) == ["old"]


def test_gc_on_a_terminal_lists_what_would_go_and_deletes_only_on_yes(clients, home):
    """The confirmation rule for gc: on a terminal (NO_COLOR=1 set by `home`) it shows what it would delete
    and asks; 'no' deletes nothing, 'yes' deletes it. Cron passes --yes (see test_gc_schedule)."""
    import os

    from test_up_down import _on_a_terminal

    old = f"{clients.project}-old"
    bucket.ensure(clients, old, "us-central1", run_labels("old", ttl_s=-10))
    argv = ("gc", "--buckets", "--project", clients.project, "--owner", "ann")
    code, text = _on_a_terminal(dict(os.environ), *argv, answer="n")
    assert f"bucket us-central1/{old} run=old:" in text and "delete these 1 resource(s)? [y/N]" in text, text
    assert code == 2 and "error: --yes: not confirmed; nothing was deleted" in text, text
    assert [b.name for b in bucket.list_labelled(clients)] == [old]
    code, text = _on_a_terminal(dict(os.environ), *argv, answer="y")
    assert code == 0 and f"deleted bucket us-central1/{old}" in text, text
    assert bucket.list_labelled(clients) == []


def save_timeline(clients, run, marks):
    """The run's timeline as its pipeline left it, in the bucket `write_status` made."""
    record = timeline.Timeline()
    for m in marks:
        record.mark(m.what, at=m.at, step=m.step, detail=m.detail)
    record.save(clients, L.auto_bucket(clients.project, run), run)


def test_gc_ends_the_timeline_of_a_run_nobody_watched_to_its_end(clients, home):
    """`run --detach --no-supervisor`: nobody watched the job end, so nothing ended its timeline; the gc that
    deletes its TPU does, and the run's time stops growing. A timeline that ended is left as it was."""
    t = time.time()
    unwatched = [timeline.Mark(t - 30, "up"), timeline.Mark(t - 20, "launch"), timeline.Mark(t - 19, "workers_ready"),
                 timeline.Mark(t - 18, "detached", detail="detached")]
    ended = [timeline.Mark(t - 30, "up"), timeline.Mark(t - 20, "teardown", detail="failed"),
             timeline.Mark(t - 10, "failed", detail="failed")]
    for run, marks in (("unwatched", unwatched), ("ended", ended)):
        make_tpu(clients, f"{run}-tpu", run_labels(run))
        write_status(clients, run, "succeeded", time.time())
        save_timeline(clients, run, marks)
    before = time.time()
    result, records = gc_cli(clients)
    assert result.exit_code == 0 and sorted(r["name"] for r in records) == ["ended-tpu", "unwatched-tpu"], result.output
    after = time.time()
    marks = timeline.load(clients, L.auto_bucket(clients.project, "unwatched"), "unwatched").marks
    teardown, end = marks[len(unwatched):]
    assert marks[:len(unwatched)] == unwatched
    assert [(m.what, m.detail) for m in (teardown, end)] == [("teardown", "gc: finished"), ("closed", "gc: finished")]
    assert before <= teardown.at < end.at <= after
    acct = timeline.account(timeline.Timeline(marks), now=after + 86400)
    assert acct.ended and acct.wall_s == pytest.approx(end.at - unwatched[0].at) and acct.goodput is None
    assert timeline.load(clients, L.auto_bucket(clients.project, "ended"), "ended").marks == ended
