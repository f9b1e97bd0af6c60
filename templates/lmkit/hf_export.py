"""Hugging Face export helpers both templates' exporters (bert/export.py, gpt2/export.py) share: the latest
portable checkpoint read from the bucket as arrays by Keras path, the task it was trained with (run.json), shape
checks, the transformer layers' variables, and the safetensors / JSON writers. Laptop side: numpy, `safetensors`
and `tokenizers`; no TensorFlow, no Keras, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from .portable import INDEX, model_arrays, parse_index, step_of
from .trainer import RUN_STATE  # run.json: the task that model_dir was trained with (trainer.py is light to import)


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def read_json(run, url: str) -> dict:
    try:
        return json.loads(run.read(url))
    except ValueError as exc:
        raise ValueError(f"{url}: not JSON ({exc})") from exc


def latest_checkpoint(run) -> tuple[int, dict]:
    """(step, model arrays by Keras path) of the newest checkpoint in `run.model_dir`. Raises FileNotFoundError
    when there is none (the index or the file it names is missing)."""
    ckpt_dir = join(run.model_dir, "checkpoints")
    names = parse_index(run.read(join(ckpt_dir, INDEX)).decode())
    if not names:
        raise FileNotFoundError(f"{join(ckpt_dir, INDEX)} names no checkpoint")
    step = step_of(names[0])
    if step is None:
        raise ValueError(f"{join(ckpt_dir, names[0])} is not a portable .npz checkpoint (written by another "
                         "version of the template)")
    return step, model_arrays(run.read(join(ckpt_dir, names[0])))


def task_of(run) -> dict:
    """The task the checkpoints were trained with (vocab_size resolved), from model_dir/run.json."""
    return read_json(run, join(run.model_dir, RUN_STATE))["task"]


def take(weights: dict, name: str, shape: tuple):
    """One checkpoint array, checked against the shape the task implies. Raises ValueError."""
    if name not in weights:
        raise ValueError(f"the checkpoint has no variable {name!r}: it was written by another model")
    value = weights[name]
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"checkpoint variable {name!r} has shape {tuple(value.shape)}, the task implies {shape}")
    return value


def dense(weights: dict, name: str, n_in: int, n_out: int):
    """A Keras kernel stored [in, ...] (Dense, or MultiHeadAttention's Q/K/V [in, heads, head_dim]) flattened to
    [in, out]: Keras' own and GPT-2's Conv1D layout; a torch Linear weight is its transpose."""
    return weights[name].reshape(n_in, n_out)


def require() -> None:
    """Import the laptop-side libraries first (ImportError), so a missing one fails before anything is written."""
    import numpy  # noqa: F401
    import safetensors.numpy  # noqa: F401
    import tokenizers  # noqa: F401


def write_safetensors(tensors: dict, path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    # "format": "pt" is the metadata transformers expects of a PyTorch-loadable safetensors file.
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def layer_shapes(task: dict, *, norms: tuple[str, str], mlp: tuple[str, str]) -> dict:
    """The transformer layers' variables as the templates' model.py name them (`layer{i}_...`), with their shapes:
    attention, the two layer norms `norms` and the feed-forward pair `mlp` (in, out): BERT's and GPT-2's layers
    differ only in these names."""
    h, n, i = task["hidden_size"], task["num_heads"], task["intermediate_size"]
    d = h // n
    shapes = {}
    for layer in range(task["num_layers"]):
        p = f"layer{layer}"
        for part in ("query", "key", "value"):
            shapes[f"{p}_attention/{part}/kernel"] = (h, n, d)
            shapes[f"{p}_attention/{part}/bias"] = (n, d)
        shapes[f"{p}_attention/attention_output/kernel"] = (n, d, h)
        shapes[f"{p}_attention/attention_output/bias"] = (h,)
        for norm in norms:
            shapes[f"{p}_{norm}/gamma"] = (h,)
            shapes[f"{p}_{norm}/beta"] = (h,)
        shapes[f"{p}_{mlp[0]}/kernel"] = (h, i)
        shapes[f"{p}_{mlp[0]}/bias"] = (i,)
        shapes[f"{p}_{mlp[1]}/kernel"] = (i, h)
        shapes[f"{p}_{mlp[1]}/bias"] = (h,)
    return shapes
