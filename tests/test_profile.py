"""`tpuctl run SPEC --profile FIRST-LAST`: a profiler trace of those steps on worker 0, in the run's TensorBoard
directory, where TensorBoard's profile plugin (XProf) lists it; bad ranges are refused before anything exists."""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import cli_env, tpuctl, tpuctl_here
from test_run import REPO, _buckets, _text, _zero, project, tpc  # noqa: F401 (fixtures)

# The trace's run directory as the profile plugin expects it: TIMESTAMP under plugins/profile of a TensorBoard run.
TRACE_DIR = re.compile(r"^profile steps=(\d+)-(\d+) path=(\S+/tensorboard/plugins/profile/(\d{4}(?:_\d\d){5}))$", re.M)


def _bert_tiny(name: str, **job) -> dict:
    """bert-tiny on one v3-8 host, a few short executions of 2 steps."""
    return {"name": name, "zone": "us-central1-a", "accelerator": "v3-8",
            "job": {"template": "bert", "preset": "bert-tiny", **job,
                    "config": {"trainer": {"max_steps": 6, "checkpoint_every": 6, "log_every": 2,
                                           "steps_per_execution": 2, "warmup_steps": 1, "per_replica_batch_size": 8,
                                           "shuffle_buffer": 64}},
                    "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}}


@pytest.mark.parametrize(("flag", "in_file", "says"), [
    ("20-10", None, "'20-10' is not a range of steps: FIRST must be at least 1 and at most LAST; write e.g. 10-20"),
    # Beyond the preset's max_steps, which only the template knows; the flag wins over the file.
    ("5-7", "2-3", "must be FIRST-LAST training steps with 1 <= FIRST <= LAST <= trainer.max_steps (6), e.g. 20-25"),
])
def test_a_bad_step_range_is_one_line_naming_job_profile_and_creates_nothing(cloud, tmp_path, flag, in_file, says):
    import yaml

    spec = _bert_tiny("prof-bad", **({"profile": in_file} if in_file else {}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(spec))
    env = cli_env(cloud, tmp_path)
    r = tpuctl_here(env, "run", str(tmp_path / "run.yaml"), "--yes", "--profile", flag)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: job.profile: {says}\n"), r.stderr
    assert _zero(cloud, env["TPUCTL_PROJECT"]) and not _buckets(cloud, env["TPUCTL_PROJECT"])


def test_a_step_range_in_the_spec_is_two_step_numbers_and_the_flag_replaces_it():
    from tpuctl import spec as spec_mod
    from tpuctl.errors import BadInput

    spec = spec_mod.from_mapping(_bert_tiny("prof-spec", profile=" 20 - 25 "))
    assert spec.job.profile == "20-25"
    assert spec_mod.with_profile(spec, "100-110").job.profile == "100-110"
    assert spec_mod.with_profile(spec, None).job.profile == "20-25"
    for bad, says in (("abc", "'abc' is not a range of steps; write FIRST-LAST, e.g. 100-110"),
                      ("0-3", "'0-3' is not a range of steps: FIRST must be at least 1 and at most LAST; write e.g. 1-3")):
        with pytest.raises(BadInput) as raised:
            spec_mod.with_profile(spec, bad)
        assert (raised.value.field, raised.value.message) == ("job.profile", says)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
        # The profile plugin gzips its answers (as a browser accepts them) whether asked to or not.
        return json.loads(gzip.decompress(body) if r.headers.get("Content-Encoding") == "gzip" else body)


@pytest.mark.slow  # a bert-tiny run on JAX and a TensorBoard: ~2-3 min on 2 cores
@pytest.mark.tf
@pytest.mark.timeout(900)
def test_a_profiled_run_leaves_a_trace_that_the_boards_profile_tab_lists(tpc, cloud, project, tmp_path,
                                                                         monkeypatch):
    import tpuctl as lib

    for name, value in (("TPUCTL_API_ENDPOINT", cloud.endpoint), ("STORAGE_EMULATOR_HOST", cloud.storage_host),
                        ("TPUCTL_PROJECT", project)):
        monkeypatch.setenv(name, value)
    o = lib.run(_bert_tiny("prof-jax", framework="jax"), poll_s=0.5, fit_check=False, profile="3-4")
    assert o.state == "succeeded" and o.step == 6, o
    log = _text(tpc, o.bucket, "runs/prof-jax/logs/worker-0.log")
    traced = TRACE_DIR.search(log)
    assert traced, log[-2000:]
    first, last, where, stamp = traced.groups()
    assert (first, last) == ("3", "4") and where == f"gs://{o.bucket}/runs/prof-jax/model/tensorboard/plugins/profile/{stamp}"
    # Worker 0's trace, in the bucket beside the scalars: the run outlives its TPU, and so does its profile.
    traces = [b.name for b in tpc.storage.list_blobs(o.bucket, prefix=f"runs/prof-jax/model/tensorboard/plugins/")]
    assert any(name.endswith(".xplane.pb") and f"/{stamp}/" in name for name in traces), traces

    proc = subprocess.Popen([sys.executable, "-m", "tpuctl", "board", "prof-jax", "--port", "0", "--interval", "1",
                             "--json"], env=cli_env(cloud, tmp_path, project), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.poll() is not None else "no line"
        url = json.loads(line)["url"].rstrip("/")
        deadline, runs = time.monotonic() + 120, []
        while time.monotonic() < deadline and f"prof-jax/{stamp}" not in runs:
            try:  # the plugin answers once TensorBoard has loaded it
                runs = _get(f"{url}/data/plugin/profile/runs")
            except OSError:
                pass
            time.sleep(1)
        # One profile per TensorBoard run (the tpuctl run), named by the time it was taken.
        assert runs == [f"prof-jax/{stamp}"], runs
        tools = _get(f"{url}/data/plugin/profile/run_tools?" + urllib.parse.urlencode({"run": runs[0]}))
        assert any(tool.startswith("trace_viewer") for tool in tools), tools
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _zero(cloud, project)


@pytest.mark.slow  # bert-tiny on TensorFlow for 6 steps: ~40 s on 2 cores
@pytest.mark.tf
def test_on_tensorflow_the_worker_writes_its_trace_where_the_profile_plugin_looks(tmp_path):
    """The TensorFlow backend's profiler, through the worker's own entry point (a fresh process: Keras fixes its
    backend at import)."""
    from test_bert_train import _worker_env
    from tpuctl.templates.bert import prepare as prep

    data = tmp_path / "prepared"
    prep.prepare([str(REPO / "examples" / "data" / "corpus.txt")], data, prep.PrepareOptions(vocab_size=600))
    model_dir = tmp_path / "model"
    trainer = _bert_tiny("unused")["job"]["config"]["trainer"]
    (tmp_path / "config.json").write_text(json.dumps({"preset": "bert-tiny", "trainer": trainer, "runtime": {
        "data_dir": str(data), "model_dir": str(model_dir), "framework": "tensorflow", "profile": "3-4"}}))
    r = subprocess.run([sys.executable, "-m", "bert.train", "--config", str(tmp_path / "config.json")],
                       cwd=tmp_path, env=_worker_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("start backend=tensorflow "), r.stdout
    traced = TRACE_DIR.search(r.stdout)
    assert traced and traced.group(1, 2) == ("3", "4"), r.stdout
    run_dir = Path(traced.group(3))
    assert run_dir.parent == model_dir / "tensorboard" / "plugins" / "profile", run_dir
    assert [p.suffixes[-2:] for p in run_dir.iterdir()] == [[".xplane", ".pb"]], list(run_dir.iterdir())
    assert all(p.stat().st_size > 0 for p in run_dir.iterdir())
