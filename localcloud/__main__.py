"""`python -m tpuctl.localcloud serve --state-dir D --speed X [--port P]`: run the local cloud in the
foreground until SIGTERM/SIGINT. When ready it writes `D/localcloud.json` (pid, endpoint, storage_host,
speed, started); it removes that file on a clean exit. Exit 2 on bad arguments or a busy port."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .cloud import LocalCloud
from .daemon import INFO_FILE


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
    args = parser.parse_args(argv)
    if args.speed <= 0:
        parser.error("--speed must be > 0")

    state_dir = args.state_dir.resolve()
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
                "worker_python": cloud.python.mode}
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, info_path)
        print(f"localcloud ready at {cloud.endpoint} (storage {cloud.storage_host}, speed {args.speed:g}x)", flush=True)
        stop.wait()
    finally:
        cloud.stop()
        info_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
