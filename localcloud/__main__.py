"""`python -m tpuctl.localcloud serve --state-dir D --speed X [--port P] [--idle-stop S]`: run the local cloud
in the foreground until SIGTERM/SIGINT, or until it has been idle for S seconds (no request to any API, no
TPU node or VM billed, no operation under way; 0 = never). When ready it writes `D/localcloud.json` (pid,
endpoint, storage_host, speed, started, idle_stop_s); it removes that file on a clean exit. Exit 2 on bad
arguments or a busy port."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .cloud import LocalCloud
from .daemon import INFO_FILE

IDLE_GRACE_S = 2.0
LOCK_WAIT_S = 10.0
TRIM_EVERY_S = 2.0
# Bodies at least this large get their own mapping, returned to the OS when freed (mallopt(3), M_MMAP_THRESHOLD).
MMAP_THRESHOLD = 256 << 10
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
try:  # glibc only; elsewhere the allocator's own policy stands
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim, _LIBC.mallopt
except (OSError, AttributeError):
    _LIBC = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpuctl.localcloud")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the local cloud in the foreground")
    serve.add_argument("--state-dir", required=True, type=Path)
    serve.add_argument("--speed", type=float, default=20.0)
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--no-strict", action="store_true", help="do not validate bodies against the discovery documents")
    serve.add_argument("--worker-python", choices=["runtime", "host"], default=None,
                       help="TPU workers run jobs on their runtime image's software (default) or this interpreter")
    serve.add_argument("--runtime-cache", type=Path, default=None,
                       help="where runtime image venvs are built (default: $TPUCTL_RUNTIME_CACHE or STATE_DIR/runtimes)")
    serve.add_argument("--idle-stop", type=float, default=0.0, metavar="SECONDS",
                       help="exit after this long without requests or billed resources (0: never)")
    args = parser.parse_args(argv)
    if args.speed <= 0:
        parser.error("--speed must be > 0")
    if args.idle_stop < 0:
        parser.error("--idle-stop must be >= 0")

    _fix_mmap_threshold()
    state_dir = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_state_dir(state_dir)
    if lock is None:
        print(f"localcloud: another local cloud serves {state_dir}: stop it first", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cloud = LocalCloud(speed=args.speed, strict=not args.no_strict, state_dir=state_dir, port=args.port,
                       worker_python=args.worker_python, runtime_cache=args.runtime_cache)
    try:
        cloud.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"localcloud: port {args.port} is busy: choose another with --port or stop what uses it", file=sys.stderr)
            return 2
        raise
    info_path = state_dir / INFO_FILE
    try:
        info = {"pid": os.getpid(), "endpoint": cloud.endpoint, "storage_host": cloud.storage_host,
                "speed": args.speed, "started": time.time(), "state_dir": str(state_dir),
                "idle_stop_s": args.idle_stop, "worker_python": cloud.python.mode}
        _publish(info_path, info)
        print(f"localcloud ready at {cloud.endpoint} (storage {cloud.storage_host}, speed {args.speed:g}x)", flush=True)
        _serve_until_idle(cloud, stop, args.idle_stop, info_path, info, lambda: _holds(lock, state_dir))
    finally:
        cloud.stop()
        _withdraw(info_path, os.getpid())
    return 0


def _holds(lock, state_dir: Path) -> bool:
    """Whether `state_dir` is still the one this daemon locked: removed (say, `rm -rf ~/.tpuctl`) and perhaps
    recreated by another daemon, its lock file is another file or none."""
    try:
        here, ours = os.stat(state_dir / "localcloud.lock"), os.fstat(lock.fileno())
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)


def _withdraw(info_path: Path, pid: int) -> None:
    """Remove the info file if it is this daemon's: another daemon's must stay, or tpuctl could not find it."""
    try:
        if json.loads(info_path.read_text()).get("pid") != pid:
            return
    except (OSError, ValueError):
        return
    info_path.unlink(missing_ok=True)


def _lock_state_dir(state_dir: Path):
    """An exclusive lock on the state dir, held until this process exits; None if another daemon keeps it
    past LOCK_WAIT_S. Waiting covers a daemon that is still shutting down after its idle stop (its info file
    already withdrawn): the next one loads the state only once the last one has written it."""
    lock = open(state_dir / "localcloud.lock", "a")
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                return None
            time.sleep(0.1)


def _fix_mmap_threshold() -> None:
    """Keep request bodies out of the heap. glibc raises its mmap threshold to the size of each mmapped block freed
    (up to 32 MiB on 64-bit), so after the first checkpoint upload every later one is carved from a thread's arena
    instead, and arenas x bodies stay resident however often the heap is trimmed: the daemon's RSS grew by tens of
    MB per few runs (bench/localcloud_soak.py). Setting the threshold turns that dynamic adjustment off (mallopt(3):
    "Setting this parameter disables dynamic adjustment")."""
    if _LIBC is not None:
        _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _trim() -> None:
    """Hand freed heap pages back to the OS. Request threads come and go, each may get its own malloc arena,
    and an arena keeps the high-water mark of the bodies its threads buffered (uploads below 8 MiB arrive as
    one multipart body): without this the daemon's RSS climbs to arenas x largest body and stays there."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _publish(info_path: Path, info: dict) -> None:
    tmp = info_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, info_path)


def _serve_until_idle(cloud: LocalCloud, stop: threading.Event, idle_stop_s: float, info_path: Path,
                      info: dict, holds_state_dir) -> None:
    """Block until `stop` is set or, with `idle_stop_s`, until the cloud has been idle that long (checked every
    TRIM_EVERY_S, or a tenth of a shorter period), trimming the heap meanwhile. Before going it withdraws its
    info file and keeps serving for IDLE_GRACE_S: a command that read the file just before still gets its
    answers (and keeps it running). An info file removed meanwhile is written again (tpuctl finds the daemon by
    it); a state dir removed or replaced (`holds_state_dir()` false) stops the daemon at once, writing nothing
    there: its files are gone, or another daemon's."""
    while not stop.wait(min(TRIM_EVERY_S, max(0.05, idle_stop_s / 10)) if idle_stop_s else TRIM_EVERY_S):
        _trim()
        if not holds_state_dir():
            cloud.disown_state_dir()
            print("localcloud: its state dir was removed or replaced: stopping", flush=True)
            return
        if not info_path.exists():
            with contextlib.suppress(OSError):
                _publish(info_path, info)
        idle = cloud.idle_s()
        if not idle_stop_s or idle < idle_stop_s:
            continue
        _withdraw(info_path, info["pid"])
        if stop.wait(IDLE_GRACE_S) or cloud.idle_s() >= idle + IDLE_GRACE_S * 0.9:
            print(f"localcloud: idle for {idle:.0f} s (no requests, nothing billed): stopping", flush=True)
            return
        _publish(info_path, info)  # a request came in meanwhile: still in use


if __name__ == "__main__":
    sys.exit(main())
