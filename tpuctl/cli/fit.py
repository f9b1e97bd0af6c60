"""`tpuctl fit`: will the run fit the TPU's memory, how fast, for how much; creates nothing."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from tpuctl import api, console
from tpuctl import fitting as fit_mod
from tpuctl.cli.spec_flags import SpecFlags, spec_options

SECTION = "Run a training job"


SHARDING_SAYS = {  # Fit.sharding -> its row
    "data": "data: every device holds all the weights",
    "zero1": "zero1: every device holds all the weights, the optimizer state is split over the devices",
    "fsdp": "fsdp: weights, gradients and optimizer state split over the devices",
}


def _rows(r: fit_mod.Fit) -> list[tuple[str, str]]:
    how = f"compiled by libtpu {r.libtpu}" if r.method == "compiled" else f"analytic estimate ({r.not_compiled})"
    compiled = f"{r.compiled_flops_per_step / 1e9:,.1f} GFLOP" if r.compiled_flops_per_step is not None else "-"
    return [
        ("slice", f"{r.accelerator} ({r.chips} chip{'s' if r.chips != 1 else ''}, topology {r.topology}); {how}"),
        ("fits", f"{'yes' if r.fits else 'NO'}: {r.hbm_per_chip_bytes / 1e9:.2f} of "
                 f"{r.hbm_capacity_bytes / 1e9:.2f} GB HBM per chip"),
        ("framework", "JAX" if r.framework == "jax" else
         "TensorFlow: its Keras model's XLA program, compiled through JAX (TensorFlow compiles for a TPU only on "
         "one), without the JAX step's Pallas kernels and remat"),
        ("sharding", SHARDING_SAYS[r.sharding]),
        ("batch", f"{r.per_chip_batch} per chip, {r.global_batch} global, seq {r.seq_len}, {r.precision}"),
        ("largest per-chip batch", f"{r.max_per_chip_batch} ({r.max_batch_is})"),
        ("remat policy", r.remat_policy + (" (chosen: the batch does not fit without it; set trainer.remat_policy)"
                                           if r.remat_chosen else "")),
        ("model FLOPs / step / chip", f"{r.model_flops_per_step / 1e9:,.1f} GFLOP (6·N·tokens + attention, "
                                      f"N = {r.flop_params:,}" + (f" of the {r.params:,} weights: the ones a matmul "
                                      "applies per token" if r.flop_params != r.params else "") + ")"),
        ("compiled FLOPs / step / chip", compiled),
        ("bytes accessed / step / chip", f"{r.bytes_accessed_per_step / 1e9:,.2f} GB"),
        ("compiler's cycles / step", "-" if r.compiler_cycles_per_step is None else
         f"{r.compiler_cycles_per_step / 1e6:,.2f} M (the compiler's own estimate, Pallas kernels uncounted; "
         "compare programs on one chip by it too: the roofline can rank them the other way)"),
        *([("slices", f"{r.slices} x {r.accelerator}, data parallel across them over DCN (weak scaling: each runs "
                      f"the per-chip batch); step, tokens/s and cost are for all {r.slices}")] if r.slices > 1 else []),
        ("est. step time", f"{r.est_step_s * 1e3:,.2f} ms (roofline"
                           + (f", of which {r.dcn_s * 1e3:,.2f} ms the gradient all-reduce over DCN, an estimate from "
                              "Google's published DCN bandwidth)" if r.slices > 1 else ")")),
        ("est. MFU", f"{r.est_mfu:.0%}"),
        ("est. tokens/s", f"{r.est_tokens_per_s:,.0f}"),
        ("est. run", f"{fit_mod.duration_text(r.est_run_s)} for {r.max_steps:,} steps, "
                     f"${r.est_cost_usd:,.2f} at ${r.price_per_hour:,.2f}/h"),
    ]


@click.command("fit")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
@spec_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def fit_command(spec_file, spec_flags: SpecFlags, as_json) -> None:
    """Compile the job's training step for the TPU (per-chip HBM, largest batch, est. step time and cost)."""
    from tpuctl.cli.provision import resolve_spec

    spec, _ = resolve_spec(spec_file, spec_flags)
    r = api.fit(spec, spec_dir=Path(spec_file).resolve().parent, on_event=console.report)  # on stderr
    if r is None:
        console.info("fit: the template's config has no transformer shape to estimate from, and no step to "
                     f"compile (template.json `fit`); with one, install the compiler: {fit_mod.INSTALL_HINT}")
        return
    if as_json:
        console.emit_json(r.to_json())
        return
    console.table(("", ""), [(k, escape(v)) for k, v in _rows(r)], title=f"fit of {Path(spec_file).name} (estimates are estimates)")


fit_command.section = SECTION
commands = [fit_command]
