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
    if t.api == "compute":
        # Compute Engine TPUs (TPU7x) boot an accelerator OS image into which jax[tpu] is pip-installed, as on
        # the TPU API's base images (cloud.google.com/tpu/docs/tpu7x: JAX and PyTorch only).
        return t.default_runtime
    runtime = JAX_RUNTIMES.get(t.generation)
    return runtime if runtime in t.runtimes else None


def choose(requested: str, t: AcceleratorType, runtime_version: str | None,
           offered: tuple[str, ...] = ("tensorflow", "jax")) -> Choice:
    """The framework and runtime for `requested` ("auto" | "tensorflow" | "jax") on `t`, where the template
    offers `offered`. An explicit `runtime_version` is kept and decides the framework under auto.
    Raises BadInput (field job.framework or runtime_version) naming what would work."""
    if tuple(offered) == ("tensorflow",):
        # A TensorFlow-only template: nothing to choose; Catalog.check refuses a type or runtime without TF.
        return Choice("tensorflow", runtime_version or t.default_runtime)
    tf_ok = tensorflow_supported(t) and "tensorflow" in offered
    jax_rt = jax_runtime(t) if "jax" in offered else None
    alternatives = "; ".join(filter(None, [
        f"framework: tensorflow (runtime {t.default_runtime})" if tf_ok else "",
        f"framework: jax (runtime {jax_rt})" if jax_rt else ""])) or "another accelerator type"
    framework = requested
    if runtime_version is not None and requested == "auto":
        framework = "tensorflow" if is_tensorflow_runtime(runtime_version) else "jax"
    elif requested == "auto":
        framework = "tensorflow" if tf_ok else "jax"
    if framework == "tensorflow" and not tf_ok:
        why = (f"TensorFlow does not run on {t.generation} (Google ships TensorFlow runtimes for v2-v5p only)"
               if not tensorflow_supported(t) else "the template does not offer TensorFlow")
        raise BadInput(f"{why}; use {alternatives}", field="job.framework")
    if framework == "jax" and not jax_rt:
        why = (f"no JAX base image for {t.generation} in the catalog" if "jax" in offered
               else "the template does not offer JAX")
        raise BadInput(f"{why}; use {alternatives}", field="job.framework")
    if runtime_version is None:
        return Choice(framework, t.default_runtime if framework == "tensorflow" else jax_rt)
    if is_tensorflow_runtime(runtime_version) != (framework == "tensorflow"):
        kind = "a TensorFlow runtime" if is_tensorflow_runtime(runtime_version) else "not a TensorFlow runtime"
        raise BadInput(f"{runtime_version} is {kind}, framework is {framework}; use {alternatives}",
                       field="runtime_version")
    return Choice(framework, runtime_version)
