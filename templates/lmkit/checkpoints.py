"""Backend-neutral checkpoints: the model's and the optimizer's variables by Keras path, in one `.npz` file.

`model_dir/checkpoints/ckpt-STEP.npz` holds `model/PATH` and `optimizer/PATH` arrays (Keras 3 variable
paths without the optimizer's own name, the same on TensorFlow and JAX; the optimizer's `iteration` is the
step counter), `rng/I` (the model's random seed generators' states, dropout's, in the model's order: their
paths are numbered per process) and `data/examples` (the global count of training sequences the run had
consumed: where the data order goes on), so that a resume continues exactly where the run stopped; written to `NAME.tmp` and renamed; then the index `checkpoint` (TensorFlow's CheckpointState
text) is rewritten the same way, last, so a reader that finds an index finds its file. tf.train.Checkpoint
would tie the weights to TensorFlow; this format lets a model trained on one backend resume on the other. Local paths and gs:// through tf.io.gfile.
"""

from __future__ import annotations

import io

import numpy as np
import tensorflow as tf

from .errors import ConfigError
from .portable import INDEX, index_text, parse_index


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def host_array(value) -> np.ndarray:
    """A value as numpy on this host, whole: a JAX array replicated over other processes' devices is not fully
    addressable, but any local shard of a replicated array is the whole value; one split over them (runtime.sharding
    fsdp) is gathered from every process, a collective that every process must call, in the same order."""
    if split_over_processes(value):
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    elif getattr(value, "is_fully_addressable", True) is False:
        value = value.addressable_shards[0].data
    return np.asarray(value)


def split_over_processes(value) -> bool:
    """Whether `value` is a JAX array split over several processes' devices: no process holds all of it."""
    return getattr(value, "is_fully_addressable", True) is False and not value.is_fully_replicated


def host_value(variable) -> np.ndarray:
    return host_array(variable.value)


DATA_POSITION = "data/examples"


def _variables(model, optimizer) -> dict:
    found = {f"model/{v.path}": v for v in model.weights}
    # An optimizer's path starts with its auto-generated, per-process unique name ("adam_w_1/..."): dropped.
    found.update({f"optimizer/{v.path.split('/', 1)[-1]}": v for v in optimizer.variables})
    # The seed generators' states: variables of the model that are not weights.
    weights = {id(v) for v in model.weights}
    found.update({f"rng/{i}": v for i, v in enumerate(v for v in model.variables if id(v) not in weights)})
    return found


def _write_atomically(path: str, data: bytes) -> None:
    with tf.io.gfile.GFile(path + ".tmp", "wb") as f:
        f.write(data)
    tf.io.gfile.rename(path + ".tmp", path, overwrite=True)


def _index(directory: str) -> list[str]:
    """The checkpoint names the index holds, newest first."""
    path = _join(directory, INDEX)
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path, "r") as f:
        return parse_index(f.read())


def latest(directory: str) -> str | None:
    """The newest checkpoint's path, or None. Never blocks beyond one read."""
    names = _index(directory)
    return _join(directory, names[0]) if names else None


def save(directory: str, step: int, model, optimizer, *, keep: int, examples: int, write: bool = True) -> str | None:
    """Write `ckpt-STEP.npz` (with `examples`, the sequences consumed), then the index; drop checkpoints beyond
    the newest `keep`. Idempotent per step. Every array is whole, however the run splits it over its devices, so
    a run of any other mesh (devices, processes, runtime.sharding) resumes it. JAX on several processes: all
    call it, since gathering split weights is a collective; only the one with `write` (process 0) writes, the
    others return None."""
    arrays = {name: host_value(v) for name, v in _variables(model, optimizer).items()
              if write or split_over_processes(v.value)}
    if not write:
        return None
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **{DATA_POSITION: np.int64(examples)})
    tf.io.gfile.makedirs(directory)
    name = f"ckpt-{step}.npz"
    _write_atomically(_join(directory, name), buffer.getvalue())
    names = [name] + [n for n in _index(directory) if n != name]
    _write_atomically(_join(directory, INDEX), index_text(names[:keep]).encode())
    for old in names[keep:]:
        if tf.io.gfile.exists(_join(directory, old)):
            tf.io.gfile.remove(_join(directory, old))
    return _join(directory, name)


def process0(flag: bool, processes: int) -> bool:
    """Process 0's answer on every host (JAX, several processes); the local one otherwise. Blocks until all
    processes ask."""
    if processes < 2:
        return flag
    from jax.experimental import multihost_utils

    return bool(int(multihost_utils.broadcast_one_to_all(np.int32(flag))))


def restore(path: str | None, model, optimizer, *, processes: int = 1) -> int | None:
    """Assign every model and optimizer variable from `path` (None: nothing to restore). Returns the sequences
    the run had consumed (None: nothing restored; -1: a checkpoint from before the data position was saved).
    Raises ConfigError when the file lacks a variable or holds another shape (another model; the run.json check
    catches that first); seed generator states a checkpoint lacks (an older one) keep their start.

    JAX on several hosts (`processes` > 1): process 0's view wins. It alone reads; whether it found a
    checkpoint and every value are broadcast to the others, so the hosts cannot start from different steps
    (a host whose copy of model_dir lags would otherwise resume elsewhere and hang the collectives).
    """
    variables = _variables(model, optimizer)
    stored = {}
    if path is not None:
        with tf.io.gfile.GFile(path, "rb") as f:
            arrays = np.load(io.BytesIO(f.read()))
            stored = {name: arrays[name] for name in arrays.files}
    if processes > 1:
        from jax.experimental import multihost_utils

        if not process0(path is not None, processes):
            return None
        local = {name: stored.get(name, np.zeros(v.shape, v.dtype)) for name, v in variables.items()}
        local[DATA_POSITION] = stored.get(DATA_POSITION, np.int64(-1))
        stored = multihost_utils.broadcast_one_to_all(local)
    elif path is None:
        return None
    for name, variable in variables.items():
        if name.startswith("rng/") and name not in stored:
            continue
        if name not in stored or tuple(stored[name].shape) != tuple(variable.shape):
            raise ConfigError("task", f"checkpoint {path} has no {name} of shape {tuple(variable.shape)}; "
                                      "it was written by another model")
        variable.assign(np.asarray(stored[name]))
    return int(stored.get(DATA_POSITION, -1))
