"""Compile a template's training step for a TPU slice that is not there: `python -m tpuctl.templates.aot`.

The compiling half of `tpuctl fit` (tpuctl/fitting.py), in a process of its own: Keras fixes its backend at import,
the TPU compiler (libtpu) prints its own diagnostics on stderr, and a gpt2-small compile takes minutes on a
laptop. Protocol, one JSON object per line:

    stdin:  {"root", "builtin", "config", "vocab_size", "topology", "topology_options"}, then {"batch": N} per
            compile (N: per-device batch; with "remat": P, under the template's remat policy P instead of the
            config's), then EOF
    stdout: {"model": {...}, "state_bytes": B} once the step is built (B: its state's bytes on each device: all
            of it replicated, 1/N of what runtime.sharding fsdp splits over N devices), then per compile {"batch": N,
            "memory": {...}, "cost": {"flops", "bytes", "undeclared_kernel_bytes", "estimated_cycles"}, "seconds": S},
            or {"batch": N, "oom": REQUIRED, "message": ...} when the compiler refuses a program over the chip's HBM
            (REQUIRED: the temporaries' bytes it names, or null), or {"error": "..."} and exit 1

Only lines starting with tpuctl.fitting.AOT_PREFIX are the protocol's (anything else on stdout is a library's).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

# The TPU compiler refuses a program over HBM with status RESOURCE_EXHAUSTED, naming what its temporaries need:
# "... the total memory required for HLO temporaries (23.68G) exceeds available HBM (15.75G)".
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"
REQUIRED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
# A Pallas kernel is one custom call to the compiler, whose cost analysis counts only what the kernel declares
# (pl.CostEstimate, in its backend config); JAX's splash attention declares nothing, so its HBM traffic would be
# missing from the bytes `fit` and bench/tpu_compile.py read. For such a call its operands read once and results
# written once are counted: a floor of its traffic. (Shapes in the optimized HLO: "%name = RESULT custom-call(...)
# ... custom_call_target="tpu_custom_call", operand_layout_constraints={OPERANDS}, ...".)
KERNEL_CALL = re.compile(r"= (.*?) custom-call\(.*custom_call_target=\"tpu_custom_call\", "
                         r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")  # shapes{layout}, ...
ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
# The compiler's own estimate of each instruction's time, in the optimized HLO's backend configs; INT64_MAX where
# it has none (tpu7x's gather offloaded to its SparseCores), and a Pallas kernel carries no estimate at all.
ESTIMATED_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
NO_ESTIMATE = 2**63 - 1
MEMORY = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")


def _say(obj: dict) -> None:
    from tpuctl.fitting import AOT_PREFIX

    sys.stdout.write(AOT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _required(message: str) -> int | None:
    found = REQUIRED.search(message)
    if found is None:
        return None
    return int(float(found.group(1)) * 1024 ** "_KMGT".index(found.group(2) or "_"))


def compile_point(target: dict, batch: int, remat: str | None = None) -> dict:
    """Compile `target`'s (a template's `fit` answer) step at per-device `batch` (under remat policy `remat`
    if given, through the target's `step_for`): measured()'s answer for it."""

    def compile_step():
        # step_for sets the policy on the model it shares with `step`: after another policy's compile, `step`
        # would trace under that one, so each compile names its own (the config's unless `remat`).
        step = target["step_for"](remat or target["remat_policy"]) if "step_for" in target else target["step"]
        return step.lower(target["state"], target["batch"](batch)).compile()

    return measured(compile_step, batch)


def measured(compile_step, batch: int) -> dict:
    """The protocol's answer for the program `compile_step()` compiles (at per-device `batch`): {"batch",
    "memory", "cost", "seconds"}, or {"batch", "oom", "message", "seconds"} when the compiler refuses it over HBM.
    Raises whatever else the compile raises. bench/tpu_compile.py measures MaxText's step with it too."""
    started = time.monotonic()
    try:
        compiled = compile_step()
    except Exception as exc:  # jax's JaxRuntimeError; its status code leads its message
        if not str(exc).startswith(OUT_OF_MEMORY):
            raise
        return {"batch": batch, "oom": _required(str(exc)), "message": str(exc).splitlines()[0][:300],
                "seconds": round(time.monotonic() - started, 1)}
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list per device in older jax
    hlo = compiled.as_text()
    kernels = undeclared_kernel_bytes(hlo)
    return {"batch": batch, "memory": {k: int(getattr(memory, k)) for k in MEMORY},
            "cost": {"flops": float(cost.get("flops", 0.0)),
                     "bytes": float(cost.get("bytes accessed", 0.0)) + kernels, "undeclared_kernel_bytes": kernels,
                     "estimated_cycles": estimated_cycles(hlo)},
            "seconds": round(time.monotonic() - started, 1)}


def undeclared_kernel_bytes(hlo: str) -> int:
    """The bytes of the operands and results of the Pallas kernels in optimized HLO text `hlo` that declare no
    cost (KERNEL_CALL): what the compiler's cost analysis leaves out of "bytes accessed", at least."""
    total = 0
    for line in hlo.splitlines():
        found = KERNEL_CALL.search(line)
        if found is None or '"cost_estimate"' in line:
            continue
        for dtype, dims in ARRAY.findall(found.group(1) + " " + found.group(2)):
            size = 1 if dtype == "pred" else max(1, int(dtype.lstrip("subf")) // 8)
            total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def estimated_cycles(hlo: str) -> int:
    """The compiler's cycle estimates of the instructions in optimized HLO text `hlo`, summed: its own view of
    a device's step time, beside the roofline's bytes / HBM bandwidth (bench/tpu_compile.py compares two
    programs' sums on one chip, where the clock cancels out). Pallas kernels count 0: they carry no estimate."""
    return sum(c for c in map(int, ESTIMATED_CYCLES.findall(hlo)) if c != NO_ESTIMATE)


def compile_only() -> None:
    """This process's environment for compiling for a TPU that is not here; before Keras or JAX is imported."""
    os.environ["KERAS_BACKEND"] = "jax"
    # The host runs the model's construction; the TPU is only a compile target (libtpu's topology API).
    os.environ["JAX_PLATFORMS"] = "cpu"
    # libtpu takes /tmp/libtpu_lockfile so two processes cannot drive one TPU's chips: a compile-only client
    # drives none, and without this a second compile on the machine (another user's, another test's) aborts.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def use_the_workers_compiler_flags(template) -> None:
    """The compiler flags `template`'s workers give libtpu, before libtpu loads here: where it trains with lmkit
    (template.json `uses` it), lmkit's, which its resolve_jax adds to LIBTPU_INIT_ARGS; none of ours otherwise."""
    if any(package.name == "lmkit" for package in template.uses):
        from .lmkit import strategy

        strategy.use_libtpu_flags()


def main() -> int:
    compile_only()
    request = json.loads(sys.stdin.readline())
    from pathlib import Path

    from tpuctl.templates import contract

    template = contract.load(Path(request["root"]), builtin=request["builtin"])
    use_the_workers_compiler_flags(template)
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=request["topology"], platform="tpu",
                                           **request.get("topology_options", {})).devices
    target = template.fit_target(request["config"], devices=devices, vocab_size=request["vocab_size"])
    state_bytes = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                      for group in target["state"] for leaf in group)
    model = {k: target[k] for k in ("per_device_batch", "max_steps", "params", "layers", "hidden", "seq_len",
                                    "precision")}
    # A template without remat offers none to try (`fit` then reports the config's as "none").
    model.update({k: target[k] for k in ("remat_policy", "remat_policies", "flop_params") if k in target})
    _say({"model": model, "state_bytes": int(state_bytes)})
    for line in sys.stdin:
        request = json.loads(line)
        _say(compile_point(target, request["batch"], request.get("remat")))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # the parent turns it into one line; the traceback stays on stderr for --verbose
        import traceback

        traceback.print_exc()
        _say({"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
