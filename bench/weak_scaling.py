"""Weak scaling of gpt2-small (seq 1024) over 1, 2 and 4 slices of v5p-8: `tpuctl fit --slices N`'s estimate.

`python bench/weak_scaling.py [--compile]`: every slice runs the preset's per-chip batch; the step adds the
gradients' all-reduce across the slices over DCN at Google's published bandwidth (tpuctl/fitting.py,
dcn_seconds). Prints step time (and its DCN part), tokens/s and the scaling efficiency (tokens/s over N times one
slice's). Analytic by default; `--compile` compiles one slice's step with the TPU compiler (libtpu), which the
N-slice figures share (the DCN all-reduce is not in one slice's program either way).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

SPEC = "name: ws\nzone: us-east5-a\naccelerator: v5p-8\njob: {template: gpt2, preset: gpt2-small, framework: jax}\n"
SLICES = (1, 2, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile one slice's step instead of estimating")
    a = ap.parse_args(argv)
    if not a.compile:
        sys.modules["libtpu"] = None  # tpuctl.fitting then answers with its analytic estimate
    import tpuctl
    from tpuctl import spec as spec_mod

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ws.yaml"
        path.write_text(SPEC)
        fits = [tpuctl.fit(spec_mod.from_mapping({**spec_mod.read_file(path), "slices": n}), spec_dir=Path(tmp))
                for n in SLICES]
    one = fits[0]
    for r in fits:
        print(f"gpt2-small {r.slices} x v5p-8 ({r.slices * r.chips} chips, global batch {r.global_batch} x "
              f"{r.seq_len}): est. step {r.est_step_s * 1e3:.1f} ms (DCN all-reduce {r.dcn_s * 1e3:.1f} ms), "
              f"{r.est_tokens_per_s:,.0f} tokens/s, MFU {r.est_mfu:.0%}, scaling efficiency "
              f"{r.est_tokens_per_s / (r.slices * one.est_tokens_per_s):.0%}, ${r.price_per_hour:,.2f}/h", flush=True)
    how = one.method if a.compile else "analytic (not compiled: the default; --compile asks libtpu)"
    print(f"method: {how}; {one.params:,} weights, "
          f"per-chip batch {one.per_chip_batch}, {one.precision}; DCN {tpuctl.fitting.CHIPS['v5p'].dcn_bytes_per_s * 8 / 1e9:.0f} "
          "Gbps a chip (cloud.google.com/tpu/docs/v5p), not overlapped with compute: estimates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
