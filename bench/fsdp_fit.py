"""gpt2-xl (1.5B) on one host of v5e, v5p and v6e with `job.sharding` data and fsdp: `tpuctl fit`'s answer for each
(fits or not, HBM per chip, est. step time, largest per-chip batch), and what `auto` picks.

`python bench/fsdp_fit.py [--compile]`: the analytic estimate by default (the TPU compiler on this 2-core machine
took 413 s for gpt2-tiny's step under load; gpt2-xl's 48 layers would take far over the 10 minutes a point may);
`--compile` asks the TPU compiler (libtpu) instead, cached under TPUCTL_HOME/fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ACCELERATORS = {"v5litepod-8": "us-west4-a", "v5p-8": "us-east5-a", "v6e-8": "us-east5-b"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile with the TPU compiler instead of estimating")
    a = ap.parse_args(argv)
    if not a.compile:
        sys.modules["libtpu"] = None  # tpuctl.fitting then answers with its analytic estimate
    import tpuctl

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for accelerator, zone in ACCELERATORS.items():
            picked = {}
            for sharding in ("data", "fsdp", "auto"):
                spec = {"name": "xl", "zone": zone, "accelerator": accelerator,
                        "job": {"template": "gpt2", "preset": "gpt2-xl", "framework": "jax", "sharding": sharding}}
                path = Path(tmp) / f"{accelerator}-{sharding}.json"
                path.write_text(json.dumps(spec))
                r = tpuctl.fit(path)
                if sharding == "auto":
                    picked[accelerator] = r.sharding
                    continue
                rows.append(r)
                print(f"gpt2-xl {accelerator} {sharding}: fits {'yes' if r.fits else 'NO'}, "
                      f"{r.hbm_per_chip_bytes / 1e9:.1f} of {r.hbm_capacity_bytes / 1e9:.1f} GB HBM per chip at "
                      f"per-chip batch {r.per_chip_batch}, est. {r.est_step_s * 1e3:,.0f} ms/step "
                      f"(MFU {r.est_mfu:.0%}), largest per-chip batch {r.max_per_chip_batch} ({r.max_batch_is}); "
                      f"{r.method}", flush=True)
            print(f"gpt2-xl {accelerator} auto: {picked[accelerator]}", flush=True)
    how = rows[0].method if a.compile else ("analytic: not compiled, a gpt2-xl compile takes far over 10 min per "
                                            "point on this 2-core machine (gpt2-tiny's took 413 s under load)")
    print(f"method: {how}; {rows[0].params:,} weights, seq {rows[0].seq_len}, {rows[0].precision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
