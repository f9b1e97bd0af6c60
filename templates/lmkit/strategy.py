"""Strategy resolution: the one place that decides which devices train.

Order (first match wins):
1. `runtime.replicas = N > 0`: CPU rehearsal of an N-core TPU. The CPU is split into N logical devices
   *before anything probes for accelerators* (once TF's runtime is initialised the split raises), and
   MirroredStrategy all-reduces through one device (the collective all-reduce fails with
   steps_per_execution > 1 on logical CPUs).
2. `runtime.tpu` set: "local" (this TPU VM's chips), a TPU node name, or `grpc://host:8470`.
3. From the machine: `COLAB_TPU_ADDR` (Colab) or a `grpc://` `TPU_NAME` (Kaggle-style); else a Cloud TPU VM
   as its metadata server describes it (guest.py): "local" on a one-host slice, the node's name (tpu-env
   NODE_ID) on a multi-host slice; else TPU device files without metadata: "local".
4. GPUs: MirroredStrategy over all of them.
5. The CPU: TF's default strategy.

On a TPU VM the chips must be there (`/dev/accel*`, `/dev/vfio/N`) and so must libtpu (`find_libtpu`): if not,
resolve() raises AcceleratorError naming what it tried, never falls back to the CPU. The one exception is an
explicit request for a CPU rehearsal from whoever runs the VM: `LOCALCLOUD_TPU_REHEARSAL=cpu` (tpuctl's
local cloud sets it on its emulated TPU VMs, which have no chips).

Pod slices: TensorFlow drives every host of a slice from one client process (worker 0, with
`TPU_LOAD_LIBRARY=0` so it does not claim its own chips directly); the TPU runtime on the other hosts
serves it, and tf.data runs one input pipeline per host there. The same command is started on every
worker, so `follower()` tells workers 1..N-1 that they have nothing to run. `set_tpu_environment`
has the TF load-time variables for both cases.

JAX (`resolve_jax`, `runtime.framework = "jax"`): one process per worker host, every worker runs the job.
On a multi-host slice `jax.distributed.initialize` gets worker 0's IP from `worker-network-endpoints` (port
8482, JAX's own Cloud TPU default in `jax/_src/clusters/cloud_tpu_cluster.py` of the pinned jax 0.10.2), the
number of processes and this process's id (`agent-worker-number`) from the metadata server (guest.py), the
way JAX's own Cloud TPU detection reads them. Training is `keras.distribution.DataParallel` over every device of the slice; each
process feeds its local devices' share of the global batch. A CPU rehearsal (`runtime.replicas`, or
`LOCALCLOUD_TPU_REHEARSAL=cpu` on a chipless TPU VM) forces that host's device count on the CPU
(`--xla_force_host_platform_device_count`); its processes still meet through the coordinator and all-reduce
across processes (gloo), so a 2-host slice rehearses real cross-process collectives.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import guest
from .errors import AcceleratorError

PJRT_LIBTPU = "/lib/libtpu.so"
# Where the dynamic loader finds a bare "libtpu.so" on TPU VM images (TF's last resort is dlopen("libtpu.so")).
SYSTEM_LIBTPU = (PJRT_LIBTPU, "/usr/lib/libtpu.so")
CPU_REHEARSAL_VAR = "LOCALCLOUD_TPU_REHEARSAL"
JAX_COORDINATOR_PORT = 8482  # jax/_src/clusters/cloud_tpu_cluster.py: the coordinator on worker 0
DEVICE_PATTERNS = ("/dev/accel*", "/dev/vfio/[0-9]*")
# The TPU compiler's flags for the JAX programs of templates built on lmkit, on a TPU VM (resolve_jax) and compiled
# ahead of time (aot.py), so that `tpuctl fit` measures the program that runs. Where a matmul's operand or result
# is split over the devices (runtime.sharding zero1, fsdp), libtpu 0.0.42 may compute it as a windowed einsum: a
# loop of partial matmuls, one a device's shard, beside collective-permutes. On a tpu7x it chose them for
# bert-base at seq 512 and for gpt2-small, and they moved far more HBM bytes than an all-gather or a
# reduce-scatter beside one matmul: bert-512 under fsdp 31.1 against 20.6 GB a device a step (a loop's body is
# counted once, so more still), under zero1 30.9 against 23.8, with 12% and 31% more HBM; elsewhere the programs
# are the same either way (bench/RESULTS.md, tpu_compile). What they would buy is overlapping that traffic with
# the matmuls, which the roofline `fit` estimates by does not count for either form.
LIBTPU_FLAGS = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
                "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")


@dataclass(frozen=True)
class Resolved:
    strategy: Any  # tf.distribute.Strategy
    kind: str  # "tpu" | "gpu" | "cpu"
    replicas: int  # replicas in sync: global batch = per-replica batch x this
    hosts: int  # input pipelines (one per worker host)
    backend: str = "tensorflow"
    processes: int = 1  # programs that train together (TF: one client; JAX: one per host)
    process: int = 0  # this one's index: only process 0 writes checkpoints and summaries
    slices: int = 1  # JAX multislice: slices whose hosts train together over DCN


def follower() -> int | None:
    """This worker's index on workers 1..N-1 of a multi-host TPU VM slice, where worker 0's client does all
    the work; None anywhere else. From the metadata server alone."""
    vm = guest.tpu_vm()
    return vm.worker if vm is not None and len(vm.hosts) > 1 and vm.worker != 0 else None


def find_libtpu() -> tuple[str | None, list[str]]:
    """The libtpu.so this TPU VM would load, and every place looked, in TensorFlow's and JAX's order:
    `TPU_LIBRARY_PATH`, the pip `libtpu` package, then the system library the runtime images install."""
    tried = []
    candidates = []
    override = os.environ.get("TPU_LIBRARY_PATH")
    if override:
        candidates.append(("TPU_LIBRARY_PATH=", override))
    else:
        tried.append("TPU_LIBRARY_PATH (unset)")
    spec = importlib.util.find_spec("libtpu")
    if spec is not None and spec.origin:
        candidates.append(("pip libtpu: ", str(Path(spec.origin).parent / "libtpu.so")))
    else:
        tried.append("pip package libtpu (not installed)")
    candidates += [("", path) for path in SYSTEM_LIBTPU]
    for label, path in candidates:
        if os.path.isfile(path):
            return path, tried
        tried.append(f"{label}{path} (missing)")
    return None, tried


def resolve(runtime: Any) -> Resolved:
    """Pick and initialise the strategy. Blocks while a TPU system initialises. Raises AcceleratorError."""
    vm = None if runtime.replicas else guest.tpu_vm()
    tpu = "" if runtime.replicas else runtime.tpu or _tpu_from_env(vm)
    rehearse = False
    if tpu and not tpu.startswith("grpc://") and (vm is not None or _chips()):
        rehearse = _check_tpu_host(vm, tpu)
        if rehearse:
            tpu = ""
    import tensorflow as tf

    if runtime.replicas:
        return _cpu_replicas(tf, runtime.replicas)
    if tpu:
        return _tpu(tf, tpu)
    gpus = [] if rehearse else tf.config.list_logical_devices("GPU")
    if gpus:
        strategy = tf.distribute.MirroredStrategy([d.name for d in gpus])
        return Resolved(strategy, "gpu", strategy.num_replicas_in_sync, 1)
    return Resolved(tf.distribute.get_strategy(), "cpu", 1, 1)


def use_libtpu_flags() -> None:
    """Adds to LIBTPU_INIT_ARGS each of LIBTPU_FLAGS it does not name already (one set there wins). libtpu reads
    it once, when it loads: call before that (before anything imports jax). Idempotent."""
    current = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    named = {flag.split("=", 1)[0] for flag in current}
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(
        current + [flag for flag in LIBTPU_FLAGS if flag.split("=", 1)[0] not in named])


def resolve_jax(runtime: Any) -> Resolved:
    """Initialise JAX (multi-host: blocks until every process reached the coordinator) and return a
    DataParallel distribution over all devices. Call before anything imports jax. Raises AcceleratorError."""
    use_libtpu_flags()
    vm = None if runtime.replicas else guest.tpu_vm()
    devices = runtime.replicas
    if not devices and (vm is not None or _chips()):
        if _check_tpu_host(vm, "local", configure_tf=False):
            devices = _devices_per_host(vm) if vm is not None else 1
    if devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    import jax
    import keras

    cluster = jax_cluster(vm, rehearsal=bool(devices))
    if cluster is not None:
        try:
            jax.distributed.initialize(**cluster)
        except (RuntimeError, ValueError) as exc:
            raise AcceleratorError(f"runtime.framework: jax.distributed.initialize({cluster}) failed: {exc}") from exc
    platform = jax.devices()[0].platform
    slices = vm.slices if vm is not None else 1
    devices = hybrid_devices(jax, slices) if slices > 1 else jax.devices()
    distribution = keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    # Global, not only a scope: fit() distributes each batch under the distribution in force when it runs.
    keras.distribution.set_distribution(distribution)
    return Resolved(distribution, "tpu" if platform == "tpu" else platform, jax.device_count(), jax.process_count(),
                    backend="jax", processes=jax.process_count(), process=jax.process_index(), slices=slices)


def hybrid_devices(jax, slices: int) -> list:
    """Every device in the order of `mesh_utils.create_hybrid_device_mesh`: data parallel across the slices
    (DCN, the outer axis), each slice's devices by its ICI topology inside. TPU devices say their slice
    (`slice_index`); a CPU rehearsal's all say 0, so its processes (one per emulated host, slice-major as JAX
    numbers them) are the granules (`process_is_granule`, the function's own fallback)."""
    from jax.experimental import mesh_utils

    devices = jax.devices()
    if devices[0].platform == "tpu":
        mesh = mesh_utils.create_hybrid_device_mesh((len(devices) // slices,), (slices,), devices)
    else:
        mesh = mesh_utils.create_hybrid_device_mesh((jax.local_device_count(),), (jax.process_count(),), devices,
                                                    process_is_granule=True)
    return list(mesh.reshape(-1))


SHARD = "shard"  # in a layout (template Objective.fsdp_layout): the dimension split over the data-parallel axis
# The layers lmkit gives both built-in templates, by Keras path (LayoutMap regexes, matched whole): each weight's
# hidden dimension is split, as keras-hub's GPT-2 and Gemma layout maps split theirs over the data axis; the
# attention kernels are [hidden, heads, head_dim] and [heads, head_dim, hidden]. A template adds its own layers'.
# Not the token embedding (replicated): the tied output head contracts it over the hidden dimension, and split
# there XLA sums partial [batch, positions, vocab] logits across devices (gpt2-tiny's step compiled for v5e:2x2
# then needed 200 MB of temporaries instead of 9 MB); replicated, it costs gpt2-xl 1.3 GB a chip.
TRANSFORMER_LAYOUT = {
    "position_embedding/positions": (None, SHARD),
    r"layer\d+_attention/(query|key|value)/kernel": (SHARD, None, None),
    r"layer\d+_attention/attention_output/kernel": (None, None, SHARD),
}


def shard_weights(resolved: Resolved, layout: dict[str, tuple]) -> Resolved:
    """`resolved` (resolve_jax's data parallelism) with the weights split over the same devices (FSDP, ZeRO-3):
    Keras' ModelParallel on the data-parallel mesh, whose LayoutMap splits, for each weight `layout` names (a
    regex of Keras paths -> per dimension SHARD or None), that dimension over the mesh's batch axis; the batch is
    split as before. The optimizer's slots take their weight's layout (Keras' add_variable_from_reference), and
    XLA gathers each weight where a step uses it and reduce-scatters its gradient. Unnamed variables (biases,
    LayerNorm, the seed generators) stay replicated. Call before the model is built; sets it globally."""
    import keras

    data_parallel = resolved.strategy
    mesh, axis = data_parallel.device_mesh, data_parallel.batch_dim_name
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, dims in layout.items():
        layout_map[pattern] = tuple(axis if dim == SHARD else dim for dim in dims)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=axis,
                                                    auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    return replace(resolved, strategy=distribution)


def split_slot(shape: tuple[int, ...], devices: int) -> tuple | None:
    """runtime.sharding zero1 (ZeRO-1; XLA's weight-update sharding, arXiv:2004.13336): how an optimizer slot of
    `shape` is placed on `devices` data-parallel devices, per dimension SHARD or None: split on its first dimension
    that `devices` divides; None (kept whole) for a scalar, one device, or no such dimension. The weights stay
    whole, so the step is data parallelism's but for the update: XLA reduce-scatters each gradient, updates its
    share of the weight and slots, and all-gathers the weight (the bytes of the all-reduce it replaces)."""
    if devices < 2:
        return None
    dim = next((i for i, size in enumerate(shape) if size >= devices and size % devices == 0), None)
    return None if dim is None else tuple(SHARD if i == dim else None for i in range(len(shape)))


def slot_layouts(resolved: Resolved):
    """runtime.sharding zero1 on `resolved` (resolve_jax's data parallelism): a weight's shape -> the Keras
    TensorLayout its optimizer slots take (split_slot over the mesh's batch axis), or None to keep them whole;
    for lmkit's AdamW(split_slots=...)."""
    import keras

    data_parallel = resolved.strategy
    mesh, axis = data_parallel.device_mesh, data_parallel.batch_dim_name

    def layout(shape: tuple[int, ...]):
        dims = split_slot(tuple(shape), mesh.devices.size)
        return None if dims is None else keras.distribution.TensorLayout(
            tuple(axis if dim == SHARD else None for dim in dims), mesh)

    return layout


def jax_cluster(vm: guest.TpuVm | None, *, rehearsal: bool) -> dict | None:
    """`jax.distributed.initialize`'s arguments on a multi-host slice or a multislice (None on one host):
    worker 0's IP from worker-network-endpoints with JAX's port, the number of workers, and this worker's
    agent-worker-number. A multislice as JAX's `BaseTpuCluster` counts it: the coordinator is
    MEGASCALE_COORDINATOR_ADDRESS (what precedes any ':'), slices x hosts processes, and this one is
    slice id x hosts + its worker number."""
    if vm is None or len(vm.hosts) * vm.slices < 2:
        return None
    key = vm.node or vm.endpoints
    host = vm.hosts[0]
    if vm.slices > 1:
        host = (vm.coordinator or host).split(":")[0]
        # Every slice's node is PREFIX-<slice id>: the prefix is what the rehearsal's slices share.
        key = key.removesuffix(f"-{vm.slice_id}")
    port = _rehearsal_port(key) if rehearsal else JAX_COORDINATOR_PORT
    return {"coordinator_address": f"{host}:{port}", "num_processes": len(vm.hosts) * vm.slices,
            "process_id": vm.slice_id * len(vm.hosts) + vm.worker}


def _devices_per_host(vm: guest.TpuVm) -> int:
    """JAX devices per host of this TPU VM. From its accelerator type where the metadata server has one (TPU
    API VMs): v4 and v5p names count TensorCores (two per megacore chip, one JAX device); v2/v3 (one device per
    core), v5e, v6e and later count chips. Else from its Compute Engine machine type, whose `-Nt` suffix counts
    the VM's chips: TPU7x chips are two JAX devices each (tpu/docs/tpu7x, "Dual-chiplet architecture")."""
    if vm.accelerator_type:
        family, _, size = vm.accelerator_type.rpartition("-")
        count = int(size) // (2 if family in ("v4", "v5p") else 1)
        return max(count // max(len(vm.hosts), 1), 1)
    chips = re.search(r"-(\d+)t$", vm.machine_type or "")
    if chips is None:
        raise AcceleratorError(f"{vm.name}: its metadata server names neither an accelerator-type nor a TPU "
                               "machine type, so how many devices it has is unknown")
    return int(chips.group(1)) * (2 if (vm.machine_type or "").startswith("tpu7x") else 1)


def _rehearsal_port(node: str) -> int:
    """A rehearsal's hosts share one machine (and 127.0.0.1) with other rehearsals: a port per node, not 8482.
    Below Linux's ephemeral range (32768 and up by default): a port there can already be some connection's own
    end, and the coordinator then fails to bind it (seen in CI as "Failed to add port to server")."""
    import zlib

    return 10000 + zlib.crc32(node.encode()) % 22768


def _check_tpu_host(vm: guest.TpuVm | None, tpu: str, *, configure_tf: bool = True) -> bool:
    """On a TPU host: its chips and libtpu must be there. True for an explicitly requested CPU rehearsal."""
    where = (f"TPU VM {vm.name} ({vm.accelerator_type or vm.machine_type}) worker {vm.worker} per its metadata server"
             if vm is not None else "this TPU host")
    libtpu, tried = find_libtpu()
    if not _chips():
        if os.environ.get(CPU_REHEARSAL_VAR) == "cpu":
            return True
        raise AcceleratorError(
            f"runtime.tpu: {where}, but no TPU chips are attached: tried {', '.join(DEVICE_PATTERNS)}; libtpu: "
            f"{libtpu or '; '.join(tried)}. Not falling back to the CPU; set runtime.replicas to rehearse on it")
    if tpu == "local" and libtpu is None:
        raise AcceleratorError(f"runtime.tpu: {where} has TPU chips but no libtpu.so: tried {'; '.join(tried)}")
    if configure_tf:  # on JAX, TensorFlow (the input pipeline) must stay off the chips
        set_tpu_environment(tpu, libtpu)
    return False


def set_tpu_environment(tpu: str, libtpu: str | None) -> None:
    """The variables TF reads when it loads, as Google's TF-on-TPU-VM recipes set them; ones already set win.

    Pod client (a node name on a TPU VM): TPU_LOAD_LIBRARY=0, the chips are reached through each host's
    TPU runtime. One host whose libtpu is the system one at /lib/libtpu.so (the PJRT runtimes,
    `tpu-vm-tf-*-pjrt`, all v5e/v5p/v6e): the TPU is a pluggable device loaded from that library. Otherwise
    (stream-executor runtimes: TPU_LIBRARY_PATH or the pip libtpu) TF finds libtpu itself.
    """
    if tpu.startswith("grpc://"):
        return
    if tpu != "local":
        os.environ.setdefault("TPU_LOAD_LIBRARY", "0")
    elif libtpu == PJRT_LIBTPU:
        os.environ.setdefault("NEXT_PLUGGABLE_DEVICE_USE_C_API", "true")
        os.environ.setdefault("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", PJRT_LIBTPU)


def _tpu_from_env(vm: guest.TpuVm | None) -> str:
    if os.environ.get("COLAB_TPU_ADDR"):
        return f"grpc://{os.environ['COLAB_TPU_ADDR']}"
    name = os.environ.get("TPU_NAME", "")
    if name.startswith("grpc://"):
        return name
    if vm is not None and len(vm.hosts) > 1 and not vm.node:
        # TensorFlow drives a multi-host slice by its TPU API node name; a Compute Engine TPU VM has none.
        raise AcceleratorError(f"runtime.tpu: {vm.name} is a multi-host slice without a TPU node name (tpu-env "
                               "NODE_ID), which TensorFlow's TPUClusterResolver needs; train it with JAX")
    if vm is not None:
        return vm.node if len(vm.hosts) > 1 else "local"
    return "local" if _chips() else ""


def _chips() -> list[str]:
    return [path for pattern in DEVICE_PATTERNS for path in glob.glob(pattern)]


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
