"""Which framework a job trains with on a TPU type, and the TPU VM runtime (software image) that brings it.

Google's truth, not ours:
- TensorFlow runs on the `tpu-vm-tf-*` runtimes, which Google publishes up to TensorFlow 2.18 and for v2-v5p
  only; from v6e on there is no TensorFlow support (cloud.google.com/tpu/docs/runtimes,
  cloud.google.com/tpu/docs/v6e). `runtime_version: tpu-vm-tf-*` therefore means TensorFlow.
- JAX runs on each generation's base image, into which `jax[tpu]` is pip-installed
  (cloud.google.com/tpu/docs/run-calculation-jax; cloud.google.com/tpu/docs/runtimes "JAX and PyTorch"):
  `tpu-ubuntu2204-base` for v2-v4, `v2-alpha-tpuv5-lite` for v5e, `v2-alpha-tpuv5` for v5p,
  `v2-alpha-tpuv6e` for v6e.
`auto` picks TensorFlow where Google supports it and the template offers it, JAX elsewhere. A combination that
cannot work is a BadInput (exit 2) naming what would. Pure: no API call.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuctl.catalog import AcceleratorType
from tpuctl.errors import BadInput

FRAMEWORKS = ("auto", "tensorflow", "jax")
JAX_RUNTIMES = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
                "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}


@dataclass(frozen=True)
class Choice:
    framework: str  # "tensorflow" | "jax"
    runtime_version: str


def is_tensorflow_runtime(runtime: str) -> bool:
    return runtime.startswith("tpu-vm-tf-")


def tensorflow_supported(t: AcceleratorType) -> bool:
    return t.tensorflow and any(is_tensorflow_runtime(r) for r in t.runtimes)  # the catalog: none from v6e on


def jax_runtime(t: AcceleratorType) -> str | None:
    if t.boots_os_image:  # jax[tpu] is pip-installed on it, as on the TPU API's base images
        return t.default_runtime
    runtime = JAX_RUNTIMES.get(t.generation)
    return runtime if runtime in t.runtimes else None


def choose(requested: str, t: AcceleratorType, runtime_version: str | None,
           offered: tuple[str, ...] = ("tensorflow", "jax")) -> Choice:
    """The framework and runtime for `requested` ("auto" | "tensorflow" | "jax") on `t`, where the template
    offers `offered`. An explicit `runtime_version` is kept and decides the framework under auto.
    Raises BadInput naming the field the user gave: `runtime_version` when the runtime decided (or contradicts)
    the framework, else `job.framework`; the message names what would work instead."""
    if tuple(offered) == ("tensorflow",):
        # A TensorFlow-only template: nothing to choose; Catalog.check refuses a type or runtime without TF.
        return Choice("tensorflow", runtime_version or t.default_runtime)
    # Each framework's runtime on this type for this template; None where it cannot run.
    runtimes = {"tensorflow": t.default_runtime if tensorflow_supported(t) and "tensorflow" in offered else None,
                "jax": jax_runtime(t) if "jax" in offered else None}
    by_runtime = runtime_version is not None and requested == "auto"
    if by_runtime:
        framework = "tensorflow" if is_tensorflow_runtime(runtime_version) else "jax"
    elif requested == "auto":
        framework = "tensorflow" if runtimes["tensorflow"] else "jax"
    else:
        framework = requested
    if runtimes[framework] is None:
        why = _why_not(framework, t, offered)
        if by_runtime:  # the user named a runtime, not a framework: the runtime is what to change
            others = [f"runtime {rt} ({_TITLE[fw]})" for fw, rt in runtimes.items() if rt]
            raise BadInput(f"runtime {runtime_version} is {_kind(runtime_version)}, and {why}; use "
                           f"{' or '.join(others) or 'another accelerator type'}", field="runtime_version")
        others = [f"framework: {fw} (runtime {rt})" for fw, rt in runtimes.items() if rt]
        raise BadInput(f"{why}; use {'; '.join(others) or 'another accelerator type'}", field="job.framework")
    if runtime_version is None:
        return Choice(framework, runtimes[framework])
    if is_tensorflow_runtime(runtime_version) != (framework == "tensorflow"):
        # Both were given and disagree: either keeps working if the other one changes.
        fixes = [f"runtime {runtimes[framework]} for {_TITLE[framework]}"]
        other = "jax" if framework == "tensorflow" else "tensorflow"
        if runtimes[other]:
            fixes.append(f"framework: {other} to keep {runtime_version}")
        raise BadInput(f"runtime {runtime_version} is {_kind(runtime_version)}, and framework is {framework}; use "
                       f"{', or '.join(fixes)}", field="runtime_version")
    return Choice(framework, runtime_version)


def for_sharding(requested: str, sharding: str) -> str:
    """The framework to `choose` from under `job.sharding`: zero1 and fsdp split the training state with Keras'
    distribution API (the templates' runtime.sharding), which runs on JAX only, so they make auto JAX and refuse
    TensorFlow (BadInput naming job.sharding); auto (a split only where data does not fit, tpuctl.fitting) and
    data take any."""
    if sharding not in SPLIT:
        return requested
    if requested == "tensorflow":
        raise BadInput(f"{sharding} {SPLIT[sharding]} with Keras' distribution API, which runs on JAX, and "
                       "job.framework is tensorflow", field="job.sharding",
                       hint="set job.framework: jax (or auto), or job.sharding: data")
    return "jax"


def for_run(requested: str, sharding: str, slices: int, t: AcceleratorType, runtime_version: str | None,
            offered: tuple[str, ...]) -> Choice:
    """`choose` for a job under `sharding` (for_sharding) on `slices` slices: a multislice runs JAX
    (Queued.check_slices), so auto picks it there. What a run's plan and its fit check train with."""
    asked = for_sharding(requested, sharding)
    if slices > 1 and asked == "auto":
        offered = tuple(f for f in offered if f != "tensorflow") or offered
    return choose(asked, t, runtime_version, offered)


SPLIT = {"zero1": "splits the optimizer state", "fsdp": "splits the weights"}  # job.sharding: what each splits


_TITLE = {"tensorflow": "TensorFlow", "jax": "JAX"}


def _kind(runtime: str) -> str:
    return "a TensorFlow image" if is_tensorflow_runtime(runtime) else "an image without TensorFlow"


def _why_not(framework: str, t: AcceleratorType, offered: tuple[str, ...]) -> str:
    if framework not in offered:
        return f"the template does not offer {_TITLE[framework]}"
    if framework == "tensorflow":
        return f"TensorFlow does not run on {t.generation} (Google ships TensorFlow runtimes for v2-v5p only)"
    return f"no JAX base image for {t.generation} in the catalog"
