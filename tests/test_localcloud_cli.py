"""`tpuctl local start/env/status/fault/stop` as a user runs them: subprocesses against a real daemon."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from conftest import FAST_POLLING
from tpuctl import console
from tpuctl.cli import cli
from tpuctl.localcloud import daemon

TPUCTL = [sys.executable, "-m", "tpuctl"]


def _tpuctl(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """A real `tpuctl` process, as the user runs it."""
    env = {**os.environ, "TPUCTL_HOME": str(home), "NO_COLOR": "1"}
    proc = subprocess.run([*TPUCTL, *args], env=env, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"tpuctl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def invoke(home, monkeypatch):
    """The same commands in-process: the CLI's import time is paid once, not per call."""
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        # tpuctl.console's rich consoles hold the streams of import time: point them at ours meanwhile.
        saved = console.out.file, console.err.file
        console.out.file, console.err.file = out, err
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(list(args), prog_name="tpuctl", standalone_mode=False) or 0
        except SystemExit as exc:
            code = exc.code or 0
        finally:
            console.out.file, console.err.file = saved
        if check and code != 0:
            raise AssertionError(f"tpuctl {' '.join(args)} -> {code}\n{out.getvalue()}\n{err.getvalue()}")
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def home(tmp_path):
    yield tmp_path
    state = tmp_path / "localcloud"
    if daemon.status(state):
        daemon.stop(state)


def test_start_env_status_fault_stop(home, invoke):
    started = _tpuctl(home, "local", "start", "--speed", "1000")
    exports = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines())
    assert exports["TPUCTL_API_ENDPOINT"].startswith("http://127.0.0.1:")
    assert exports["STORAGE_EMULATOR_HOST"].startswith("http://127.0.0.1:")
    assert "local cloud running at" in started.stderr

    again = invoke("local", "start", check=False)
    assert again.returncode == 1 and again.stderr.strip().count("\n") == 0 and "already running" in again.stderr

    assert invoke("local", "env").stdout == started.stdout

    tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                           client_options=ClientOptions(api_endpoint=exports["TPUCTL_API_ENDPOINT"]))
    tpu.create_node(parent="projects/lc-cli/locations/us-central1-b", node_id="cli", node=tpu_v2.Node(
        accelerator_type="v2-8", runtime_version="tpu-vm-tf-2.14.1")).result(polling=FAST_POLLING)

    status = json.loads(_tpuctl(home, "local", "status", "--json").stdout)
    node = next(n for n in status["resources"]["nodes"] if n["name"].endswith("/nodes/cli"))
    assert node["state"] == "READY" and len(node["workers"]) == 1 and node["workers"][0]["port"] > 0
    assert any(r["resource"] == node["name"] for r in status["meter"]["resources"])
    table = invoke("local", "status")
    assert "cli" in table.stdout and "READY" in table.stdout

    fault = json.loads(invoke("local", "fault", "capacity", "--zone", "us-central1-b", "--count", "2", "--code", "9").stdout)
    assert fault["kind"] == "capacity" and fault["count"] == 2 and fault["code"] == 9
    assert [f["id"] for f in json.loads(invoke("local", "fault", "list").stdout)] == [fault["id"]]
    missing = invoke("local", "fault", "kill-worker", check=False)
    assert missing.returncode == 2 and "node" in missing.stderr
    invoke("local", "fault", "clear")
    assert json.loads(invoke("local", "fault", "list").stdout) == []

    info = daemon.status(home / "localcloud")
    rss_kb = int(next(line.split()[1] for line in Path(f"/proc/{info['pid']}/status").read_text().splitlines()
                      if line.startswith("VmRSS:")))
    assert rss_kb < 200 * 1024

    _tpuctl(home, "local", "stop")
    stopped = invoke("local", "stop")
    assert "nothing to stop" in stopped.stderr
    gone = invoke("local", "status", check=False)
    assert gone.returncode == 1 and "no local cloud is running" in gone.stderr


def test_busy_port_is_one_clear_line(home, invoke):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = invoke("local", "start", "--port", str(port), check=False)
    assert proc.returncode == 1
    assert f"port {port} is busy" in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert daemon.status(home / "localcloud") is None


def test_daemon_is_ready_quickly_and_ensure_running_reuses_it(tmp_path):
    t0 = time.monotonic()
    info = daemon.start(tmp_path, 20)
    try:
        ready_s = time.monotonic() - t0
        assert ready_s < 5, f"ready after {ready_s:.2f} s"
        assert daemon.ensure_running(tmp_path, 20) == info
        assert daemon.env_lines(info) == [f"export TPUCTL_API_ENDPOINT={info['endpoint']}",
                                          f"export STORAGE_EMULATOR_HOST={info['storage_host']}"]
    finally:
        daemon.stop(tmp_path)
    assert daemon.status(tmp_path) is None
    with pytest.raises(daemon.NotRunning):
        daemon.stop(tmp_path)
