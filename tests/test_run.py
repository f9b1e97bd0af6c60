"""`tpuctl run` on the local cloud: the whole pipeline with the stand-in template on a 4-worker slice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_jobs_harness import STANDIN
from tpuctl import spec as spec_mod
from tpuctl.errors import JobFailed
from tpuctl.jobs.pipeline import Pipeline, RunOptions

HOSTILE = ["it's", "$(touch PWNED)", "a; touch PWNED2", "line1\nline2", "`id`"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch) -> str:
    """A fresh project on the session's local cloud (conftest `cloud`), and a private TPUCTL_HOME."""
    from conftest import new_project

    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    return new_project()


@pytest.fixture
def tpc(cloud, project):
    """tpuctl's own clients (`provision.Clients`) for that project."""
    from google.auth.credentials import AnonymousCredentials

    from tpuctl.provision.clients import build

    return build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                 storage_host=cloud.storage_host, local=True)


def _spec(name: str, *, trainer: dict | None = None, args=(), accelerator="v3-32", **job) -> dict:
    # A v3-8 is also in us-central1-a; v3 slices only in europe-west4-a (tpu/docs/regions-zones).
    zone = "us-central1-a" if accelerator == "v3-8" else "europe-west4-a"
    return {"name": name, "zone": zone, "accelerator": accelerator, "provisioning": "spot",
            "job": {"template": str(STANDIN), "args": list(args),
                    "config": {"trainer": {"max_steps": 15, "checkpoint_every": 5, **(trainer or {})}}, **job}}


def _live(cloud, project: str) -> dict:
    inv = cloud.inventory()
    return {"nodes": [n["name"] for n in inv["nodes"] if n["project"] == project],
            "instances": [i["name"] for i in inv["instances"] if i["project"] == project],
            "queued": [q["name"] for q in inv["queued_resources"] if f"projects/{project}/" in q["name"]],
            **{kind: [r["name"] for r in inv[kind] if r["project"] == project]
               for kind in ("instance_group_managers", "instance_templates", "resource_policies")}}


def _zero(cloud, project: str) -> bool:
    return not any(_live(cloud, project).values())


def _buckets(cloud, project: str) -> list[str]:
    return [b["name"] for b in cloud.inventory()["buckets"] if b["project"] == project]


def _node_path(p: Pipeline) -> str:
    """The node's full name: the session cloud holds other tests' projects, where short names repeat."""
    return f"projects/{p.project}/locations/{p.zone}/nodes/{p.node}"


def _no_pwned(log: str) -> bool:
    """The stand-in prints its worker's HOME, where a hostile `$(touch PWNED)` run by a shell would land."""
    home = next(line[len("home="):] for line in log.splitlines() if line.startswith("home="))
    return not list(Path(home).rglob("PWNED*"))


def _text(clients, bucket: str, name: str) -> str:
    return clients.storage.bucket(bucket).blob(name).download_as_text()


def test_run_trains_on_every_worker_and_tears_down(tpc, cloud, project, tmp_path):
    spec = spec_mod.from_mapping(_spec("ok-run", args=HOSTILE))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5, download=tmp_path / "out"))
    o = p.run()
    assert o.state == "succeeded" and o.step == 15 and o.recoveries == 0
    assert _zero(cloud, project)
    assert _buckets(cloud, project) == [o.bucket], "bucket kept"
    assert _text(tpc, o.bucket, "runs/ok-run/model/checkpoint") == "ckpt-15.json"
    assert (tmp_path / "out" / "export" / "final.json").exists()
    status = json.loads(_text(tpc, o.bucket, "runs/ok-run/status.json"))
    assert status["state"] == "succeeded" and status["step"] == 15 and status["recovering"] is False
    for w in range(4):
        log = _untimed(_text(tpc, o.bucket, f"runs/ok-run/logs/worker-{w}.log"))
        assert json.loads(log[0][len("args="):]) == HOSTILE
        assert "step=15 loss=0.667 examples_per_sec=100.0" in log
    assert _no_pwned(_text(tpc, o.bucket, "runs/ok-run/logs/worker-0.log"))
    # Paths as the user will use them, not the local cloud worker's mirror of the bucket.
    assert f"checkpoint step=15 path=gs://{o.bucket}/runs/ok-run/model/ckpt-15.json" in log
    assert set(o.phases) >= {"validate", "up", "upload", "launch", "train", "tear down", "collect"}
    # From the last step by the worker's clock (the job's final checkpoint, export and sync, the watch's poll) to
    # the delete request: 2.5-5.5 s on this 2-core machine, more under a loaded suite.
    assert o.last_step_to_delete_s is not None and o.last_step_to_delete_s <= 10


def test_a_log_stream_that_lags_the_job_still_reports_its_last_step(tpc, cloud, project, monkeypatch):
    """CI (2 cores, loaded) saw a recovered run succeed at step 8 of 30: on the recreated node the short job
    ended on every worker before the new stream's first line arrived, and the watch cut the stream off after
    0.5 s. Here every stream starts 1.5 s after the poll found the job done everywhere."""
    import asyncio

    from tpuctl.jobs import launch, logs

    ended: dict[int, asyncio.Event] = {}
    real_poll, real_follow = launch.poll, logs.follow

    def ended_event() -> asyncio.Event:  # one per event loop: each watch runs its own
        return ended.setdefault(id(asyncio.get_running_loop()), asyncio.Event())

    async def poll(fleet, run):
        states = await real_poll(fleet, run)
        if all(s.done for s in states):
            ended_event().set()
        return states

    async def late_follow(fleet, run, sink, **kw):
        await ended_event().wait()
        await asyncio.sleep(1.5)
        return await real_follow(fleet, run, sink, **kw)

    monkeypatch.setattr(launch, "poll", poll)
    monkeypatch.setattr(logs, "follow", late_follow)
    spec = spec_mod.from_mapping(_spec("lag-run", accelerator="v3-8"))
    o = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5)).run()
    assert o.state == "succeeded" and o.step == 15 and o.loss is not None
    assert _zero(cloud, project)


def test_a_failed_workers_last_lines_reach_the_error_however_late_its_stream(tpc, cloud, project, monkeypatch):
    """The job fails on worker 2 while the log streams are still to start: the error's hint still carries the
    worker's last line (its log is read to the end once the job failed), and no line twice."""
    import asyncio

    from tpuctl.jobs import logs

    real_follow = logs.follow

    async def stalled_follow(fleet, run, sink, *, follow=True, **kw):
        if follow:  # the watch's streams: never get going (the read of a failed worker's log is not one)
            await asyncio.Event().wait()
        return await real_follow(fleet, run, sink, follow=follow, **kw)

    monkeypatch.setattr(logs, "follow", stalled_follow)
    spec = spec_mod.from_mapping(_spec("lag-fail", accelerator="v3-8",
                                       trainer={"max_steps": 500, "fail_at_step": 4, "fail_worker": 0}))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    with pytest.raises(JobFailed) as e:
        p.run()
    assert "worker 0" in str(e.value) and "boom at step 4" in e.value.hint
    tail = p.outcome.tail
    assert tail and len(tail) == len(set(tail)), tail
    assert _zero(cloud, project)


@pytest.mark.slow  # fast tier: a failed run tearing down: test_max_recoveries_zero_fails_on_preemption_and_tears_down
def test_run_job_failure_stops_all_tears_down_and_shows_the_log(tpc, cloud, project):
    spec = spec_mod.from_mapping(_spec("bad-run", trainer={"max_steps": 500, "fail_at_step": 4, "fail_worker": 2}))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    with pytest.raises(JobFailed) as e:
        p.run()
    assert "worker 2" in str(e.value) and "exit code 3" in str(e.value)
    assert "boom at step 4" in e.value.hint
    assert _zero(cloud, project)
    status = json.loads(_text(tpc, p.outcome.bucket, "runs/bad-run/status.json"))
    assert status["state"] == "failed" and status["exit_code"] == 3


def test_failure_before_launch_removes_the_bucket_it_created_and_keeps_an_adopted_one(tpc, cloud, project,
                                                                                      tmp_path):
    from tpuctl.errors import BadInput
    from tpuctl.jobs.keys import ensure_keypair

    os.chmod(ensure_keypair().private_path, 0o644)  # refused at launch, after up and upload
    spec = spec_mod.from_mapping(_spec("early-fail"))
    with pytest.raises(BadInput, match="readable by other users"):
        Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5)).run()
    assert _zero(cloud, project) and _buckets(cloud, project) == [], "nothing of the failed run is left"

    # A bucket that existed before (it may hold an earlier run's checkpoints) is never deleted that way.
    kept = Pipeline(tpc, spec, options=RunOptions(poll_s=0.5))
    kept.validate()
    tpc.storage.create_bucket(kept.plan.bucket, location=kept.plan.region)
    with pytest.raises(BadInput, match="readable by other users"):
        Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5)).run()
    assert _zero(cloud, project) and _buckets(cloud, project) == [kept.plan.bucket]
    tpc.storage.bucket(kept.plan.bucket).delete(force=True)

    # Prepared data is costly to make again: a bucket holding it is kept for the rerun, which reuses it.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence {i} of a small corpus about tpus and buckets\n" for i in range(400)))
    with_data = spec_mod.from_mapping({**_spec("early-fail"), "job": {
        **_spec("early-fail")["job"], "data": {"corpus": [str(corpus)], "vocab_size": 400, "seq_len": 128}}})
    with pytest.raises(BadInput, match="readable by other users"):
        Pipeline(tpc, with_data, options=RunOptions(yes=True, poll_s=0.5)).run()
    assert _zero(cloud, project) and _buckets(cloud, project) == [kept.plan.bucket]
    assert tpc.storage.bucket(kept.plan.bucket).blob("runs/early-fail/data/manifest.json").exists()


def _untimed(text: str) -> list[str]:
    """The lines of a log without the time its step lines end with (the stand-in's clock, as the templates')."""
    return [line.rsplit(" time=", 1)[0] for line in text.splitlines()]


def run_preempted_at(p: Pipeline, cloud, step: int, path=None):
    """p.run() while the cloud preempts the node once, when the job has reached `step` (`path(p)`: the node's
    resource path, the TPU API node's by default); returns the outcome."""
    preempted = threading.Event()

    def preempt():
        while not preempted.is_set():
            if (p.outcome.step or 0) >= step and p.node:
                cloud.preempt((path or _node_path)(p))
                preempted.set()
            time.sleep(0.05)

    threading.Thread(target=preempt, daemon=True).start()
    try:
        return p.run()
    finally:
        preempted.set()


def test_preemption_mid_run_recovers_from_the_checkpoint(tpc, cloud, project, tmp_path):
    """Also the whole-run check of the preemption notice (test_preemption_notice tests the agent's side): the
    periodic checkpoints lie beyond the run, so the step it resumes from is the one the notice saved."""
    spec = spec_mod.from_mapping(_spec("pre-run", trainer={"max_steps": 40, "checkpoint_every": 1000,
                                                           "step_seconds": 0.1}))
    seen: list = []
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5), on_event=seen.append)
    started = time.time()
    o = run_preempted_at(p, cloud, 12)
    wall = time.time() - started - o.phases["validate"]  # the timeline starts when the TPU is requested
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 40
    assert _zero(cloud, project)
    from tpuctl import events

    recovery = [(e.type, e.attempt) for e in seen if isinstance(e, (events.RecoveryStarted, events.RecoveryEnded))]
    assert recovery == [("recovery_started", 1), ("recovery_ended", 1)]
    assert [e for e in seen if isinstance(e, events.RecoveryEnded)][0].ok
    log = _text(tpc, o.bucket, "runs/pre-run/logs/worker-0.log")
    restored = [int(line.split("=")[1]) for line in log.splitlines() if line.startswith("restored step=")]
    assert restored and restored[0] >= 12, log[:2000]  # without the notice's save: from step 0
    first_step_after = int(log.split("restored step=")[1].split("\n", 2)[1].split()[0].split("=")[1])
    assert first_step_after == restored[0] + 1
    # The cost counts both incarnations of the node, each over its own life, and nothing after teardown.
    from tpuctl import catalog, cost
    from tpuctl.ledger import Ledger

    nodes = sorted((e for e in Ledger().entries() if e.kind == "tpu" and e.run == "pre-run"), key=lambda e: e.created)
    assert len(nodes) == 2 and all(e.deleted is not None for e in nodes)
    assert nodes[0].deleted <= nodes[1].created
    expected = sum(cost.accrued(e, catalog.load(), now=time.time()) for e in nodes)
    assert o.cost_usd == pytest.approx(expected, rel=0.05, abs=1e-4) and o.cost_usd > 0
    # Its goodput, from its timeline in the bucket: the phases add up to its wall time and its cost, the
    # preemption's loss (steps after the restored checkpoint, the recovery) on its own, one recovery.
    status = json.loads(_here(cloud, tmp_path, project, "job", "status", "pre-run", "--json").stdout)
    by_phase = json.loads(_here(cloud, tmp_path, project, "cost", "pre-run", "--json").stdout)
    print("DEBUGMARKS", [(round(m.at - started, 2), m.what, m.step) for m in p.timeline.marks])
    print("DEBUGPHASE", by_phase)
    assert status["recoveries"] == by_phase["recoveries"] == 1 and by_phase["ended"]
    assert 0 < status["goodput"] == by_phase["goodput"] < 1
    assert sum(by_phase["seconds"].values()) == pytest.approx(by_phase["wall_s"], abs=0.05)
    assert by_phase["wall_s"] == pytest.approx(wall, abs=1.0)
    assert sum(by_phase["usd"].values()) == pytest.approx(by_phase["total_usd"], abs=1e-5)
    assert by_phase["total_usd"] == pytest.approx(o.cost_usd, abs=2e-4)
    seconds, usd = by_phase["seconds"], by_phase["usd"]
    # 40 steps of 0.1 s (4.07 s at a load average of 17: up to twice that), a few lost: the rest is launching,
    # recovering and tearing down. The first node, a spot one preempted in its first minute, cost nothing; the
    # second bills from the recovery on.
    assert 1 < seconds["productive"] < 8 and seconds["recovery"] > 1
    assert by_phase["lost_to_preemption_usd"] == pytest.approx(usd["wasted_progress"] + usd["recovery"], abs=2e-6)
    assert by_phase["lost_to_preemption_usd"] > 0
    shown = _here(cloud, tmp_path, project, "cost", "pre-run")
    assert "productive" in shown.stdout and "lost to preemption: $" in shown.stderr, shown.stderr


def test_max_recoveries_zero_fails_on_preemption_and_tears_down(tpc, cloud, project):
    spec = spec_mod.from_mapping(_spec("pre-zero", trainer={"max_steps": 200, "step_seconds": 0.05}, max_recoveries=0))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    threading.Thread(target=lambda: (time.sleep(0.1), [time.sleep(0.05) for _ in iter(lambda: (p.outcome.step or 0) >= 3, True)],
                                     cloud.preempt(_node_path(p))), daemon=True).start()
    with pytest.raises(JobFailed) as e:
        p.run()
    assert "max recoveries is 0" in str(e.value)
    assert _zero(cloud, project)


# ---------------------------------------------------------------------------------- the CLI, as a process

def _env(cloud, tmp_path, project: str) -> dict:
    return {**os.environ, "TPUCTL_API_ENDPOINT": cloud.endpoint, "STORAGE_EMULATOR_HOST": cloud.storage_host,
            "TPUCTL_PROJECT": project, "TPUCTL_HOME": str(tmp_path / "home"), "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1"}


def _spec_file(tmp_path, spec: dict) -> Path:
    import yaml

    f = tmp_path / f"{spec['name']}.yaml"
    f.write_text(yaml.safe_dump(spec))
    return f


def _start(cloud, tmp_path, project, *argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tpuctl", *argv], env=_env(cloud, tmp_path, project), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_line(proc: subprocess.Popen, needle: str, seen: list[str], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"exited before {needle!r}: {''.join(seen)}")
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} within {timeout}s: {''.join(seen)}")


# Each phase once and each signal twice (one handler serves both), not all eight pairs: bench/chaos.py's sigint@run
# and sigterm@run scenarios signal `tpuctl run` at random moments of every phase.
# The fast tier keeps both signals (up-SIGTERM, train-SIGINT); the middle phases run in the whole suite.
@pytest.mark.parametrize("phase,sig", [("up", signal.SIGTERM),
                                       pytest.param("upload", signal.SIGINT, marks=pytest.mark.slow),
                                       pytest.param("launch", signal.SIGTERM, marks=pytest.mark.slow),
                                       ("train", signal.SIGINT)], ids=["up-SIGTERM", "upload-SIGINT",
                                                                       "launch-SIGTERM", "train-SIGINT"])
def test_run_tears_down_on_signal_at_each_phase(cloud, project, tmp_path, phase, sig):
    spec = _spec_file(tmp_path, _spec("sig-run", accelerator="v3-8", trainer={"max_steps": 2000, "step_seconds": 0.05}))
    proc = _start(cloud, tmp_path, project, "run", str(spec), "--yes", "--poll", "0.5")
    seen: list[str] = []
    try:
        _wait_line(proc, f"==> {phase}", seen)
        if phase == "train":
            _wait_line(proc, "[w0] step=", seen)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(seen) + err
    assert "==> tear down" in err
    assert _zero(cloud, project), _live(cloud, project)


@pytest.mark.slow  # fast tier: a whole run: test_run_trains_on_every_worker_and_tears_down
def test_killed_launcher_leaves_the_job_running_and_attach_finishes_it(tpc, cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("det-run", trainer={"max_steps": 40, "step_seconds": 0.05}))
    proc = _start(cloud, tmp_path, project, "run", str(spec), "--yes", "--poll", "0.5")
    seen: list[str] = []
    try:
        _wait_line(proc, "[w0] step=3 ", seen)
    finally:
        proc.kill()  # no teardown possible: the job must go on without the laptop
        proc.wait()
    assert _live(cloud, project)["nodes"], "TPU still up"
    attach = _start(cloud, tmp_path, project, "run", "--attach", "det-run", "--json", "--poll", "0.5")
    out, err = attach.communicate(timeout=120)
    assert attach.returncode == 0, err
    summary = json.loads(out.splitlines()[-1])  # after the events
    assert summary["state"] == "succeeded" and summary["step"] == 40
    assert _zero(cloud, project)
    assert "step=40 " in _text(tpc, summary["bucket"], "runs/det-run/logs/worker-3.log")


@pytest.mark.slow  # fast tier: a whole run: test_run_trains_on_every_worker_and_tears_down
def test_detach_returns_after_launch_and_job_commands_see_it(tpc, cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("dt-run", accelerator="v3-8", trainer={"max_steps": 30, "step_seconds": 0.05}))
    run = subprocess.run([sys.executable, "-m", "tpuctl", "run", str(spec), "--yes", "--detach", "--no-supervisor"], env=_env(cloud, tmp_path, project),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "tpuctl run --attach dt-run" in run.stderr
    logs = subprocess.run([sys.executable, "-m", "tpuctl", "logs", "dt-run", "-f"], env=_env(cloud, tmp_path, project),
                          capture_output=True, text=True, timeout=120)
    assert logs.returncode == 0, logs.stderr
    assert "[w0] step=30 loss=0.333 examples_per_sec=100.0" in _untimed(logs.stdout)
    doc = json.loads(_here(cloud, tmp_path, project, "job", "status", "dt-run", "--json").stdout)
    assert doc["workers"][0]["state"] == "exited" and doc["workers"][0]["exit_code"] == 0
    down = _here(cloud, tmp_path, project, "down", "dt-run", "--yes")
    assert down.returncode == 0, down.stderr
    assert _zero(cloud, project)
    # Nobody watched it end: `down` ended its timeline when it deleted the TPU, and its steps went unseen.
    phases = json.loads(_here(cloud, tmp_path, project, "cost", "dt-run", "--json").stdout)
    assert phases["ended"] and phases["goodput"] is None, phases


def test_bad_spec_is_one_line_exit_2_and_creates_nothing(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, {**_spec("bad-spec"), "job": {"template": "no-such-template"}})
    r = _here(cloud, tmp_path, project, "run", str(spec), "--yes")
    assert r.returncode == 2
    assert r.stderr.startswith("error: job.template: no template 'no-such-template'")
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


@pytest.mark.slow
@pytest.mark.tf
def test_real_bert_tiny_run_ends_with_a_checkpoint_in_the_bucket_and_nothing_live(tpc, cloud, project):
    spec = spec_mod.from_mapping({
        "name": "bert-e2e", "zone": "europe-west4-a", "accelerator": "v3-8", "provisioning": "spot",
        "job": {"template": "bert", "preset": "bert-tiny",
                "config": {"trainer": {"max_steps": 20, "checkpoint_every": 10, "log_every": 10,
                                       "steps_per_execution": 10, "warmup_steps": 5}},
                "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=1.0))
    o = p.run()
    assert o.state == "succeeded" and o.step == 20
    assert _zero(cloud, project)
    assert any(a.startswith("checkpoints/") for a in o.artifacts), o.artifacts
    assert any(a.startswith("tensorboard/") for a in o.artifacts), o.artifacts
    assert {"export/model.keras", "export/vocab.txt", "export/metrics.json"} <= set(o.artifacts)


@pytest.mark.slow
@pytest.mark.tf
def test_real_bert_on_a_4_worker_slice_is_driven_by_worker_0_found_from_metadata_alone(tpc, cloud, project):
    """No TPU_* variable on any worker: each learns its index, its peers and the node's name from its metadata
    server; worker 0 trains (a CPU rehearsal, as the local cloud asks), workers 1-3 idle, as on a real slice."""
    spec = spec_mod.from_mapping({
        "name": "bert-pod", "zone": "europe-west4-a", "accelerator": "v3-32", "provisioning": "spot",
        "job": {"template": "bert", "preset": "bert-tiny",
                "config": {"trainer": {"max_steps": 10, "checkpoint_every": 10, "log_every": 5,
                                       "steps_per_execution": 5, "warmup_steps": 2}},
                "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=1.0))
    o = p.run()
    assert o.state == "succeeded" and o.step == 10
    logs = [_text(tpc, o.bucket, f"runs/bert-pod/logs/worker-{w}.log") for w in range(4)]
    assert "start backend=tensorflow strategy=cpu processes=1 hosts=1 devices=1 " in logs[0]
    assert "done step=10 " in logs[0]
    for w in (1, 2, 3):
        assert f"idle worker={w} reason=pod-slice-driven-by-worker-0" in logs[w]
        assert "start backend=" not in logs[w] and "step=" not in logs[w]
    assert {"export/model.keras", "export/metrics.json"} <= set(o.artifacts)
    assert _zero(cloud, project)


@pytest.mark.slow  # fast tier: a recovery: test_max_recoveries_zero_fails_on_preemption_and_tears_down
def test_lost_worker_is_detected_and_the_run_recovers(tpc, cloud, project):
    spec = spec_mod.from_mapping(_spec("kw-run", trainer={"max_steps": 30, "checkpoint_every": 5, "step_seconds": 0.1}))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    fired = threading.Event()

    def kill_worker_1():
        while not fired.is_set():
            if (p.outcome.step or 0) >= 8 and p.node:
                cloud.faults.add("kill-worker", node=_node_path(p), worker=1)
                fired.set()
            time.sleep(0.05)

    threading.Thread(target=kill_worker_1, daemon=True).start()
    try:
        o = p.run()
    finally:
        fired.set()
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 30
    assert _zero(cloud, project)


@pytest.mark.slow  # fast tier: the watch's restarted-or-lost answer: test_an_on_demand_node_under_maintenance_is_waited_for_not_recreated
def test_a_worker_dead_under_an_open_connection_is_lost_not_restarted(tpc, cloud, project, monkeypatch):
    """The worker is killed and the watch's poll, over a connection still open, finds the job's processes gone
    ("lost"): on a READY node that reads as a restart, but the worker refuses new connections, so the node is
    lost and recreated (bench/chaos.py's kill-worker on a spot v3-8, under load, relaunched on the dead worker
    and exited 1 after waiting 180 s for its SSH)."""
    from tpuctl.jobs import launch
    from tpuctl.jobs.launch import WorkerState

    spec = spec_mod.from_mapping(_spec("kw-open", accelerator="v3-8",
                                       trainer={"max_steps": 30, "checkpoint_every": 5, "step_seconds": 0.1}))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    polled = launch.poll
    struck = threading.Event()

    async def poll(fleet, run):
        states = await polled(fleet, run)
        if not struck.is_set() and (p.outcome.step or 0) >= 8:
            struck.set()
            cloud.faults.add("kill-worker", node=_node_path(p), worker=0)
            return [WorkerState(s.index, "lost") for s in states]  # what the open connection answered
        return states

    monkeypatch.setattr(launch, "poll", poll)
    o = p.run()
    assert struck.is_set()
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 30
    assert _zero(cloud, project)


def _tpuctl(cloud, tmp_path, project, *argv, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpuctl", *argv], env=_env(cloud, tmp_path, project), cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


def _here(cloud, tmp_path, project, *argv) -> subprocess.CompletedProcess:
    """`_tpuctl` in this process (conftest `tpuctl_here`): for refusals and dry runs, which need no process."""
    from conftest import tpuctl_here

    return tpuctl_here(_env(cloud, tmp_path, project), *argv, cwd=tmp_path)


@pytest.mark.slow  # fast tier: logs: test_cli_errors; an SSH drop: test_localcloud_faults
def test_logs_follow_survives_an_injected_ssh_drop(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("lg-run", accelerator="v3-8", trainer={"max_steps": 50, "step_seconds": 0.1}))
    assert _tpuctl(cloud, tmp_path, project, "run", str(spec), "--yes", "--detach", "--no-supervisor").returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "tpuctl", "logs", "lg-run", "-f"], env=_env(cloud, tmp_path, project),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("[w0] step=10 "):
                cloud.faults.add("drop-ssh", node=f"projects/{project}/locations/us-central1-a/nodes/lg-run")
                break
        lines += proc.stdout.read().splitlines()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [line for line in _untimed("\n".join(lines)) if line.startswith("[w0] step=")]
    assert steps == [f"[w0] step={n} loss={10.0 / n:.3f} examples_per_sec=100.0" for n in range(1, 51)], lines
    assert _here(cloud, tmp_path, project, "down", "lg-run", "--yes").returncode == 0
    assert _zero(cloud, project)


@pytest.mark.slow  # fast tier: ssh and job cancel in process: test_cli_errors
def test_ssh_passes_words_verbatim_and_job_cancel_stops_the_job(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("cx-run", accelerator="v3-8", trainer={"max_steps": 5000, "step_seconds": 0.05}))
    assert _tpuctl(cloud, tmp_path, project, "run", str(spec), "--yes", "--detach", "--no-supervisor").returncode == 0
    r = _tpuctl(cloud, tmp_path, project, "ssh", "cx-run", "--", "printf", "%s\\n", "a; b", "$(touch PWNED)", "it's")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a; b", "$(touch PWNED)", "it's"]
    assert "PWNED" not in _here(cloud, tmp_path, project, "ssh", "cx-run", "--", "ls", "-a").stdout
    # tpuctl's exit codes mean tpuctl's outcomes (3 is "no capacity"): a remote failure is reported, exit 1.
    r = _here(cloud, tmp_path, project, "ssh", "cx-run", "--", "exit 3")
    assert r.returncode == 1 and "worker 0: exit 3" in r.stderr, r.stderr
    r = _tpuctl(cloud, tmp_path, project, "job", "cancel", "cx-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "cancelled" and json.loads(r.stdout)["cancelled_workers"] == [0]
    doc = json.loads(_here(cloud, tmp_path, project, "job", "status", "cx-run", "--json").stdout)
    assert doc["workers"] == [{"index": 0, "state": "exited", "exit_code": 143, "pid": None}]
    assert doc["status"]["state"] == "cancelled"
    text = _here(cloud, tmp_path, project, "job", "status", "cx-run")
    assert text.stderr.startswith("run cx-run: cancelled, step ") and "None" not in text.stderr, text.stderr
    again = _here(cloud, tmp_path, project, "job", "cancel", "cx-run")
    assert again.returncode == 0 and "already ended (cancelled); nothing to cancel" in again.stderr, again.stderr
    assert _tpuctl(cloud, tmp_path, project, "down", "cx-run", "--yes").returncode == 0
    logs = _here(cloud, tmp_path, project, "logs", "cx-run")
    assert logs.returncode == 0 and "[w0] step=1 loss=10.000 examples_per_sec=100.0" in _untimed(logs.stdout)


@pytest.mark.slow  # fast tier: job status of a running job: test_agent_protocol
def test_job_status_before_the_first_step_says_so_rather_than_step_none(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("ns-run", accelerator="v3-8", trainer={"max_steps": 2, "step_seconds": 600}))
    assert _tpuctl(cloud, tmp_path, project, "run", str(spec), "--yes", "--detach", "--no-supervisor").returncode == 0
    r = _here(cloud, tmp_path, project, "job", "status", "ns-run")
    assert r.returncode == 0 and r.stderr.startswith("run ns-run: running, no step finished yet"), r.stderr
    assert "None" not in r.stderr
    assert _here(cloud, tmp_path, project, "job", "cancel", "ns-run").returncode == 0
    assert _here(cloud, tmp_path, project, "down", "ns-run", "--yes", "--delete-bucket").returncode == 0
    assert _zero(cloud, project)


def test_dry_run_plans_and_creates_nothing(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("dry-run"))
    r = _here(cloud, tmp_path, project, "run", str(spec), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "plan for run dry-run" in r.stdout and "v3-32" in r.stderr
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


def test_missing_corpus_is_bad_input_before_anything_is_created(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, {**_spec("no-data"), "job": {"template": str(STANDIN),
                                                               "data": {"corpus": ["nowhere/*.txt"]}}})
    r = _here(cloud, tmp_path, project, "run", str(spec), "--yes")
    assert r.returncode == 2
    assert r.stderr.startswith("error: job.data.corpus: corpus 'nowhere/*.txt' matches no file")
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


@pytest.mark.parametrize("trainer, error", [
    ({"max_step": 30}, "error: job.config.trainer.max_step: unknown field; did you mean max_steps?"),
    ({"max_steps": 35}, "error: job.config.trainer.max_steps: must be a positive multiple of "
                        "trainer.steps_per_execution (10)"),
    ({"checkpoint_every": 25}, "error: job.config.trainer.checkpoint_every: must be a positive multiple of "),
    ({"log_every": "10"}, "error: job.config.trainer.log_every: expected int, got '10'"),
])
def test_bad_template_config_is_bad_input_before_anything_is_created(cloud, project, tmp_path, trainer, error):
    """The template's own schema (bert/config.py, named in its template.json) runs on the host: a typo or a
    value the worker would refuse costs no TPU and leaves no bucket, and --dry-run says the same."""
    spec = _spec_file(tmp_path, {**_spec("bad-config"), "job": {"template": "bert", "preset": "bert-tiny",
                                                                 "config": {"trainer": trainer}}})
    for mode in ("--dry-run", "--yes"):
        r = _here(cloud, tmp_path, project, "run", str(spec), mode)
        assert r.returncode == 2, (mode, r.stderr)
        assert r.stderr.splitlines()[0].startswith(error), (mode, r.stderr)
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


def test_unknown_preset_names_the_spec_field_it_came_from(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, {**_spec("bad-preset"), "job": {"template": "bert", "preset": "bert-largest"}})
    for command in (("run", str(spec), "--dry-run"), ("up", str(spec), "--dry-run"), ("fit", str(spec))):
        r = _here(cloud, tmp_path, project, *command)  # up's and fit's from the fit's own config check
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.startswith("error: job.preset: unknown preset 'bert-largest'; did you mean bert-large?"), (
            command, r.stderr)


@pytest.mark.parametrize("name", ["$(touch PWNED)", "a;b", "it's", "x\ny"])
def test_hostile_run_name_is_refused_and_creates_nothing(cloud, project, tmp_path, name):
    spec = _spec_file(tmp_path, _spec("fine-name"))
    r = _here(cloud, tmp_path, project, "run", str(spec), "--yes", "--name", name)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: name:")
    assert _buckets(cloud, project) == [] and _zero(cloud, project)
    assert not list(tmp_path.rglob("PWNED"))


def test_delete_bucket_leaves_nothing_at_all(tpc, cloud, project):
    spec = spec_mod.from_mapping(_spec("gone-run", accelerator="v3-8", trainer={"max_steps": 3}))
    o = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5, delete_bucket=True)).run()
    assert o.state == "succeeded" and o.step == 3
    assert _zero(cloud, project) and _buckets(cloud, project) == []


def test_run_json_gives_loss_and_rate_as_numbers():
    from tpuctl.jobs.pipeline import Outcome, _Stream

    stream = _Stream(Outcome(run="nums"))
    stream(0, "step=10 loss=2.500 examples_per_sec=93.5")
    stream(0, "step=20 loss=nan examples_per_sec=94.0")  # no NaN in JSON: the last finite loss stands
    doc = json.loads(json.dumps(stream.outcome.as_dict()))
    assert (doc["step"], doc["loss"], doc["examples_per_sec"]) == (20, 2.5, 94.0)


def test_example_spec_works_from_any_directory(tmp_path, monkeypatch):
    from tpuctl.jobs.pipeline import _corpus_path

    example = Path(__file__).resolve().parents[1] / "examples" / "bert-tiny.yaml"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "decoy.txt").write_text("the working directory's file, not the spec's\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "GOOGLE_", "CLOUDSDK_"))}
    from conftest import tpuctl_here

    dry = tpuctl_here({**env, "TPUCTL_HOME": str(tmp_path / "home"), "HOME": str(tmp_path), "NO_COLOR": "1"},
                      "run", str(example), "--dry-run", "--json", cwd=elsewhere)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout.splitlines()[-1])["state"] == "planned"  # the summary, after the events
    monkeypatch.chdir(elsewhere)  # a relative path means the spec's directory even where the cwd has a match
    assert _corpus_path("data/*.txt", example.parent) == str(example.parent / "data" / "*.txt")


# The fast tier keeps only-lost-workers: the same wait for the same node, reached through the race as well.
@pytest.mark.parametrize("watch_saw", [pytest.param("maintenance", marks=pytest.mark.slow), "only-lost-workers"])
def test_an_on_demand_node_under_maintenance_is_waited_for_not_recreated(tpc, cloud, project, monkeypatch, watch_saw):
    """`only-lost-workers`: the node went into maintenance just after the watch read it READY, so the watch saw
    only its workers gone (a race CI met); the node is still the one to wait for."""
    spec = spec_mod.from_mapping({**_spec("mx-run", accelerator="v3-8", trainer={
        "max_steps": 30, "checkpoint_every": 5, "step_seconds": 0.1}), "provisioning": "on-demand"})
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.3))
    fired = threading.Event()
    if watch_saw == "only-lost-workers":
        from dataclasses import replace

        from tpuctl.jobs import cluster
        from tpuctl.provision import State

        node_state, stale = cluster.node_state, []  # the first REPAIRING read, which the watch was told was READY

        def read_before_the_repair(*args):
            node = node_state(*args)
            if not stale and node is not None and node.state is State.REPAIRING:
                stale.append(node)
                return replace(node, state=State.READY)
            return node

        monkeypatch.setattr(cluster, "node_state", read_before_the_repair)
    ids: list[str] = []

    def repair_at_step_8():
        while not fired.is_set():
            if (p.outcome.step or 0) >= 8 and p.node:
                ids.append(tpc.tpu.get_node(name=_node_path(p)).id)
                cloud.repair(_node_path(p), seconds=2000)  # 2 s of REPAIRING at the tests' speed
                fired.set()
            time.sleep(0.05)

    def node_id_at_the_end(outcome_step: int = 30):
        while (p.outcome.step or 0) < outcome_step:
            time.sleep(0.05)
        ids.append(tpc.tpu.get_node(name=_node_path(p)).id)

    threading.Thread(target=repair_at_step_8, daemon=True).start()
    watcher = threading.Thread(target=node_id_at_the_end, daemon=True)
    watcher.start()
    try:
        o = p.run()
    finally:
        fired.set()
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 30
    watcher.join(timeout=1)
    assert len(ids) == 2 and ids[0] == ids[1]  # the same node throughout: waited for, never deleted
    assert watch_saw == "maintenance" or stale
    from tpuctl.ledger import Ledger

    assert len([e for e in Ledger().entries() if e.kind == "tpu" and e.run == "mx-run"]) == 1
    assert _zero(cloud, project)
