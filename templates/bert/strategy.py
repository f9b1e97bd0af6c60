"""Strategy resolution: the one place that decides which devices train.

Order (first match wins):
1. `runtime.replicas = N > 0`: CPU rehearsal of an N-core TPU. The CPU is split into N logical devices
   *before anything probes for accelerators* (once TF's runtime is initialised the split raises), and
   MirroredStrategy all-reduces through one device (the collective all-reduce fails with
   steps_per_execution > 1 on logical CPUs).
2. `runtime.tpu` set: "local" (this TPU VM's chips), a TPU node name, or `grpc://host:8470`.
3. From the environment: `COLAB_TPU_ADDR` (Colab), a `grpc://` `TPU_NAME` (Kaggle-style), or TPU device
   files on this host (`/dev/accel*`, `/dev/vfio/*`: a TPU VM): "local" on a one-host slice; on a multi-host
   pod slice (`TPU_WORKER_HOSTNAMES` lists several hosts) the resolver gets `TPU_NAME`. Env names without
   device files (an emulated TPU VM) fall through.
4. GPUs: MirroredStrategy over all of them.
5. The CPU: TF's default strategy.

Pod slices: TensorFlow drives every host of a slice from one client process (worker 0, with
`TPU_LOAD_LIBRARY=0` so it does not claim its own chips directly); the TPU runtime on the other hosts
serves it, and tf.data runs one input pipeline per host there. The same command is started on every
worker, so `is_follower()` tells workers 1..N-1 that they have nothing to run. `set_tpu_environment`
has the TF load-time variables for both cases.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from .config import RuntimeConfig
from .errors import AcceleratorError

PJRT_LIBTPU = "/lib/libtpu.so"


@dataclass(frozen=True)
class Resolved:
    strategy: Any  # tf.distribute.Strategy
    kind: str  # "tpu" | "gpu" | "cpu"
    replicas: int  # replicas in sync: global batch = per-replica batch x this
    hosts: int  # input pipelines (one per worker host)


def is_follower() -> bool:
    """True on workers 1..N-1 of a multi-host TPU VM slice, where worker 0's client does all the work."""
    return _tpu_vm() and len(_hosts()) > 1 and os.environ.get("TPU_WORKER_ID", "0") != "0"


def resolve(runtime: RuntimeConfig) -> Resolved:
    """Pick and initialise the strategy. Blocks while a TPU system initialises. Raises AcceleratorError."""
    tpu = "" if runtime.replicas else runtime.tpu or _tpu_from_env()
    if tpu:
        set_tpu_environment(tpu)
    import tensorflow as tf

    if runtime.replicas:
        return _cpu_replicas(tf, runtime.replicas)
    if tpu:
        return _tpu(tf, tpu)
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        strategy = tf.distribute.MirroredStrategy([d.name for d in gpus])
        return Resolved(strategy, "gpu", strategy.num_replicas_in_sync, 1)
    return Resolved(tf.distribute.get_strategy(), "cpu", 1, 1)


def set_tpu_environment(tpu: str) -> None:
    """The variables TF reads when it loads, as Google's TF-on-TPU-VM recipes set them; ones already set win.

    Pod client (a node name on a TPU VM): TPU_LOAD_LIBRARY=0, the chips are reached through each host's
    TPU runtime. One host on a PJRT runtime (`tpu-vm-tf-*-pjrt`, all v5e/v5p/v6e; they ship
    /lib/libtpu.so): the TPU is a pluggable device loaded from that library.
    """
    if not _tpu_vm() or tpu.startswith("grpc://"):
        return
    if tpu != "local":
        os.environ.setdefault("TPU_LOAD_LIBRARY", "0")
    elif os.path.exists(PJRT_LIBTPU):
        os.environ.setdefault("NEXT_PLUGGABLE_DEVICE_USE_C_API", "true")
        os.environ.setdefault("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", PJRT_LIBTPU)


def _tpu_from_env() -> str:
    if os.environ.get("COLAB_TPU_ADDR"):
        return f"grpc://{os.environ['COLAB_TPU_ADDR']}"
    name = os.environ.get("TPU_NAME", "")
    if name.startswith("grpc://"):
        return name
    if _tpu_vm():
        return name if len(_hosts()) > 1 and name else "local"
    return ""


def _tpu_vm() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _hosts() -> list[str]:
    return [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]


def _tpu(tf, tpu: str) -> Resolved:
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        strategy = tf.distribute.TPUStrategy(resolver)
    except (ValueError, IndexError, tf.errors.OpError) as exc:
        raise AcceleratorError(f"runtime.tpu: cannot initialise TPU {tpu!r}: {exc}") from exc
    return Resolved(strategy, "tpu", strategy.num_replicas_in_sync, strategy.extended.num_hosts)


def _cpu_replicas(tf, n: int) -> Resolved:
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError as exc:
        raise AcceleratorError("runtime.replicas: TensorFlow was already initialised in this process; "
                               "the CPU split must happen first (run the trainer in a fresh process)") from exc
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:n]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    return Resolved(strategy, "cpu", n, 1)
