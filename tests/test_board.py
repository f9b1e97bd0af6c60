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

from conftest import cli_env, new_project, tpuctl

SCALARS = Path(__file__).parent / "job_templates" / "scalars"
TAGS = {"loss", "mlm_accuracy", "learning_rate", "examples_per_sec"}


@pytest.fixture(scope="module")
def finished(localcloud, tmp_path_factory):
    """Two runs of the scalars template (it logs as the BERT template does), trained and torn down; their
    buckets are kept. Yields (home, project, {run: max_steps}, the last run's Outcome)."""
    from google.auth.credentials import AnonymousCredentials

    from tpuctl import spec as spec_mod
    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.provision.clients import build

    home, project = tmp_path_factory.mktemp("board"), new_project()
    clients = build(project=project, credentials=AnonymousCredentials(), endpoint=localcloud.endpoint,
                    storage_host=localcloud.storage_host, local=True)
    runs = {"board-a": 20, "board-b": 10}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPUCTL_HOME", str(home / "home"))  # the CLI's home in cli_env: the ledger is shared
        for run, steps in runs.items():
            spec = spec_mod.from_mapping({
                "name": run, "zone": "us-central1-a", "accelerator": "v3-8", "provisioning": "spot",
                "job": {"template": str(SCALARS), "config": {"trainer": {"max_steps": steps, "log_every": 5}}}})
            outcome = Pipeline(clients, spec, options=RunOptions(yes=True, poll_s=0.5)).run()
            assert outcome.state == "succeeded", outcome
    yield home, project, runs, outcome


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow  # two pipeline runs and a TensorBoard: ~40 s on 2 cores
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
        assert Path(ready["logdir"]).is_relative_to(home / "home" / "board")
        deadline, tags = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # TensorBoard loads the logdir in the background
            tags = _get(f"{url}/data/plugin/scalars/tags")
            if all(TAGS <= set(tags.get(run, {})) for run in runs):
                break
            time.sleep(1)
        assert set(tags) == set(runs), tags  # one TensorBoard run per tpuctl run, named by it
        for run, max_steps in runs.items():
            assert TAGS <= set(tags[run]), tags
            for tag in TAGS:
                query = urllib.parse.urlencode({"run": run, "tag": tag})
                points = _get(f"{url}/data/plugin/scalars/scalars?{query}")
                assert [step for _, step, _ in points] == list(range(5, max_steps + 1, 5)), (run, tag, points)
            loss = _get(f"{url}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": "loss"}))
            assert [round(v, 4) for _, _, v in loss] == [round(10.0 / s, 4) for s in range(5, max_steps + 1, 5)]
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
    r = tpuctl(cli_env(cloud, tmp_path), "board", "no-such-run", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: run: run no-such-run has no bucket in project"), r.stderr
    assert not (tmp_path / "home" / "board").exists() or not any((tmp_path / "home" / "board").rglob("*"))


def test_the_end_of_tpuctl_run_says_how_to_look(finished, cli_stderr):
    from tpuctl.cli.jobs import _summary

    _summary(finished[3])
    assert "  TensorBoard: tpuctl board board-b" in cli_stderr.getvalue().splitlines()
