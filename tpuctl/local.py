"""The embedded local cloud from Python (`tpuctl.local.start()` / `stop()`), as `tpuctl local start|stop`.

The API (`tpuctl.up`, `tpuctl.run`, ...) starts it by itself when no Google project or credentials are set;
`start` is for choosing its speed or the workers' interpreter first, `stop` for ending it (its state stays).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuctl import config, paths
from tpuctl.errors import LocalCloudError


@dataclass(frozen=True)
class LocalCloud:
    endpoint: str  # the emulated Google APIs (TPU, Compute Engine, IAM, ...)
    storage_host: str  # the Cloud Storage emulator (STORAGE_EMULATOR_HOST)
    pid: int


def _of(info: dict) -> LocalCloud:
    return LocalCloud(endpoint=info["endpoint"], storage_host=info["storage_host"], pid=int(info["pid"]))


def start(*, speed: float = 20.0, worker_python: str | None = None, idle_stop: str | None = None) -> LocalCloud:
    """The running local cloud, started in the background if none runs (then blocks until it serves).
    Idempotent: a running one is returned as it is, whatever `speed` says. `worker_python`: "runtime"
    (default) or "host" (this interpreter: fast, no per-image venv). Raises LocalCloudError."""
    from tpuctl.localcloud import daemon

    state_dir = paths.localcloud_dir()
    try:
        running = daemon.status(state_dir)
        return _of(running or daemon.start(state_dir, speed, idle_stop_s=config.local_idle_stop_s(idle_stop),
                                           worker_python=worker_python))
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc), hint="") from None


def stop() -> LocalCloud | None:
    """Stop the local cloud (blocks until it exited); None when none was running. Idempotent."""
    from tpuctl.localcloud import daemon

    try:
        return _of(daemon.stop(paths.localcloud_dir()))
    except daemon.NotRunning:
        return None
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc), hint="") from None
