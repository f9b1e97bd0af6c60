"""TPU7x through Compute Engine: catalog, plan, up/status/down/gc/cost, flex-start, against strict localcloud."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from conftest import tpuctl, tpuctl_here
from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from tpuctl import catalog as catalog_mod
from tpuctl import cost, provision as prov, spec
from tpuctl.errors import BadInput, CapacityError, NameTaken, NotFound
from tpuctl.ledger import entry_of
from tpuctl.provision import compute_tpu, gc
from test_provision import everything

ZONE = "us-central1-c"
IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x"
FAST_DEADLINE = 60.0


def make_plan(pc, **fields):
    raw = {"name": "x1", "accelerator": "tpu7x-8", "zone": ZONE, "ttl": "2h", **fields}
    return prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester")


def test_catalog_lists_tpu7x_as_compute_engine_types():
    cat = catalog_mod.load()
    t = cat.accelerator("tpu7x-8")
    assert (t.chips, t.cores, t.hosts, t.topology, t.api, t.machine_type) == (4, 8, 1, "2x2x1", "compute",
                                                                              "tpu7x-standard-4t")
    assert (cat.accelerator("tpu7x-16").topology, cat.accelerator("tpu7x-16").hosts) == ("2x2x2", 2)
    assert (cat.accelerator("tpu7x-128").topology, cat.accelerator("tpu7x-128").hosts) == ("4x4x4", 16)
    assert not t.tensorflow and "flex-start" in t.provisioning
    assert cat.accelerator("v3-8").api == "tpu-v2"
    assert cat.tpu_price_per_hour("tpu7x-8", ZONE, spot=True) < cat.tpu_price_per_hour("tpu7x-8", ZONE, spot=False)
    assert any("tpu7x" in s.lower() and "price" in s.lower() for s in cat._data["sources"])


def test_catalog_list_shows_which_api_provisions_each_type(env):
    p = tpuctl(env, "catalog", "list", "--json")
    assert p.returncode == 0, p.stderr
    apis = {a["name"]: a["api"] for a in json.loads(p.stdout)["accelerators"]}
    assert apis["tpu7x-8"] == "compute" and apis["v3-8"] == "tpu-v2" and apis["v6e-8"] == "tpu-v2"
    p = tpuctl_here(env, "catalog", "list", "-g", "tpu7x")
    assert p.returncode == 0 and "compute" in p.stdout and "tpu7x-8" in p.stdout, p.stderr


@pytest.mark.parametrize("fields,field", [
    ({"accelerator": "tpu7x-16", "provisioning": "flex-start", "max_run_duration": "4h"}, "provisioning"),
    ({"provisioning": "queued"}, "provisioning"),
    ({"provisioning": "flex-start"}, "max_run_duration"),
    ({"provisioning": "flex-start", "max_run_duration": "8d"}, "max_run_duration"),
    ({"accelerator": "v3-8", "zone": "europe-west4-a", "provisioning": "flex-start", "max_run_duration": "4h"},
     "provisioning"),
])
def test_plan_refuses_what_google_does_not_offer(pc, fields, field):
    with pytest.raises(BadInput) as exc:
        make_plan(pc, **fields)
    assert exc.value.field == field


def test_a_tensorflow_job_on_tpu7x_is_refused_naming_jax(pc):
    raw = {"name": "x1", "accelerator": "tpu7x-8", "zone": ZONE}
    with pytest.raises(BadInput) as exc:
        prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester", framework="tensorflow")
    assert exc.value.field == "accelerator" and "JAX" in exc.value.message
    prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester")  # `up` (no job) is fine


def test_up_status_cost_down_of_a_tpu7x_single_host(pc, cloud):
    plan = make_plan(pc, provisioning="spot")
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    tpu_r = result.get(prov.Kind.TPU)
    assert tpu_r.detail["api"] == "compute" and tpu_r.accelerator == "tpu7x-8" and tpu_r.spot
    assert len(tpu_r.workers) == 1
    inst = pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
    assert inst.machine_type.endswith("/machineTypes/tpu7x-standard-4t")
    assert inst.scheduling.provisioning_model == "SPOT" and inst.labels["tpuctl-run"] == "x1"
    # Spot TPUs are recreated after preemption, never restarted: Google deletes the VM rather than keep it stopped.
    assert inst.scheduling.instance_termination_action == "DELETE"
    # Guest attributes on, so the guest publishes its SSH host keys and they are pinned, not trusted on first use.
    assert {i.key: i.value for i in inst.metadata.items}["enable-guest-attributes"] == "TRUE"
    # The bucket is in the TPU's region and the instance's service account may write to it.
    bucket = pc.storage.lookup_bucket(plan.bucket)
    assert bucket.location.lower() == "us-central1"
    sa = inst.service_accounts[0].email
    members = {m for b in bucket.get_iam_policy(requested_policy_version=3).bindings for m in b["members"]}
    assert f"serviceAccount:{sa}" in members
    # status: one run, the TPU counted as such (not a VM), priced at the catalog's TPU7x spot price.
    cat = catalog_mod.load()
    [run] = prov.status(pc, "x1", price=lambda r: cost.hourly(entry_of(r), cat))
    assert run.zone == ZONE and run.workers == 1 and run.state is prov.State.READY
    assert run.price_per_hour == pytest.approx(cat.tpu_price_per_hour("tpu7x-8", ZONE, spot=True))
    # localcloud bills it as a TPU at its own TPU7x price (4 chips).
    meter = {m["resource"]: m for m in cloud.meter_report()["resources"]}
    row = meter[f"projects/{pc.project}/zones/{ZONE}/instances/x1"]
    assert row["kind"] == "tpu" and row["sku"] == f"tpu/tpu7x-standard-4t/{ZONE}/spot"
    assert row["usd_per_hour"] == pytest.approx(run.price_per_hour)  # what tpuctl says it costs
    prov.down(pc, "x1", delete_bucket=True)
    assert everything(pc) == []


def test_capacity_fails_over_to_the_next_zone_and_rolls_back(pc, cloud):
    cloud.faults.add("capacity", service="compute", method="instances.insert", zone=ZONE)
    with pytest.raises(CapacityError) as exc:
        prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    assert "tpu7x-8" in exc.value.message
    assert everything(pc) == []


def test_a_tpu_instance_starts_pending_and_one_deleted_while_pending_is_a_stockout(pc, cloud, monkeypatch):
    """compute/docs/instances/instance-lifecycle: "TPU instances start instead in the PENDING state"; one that
    cannot get its resources gets "an error and Compute Engine deletes the compute instance": tpuctl takes an
    instance gone while PENDING for no capacity (so the zone fails over), not for a vanished one."""
    from tpuctl.provision import vm

    cloud.faults.add("stuck", service="compute", method="instances.insert", zone=ZONE, count=1)
    body = compute_v1.Instance(name="p1", machine_type=f"zones/{ZONE}/machineTypes/tpu7x-standard-4t", disks=[
        compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=make_plan(pc).runtime_version))])
    pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=body)
    assert pc.instances.get(project=pc.project, zone=ZONE, instance="p1").status == "PENDING"
    vm.delete(pc, ZONE, "p1", deadline_s=FAST_DEADLINE)  # "You can optionally delete the compute instance"

    answers = iter([None, compute_v1.Instance(name="p2", status="PENDING"), None])
    monkeypatch.setattr(vm, "get", lambda *a, **k: next(answers))
    monkeypatch.setattr(vm.waits, "call", lambda *a, **k: None)
    monkeypatch.setattr(vm, "wait_zone_op", lambda *a, **k: None)
    convert = lambda i: prov.Resource(kind=prov.Kind.TPU, name="p2", project=pc.project, location=ZONE,  # noqa: E731
                                      state=vm.states.instance_state(i.status), labels={}, created=None, run=None)
    with pytest.raises(CapacityError, match="PENDING"):
        vm.ensure_instance(pc, ZONE, "p2", {}, lambda: body, convert, what="TPU VM p2", field="accelerator",
                           deadline_s=5)


def test_gc_deletes_an_expired_tpu7x_run(pc):
    plan = make_plan(pc, ttl="60s")
    prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    found = gc.scan(pc)
    actions = gc.decide(found, {}, {}, gc.Policy(now=time.time() + 120, owner="tester"))
    tpu_actions = [a for a in actions if a.resource.kind is prov.Kind.TPU]
    assert [a.reasons for a in tpu_actions] == [("expired",)]
    outcomes = gc.execute(pc, actions, dry_run=False)
    assert all(o.ok for o in outcomes)
    with pytest.raises(gexc.NotFound):
        pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
    prov.down(pc, "x1", delete_bucket=True)


def test_flex_start_instance_is_deleted_at_its_max_run_duration(pc, cloud):
    # 10 simulated minutes at speed 1000 are 0.6 s of wall clock.
    plan = make_plan(pc, provisioning="flex-start", max_run_duration="10m")
    assert plan.to_json()["max_run_duration"] == "10m"
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    tpu_r = result.get(prov.Kind.TPU)
    assert tpu_r.detail["provisioning"] == "flex-start"
    inst = pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
    assert inst.scheduling.instance_termination_action == "DELETE"
    assert inst.scheduling.max_run_duration.seconds == 600
    # status shows when it ends; cost stops there.
    [run] = prov.status(pc, "x1")
    [r] = [r for r in run.resources if r.kind is prov.Kind.TPU]
    ends = datetime.fromisoformat(r.detail["ends"]).timestamp()
    assert ends > time.time() - 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
        except gexc.NotFound:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the flex-start instance outlived its max run duration")
    e = entry_of(r)
    assert e.ends == pytest.approx(ends)
    cat = catalog_mod.load()
    later = ends + 3600
    assert e.billed_from > e.created  # it billed from RUNNING (lastStartTimestamp), not from its insert
    assert cost.accrued(e, cat, now=later) == pytest.approx(cost.hourly(e, cat) * (ends - e.billed_from) / 3600)
    # gc sees the run's end as a reason even before the listing catches up.
    found = gc.scan(pc) + [r]
    actions = gc.decide(found, {}, {}, gc.Policy(now=ends + 1, owner="tester"))
    assert any("ended" in a.reasons for a in actions if a.resource.kind is prov.Kind.TPU)
    prov.down(pc, "x1", delete_bucket=True)
    assert everything(pc) == []


def test_localcloud_refuses_flex_start_without_a_duration_in_range(pc, cloud):
    req = compute_tpu.TpuVmRequest(name="y1", zone=ZONE, machine_type="tpu7x-standard-4t", image=IMAGE,
                                   labels={}, service_account="a@b.iam.gserviceaccount.com",
                                   provisioning="flex-start", max_run_duration_s=8 * 86400)
    with pytest.raises(gexc.BadRequest):
        pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=compute_tpu.instance_proto(req))
    inst = compute_tpu.instance_proto(req.in_zone("us-central1-a"))
    inst.scheduling.max_run_duration = compute_v1.Duration(seconds=3600)
    with pytest.raises(gexc.BadRequest):  # TPU7x machine type is not offered in that zone
        pc.instances.insert_unary(project=pc.project, zone="us-central1-a", instance_resource=inst)
    assert everything(pc) == []



def test_a_flex_start_insert_waits_for_capacity_as_long_as_valid_until_says(pc, cloud):
    """InstanceParams.requestValidForDuration bounds how long a flex-start insert waits for capacity (PENDING,
    its operation running); tpuctl sends the spec's valid_until, else 30 minutes; Google allows at most 2 h."""
    # Capacity comes back after 40 looks (20 simulated minutes): within the default wait, so `up` succeeds.
    cloud.faults.add("capacity", service="compute", method="instances.insert", zone=ZONE, count=40)
    prov.apply(pc, make_plan(pc, provisioning="flex-start", max_run_duration="1h"), deadline_s=FAST_DEADLINE)
    inst = pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
    assert inst.status == "RUNNING" and "params" not in compute_v1.Instance.to_dict(inst)  # input only
    prov.down(pc, "x1", delete_bucket=True)
    # None within valid_until: the insert fails as a stockout, after waiting, and nothing is left.
    cloud.faults.add("capacity", service="compute", method="instances.insert", zone=ZONE)
    plan = make_plan(pc, provisioning="flex-start", max_run_duration="1h", valid_until="5m")
    op = pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=compute_tpu.instance_proto(
        compute_tpu.TpuVmRequest(name="w1", zone=ZONE, machine_type="tpu7x-standard-4t", image=IMAGE, labels={},
                                 service_account="a@b.iam.gserviceaccount.com", provisioning="flex-start",
                                 max_run_duration_s=3600, capacity_wait_s=300)))
    assert pc.instances.get(project=pc.project, zone=ZONE, instance="w1").status == "PENDING"
    assert pc.zone_operations.get(project=pc.project, zone=ZONE, operation=op.name).status == compute_v1.Operation.Status.RUNNING
    with pytest.raises(CapacityError):
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert everything(pc) == []
    with pytest.raises(BadInput) as bad:
        make_plan(pc, provisioning="flex-start", max_run_duration="1h", valid_until="3h")
    assert bad.value.field == "valid_until"
    with pytest.raises(gexc.BadRequest):
        pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=compute_tpu.instance_proto(
            compute_tpu.TpuVmRequest(name="w2", zone=ZONE, machine_type="tpu7x-standard-4t", image=IMAGE, labels={},
                                     service_account="a@b.iam.gserviceaccount.com", provisioning="flex-start",
                                     max_run_duration_s=3600, capacity_wait_s=3 * 3600)))


def test_a_flex_start_instance_that_says_stop_is_stopped_at_its_end(pc, cloud):
    """about-flex-start-vms: "Compute Engine automatically stops or deletes the VMs based on the termination
    action that is specified in the VM properties": STOP is as valid as DELETE."""
    req = compute_tpu.TpuVmRequest(name="s1", zone=ZONE, machine_type="tpu7x-standard-4t", image=IMAGE, labels={},
                                   service_account="a@b.iam.gserviceaccount.com", provisioning="flex-start",
                                   max_run_duration_s=30)
    inst = compute_tpu.instance_proto(req)
    inst.scheduling.instance_termination_action = "STOP"
    pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=inst)
    deadline = time.monotonic() + 30
    while pc.instances.get(project=pc.project, zone=ZONE, instance="s1").status != "TERMINATED":
        assert time.monotonic() < deadline, "the flex-start instance was not stopped at its max run duration"
        time.sleep(0.05)
    compute_tpu.delete(pc, ZONE, "s1", deadline_s=FAST_DEADLINE)


def test_up_and_run_tpu7x_from_the_cli_plan_it_on_compute_engine_with_jax(env, tmp_path):
    p = tpuctl_here(env, "up", "--accelerator", "tpu7x-8", "--zone", ZONE, "--name", "c7", "--provisioning",
                    "flex-start", "--max-run-duration", "2h", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)["plan"]
    assert plan["api"] == "compute" and plan["max_run_duration"] == "2h"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("accelerator: tpu7x-8\nzone: us-central1-c\njob: {template: bert, preset: bert-tiny}\n")
    p = tpuctl_here(env, "run", str(spec_file), "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "jax on projects/ubuntu-os-accelerator-images" in p.stdout + p.stderr, p.stdout + p.stderr
    p = tpuctl_here(env, "run", str(spec_file), "--dry-run", "--framework", "tensorflow")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "jax" in errors[0].lower(), p.stderr


def test_status_accrues_a_flex_start_tpu_only_until_its_end():
    from datetime import timezone

    from tpuctl.provision import inventory
    from tpuctl.provision.resources import Kind, Resource, State

    t0 = 1_800_000_000.0
    r = Resource(kind=Kind.TPU, name="f", project="p", location=ZONE, state=State.READY,
                 labels={"tpuctl-run": "f", "tpuctl-owner": "o"}, created=datetime.fromtimestamp(t0, timezone.utc),
                 run="f", accelerator="tpu7x-8",
                 detail={"api": "compute", "ends": datetime.fromtimestamp(t0 + 3600, timezone.utc).isoformat()})
    [run] = inventory.runs([r], price=lambda _r: 10.0, now=t0 + 5 * 3600)
    assert run.accrued == pytest.approx(10.0)


def slice_parts(pc) -> list[str]:
    """Workload policies, instance templates and MIGs of the project, straight from the APIs."""
    region = "us-central1"
    out = [p.name for p in pc.resource_policies.list(project=pc.project, region=region)]
    out += [t.name for t in pc.instance_templates.list(project=pc.project, region=region)]
    out += [m.name for m in pc.instance_groups.list(project=pc.project, zone=ZONE)]
    return out


def test_multi_host_slice_is_a_mig_with_a_workload_policy_and_one_resource(pc, cloud):
    plan = make_plan(pc, accelerator="tpu7x-16")
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    r = result.get(prov.Kind.TPU)
    assert (r.name, r.accelerator, r.detail["api"], len(r.workers)) == ("x1", "tpu7x-16", "compute-mig", 2)
    policy = pc.resource_policies.get(project=pc.project, region="us-central1", resource_policy="x1-wp")
    assert policy.workload_policy.type_ == "HIGH_THROUGHPUT" and policy.workload_policy.accelerator_topology == "2x2x2"
    mig = pc.instance_groups.get(project=pc.project, zone=ZONE, instance_group_manager="x1")
    assert mig.target_size == 2 and mig.resource_policies.workload_policy.endswith("/resourcePolicies/x1-wp")
    # The jobs layer reaches both hosts as workers 0 and 1 of one slice (SSH ports and host keys from each
    # instance's guest attributes); each guest tells JAX its process id and the slice's hosts, as on a TPU API node.
    workers = prov.workers(pc, ZONE, "x1")
    assert [w.index for w in workers] == [0, 1] and len({w.port for w in workers}) == 2
    assert all(w.port != 22 and (w.host_key or "").startswith("ssh-ed25519 ") for w in workers)
    instances = sorted(pc.instances.list(project=pc.project, zone=ZONE), key=lambda i: i.name)
    assert [w.host_key_alias for w in workers] == [f"compute.{i.id}" for i in instances]  # gcloud's HostKeyAlias
    members = [i.name for i in instances]
    trees = [cloud.compute.guest_metadata(f"projects/{pc.project}/zones/{ZONE}/instances/{m}") for m in members]
    attrs = [t["instance"]["attributes"] for t in trees]
    assert [a["agent-worker-number"] for a in attrs] == ["0", "1"]
    assert attrs[0]["worker-network-endpoints"] == attrs[1]["worker-network-endpoints"]
    assert [e.split(":")[0] for e in attrs[0]["worker-network-endpoints"].split(",")] == members
    # Only what JAX's GceTpuCluster reads, and the machine type every Compute Engine VM's metadata names: no
    # source shows a TPU API node's accelerator-type or tpu-env on a Compute Engine TPU VM.
    assert not {"accelerator-type", "tpu-env"} & {k for a in attrs for k in a}
    number = trees[0]["project"]["numeric-project-id"]
    assert {t["instance"]["machine-type"] for t in trees} == {f"projects/{number}/machineTypes/tpu7x-standard-4t"}
    # status: one run, one TPU with two workers, priced as 8 chips.
    cat = catalog_mod.load()
    [run] = prov.status(pc, "x1", price=lambda r: cost.hourly(entry_of(r), cat))
    assert [x.kind for x in run.resources].count(prov.Kind.TPU) == 1 and run.workers == 2
    assert run.price_per_hour == pytest.approx(cat.tpu_price_per_hour("tpu7x-16", ZONE, spot=False))
    # The local cloud's own inventory (`tpuctl local status`) shows the slice's parts too, not just its VMs.
    def parts() -> list[tuple[str, str]]:
        inv = cloud.inventory()
        return sorted((kind, r["name"]) for kind in ("instance_group_managers", "instance_templates",
                                                     "resource_policies") for r in inv[kind] if r["project"] == pc.project)

    assert parts() == [("instance_group_managers", "x1"), ("instance_templates", "x1-tpl"),
                       ("resource_policies", "x1-wp")]
    mig_row = next(m for m in cloud.inventory()["instance_group_managers"] if m["project"] == pc.project)
    assert mig_row["instances"] == members and mig_row["target_size"] == 2
    prov.down(pc, "x1", delete_bucket=True)
    assert everything(pc) == [] and slice_parts(pc) == [] and parts() == []


def test_a_slices_hosts_name_their_mig_by_project_number_and_up_still_finds_them(pc, cloud):
    # Compute writes `created-by` and `instance-template` with the project's number (gcpdiag: "note how it
    # uses a project number and not a project id"); tpuctl knows the id, so it must find the hosts through the
    # MIG itself, not by comparing that path.
    result = prov.apply(pc, make_plan(pc, accelerator="tpu7x-16"), deadline_s=FAST_DEADLINE)
    r = result.get(prov.Kind.TPU)
    assert (r.detail["api"], len(r.workers), r.state) == ("compute-mig", 2, prov.State.READY)
    number = pc.projects.get_project(name=f"projects/{pc.project}").name.rsplit("/", 1)[-1]
    assert number.isdigit() and number != pc.project
    for inst in pc.instances.list(project=pc.project, zone=ZONE):
        meta = compute_tpu.metadata_of(inst)
        assert meta["created-by"] == f"projects/{number}/zones/{ZONE}/instanceGroupManagers/x1"
        assert meta["instance-template"] == f"projects/{number}/regions/us-central1/instanceTemplates/x1-tpl"
    [run] = prov.status(pc, "x1")
    assert [x.kind for x in run.resources].count(prov.Kind.TPU) == 1 and run.workers == 2
    prov.down(pc, "x1", delete_bucket=True)
    assert everything(pc) == [] and slice_parts(pc) == []


def test_a_slice_without_capacity_is_rolled_back_whole(pc, cloud):
    # The MIG keeps retrying; its managed instances report the stockout in lastAttempt, which tpuctl reads.
    cloud.faults.add("capacity", service="compute", method="instances.insert", zone=ZONE)
    with pytest.raises(CapacityError):
        prov.apply(pc, make_plan(pc, accelerator="tpu7x-16"), deadline_s=FAST_DEADLINE)
    assert everything(pc) == [] and slice_parts(pc) == []


def test_localcloud_refuses_a_tpu_mig_whose_policy_does_not_match_its_size(pc, cloud):
    region, base = "us-central1", f"projects/{pc.project}/regions/us-central1"
    pc.resource_policies.insert_unary(project=pc.project, region=region, resource_policy_resource=compute_v1.ResourcePolicy(
        name="wp", workload_policy=compute_v1.ResourcePolicyWorkloadPolicy(type_="HIGH_THROUGHPUT",
                                                                           accelerator_topology="2x2x1")))
    req = compute_tpu.TpuVmRequest(name="m", zone=ZONE, machine_type="tpu7x-standard-4t", image=IMAGE, labels={},
                                   service_account="a@b.iam.gserviceaccount.com")
    inst = compute_tpu.instance_proto(req)
    pc.instance_templates.insert_unary(project=pc.project, region=region, instance_template_resource=compute_v1.InstanceTemplate(
        name="tpl", properties=compute_v1.InstanceProperties(machine_type="tpu7x-standard-4t", disks=inst.disks,
                                                             network_interfaces=inst.network_interfaces)))
    time.sleep(0.1)
    with pytest.raises(gexc.BadRequest):
        pc.instance_groups.insert_unary(project=pc.project, zone=ZONE, instance_group_manager_resource=compute_v1.InstanceGroupManager(
            name="m", base_instance_name="m", target_size=2, instance_template=f"{base}/instanceTemplates/tpl",
            resource_policies=compute_v1.InstanceGroupManagerResourcePolicies(workload_policy=f"{base}/resourcePolicies/wp")))
    compute_tpu.delete_slice(pc, ZONE, "m")  # idempotent: the MIG never existed
    pc.instance_templates.delete_unary(project=pc.project, region=region, instance_template="tpl")
    pc.resource_policies.delete_unary(project=pc.project, region=region, resource_policy="wp")


def test_the_jobs_layers_node_calls_answer_for_a_tpu7x_vm(pc, cloud):
    """What `tpuctl run` asks of a node (get, workers, authorize, recreate, delete) works on a Compute Engine
    TPU VM through the same provision functions as on a TPU API node."""
    prov.apply(pc, make_plan(pc, provisioning="spot"), deadline_s=FAST_DEADLINE)
    node = prov.get_node(pc, ZONE, "x1")
    assert (node.kind, node.state, node.detail["api"], len(node.workers)) == (prov.Kind.TPU, prov.State.READY,
                                                                               "compute", 1)
    [w] = prov.workers(pc, ZONE, "x1")
    assert w.port != 22 and w.host_key.startswith("ssh-ed25519 ")
    assert prov.authorize_key(pc, ZONE, "x1", "alice", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey alice") == "alice"
    inst = pc.instances.get(project=pc.project, zone=ZONE, instance="x1")
    assert "alice:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey alice" in compute_tpu.metadata_of(inst)["ssh-keys"]
    assert prov.recreate_node(pc, ZONE, "x1").created == node.created  # READY: left alone
    with pytest.raises(NotFound):  # `tpuctl run` then deletes it and makes it again from the plan
        prov.recreate_node(pc, ZONE, "x1", force=True)
    prov.delete_node(pc, ZONE, "x1")
    with pytest.raises(NotFound):
        prov.get_node(pc, ZONE, "x1")
    prov.down(pc, "x1", delete_bucket=True)
    assert everything(pc) == []


def test_a_workload_policy_named_like_the_slices_but_not_the_runs_is_refused_and_left_alone(pc, cloud):
    """A resource policy has no labels: the run's names the run in its description. Another's policy of the
    slice's name (here with another topology, which a MIG would have taken) is NameTaken; nothing is created."""
    region = "us-central1"
    theirs = compute_v1.ResourcePolicy(name="x1-wp", description="someone else's", workload_policy=(
        compute_v1.ResourcePolicyWorkloadPolicy(type_="HIGH_THROUGHPUT", accelerator_topology="4x4x4")))
    pc.resource_policies.insert_unary(project=pc.project, region=region, resource_policy_resource=theirs)
    before = slice_parts(pc)
    with pytest.raises(NameTaken, match="workload policy x1-wp already exists and does not belong to run 'x1'"):
        prov.apply(pc, make_plan(pc, accelerator="tpu7x-16"), deadline_s=FAST_DEADLINE)
    assert slice_parts(pc) == before
    assert pc.resource_policies.get(project=pc.project, region=region, resource_policy="x1-wp").description == \
        "someone else's"
    pc.resource_policies.delete_unary(project=pc.project, region=region, resource_policy="x1-wp")
    prov.down(pc, "x1", delete_bucket=True)


@pytest.mark.parametrize("taken", ["template", "mig"])
def test_a_slice_named_like_another_runs_parts_is_refused_and_theirs_left_alone(pc, cloud, taken):
    """A MIG has no labels: it is the run's only when it uses the run's instance template, whose labels say so.
    Another run's template or MIG of the slice's name is NameTaken; nothing of theirs is adopted or rolled back."""
    region, base = "us-central1", f"projects/{pc.project}/regions/us-central1"
    tpl_name = "x1-tpl" if taken == "template" else "theirs-tpl"
    tpl = compute_v1.InstanceTemplate(name=tpl_name, properties=compute_v1.InstanceProperties(
        machine_type="n2-standard-2", labels={"tpuctl-run": "theirs"},
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image="projects/debian-cloud/global/images/family/debian-12", disk_size_gb=10))],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")]))
    pc.instance_templates.insert_unary(project=pc.project, region=region, instance_template_resource=tpl)
    if taken == "mig":
        mig = compute_v1.InstanceGroupManager(name="x1", base_instance_name="x1", target_size=1,
                                              instance_template=f"{base}/instanceTemplates/{tpl_name}")
        pc.instance_groups.insert_unary(project=pc.project, zone=ZONE, instance_group_manager_resource=mig)
    before = slice_parts(pc)
    with pytest.raises(NameTaken, match="does not belong to run 'x1'"):
        prov.apply(pc, make_plan(pc, accelerator="tpu7x-16"), deadline_s=FAST_DEADLINE)
    assert slice_parts(pc) == before
    if taken == "mig":
        compute_tpu.delete_slice(pc, ZONE, "x1", deadline_s=FAST_DEADLINE)  # its template is theirs-tpl: left
    pc.instance_templates.delete_unary(project=pc.project, region=region, instance_template=tpl_name)
    prov.down(pc, "x1", delete_bucket=True)
