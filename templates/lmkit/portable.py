"""The portable checkpoint format (checkpoints.py writes it) read without TensorFlow or Keras: stdlib + numpy.

A checkpoint directory holds `ckpt-STEP.npz` files (`model/PATH` and `optimizer/PATH` arrays by Keras variable
path) and the index `checkpoint` (TensorFlow's CheckpointState text) naming them, newest first. The laptop side
(the Hugging Face export) reads checkpoints from the bucket through this module after the TPU is gone.
"""

from __future__ import annotations

import io
import re

INDEX = "checkpoint"
MODEL_PREFIX = "model/"


def parse_index(text: str) -> list[str]:
    """The checkpoint names an index holds, newest first."""
    pairs = re.findall(r'^(model_checkpoint_path|all_model_checkpoint_paths): "(.*)"$', text, re.M)
    latest = [v for k, v in pairs if k == "model_checkpoint_path"]
    return latest + [v for k, v in reversed(pairs) if k != "model_checkpoint_path" and v not in latest]


def index_text(names: list[str]) -> str:
    """TensorFlow's CheckpointState text format (newest in model_checkpoint_path, the list oldest first): what
    TF's tools and tpuctl's worker agent read as a checkpoint directory's pointer."""
    return "".join([f'model_checkpoint_path: "{names[0]}"\n',
                    *(f'all_model_checkpoint_paths: "{n}"\n' for n in reversed(names))])


def step_of(name: str) -> int | None:
    """The step a checkpoint name carries (`ckpt-200.npz` -> 200), or None."""
    m = re.fullmatch(r"ckpt-(\d+)\.npz", name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def model_arrays(data: bytes) -> dict:
    """The model's variables of one `.npz` checkpoint, by Keras path without the `model/` prefix."""
    import numpy as np

    with np.load(io.BytesIO(data)) as arrays:
        return {name[len(MODEL_PREFIX):]: arrays[name] for name in arrays.files if name.startswith(MODEL_PREFIX)}
