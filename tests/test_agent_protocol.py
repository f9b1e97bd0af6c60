"""The worker agent's protocol with tpuctl: the status.json schema every reader and writer shares
(jobs/agent/status.py), and the bundle that carries the whole agent package to workers that have no tpuctl."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import tpuctl
from tpuctl.errors import BadInput, CloudError
from tpuctl.jobs import bundle as bundles
from tpuctl.jobs.agent.status import VERSION, CorruptStatus, RunStatus

STANDIN = Path(__file__).parent / "job_templates" / "standin"

# status.json as the agents and `tpuctl run` wrote it before it had a schema (no `version`): a run Google ended.
UNVERSIONED = {"state": "failed", "heartbeat": 1795842723, "step": 45, "exit_code": 143, "workers": 4,
               "recovering": False, "final": True, "ended": "max_run_duration"}


def test_a_status_record_round_trips_and_keeps_the_fields_it_does_not_know():
    record = RunStatus(state="running", heartbeat=12.5, step=3, workers=2, recovering=True)
    assert RunStatus.from_json(record.to_json()) == record
    # A newer writer's fields survive an older writer's merge, which stamps its own version.
    newer = {"state": "running", "version": VERSION + 1, "preemptions": [{"at": 5}], "step": 2}
    merged = RunStatus.from_json(json.dumps(newer)).merged({"step": 7, "heartbeat": 99})
    assert merged.extra == {"preemptions": [{"at": 5}]}
    assert json.loads(merged.to_json()) == {**RunStatus(state="running").to_doc(), "preemptions": [{"at": 5}],
                                            "step": 7, "heartbeat": 99, "version": VERSION}
    with pytest.raises(TypeError):  # a writer's typo is not a new field
        record.merged({"stpe": 4})


def test_a_status_written_before_the_schema_reads_as_version_0_with_its_fields():
    old = RunStatus.from_json(json.dumps(UNVERSIONED).encode())
    assert (old.version, old.state, old.step, old.exit_code, old.workers, old.final, old.ended, old.heartbeat) == (
        0, "failed", 45, 143, 4, True, "max_run_duration", 1795842723.0)
    assert old.extra == {} and not old.recovering and not old.interrupted
    assert json.loads(old.merged({}).to_json())["version"] == VERSION


@pytest.mark.parametrize("raw", [b"{half", b"\xff\xfe", b"[1]", b'{"heartbeat": 5}', b'{"state": ""}',
                                 b'{"state": "running", "step": "ten"}', b'{"state": "running", "final": "yes"}',
                                 b'{"state": "running", "heartbeat": true}', b'{"state": "running", "version": "2"}'])
def test_what_is_not_a_status_record_is_refused_as_such(raw):
    with pytest.raises(CorruptStatus):
        RunStatus.from_json(raw)


def test_a_corrupt_status_is_an_error_with_a_hint_for_the_cli_and_decides_nothing_for_gc(cloud, env, pc):
    """`tpuctl job status` on a run whose status.json is no status record: one error line and what to do, exit 1,
    no traceback; gc reads no status for it (a foreign file must not decide, nor stop gc for other runs)."""
    from tpuctl.jobs import cluster
    from tpuctl.provision import bucket, gc
    from tpuctl.provision import labels as L

    run = "corrupt-status"
    name = L.auto_bucket(pc.project, run)
    bucket.ensure(pc, name, "us-central1", L.run_labels(run, owner_name="ann", ttl_s=3600))
    pc.storage.bucket(name).blob(f"runs/{run}/status.json").upload_from_string(b'{"state": "running", "step": "x"}')
    with pytest.raises(CloudError) as err:
        cluster.read_status(pc, name, run)
    assert "is not a status record: field 'step'" in str(err.value)
    assert f"--name {run}" in err.value.hint and f"gs://{name}/runs/{run}/status.json" in err.value.hint
    assert gc.read_status(pc, name, run) is None
    shown = tpuctl(env, "job", "status", run)
    assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr
    assert f"error: gs://{name}/runs/{run}/status.json is not a status record" in shown.stderr, shown.stderr
    assert f"tpuctl run SPEC --name {run}" in shown.stderr, shown.stderr


def test_the_bundle_carries_every_agent_module_importable_without_tpuctl(tmp_path):
    """A worker has the bundle and the standard library (plus google-cloud-storage), not tpuctl: every module of
    the agent package must be in the bundle and import from it alone."""
    job = bundles.JobDescription(run="r1", project="p", bucket="b", module="standin.train", config={},
                                 storage="mirror")
    with tarfile.open(bundles.build(STANDIN, job, tmp_path / "out").path) as tar:
        tar.extractall(tmp_path / "bundle", filter="data")
    modules = sorted(p.stem for p in Path(bundles.__file__).with_name("agent").glob("*.py"))
    assert {"__main__", "install", "mirror", "notice", "status", "storage", "supervisor"} <= set(modules)
    assert json.loads((tmp_path / "bundle" / "job.json").read_text())["storage"] == "mirror"
    # -I: no PYTHONPATH, no user site, no current directory; the bundle is the only addition to the path.
    check = (f"import importlib, sys; sys.path.insert(0, {str(tmp_path / 'bundle')!r}); "
             f"[importlib.import_module('{bundles.AGENT_PACKAGE}.' + m) for m in {modules!r}]; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tpuctl', 'google')))")
    done = subprocess.run([sys.executable, "-I", "-c", check], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", "the agent imports tpuctl or a storage client at import: " + done.stdout
    usage = subprocess.run([sys.executable, "-I", "-c", f"import sys, runpy; sys.path.insert(0, {str(tmp_path / 'bundle')!r}); "
                            f"sys.argv = ['x', '--help']; runpy.run_module({bundles.AGENT_PACKAGE!r}, run_name='__main__')"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert usage.returncode == 0 and "{prepare,run}" in usage.stdout, usage.stderr


def test_a_bundle_names_a_storage_the_agent_has(tmp_path):
    job = bundles.JobDescription(run="r1", project="p", bucket="b", module="standin.train", config={}, storage="s3")
    with pytest.raises(BadInput) as err:
        bundles.build(STANDIN, job, tmp_path)
    assert err.value.field == "job.storage"
