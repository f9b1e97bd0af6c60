"""`tpuctl board`: the real TensorBoard on finished local-cloud runs, read through its HTTP API as a browser would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import cli_env, new_project, tpuctl, tpuctl_here
from test_run import run_preempted_at

SCALARS = Path(__file__).parent / "job_templates" / "scalars"
TAGS = {"loss", "mlm_accuracy", "learning_rate", "examples_per_sec"}


@pytest.fixture(scope="module")
def finished(localcloud, tmp_path_factory):
    """Two runs of the scalars template (it logs as the BERT template does), trained and torn down; their
    buckets are kept. board-b's Spot TPU is preempted once (at step 12) and the run recovers: the template
    does not resume, so its second incarnation logs every step again. Yields (home, project,
    {run: max_steps}, the last run's Outcome)."""
    from google.auth.credentials import AnonymousCredentials

    from tpuctl import spec as spec_mod
    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.provision.clients import build

    home, project = tmp_path_factory.mktemp("board"), new_project()
    clients = build(project=project, credentials=AnonymousCredentials(), endpoint=localcloud.endpoint,
                    storage_host=localcloud.storage_host, local=True)
    runs = {"board-a": 20, "board-b": 40}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPUCTL_HOME", str(home / "home"))  # the CLI's home in cli_env: the ledger is shared
        for run, steps in runs.items():
            spec = spec_mod.from_mapping({
                "name": run, "zone": "us-central1-a", "accelerator": "v3-8", "provisioning": "spot",
                "job": {"template": str(SCALARS), "config": {"trainer": {
                    "max_steps": steps, "log_every": 5, "step_seconds": 0.05 if run == "board-a" else 0.1}}}})
            pipeline = Pipeline(clients, spec, options=RunOptions(yes=True, poll_s=0.5))
            outcome = pipeline.run() if run == "board-a" else run_preempted_at(pipeline, localcloud, 12)
            assert outcome.state == "succeeded" and outcome.recoveries == (run == "board-b"), outcome
    yield home, project, runs, outcome


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _scalars(url: str, run: str, tag: str) -> list:
    """[[wall_time, step, value], ...] as TensorBoard's scalars dashboard fetches them."""
    return _get(f"{url}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": tag}))


@pytest.mark.slow  # two pipeline runs and a TensorBoard: ~70 s on 2 cores
def test_board_shows_each_runs_scalars_at_the_steps_it_logged_and_stops_on_ctrl_c(finished, cloud):
    home, project, runs, _ = finished
    proc = subprocess.Popen([sys.executable, "-m", "tpuctl", "board", *runs, "--port", "0", "--interval", "1",
                             "--json"], env=cli_env(cloud, home, project), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.poll() is not None else "no line"
        ready = json.loads(line)
        url = ready["url"].rstrip("/")
        assert url.startswith("http://127.0.0.1:") and ready["runs"] == list(runs)
        # The local cloud's bucket is its emulator, which TensorBoard's gs:// reader cannot reach: the mirror.
        assert ready["source"] == "mirror" and "STORAGE_EMULATOR_HOST" in ready["why"], ready
        assert Path(ready["logdir"]).is_relative_to(home / "home" / "board")
        deadline, tags = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # TensorBoard loads the logdir in the background
            tags = _get(f"{url}/data/plugin/scalars/tags")
            if all(TAGS <= set(tags.get(run, {})) and f"{run}/tpuctl-record" in tags for run in runs):
                break
            time.sleep(1)
        # One TensorBoard run per tpuctl run, named by it, and beside it the run's record.
        assert set(tags) == {*runs, *(f"{run}/tpuctl-record" for run in runs)}, tags
        for run, max_steps in runs.items():
            assert TAGS <= set(tags[run]), tags
            logged = list(range(5, max_steps + 1, 5))
            for tag in TAGS:
                points = _scalars(url, run, tag)
                steps = [step for _, step, _ in points]
                # The preempted run logged its first steps twice, once per incarnation.
                assert (steps == logged) if run == "board-a" else (sorted(set(steps)) == logged), (run, tag, points)
            loss = {s: round(v, 4) for _, s, v in _scalars(url, run, "loss")}
            assert loss == {s: round(10.0 / s, 4) for s in logged}
        # The record: board-b's first TPU was preempted and cost something; its successor finished the run.
        preempted = _scalars(url, "board-b/tpuctl-record", "tpuctl/preempted")
        assert [(s, v) for _, s, v in preempted] == [(0, 1.0), (1, 0.0)]
        assert [s for _, s, _ in _scalars(url, "board-b/tpuctl-record", "tpuctl/recoveries")] == [0, 1]
        assert [(s, v) for _, s, v in _scalars(url, "board-a/tpuctl-record", "tpuctl/preempted")] == [(0, 0.0)]
        (_, step, usd), = _scalars(url, "board-b/tpuctl-record", "tpuctl/cost_usd")
        assert step == 40 and usd > 0
        text = _get(f"{url}/data/plugin/text/text?" + urllib.parse.urlencode(
            {"run": "board-b/tpuctl-record", "tag": "tpuctl/record"}))
        assert "board-b</strong>: succeeded, step 40, 1 recovery(ies)" in text[-1]["text"], text
        # The timeline: the preemption where it struck (the step the watch last saw, 12 or a log line later),
        # and at the last step the run's goodput and its seconds and dollars by phase, the lost ones included.
        (_, s0, n0), (_, struck, n1) = _scalars(url, "board-b/tpuctl-record", "tpuctl/preemptions")
        assert (s0, n0, n1) == (0, 0.0, 1.0) and 12 <= struck < 20, struck
        assert [(s, v) for _, s, v in _scalars(url, "board-a/tpuctl-record", "tpuctl/preemptions")] == [(0, 0.0)]
        tags_b = tags["board-b/tpuctl-record"]
        assert {"tpuctl/goodput", "tpuctl/lost_to_preemption_usd", "tpuctl/phase_seconds/recovery",
                "tpuctl/phase_usd/productive"} <= set(tags_b), tags_b
        (_, step, goodput), = _scalars(url, "board-b/tpuctl-record", "tpuctl/goodput")
        assert step == 40 and 0 < goodput < 1
        (_, _, recovery_s), = _scalars(url, "board-b/tpuctl-record", "tpuctl/phase_seconds/recovery")
        (_, _, lost_usd), = _scalars(url, "board-b/tpuctl-record", "tpuctl/lost_to_preemption_usd")
        assert recovery_s > 0 and lost_usd > 0
        phases = _get(f"{url}/data/plugin/text/text?" + urllib.parse.urlencode(
            {"run": "board-b/tpuctl-record", "tag": "tpuctl/timeline"}))[-1]["text"]
        assert "1 preemption(s)" in phases and "<td>wasted_progress</td>" in phases, phases
        assert "<td>recover</td>" in phases and "<td>done</td>" in phases, phases
        port = url.rsplit(":", 1)[1]
        taken = tpuctl(cli_env(cloud, home, project), "board", "board-a", "--port", port)
        assert taken.returncode == 2 and taken.stderr.startswith(f"error: port: port {port} is in use"), taken.stderr
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        with pytest.raises(OSError):  # TensorBoard went with it
            urllib.request.urlopen(url, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_board_of_a_run_without_a_bucket_is_one_line_and_starts_nothing(cloud, tmp_path):
    r = tpuctl_here(cli_env(cloud, tmp_path), "board", "no-such-run", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: run: run no-such-run has no bucket in project"), r.stderr
    assert not (tmp_path / "home" / "board").exists() or not any((tmp_path / "home" / "board").rglob("*"))


def test_the_end_of_tpuctl_run_says_how_to_look(cli_stderr):
    from tpuctl.cli.jobs import _summary
    from tpuctl.jobs.pipeline import Outcome

    # A finished run's outcome as the pipeline leaves it (it kept the bucket): formatting needs no slow run.
    _summary(Outcome(run="board-b", state="succeeded", step=40, bucket="tpuctl-board-b", artifacts=["x"]))
    assert "  TensorBoard: tpuctl board board-b" in cli_stderr.getvalue().splitlines()


def test_the_board_reads_the_bucket_only_on_google_with_a_gs_reader():
    from tpuctl.jobs.board import choose

    def reader(found):
        def ask():
            asked.append(True)
            return found
        return ask

    asked: list = []
    # TensorBoard reads gs:// itself with TensorFlow's GCS filesystem (or gcsfs) on Google, for one run.
    assert choose(local=False, runs=1, reader=reader("tensorflow")).source == "bucket"
    assert choose(local=False, runs=1, reader=reader("gcsfs")).source == "bucket"
    # Without a reader it cannot: the mirror, and the way to read the bucket directly.
    none = choose(local=False, runs=1, reader=reader(None))
    assert none.source == "mirror" and "pip install tensorflow" in none.why
    assert len(asked) == 3
    # The local cloud's emulator, and several runs (one --logdir holds one bucket's run): the mirror, unasked.
    assert choose(local=True, runs=1, reader=reader("tensorflow")).source == "mirror"
    assert choose(local=False, runs=2, reader=reader("tensorflow")).source == "mirror"
    assert len(asked) == 3


def test_the_gs_reader_probe_finds_the_installed_tensorflows_gcs_filesystem():
    import importlib.util

    from tpuctl.jobs.board import gs_reader

    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("no TensorFlow here: the probe's answer depends on gcsfs")
    assert gs_reader() == "tensorflow"


def test_the_record_of_two_preemptions_goes_next_to_the_runs_events_when_tensorboard_reads_the_bucket(
        cloud, tmp_path, monkeypatch):
    # Where TensorBoard reads gs:// itself (Google), it sees only the bucket: the board uploads the record there,
    # whole after each change, and a later board's record replaces the earlier one (TensorBoard would show both).
    from google.auth.credentials import AnonymousCredentials

    from tpuctl.jobs.board import RECORD, Record, Source
    from tpuctl.provision.clients import build

    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    project = new_project()
    clients = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                    storage_host=cloud.storage_host, local=True)
    bucket = clients.storage.create_bucket(f"tpuctl-{project}", location="us-central1")
    src = Source(run="rec", bucket=bucket.name, prefix="runs/rec/model/tensorboard/", local=tmp_path / "rec")
    bucket.blob(f"{src.prefix}events.out.tfevents.1.worker0").upload_from_string(b"the run's own")
    # A run preempted twice (at steps 15 and 30), resuming from its checkpoints, as the pipeline marks it.
    t = time.time() - 600
    marks = [(0, "up", None, ""), (60, "launch", None, ""), (61, "workers_ready", None, ""), (62, "watch", None, ""),
             (90, "first_step", 1, ""), (150, "last_step", 15, ""), (151, "recover", None, "lost"),
             (200, "launch", None, ""), (201, "workers_ready", None, ""), (202, "watch", None, ""),
             (220, "first_step", 11, ""), (300, "last_step", 30, ""), (301, "recover", None, "maintenance"),
             (350, "launch", None, ""), (351, "workers_ready", None, ""), (352, "watch", None, ""),
             (360, "first_step", 26, ""), (500, "last_step", 50, ""), (501, "teardown", None, ""),
             (520, "done", None, "")]
    bucket.blob("runs/rec/timeline.json").upload_from_string(json.dumps({"v": 1, "marks": [
        {"at": t + dt, "what": what, "step": step, "detail": detail} for dt, what, step, detail in marks]}))
    first = Record(clients, src, publish=True)
    first.update()
    first.close()
    time.sleep(1.1)  # a record file is named by the second it started
    second = Record(clients, src, publish=True)
    second.update()
    objects = {b.name: b for b in clients.storage.list_blobs(bucket.name, prefix=src.prefix)}
    mine = f"{src.prefix}{RECORD}/{second.path.name}"
    assert sorted(objects) == [f"{src.prefix}events.out.tfevents.1.worker0", mine], sorted(objects)
    published = objects[mine].download_as_bytes()
    assert published == second.path.read_bytes()
    # The preemptions at a glance: a count that steps up where each struck.
    points = [(e.step, v.tensor.float_val[0]) for e in _events(published) for v in e.summary.value
              if v.tag == "tpuctl/preemptions"]
    assert points == [(0, 0.0), (15, 1.0), (30, 2.0)], points
    text, = [v.tensor.string_val[0].decode() for e in _events(published) for v in e.summary.value
             if v.tag == "tpuctl/timeline"]
    assert text.startswith("goodput ") and "2 preemption(s)" in text and "| recover |  | maintenance |" in text
    size = second.path.stat().st_size
    second.update()  # nothing changed: nothing written, nothing sent again
    assert second.path.stat().st_size == size
    assert bucket.get_blob(mine).generation == objects[mine].generation
    second.close()
    # Someone who may only read the bucket (roles/storage.objectViewer) still gets a board: the record stays
    # local and a note says so, where a 403 used to stop the board before TensorBoard started.
    from google.api_core import exceptions as gexc
    from google.cloud import storage as gcs

    def forbidden(*_, **__):
        raise gexc.Forbidden("caller does not have storage.objects.delete access")

    monkeypatch.setattr(clients.storage, "list_blobs", forbidden)
    monkeypatch.setattr(gcs.Blob, "upload_from_filename", forbidden)
    notes: list = []
    time.sleep(1.1)
    viewer = Record(clients, src, publish=True, on_event=notes.append)
    viewer.update()
    viewer.close()
    assert not viewer.publish and [n.message for n in notes] == [
        f"run rec: no write access to gs://{bucket.name}, so its record (cost, goodput, timeline) is not shown; "
        "the training curves are"]


def _events(data: bytes) -> list:
    """The Events of a TFRecord file's bytes (length, its CRC, the record, its CRC; CRCs unchecked here)."""
    from tensorboard.compat.proto import event_pb2

    events, at = [], 0
    while at < len(data):
        length = int.from_bytes(data[at:at + 8], "little")
        events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events
