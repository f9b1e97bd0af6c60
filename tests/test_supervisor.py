"""`tpuctl run --detach`: the run goes on in a supervisor VM (jobs/supervisor_vm.py) once the laptop is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env
from test_run import _live, _spec, _spec_file, _zero, project, tpc  # noqa: F401 - the fixtures too
from tpuctl import provision
from tpuctl.jobs import cluster, supervisor_vm, timeline as timelines

RUN = "sv-run"
ZONE = "us-central1-a"  # where _spec puts a v3-8


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _tpuctl_processes_outside_the_cloud() -> list[str]:
    """This test's processes running tpuctl that are not guests of the local cloud (its VMs and workers carry
    its marker variable): the laptop's."""
    found = []
    for pid in _descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "tpuctl" in cmdline and not any(e.startswith(b"LOCALCLOUD_WORKER=") for e in environ):
            found.append(cmdline)
    return found


def _until(what: str, check, timeout: float = 180.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_detached_run_survives_the_laptop_a_preemption_and_a_killed_supervisor(cloud, project, tpc, tmp_path):
    env = cli_env(cloud, tmp_path, project)
    release = tmp_path / "release"  # the job holds before step 30 until the test has done its worst
    spec = _spec_file(tmp_path, _spec(RUN, accelerator="v3-8", trainer={
        "max_steps": 40, "checkpoint_every": 5, "step_seconds": 0.05, "hold_at_step": 30, "release_file": str(release)}))
    r = subprocess.run([sys.executable, "-m", "tpuctl", "run", str(spec), "--yes", "--detach", "--poll", "0.5"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert f"supervisor VM {RUN}-supervisor: e2-small at $0.0168/h ($0.40/day)" in r.stderr, r.stderr
    assert "in the hands of its supervisor VM" in r.stderr, r.stderr
    # The laptop is closed: nothing of tpuctl runs but the cloud's own guests (the supervisor, the TPU's job).
    assert _tpuctl_processes_outside_the_cloud() == []
    bucket = json.loads(subprocess.run([sys.executable, "-m", "tpuctl", "status", RUN, "--json"], env=env,
                                       capture_output=True, text=True, timeout=60).stdout)
    vm = next((res for res in bucket["resources"] if res["kind"] == "vm"), bucket)
    assert vm.get("name") == f"{RUN}-supervisor", json.dumps(bucket)
    assert vm["labels"]["tpuctl-role"] == "supervisor"
    assert {"tpuctl-run", "tpuctl-owner", "tpuctl-expires"} <= set(vm["labels"])
    # Its own least-privilege identity (provision/supervisor_account.py), which its metadata server serves.
    instance = tpc.instances.get(project=project, zone=ZONE, instance=f"{RUN}-supervisor")
    assert [a.email for a in instance.service_accounts] == [f"tpuctl-supervisor@{project}.iam.gserviceaccount.com"]
    bucket = next(res["name"] for res in bucket["resources"] if res["kind"] == "bucket")
    beat = supervisor_vm.Heartbeat.read(tpc, bucket, RUN)
    assert beat.state == "supervising" and beat.vm == f"{RUN}-supervisor"
    # It runs the wheel the laptop uploaded, installed by its startup script, not this checkout.
    assert "tpuctl-supervisor/site/tpuctl" in beat.tpuctl, beat

    def step() -> int:
        status = cluster.read_status(tpc, bucket, RUN)
        return (status.step or 0) if status else 0

    # `--attach` from any machine follows the supervised run to its end, and changes nothing.
    follower = subprocess.Popen([sys.executable, "-m", "tpuctl", "run", "--attach", RUN, "--poll", "0.5"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    _until("step 8", lambda: step() >= 8)
    os.kill(beat.pid, signal.SIGKILL)  # the supervisor crashes: its service starts it again
    again = _until("a restarted supervisor", lambda: (b := supervisor_vm.Heartbeat.read(tpc, bucket, RUN)).pid != beat.pid
                   and b.state == "supervising" and b)
    assert again.handoff == beat.handoff
    cloud.preempt(f"projects/{project}/locations/{ZONE}/nodes/{RUN}")

    def recovered(times: int) -> bool:
        marks = [m.what for m in (timelines.load(tpc, bucket, RUN) or timelines.Timeline()).marks]
        last = len(marks) - 1 - marks[::-1].index("recover") if "recover" in marks else None
        return marks.count("recover") == times and "watch" in marks[last:]
    _until("the supervisor to recover the preempted TPU", lambda: recovered(1))
    # The supervisor is down (frozen, then killed) while the TPU is preempted and deleted: the one its service
    # starts next finds no TPU, and makes it again from the plan of the hand-off, as the laptop would.
    down = supervisor_vm.Heartbeat.read(tpc, bucket, RUN)
    os.kill(down.pid, signal.SIGSTOP)
    cloud.preempt(f"projects/{project}/locations/{ZONE}/nodes/{RUN}")
    provision.delete_node(tpc, ZONE, RUN, deadline_s=60)
    os.kill(down.pid, signal.SIGKILL)
    _until("the restarted supervisor to make the deleted TPU again", lambda: recovered(2))
    release.touch()

    def ended():
        status = cluster.read_status(tpc, bucket, RUN)
        return status is not None and status.final and status.state != "running" and _zero(cloud, project) and status
    final = _until("the run to end and leave nothing", ended, timeout=240)
    assert final.state == "succeeded" and final.step == 40, (final, _live(cloud, project))
    doc = json.loads(subprocess.run([sys.executable, "-m", "tpuctl", "job", "status", RUN, "--json"], env=env,
                                    capture_output=True, text=True, timeout=60).stdout)
    assert doc["recoveries"] == 2, doc
    # The laptop slept through the teardown: its summary counts the run until then, as `cost RUN` does.
    def cost(*args: str) -> dict:
        return json.loads(subprocess.run([sys.executable, "-m", "tpuctl", "cost", *args, "--json"], env=env,
                                         capture_output=True, text=True, timeout=60).stdout)
    summary, phases = cost(), cost(RUN)
    assert phases["ended"] and [r["usd"] for r in summary["rows"]] == [pytest.approx(phases["total_usd"], abs=1e-4)]
    assert supervisor_vm.Heartbeat.read(tpc, bucket, RUN).state == "ended"
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert f"run {RUN} is in the hands of its supervisor VM {RUN}-supervisor" in err, err
    assert f"run {RUN}: succeeded at step 40" in err and "recovering" in err, err


def test_the_wheel_of_the_installed_tpuctl_installs_and_runs_without_this_checkout(tmp_path):
    """What the supervisor VM's startup script does with it: `pip install --no-deps --target`, then the
    supervisor's own check, importing tpuctl from there (not from this checkout; run elsewhere, as the VM's
    script runs in its own directory: from the repo root, `tpuctl/` there would shadow it)."""
    wheel = supervisor_vm.build_wheel(tmp_path / "w")
    assert supervisor_vm.build_wheel(tmp_path / "again").read_bytes() == wheel.read_bytes()  # uploaded once
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import tpuctl.jobs.supervisor_vm as s, tpuctl.templates as t; "
                            "print(s.__file__); print(t.__file__)"], env=env, capture_output=True, text=True,
                           timeout=60, check=True, cwd=tmp_path).stdout.split()
    assert where == [str(site / "tpuctl/jobs/supervisor_vm.py"), str(site / "tpuctl/templates/__init__.py")]
    assert subprocess.run([sys.executable, "-m", "tpuctl.jobs.supervisor_vm", "check"], env=env,
                          timeout=60, cwd=tmp_path).returncode == 0


def test_gc_cleans_up_a_run_whose_supervisor_stopped_beating(tpc):
    from tpuctl.provision import gc
    from tpuctl.provision.resources import Kind, Resource, State

    now = time.time()
    tpc.storage.create_bucket("sv-gc-bucket")

    def run_of(name: str, beat_age: float | None) -> list[Resource]:
        labels = {"tpuctl-run": name, "tpuctl-owner": "ann", "tpuctl-created": str(int(now - 3600))}
        if beat_age is not None:
            cluster.write_json(tpc, "sv-gc-bucket", supervisor_vm.prefix(name) + "heartbeat.json",
                               {"vm": f"{name}-supervisor", "zone": ZONE, "at": now - beat_age, "state": "supervising",
                                "handoff": "h", "tpuctl": "/x", "pid": 1})
        return [Resource(kind=kind, name=f"{name}-{kind.value}", project=tpc.project, location=ZONE, state=State.READY,
                         labels={**labels, **({"tpuctl-role": "supervisor"} if kind is Kind.VM else {})}, created=None,
                         run=name) for kind in (Kind.TPU, Kind.VM)] + [
            Resource(kind=Kind.BUCKET, name="sv-gc-bucket", project=tpc.project, location="us-central1",
                     state=State.READY, labels=labels, created=None, run=name)]

    resources = run_of("lost", 10 * supervisor_vm.stale_after_s(True)) + run_of("alive", 0.5) + run_of("never", None)
    lost = gc.lost_supervisors(tpc, resources, now=now)
    assert lost == {"lost"}
    actions = gc.decide(resources, {}, {}, gc.Policy(now=now, owner="ann", idle_s=None), lost_supervisors=lost)
    assert sorted((a.resource.name, a.reasons) for a in actions if a.verdict == "delete") == [
        ("lost-tpu", ("supervisor-lost",)), ("lost-vm", ("supervisor-lost",))]


def test_down_deletes_the_supervisor_before_anything_else(tpc):
    """Alive, a supervisor takes its TPU's deletion for a preemption and makes the TPU again: `down` deletes it
    first, alone, then the rest."""
    from tpuctl import provision
    from tpuctl.provision import bucket, labels, vm

    run = "sv-down"
    base = labels.run_labels(run, owner_name="ann", ttl_s=3600)
    for name, role in ((f"{run}-supervisor", {labels.ROLE: labels.SUPERVISOR}), (f"{run}-loader", {})):
        vm.create(tpc, vm.VmRequest(name=name, zone=ZONE, machine_type="e2-small", disk_gb=10, image=supervisor_vm.IMAGE,
                                    labels={**base, **role}, service_account=bucket.default_service_account(tpc)),
                  deadline_s=60)
    events: list[tuple[str, str]] = []
    gone = provision.down(tpc, run, progress=lambda key, state, detail: events.append((key, state)))
    assert {r.name for r in gone.deleted} == {f"{run}-supervisor", f"{run}-loader"}
    supervisor_deleted = events.index((f"vm/{ZONE}/{run}-supervisor", "deleted"))
    assert all(not key.endswith("-loader") for key, _ in events[:supervisor_deleted]), events


def test_the_plan_handed_to_the_supervisor_is_the_plan_resolved(tmp_path):
    """What a restarted supervisor makes a deleted TPU again from: every field as the laptop resolved it (the
    labels' times, the VMs, the steps), through the JSON of the hand-off."""
    from tpuctl.provision.plan import from_record, make, to_record
    from tpuctl.spec import RunSpec

    spec = RunSpec.model_validate({**_spec(RUN, accelerator="v3-8"), "vms": [{"name": "loader"}],
                                   "labels": {"team": "nlp"}, "tags": ["t1"], "zone": [ZONE, "us-central1-b"]})
    plan = make(spec, project="p-1", owner="ann", now=1000.0)
    assert from_record(json.loads(json.dumps(to_record(plan)))) == plan


@pytest.mark.parametrize("planned_ago,recovered_before,why", [
    (0, 2, "max recoveries is 2"),  # the recoveries made before it (re)started count
    (7200, 0, "TTL ended"),  # planned with ttl 1h, two hours ago
])
def test_a_supervisor_that_finds_no_tpu_gives_up_where_the_plan_says_so(tpc, tmp_path, monkeypatch, planned_ago,
                                                                        recovered_before, why):
    from tpuctl.errors import JobFailed
    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.provision.plan import make
    from tpuctl.spec import RunSpec

    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    run = f"sv-gives-up-{recovered_before}"
    spec = RunSpec.model_validate({**_spec(run, accelerator="v3-8"), "ttl": "1h"})
    plan = make(spec, project=tpc.project, owner="ann", now=time.time() - planned_ago)
    tpc.storage.create_bucket(plan.bucket)
    cluster.save_launch(tpc, cluster.LaunchRecord(run=run, zone=ZONE, node=run, bucket=plan.bucket, bundle_object="b",
                                                  bundle_sha="s", python="python3", workers=1, max_recoveries=2,
                                                  launched=time.time() - 60))
    timeline = timelines.Timeline()
    for _ in range(recovered_before):
        timeline.mark("recover", at=time.time() - 30)
    timeline.save(tpc, plan.bucket, run)
    pipeline = Pipeline(tpc, options=RunOptions(attach=run, yes=True), plan=plan)
    with pytest.raises(JobFailed, match=why):
        pipeline.attach()
    assert not any(n.name.endswith(f"/{run}") for n in tpc.tpu.list_nodes(parent=f"projects/{tpc.project}/locations/{ZONE}"))
