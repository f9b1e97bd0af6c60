"""The user-facing local cloud as a background process under a state dir.

`start` spawns `python -m tpuctl.localcloud serve` detached (own session, output to
`STATE_DIR/localcloud.log`) and blocks until it answers on its admin API; `stop` sends SIGTERM and
waits; `status` reads `STATE_DIR/localcloud.json` and checks the pid is alive and really ours (a stale
file from a crash is removed). All are safe to call repeatedly; errors are `DaemonError` subclasses
with one-line messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

INFO_FILE = "localcloud.json"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
# A daemon management choice, not an emulated Google behaviour: a background process nobody uses should not
# outlive the work it serves. Idle = no request to any API, no TPU node or VM billed, no operation under way.
DEFAULT_IDLE_STOP_S = 1800.0


class DaemonError(Exception):
    """A local cloud daemon could not be started, found or stopped."""


class AlreadyRunning(DaemonError):
    def __init__(self, info: dict):
        super().__init__(f"the local cloud is already running at {info['endpoint']} (pid {info['pid']})")
        self.info = info


class NotRunning(DaemonError):
    pass


class StartFailed(DaemonError):
    pass


def _info_path(state_dir: Path) -> Path:
    return Path(state_dir) / INFO_FILE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust the pid
    return b"localcloud" in cmdline and b"serve" in cmdline


def status(state_dir: Path) -> dict | None:
    """The running daemon's info (pid, endpoint, storage_host, speed, started), or None."""
    path = _info_path(state_dir)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(info.get("pid", 0))):
        path.unlink(missing_ok=True)
        return None
    return info


def _ready(info: dict) -> bool:
    try:
        with urllib.request.urlopen(f"{info['endpoint']}/_localcloud/faults", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(state_dir: Path, speed: float = 20.0, *, port: int = 0, strict: bool = True,
          idle_stop_s: float = DEFAULT_IDLE_STOP_S, worker_python: str | None = None) -> dict:
    """Start the daemon; blocks until it serves. It exits by itself after `idle_stop_s` idle (0: never).
    AlreadyRunning / StartFailed on failure.

    `worker_python` ("runtime" or "host"; None: `$TPUCTL_WORKER_PYTHON`, else runtime) is what TPU workers
    run jobs with (see runtimes.py)."""
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    running = status(state_dir)
    if running:
        raise AlreadyRunning(running)
    log = state_dir / "localcloud.log"
    cmd = [sys.executable, "-m", "tpuctl.localcloud", "serve", "--state-dir", str(state_dir),
           "--speed", str(speed), "--port", str(port), "--idle-stop", str(idle_stop_s)]
    if not strict:
        cmd.append("--no-strict")
    if worker_python:
        cmd += ["--worker-python", worker_python]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    delay = 0.02
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            running = status(state_dir)
            if running:  # another start won the race for the state dir
                raise AlreadyRunning(running)
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
            raise StartFailed(f"the local cloud exited with code {code} while starting: "
                              f"{tail[0] if tail else 'no output'} (log: {log})")
        info = status(state_dir)
        if info and info.get("pid") == proc.pid and _ready(info):
            return info
        if info and info.get("pid") != proc.pid:  # another daemon serves this state dir: ours waits for its lock
            proc.terminate()
            raise AlreadyRunning(info)
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)
    proc.terminate()
    raise StartFailed(f"the local cloud did not become ready within {READY_TIMEOUT_S:.0f} s (log: {log})")


def stop(state_dir: Path) -> dict:
    """Stop the daemon (SIGTERM, then SIGKILL after STOP_TIMEOUT_S); returns its last info. NotRunning if none."""
    info = status(state_dir)
    if info is None:
        raise NotRunning(f"no local cloud is running for {Path(state_dir).resolve()}")
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    _info_path(state_dir).unlink(missing_ok=True)
    return info


def ensure_running(state_dir: Path, speed: float = 20.0, *, idle_stop_s: float = DEFAULT_IDLE_STOP_S) -> dict:
    """The running daemon's info, starting one if none runs (a concurrent start is tolerated)."""
    info = status(state_dir)
    if info:
        return info
    try:
        return start(state_dir, speed, idle_stop_s=idle_stop_s)
    except AlreadyRunning as exc:
        return exc.info


def env_lines(info: dict) -> list[str]:
    """Shell lines that point tpuctl and the official clients at the daemon."""
    return [f"export TPUCTL_API_ENDPOINT={info['endpoint']}", f"export STORAGE_EMULATOR_HOST={info['storage_host']}"]
