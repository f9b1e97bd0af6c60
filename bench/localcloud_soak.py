"""Local cloud daemon soak: resident memory over many up/down cycles against the real background daemon.

What a cycle does and the goal (flat after warm-up, below 200 MB): tests/daemon_soak.py, which test_localcloud_cli
also runs, short. This is its command line:

    .venv/bin/python bench/localcloud_soak.py [--cycles 300] [--uploads 4] [--upload-mb 6] [--every 25] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from daemon_soak import GROWTH_LIMIT_MB, RSS_LIMIT_MB, run  # noqa: E402 (tests/ on sys.path first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--uploads", type=int, default=4)
    ap.add_argument("--upload-mb", type=float, default=6.0)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run(args.cycles, args.uploads, args.upload_mb, args.every)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['cycles']} cycles (TPU create+delete, bucket with {r['uploads_per_cycle']} concurrent "
              f"{r['upload_mb']:g} MB uploads read back, bucket delete) in {r['seconds']:.0f} s")
        print("daemon RSS (MB) after cycle: " + ", ".join(f"{i}: {mb:.0f}" for i, mb in r["rss_mb"]))
        print(f"growth after warm-up: {r['growth_after_warmup_mb']:.1f} MB (goal < {GROWTH_LIMIT_MB:.0f}); "
              f"peak {r['peak_mb']:.0f} MB (goal < {RSS_LIMIT_MB:.0f})")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
