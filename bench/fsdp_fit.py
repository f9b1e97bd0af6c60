"""gpt2-xl (1.5B) on one host of v5e, v5p and v6e with `job.sharding` data, zero1 and fsdp: `tpuctl fit`'s answer for
each (fits or not, HBM per chip, est. step time, largest per-chip batch), and what `auto` picks.

`python bench/fsdp_fit.py [--compile]`: the analytic estimate by default (the TPU compiler on this 2-core machine
took 413 s for gpt2-tiny's step under load; gpt2-xl's 48 layers would take far over the 10 minutes a point may);
`--compile` asks the TPU compiler (libtpu) instead, cached under TPUCTL_HOME/fit.

`--extrapolate` measures with the compiler what this machine can: gpt2-xl's width (d_model 1600, 25 heads, seq
1024, vocab 50257, per-chip batch 8) cut to 2 and 4 layers, one compile each through `tpuctl fit`'s own path
(templates/aot.py), then HBM per chip and est. step time extrapolated linearly in the layer count to 48 (per-layer
cost = (4-layer - 2-layer) / 2), printed beside the analytic estimate of the full 48 layers with their ratio.
`--only v5p-8:data,...` limits the points (each compile takes minutes here; the cache keeps finished ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ACCELERATORS = {"v5litepod-8": "us-west4-a", "v5p-8": "us-east5-a", "v6e-8": "us-east5-b"}
XL_LAYERS = 48
CUT = (2, 4)  # the layer counts compiled: the difference / 2 is one layer's cost
EXTRAPOLATED = ("hbm_per_chip_bytes", "est_step_s", "compiled_flops_per_step", "bytes_accessed_per_step")


def _spec(tmp: str, accelerator: str, sharding: str, layers: int | None = None) -> Path:
    job = {"template": "gpt2", "preset": "gpt2-xl", "framework": "jax", "sharding": sharding}
    if layers is not None:
        job["config"] = {"task": {"num_layers": layers}}
    path = Path(tmp) / f"{accelerator}-{sharding}-{layers or XL_LAYERS}.json"
    path.write_text(json.dumps({"name": "xl", "zone": ACCELERATORS[accelerator], "accelerator": accelerator,
                                "job": job}))
    return path


def _analytic(tpuctl, path: Path):
    """`tpuctl fit`'s analytic estimate even where the compiler is installed (it is what fit answers without it)."""
    real = sys.modules.get("libtpu")
    sys.modules["libtpu"] = None  # `import libtpu` raises ImportError: fitting takes the analytic path
    try:
        return tpuctl.fit(path)
    finally:
        if real is None:
            del sys.modules["libtpu"]
        else:
            sys.modules["libtpu"] = real


def extrapolate(only: set[str] | None) -> int:
    """The compiled 2- and 4-layer points, the 48-layer extrapolation and the analytic figure, one line each."""
    import tpuctl

    print(f"gpt2-xl width compiled at {CUT[0]} and {CUT[1]} layers, extrapolated linearly to {XL_LAYERS} layers "
          "(per-layer = difference / 2); analytic = tpuctl fit's estimate of all 48 layers; ratio = extrapolated / "
          "analytic", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for accelerator in ACCELERATORS:
            for sharding in ("data", "fsdp"):
                if only is not None and f"{accelerator}:{sharding}" not in only:
                    continue
                started = time.monotonic()
                small, large = (tpuctl.fit(_spec(tmp, accelerator, sharding, n), max_compiles=1) for n in CUT)
                seconds = time.monotonic() - started
                if small.method != "compiled":
                    print(f"{accelerator} {sharding}: not compiled ({small.not_compiled})", flush=True)
                    return 1
                whole = _analytic(tpuctl, _spec(tmp, accelerator, sharding))
                at48 = {k: getattr(large, k) + (XL_LAYERS - CUT[1]) * (getattr(large, k) - getattr(small, k))
                        / (CUT[1] - CUT[0]) for k in EXTRAPOLATED}
                hbm, step = at48["hbm_per_chip_bytes"], at48["est_step_s"]
                refused = "" if small.fits and large.fits else " (a cut refused over HBM: its HBM is a floor)"
                if small.remat_chosen or large.remat_chosen:  # fit tried a remat policy: not the plain step's figures
                    refused += f" (remat {small.remat_policy}/{large.remat_policy} chosen: not comparable)"
                flops = (f"compiled FLOPs/step/chip {at48['compiled_flops_per_step'] / 1e12:.1f} T vs model FLOPs "
                         f"{whole.model_flops_per_step / 1e12:.1f} T (ratio "
                         f"{at48['compiled_flops_per_step'] / whole.model_flops_per_step:.2f})"
                         if small.compiled_flops_per_step and large.compiled_flops_per_step else "no compiled FLOPs")
                print(f"gpt2-xl {accelerator} {sharding}: HBM per chip {CUT[0]}L {small.hbm_per_chip_bytes / 1e9:.2f} "
                      f"GB, {CUT[1]}L {large.hbm_per_chip_bytes / 1e9:.2f} GB -> {XL_LAYERS}L extrapolated "
                      f"{hbm / 1e9:.1f} GB vs analytic {whole.hbm_per_chip_bytes / 1e9:.1f} GB (ratio "
                      f"{hbm / whole.hbm_per_chip_bytes:.2f}; {small.hbm_capacity_bytes / 1e9:.1f} GB on the chip: "
                      f"{'fits' if hbm <= small.hbm_capacity_bytes else 'does NOT fit'}); est. step "
                      f"{CUT[0]}L {small.est_step_s * 1e3:.1f} ms, {CUT[1]}L {large.est_step_s * 1e3:.1f} ms -> "
                      f"{step * 1e3:.0f} ms vs analytic {whole.est_step_s * 1e3:.0f} ms (ratio "
                      f"{step / whole.est_step_s:.2f}); {flops}; bytes accessed/step/chip "
                      f"{at48['bytes_accessed_per_step'] / 1e9:.0f} GB vs analytic "
                      f"{whole.bytes_accessed_per_step / 1e9:.0f} GB{refused}; compiled "
                      f"{small.compiles + large.compiles} now (0: cached), {seconds:.0f} s", flush=True)
    print(f"compiler: jax {small.jax}, libtpu {small.libtpu}; per-chip batch {small.per_chip_batch}, seq "
          f"{small.seq_len}, {small.precision}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile with the TPU compiler instead of estimating")
    ap.add_argument("--extrapolate", action="store_true",
                    help=f"compile {CUT[0]} and {CUT[1]} layers of gpt2-xl's width, extrapolate to {XL_LAYERS}")
    ap.add_argument("--only", help="with --extrapolate: ACCELERATOR:SHARDING,... (default: all six)")
    a = ap.parse_args(argv)
    if a.extrapolate:
        return extrapolate(set(a.only.split(",")) if a.only else None)
    if not a.compile:
        sys.modules["libtpu"] = None  # tpuctl.fitting then answers with its analytic estimate
    import tpuctl

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for accelerator in ACCELERATORS:
            picked = {}
            for sharding in ("data", "zero1", "fsdp", "auto"):
                r = tpuctl.fit(_spec(tmp, accelerator, sharding))
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
