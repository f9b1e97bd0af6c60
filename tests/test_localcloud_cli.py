"""`tpuctl local start/env/status/fault/stop` as a user runs them: subprocesses against a real daemon."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
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
from tpuctl import config, console
from tpuctl.cli import cli
from tpuctl.errors import BadInput, LocalCloudError
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


def test_a_local_cloud_that_cannot_start_is_an_error_not_a_traceback(home, invoke, monkeypatch):
    def refuse(*args, **kwargs):
        raise daemon.StartFailed("the local cloud exited with code 2 while starting: localcloud: another local "
                                 "cloud serves STATE: stop it first (log: STATE/localcloud.log)")

    monkeypatch.setattr(daemon, "ensure_running", refuse)
    proc = invoke("status", check=False)  # a DaemonError escaping the CLI would raise here
    assert proc.returncode == LocalCloudError.exit_code != 0
    assert "exited with code 2 while starting" in proc.stderr and "tpuctl local stop" in proc.stderr


def test_daemon_survives_its_info_file_removed_and_stops_when_its_state_dir_is(tmp_path):
    """`rm -rf ~/.tpuctl` under a running daemon: the next command starts another in the recreated dir, and the
    old one must stop at once rather than, at its idle stop, delete the new one's info file (tpuctl then could
    neither find the new daemon nor start one) and write its stale snapshot over the new state."""
    import shutil

    state = tmp_path / "localcloud"
    old = daemon.start(state, 1000)
    try:
        (state / daemon.INFO_FILE).unlink()  # removed by hand: the daemon writes it again
        deadline = time.monotonic() + 10
        while daemon.status(state) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.status(state) == old
        shutil.rmtree(state)
        new = daemon.ensure_running(state, 1000)
        assert new["pid"] != old["pid"]
        assert _gone(old["pid"], 10.0), "a daemon whose state dir was removed kept running"
        assert daemon.status(state) == new
    finally:
        with contextlib.suppress(daemon.NotRunning):
            daemon.stop(state)
        if not _gone(old["pid"], 0.1):
            os.kill(old["pid"], 9)


def _readme_row(first_cell_has: str) -> str:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return next(line for line in readme.splitlines() if line.startswith("|") and first_cell_has in line.split("|")[1])


def test_readme_names_exactly_the_variables_local_env_sets_and_tpuctl_reads_them():
    row = _readme_row("TPUCTL_API_ENDPOINT")
    assert "tpuctl local env" in row
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    info = {"endpoint": "http://127.0.0.1:1", "storage_host": "http://127.0.0.1:2"}
    exported = dict(line.removeprefix("export ").split("=", 1) for line in daemon.env_lines(info))
    assert documented == set(exported)
    resolved = config.settings(env=exported, config_path=Path("/nonexistent"))
    assert (resolved.endpoint, resolved.storage_host) == (info["endpoint"], info["storage_host"])


def test_readme_exit_code_130_says_an_interrupted_run_keeps_its_bucket():
    row = _readme_row(" 130 ")
    assert "bucket" in row and "kept" in row


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited; this test process started it and has not reaped it
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # fast tier: the daemon: test_start_env_status_fault_stop
def test_daemon_stops_when_idle_but_never_while_a_tpu_is_billed_or_requests_come(home, invoke):
    started = invoke("local", "start", "--speed", "1000", "--idle-stop", "2s")
    assert "stops after 2s idle" in started.stderr
    state = home / "localcloud"
    info = daemon.status(state)
    tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                           client_options=ClientOptions(api_endpoint=info["endpoint"]))
    name = "projects/lc-idle/locations/us-central1-b/nodes/idle"
    tpu.create_node(parent="projects/lc-idle/locations/us-central1-b", node_id="idle", node=tpu_v2.Node(
        accelerator_type="v2-8", runtime_version="tpu-vm-tf-2.14.1")).result(polling=FAST_POLLING)
    assert not _gone(info["pid"], 3.0), "stopped with a TPU billed"
    tpu.delete_node(name=name).result(polling=FAST_POLLING)
    for _ in range(10):  # requests keep it in use, for longer than the idle period
        tpu.list_nodes(parent="projects/lc-idle/locations/us-central1-b")
        time.sleep(0.4)
    assert daemon.status(state) is not None
    assert _gone(info["pid"], 15.0), "still running after 2 s idle"
    assert daemon.status(state) is None
    assert "idle for" in (state / "localcloud.log").read_text()
    again = daemon.ensure_running(state, 1000, idle_stop_s=0)  # the state dir is free for the next daemon
    assert again["pid"] != info["pid"] and again["idle_stop_s"] == 0


def test_idle_stop_setting_flag_env_default():
    assert config.local_idle_stop_s(env={}) == 1800
    assert config.local_idle_stop_s("2h", env={"TPUCTL_LOCAL_IDLE": "5m"}) == 7200
    assert config.local_idle_stop_s(env={"TPUCTL_LOCAL_IDLE": "5m"}) == 300
    assert config.local_idle_stop_s(env={"TPUCTL_LOCAL_IDLE": "never"}) == 0
    with pytest.raises(BadInput) as bad:
        config.local_idle_stop_s(env={"TPUCTL_LOCAL_IDLE": "soon"})
    assert bad.value.field == "TPUCTL_LOCAL_IDLE"


@pytest.mark.slow  # fast tier: the daemon: test_start_env_status_fault_stop
def test_daemon_memory_stays_flat_over_up_down_cycles_with_concurrent_uploads():
    """The soak of bench/localcloud_soak.py (tests/daemon_soak.py), short (its full run and result: bench/RESULTS.md). The daemon used to
    keep ~100 MB per concurrent checkpoint upload (465 MB here) and grew to ~600 MB over a few dozen runs; with
    glibc's dynamic mmap threshold it still grew ~40 MB over these four cycles (a CI failure)."""
    import daemon_soak as soak

    r = soak.run(cycles=8, uploads=4, upload_mb=4, every=4, settle_s=2.5)  # settled: what the daemon keeps
    assert r["peak_mb"] < soak.RSS_LIMIT_MB and r["growth_after_warmup_mb"] < soak.GROWTH_LIMIT_MB, r["rss_mb"]
