"""The embedded local cloud from Python (`tpuctl.local.start()` / `stop()`), as `tpuctl local start|stop`.

The API (`tpuctl.up`, `tpuctl.run`, ...) starts it by itself when no Google project is named;
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


DEFAULT_SPEED = 20.0


def start(*, speed: float | None = None, worker_python: str | None = None, idle_stop: str | None = None) -> LocalCloud:
    """The running local cloud, started in the background if none runs (then blocks until it serves).
    `speed`: operations run this many times faster than Google's (default 20); `worker_python`: "runtime"
    (default) or "host" (this interpreter: fast, no per-image venv); `idle_stop`: as `tpuctl local start
    --idle-stop`. Idempotent: a running one is returned when it has every setting given here; one running with
    other settings raises LocalCloudError naming them (as `tpuctl local start` refuses), never stands in for
    the one asked for: `stop()` it first. Raises LocalCloudError."""
    from tpuctl.localcloud import daemon

    state_dir = paths.localcloud_dir()
    idle_stop_s = None if idle_stop is None else config.local_idle_stop_s(idle_stop)
    try:
        running = daemon.status(state_dir)
        if running is None:
            return _of(daemon.start(state_dir, speed or DEFAULT_SPEED, worker_python=worker_python,
                                    idle_stop_s=config.local_idle_stop_s(idle_stop)))
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc), hint="") from None
    asked = {"speed": speed, "worker_python": worker_python, "idle_stop_s": idle_stop_s}
    differ = [f"{k}={running.get(k)!r}, not {v!r}" for k, v in asked.items() if v is not None and running.get(k) != v]
    if differ:
        raise LocalCloudError(f"a local cloud already runs at {running['endpoint']} with {'; '.join(differ)}",
                              hint="tpuctl.local.stop() it first (its state stays), then start it again")
    return _of(running)


def stop() -> LocalCloud | None:
    """Stop the local cloud (blocks until it exited); None when none was running. Idempotent."""
    from tpuctl.localcloud import daemon

    try:
        return _of(daemon.stop(paths.localcloud_dir()))
    except daemon.NotRunning:
        return None
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc), hint="") from None
