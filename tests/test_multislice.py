"""Multislice through one Cloud TPU v2 queued resource (`slices: N`; issue 30).

One queued resource whose node spec carries `multisliceParams {nodeCount: N, nodeIdPrefix: RUN}` makes the
slices RUN-0 .. RUN-(N-1) (tpu v2 discovery, MultisliceParams); Google's rules (tpu/docs/multislice-introduction)
are refused at plan time. Every host of every slice runs the job: JAX meets them through MEGASCALE_* in each
slice's tpu-env. Losing one slice: Google's auto repair makes it again and restarts the others (the driver
waits for the request, then requeues it whole if it is not back), and the job resumes from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

from test_run import REPO, _text, _zero, project, run_preempted_at, tpc  # noqa: F401 (fixtures)
from tpuctl import catalog as catalog_mod
from tpuctl import cost, ledger
from tpuctl import spec as spec_mod
from tpuctl.errors import BadInput, CloudError
from tpuctl.jobs.pipeline import Pipeline, RunOptions
from tpuctl.provision import preflight

plan_mod = importlib.import_module("tpuctl.provision.plan")  # `tpuctl.provision.plan` is also a function


EXAMPLE = REPO / "examples" / "gpt2-multislice.yaml"


def _spec(name: str = "ms", **fields) -> dict:
    """examples/gpt2-multislice.yaml (gpt2-tiny, as small as it trains, on 2 slices of v5p-16: 2 hosts of 4
    chips each, 4 processes), named `name`, with `fields` (and `job` fields) over it."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    job = {**raw.pop("job"), **fields.pop("job", {})}
    job["data"] = {**job["data"], "corpus": [str(EXAMPLE.parent / c) for c in job["data"]["corpus"]]}
    return {**raw, "name": name, **fields, "job": job}


def _plan(**fields):
    return plan_mod.make(spec_mod.from_mapping(_spec(**fields)), project="p", owner="me")


def test_a_multislice_plan_is_one_queued_resource_of_n_slices_priced_n_times():
    one, two = _plan(slices=1), _plan()
    assert two.slices == 2 and two.framework == "jax" and two.to_json()["slices"] == 2
    tpu = next(s for s in two.steps if s.key == "tpu")
    # Preflight checks the quota of every slice at once, with the queued-resource permissions.
    assert [q["needs"] for q in two.to_json()["quotas"]] == [2 * q["needs"] for q in one.to_json()["quotas"]] != []
    assert "tpu.queuedresources.create" in preflight.permissions_for(
        preflight.Target.of_plan(_plan(provisioning="on-demand")))
    # `tpuctl cost --estimate` (the spec's estimate) prices the N slices too.
    catalog = catalog_mod.load()
    estimate = cost.estimate_spec(spec_mod.from_mapping(_spec()), catalog)
    assert estimate.items[0].what.startswith("tpu 2 x v5p-16 (spot)")
    assert estimate.items[0].usd_per_hour == pytest.approx(tpu.price_per_hour)
    assert tpu.detail.startswith("2 slices ms-0..ms-1 of v5p-16 (2 hosts)"), tpu.detail
    assert next(s for s in two.steps if s.key == "tpu").price_per_hour == pytest.approx(
        2 * next(s for s in one.steps if s.key == "tpu").price_per_hour)


@pytest.mark.parametrize("fields, words", [
    ({"accelerator": "v3-32", "zone": "europe-west4-a"}, "TPU v4 and later"),
    ({"accelerator": "tpu7x-8", "zone": "us-central1-c"}, "Compute Engine"),
    ({"job": {"template": "bert", "framework": "tensorflow"}}, "not TensorFlow"),
    ({"provisioning": "preemptible"}, "one queued resource"),
])
def test_google_multislice_rules_are_refused_naming_slices(fields, words):
    with pytest.raises(BadInput) as info:
        _plan(**fields)
    assert info.value.field == "slices" and words in info.value.message, info.value.message


def test_slices_below_one_are_refused():
    with pytest.raises(BadInput) as info:
        _plan(slices=0)
    assert info.value.field == "slices"


def test_localcloud_makes_every_slice_with_its_megascale_tpu_env(cloud, tpc, monkeypatch):
    """The request as tpuctl sends it (official client): N nodes PREFIX-i, each worker's tpu-env naming the
    slice count, its slice and the first slice's worker 0; the driver sees them as one TPU of 4 workers."""
    from tpuctl import provision
    from tpuctl.jobs import cluster
    from tpuctl.jobs import launch as launching
    from tpuctl.jobs.ssh import Fleet
    from tpuctl.provision import tpu

    plan = _plan(name="ms-qr")
    plan = plan_mod.Plan(**{**plan.__dict__, "project": tpc.project})
    r = provision.shapes.for_tpu(plan.accelerator, plan.provisioning, plan.slices).create(
        tpc, plan, plan.run, plan.zones[0], service_account="sa@p.iam.gserviceaccount.com", deadline_s=120)
    assert (r.name, r.state.value, r.detail["slices"], r.detail["slice_nodes"]) == ("ms-qr", "ready", "2",
                                                                                   "ms-qr-0,ms-qr-1")
    assert [w.index for w in r.workers] == [0, 1, 2, 3] and len({w.port for w in r.workers}) == 4
    assert provision.get_node(tpc, plan.zones[0], "ms-qr").workers == r.workers
    parent = f"projects/{tpc.project}/locations/{plan.zones[0]}"
    envs = []
    for node in ("ms-qr-0", "ms-qr-1"):
        for worker in range(2):
            tree = cloud.tpu.guest_metadata(f"{parent}/nodes/{node}", worker)
            envs.append(dict(line.split(": ", 1) for line in tree["instance"]["attributes"]["tpu-env"].splitlines()))
    assert [(e["MEGASCALE_NUM_SLICES"], e["MEGASCALE_SLICE_ID"]) for e in envs] == [
        ("'2'", "'0'"), ("'2'", "'0'"), ("'2'", "'1'"), ("'2'", "'1'")]
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in envs} == {"'127.0.0.1'"}
    # `status` (and `cost`, from the same prices) shows one run of 2 slices, 4 workers, billing 2 slices.
    (run,) = provision.status(tpc, "ms-qr", price=lambda x: cost.hourly(ledger.entry_of(x), catalog_mod.load()))
    assert sorted(x.name for x in run.resources if x.kind.value == "tpu") == ["ms-qr-0", "ms-qr-1"]
    assert run.workers == 4 and run.price_per_hour == pytest.approx(
        next(s for s in plan.steps if s.key == "tpu").price_per_hour)
    # What tpuctl checks on every host before a launch, over SSH: 2 slices agree; a count they do not share fails.
    assert cluster.locate(tpc, "ms-qr").node == "ms-qr"
    key, targets = cluster.authorize(tpc, plan.zones[0], "ms-qr")

    async def check(slices: int) -> None:
        async with Fleet(targets, key) as fleet:
            await launching.check_slices(fleet, slices)

    asyncio.run(check(2))
    with pytest.raises(CloudError, match="worker 3 says slices=2 slice=1 \\(expected 4 and 3\\)"):
        asyncio.run(check(4))
    # Preempting one slice: Google's auto repair makes that slice again and restarts the other while the request
    # stays ACTIVE (tpu/docs/multislice-introduction); the driver waits for it, not requeues it.
    zone = plan.zones[0]
    request, lost = tpu.get_queued(tpc, zone, "ms-qr"), tpu.get_node(tpc, zone, "ms-qr-1")
    restarted = []
    real_repair = cloud.tpu.repair
    monkeypatch.setattr(cloud.tpu, "repair", lambda node, state, *a: (restarted.append((node, state)),
                                                                       real_repair(node, state, *a)))
    cloud.preempt(f"{parent}/nodes/ms-qr-1")
    action = provision.recovery_action(tpc, zone, "ms-qr")
    assert isinstance(action, provision.Wait) and isinstance(action.otherwise, provision.Requeue)
    assert action.tpu.state.value == "repairing" and action.deadline_s == provision.shapes.REPAIR_DEADLINE_S
    back = provision.recover(tpc, action, force=False, deadline_s=120)
    assert back.state.value == "ready" and len(back.workers) == 4
    again = tpu.get_queued(tpc, zone, "ms-qr")
    assert again.create_time == request.create_time and again.state.state.name == "ACTIVE"  # repaired, not requeued
    assert tpu.get_node(tpc, zone, "ms-qr-1").create_time > lost.create_time  # a new slice
    assert restarted == [(f"{parent}/nodes/ms-qr-0", "RESTARTING")]  # ... once the new one was READY
    provision.down(tpc, "ms-qr")
    assert tpu.get_queued(tpc, plan.zones[0], "ms-qr") is None and _zero(cloud, tpc.project)


@pytest.mark.parametrize("request_state, state, action", [
    ("ACTIVE", "repairing", "Wait"),  # Google's auto repair is making the lost slice again: waited for
    ("SUSPENDED", "preempted", "Requeue"),  # "no longer eligible for further allocation": queued again at once
])
def test_a_lost_slice_is_waited_for_while_its_request_is_active(request_state, state, action):
    from google.cloud import tpu_v2

    from tpuctl import provision
    from tpuctl.provision import tpu

    parent = "projects/p/locations/us-east5-a"
    qr = tpu_v2.QueuedResource(
        name=f"{parent}/queuedResources/ms", state=tpu_v2.QueuedResourceState(state=request_state),
        tpu=tpu_v2.QueuedResource.Tpu(node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(
            parent=parent, node=tpu_v2.Node(accelerator_type="v5p-16"),
            multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=2,
                                                                                  node_id_prefix="ms"))]))
    ready = tpu_v2.Node(name=f"{parent}/nodes/ms-0", state=tpu_v2.Node.State.READY)
    r = tpu.multislice_to_resource(qr, [ready, None], local=False)  # slice 1 is gone
    got = provision.shapes.QUEUED.recovery_action(r)
    assert r.state.value == state and type(got).__name__ == action
    if action == "Wait":
        assert isinstance(got.otherwise, provision.Requeue) and got.deadline_s == provision.REPAIR_DEADLINE_S


@pytest.mark.parametrize("params, words", [
    ({"nodeCount": 1}, "must be > 1"),
    ({"nodeCount": 2, "nodeIdPrefix": "bad/prefix"}, "nodeIdPrefix"),
    ({"nodeCount": 2, "accelerator": ("v3-32", "tpu-ubuntu2204-base"), "zone": "europe-west4-a"}, "v4 and later"),
])
def test_localcloud_refuses_a_multislice_google_refuses(clients, params, words):
    from google.api_core import exceptions as gexc
    from google.cloud import tpu_v2

    zone = params.get("zone", "us-central1-a")
    accelerator, runtime = params.get("accelerator", ("v5p-16", "v2-alpha-tpuv5"))
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=clients.parent(zone), node=tpu_v2.Node(accelerator_type=accelerator, runtime_version=runtime),
        multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
            node_count=params["nodeCount"], node_id_prefix=params.get("nodeIdPrefix", "")))
    with pytest.raises(gexc.BadRequest, match=words):
        clients.tpu.create_queued_resource(parent=clients.parent(zone), queued_resource_id="qr1",
                                           queued_resource=tpu_v2.QueuedResource(
                                               tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec])))


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(900)
def test_two_slices_of_two_hosts_train_as_one_job_survive_a_lost_slice_and_leave_nothing(tpc, cloud, project):
    """THE rehearsal, of examples/gpt2-multislice.yaml: 2 slices x 2 hosts are 4 CPU processes (4 forced devices each) in one JAX cluster with
    cross-process collectives. Slice 1 is preempted after the first checkpoint: Google's auto repair (as the
    local cloud emulates it) makes it again and restarts slice 0, tpuctl waits for the request to be whole,
    relaunches every host, and all four resume from the bucket's checkpoint."""
    pytest.importorskip("jax")
    p = Pipeline(tpc, spec_mod.from_mapping(_spec("ms-run")), options=RunOptions(yes=True, poll_s=1.0))
    o = run_preempted_at(p, cloud, 15,
                         path=lambda p: f"projects/{p.project}/locations/{p.zone}/nodes/{p.node}-1")
    assert (p.plan.slices, p.plan.framework, p.node) == (2, "jax", "ms-run")
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 20, o
    logs = [_text(tpc, o.bucket, f"runs/ms-run/logs/worker-{w}.log") for w in range(4)]
    for w, log in enumerate(logs):  # the relaunched job's logs: every host of both slices resumed
        start = next(line for line in log.splitlines() if line.startswith("start "))
        assert start.startswith("start backend=jax strategy=cpu processes=4 slices=2 hosts=4 devices=16 "), (w, start)
        resumed = int(re.search(r" step=(\d+) ", start)[1])
        # The checkpoint of step 10, or the one the preemption notice saved after it.
        assert 10 <= resumed < 20 and "done step=20 " in log, (w, log[-2000:])
    assert "checkpoint step=20 " in logs[0] and not any("checkpoint step=" in log for log in logs[1:])
    status = json.loads(_text(tpc, o.bucket, "runs/ms-run/status.json"))
    assert status["state"] == "succeeded" and status["recovering"] is False
    # The run's cost is its slices', none for the one TPU the jobs layer saw: one entry each, as the request was
    # repaired, not requeued (a requeue is a new request: two incarnations each); the repaired slice's entry
    # bills through the repair too, so the figure errs high by that, never low.
    tpus = sorted(e.name for e in ledger.Ledger().entries() if e.run == "ms-run" and e.kind == "tpu")
    assert tpus == ["ms-run-0", "ms-run-1"] and o.cost_usd > 0, tpus
    assert _zero(cloud, project)


def test_the_slices_flag_plans_n_slices_from_the_example(env):
    """`--slices` overrides the spec's, on the example as a user runs it (dry run: nothing is created)."""
    from conftest import tpuctl

    r = tpuctl(env, "up", str(EXAMPLE), "--slices", "3", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    plan, fit = summary["plan"], summary["fit"]  # the check `up` made first, in its JSON as in its text
    assert plan["slices"] == 3 and "3 slices gpt2-multislice-0..gpt2-multislice-2 of v5p-16" in json.dumps(plan)
    assert fit["slices"] == 3 and fit["framework"] == "jax" and fit["fits"]  # a multislice trains with JAX
    assert fit["method"] == "compiled" or "under 25% of the chip's HBM" in fit["not_compiled"]  # why not compiled


def test_a_multislice_host_joins_jax_as_jax_itself_counts_it(monkeypatch):
    """guest.py reads MEGASCALE_* where JAX's cloud_tpu_cluster.py does (the environment first, then tpu-env);
    jax_cluster gives `jax.distributed.initialize` JAX's own numbers: slices x hosts processes, this one
    slice x hosts + worker, the coordinator MEGASCALE_COORDINATOR_ADDRESS without its port."""
    from tpuctl.localcloud.metadata import MetadataServer
    from tpuctl.templates.lmkit import guest, strategy

    hosts = "t1v-n-a-w-0:1:10.0.1.1,t1v-n-a-w-1:1:10.0.1.2"
    attributes = {"accelerator-type": "v5p-16", "agent-worker-number": "1", "worker-network-endpoints": hosts,
                  "tpu-env": "MEGASCALE_COORDINATOR_ADDRESS: '10.0.0.9:8080'\nMEGASCALE_NUM_SLICES: '3'\n"
                             "MEGASCALE_SLICE_ID: '2'\nNODE_ID: 'run-2'\n"}
    with contextlib.closing(MetadataServer()) as server:
        monkeypatch.setenv("GCE_METADATA_HOST", server.attach("n", 1, lambda i: {"instance": {"attributes": attributes}})[0])
        monkeypatch.setattr(guest, "tpu_vm", guest.tpu_vm.__wrapped__)  # uncached: each call reads the server
        vm = guest.tpu_vm()
        assert (vm.slices, vm.slice_id, vm.coordinator) == (3, 2, "10.0.0.9:8080")
        assert strategy.jax_cluster(vm, rehearsal=False) == {
            "coordinator_address": "10.0.0.9:8482", "num_processes": 6, "process_id": 5}
        # Every slice's rehearsal meets on one port: the slices' nodes share their prefix.
        first = strategy.jax_cluster(guest.TpuVm(node="run-0", worker=0, hosts=vm.hosts, accelerator_type="v5p-16",
                                                 slices=3, slice_id=0, coordinator="10.0.0.9"), rehearsal=True)
        assert first["coordinator_address"] == strategy.jax_cluster(vm, rehearsal=True)["coordinator_address"]
        monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")  # the environment wins, as in JAX
        assert guest.tpu_vm().slice_id == 0


def test_a_rehearsal_coordinator_port_is_never_one_of_the_kernels_ephemeral_ports():
    """The rehearsal's coordinator port must not be one the kernel hands to connections (CI once saw
    "Failed to add port to server" on 34302): below the first ephemeral port, for any node name."""
    from tpuctl.templates.lmkit import strategy

    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        first_ephemeral = 32768  # Linux's default where /proc is not there to ask
    ports = {strategy._rehearsal_port(f"rehearsal-{i:05d}") for i in range(20000)}
    assert 1024 <= min(ports) and max(ports) < first_ephemeral
    assert len(ports) > 10000  # spread: two rehearsals at once rarely meet on one port
