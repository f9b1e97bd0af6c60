"""Hugging Face export: the latest checkpoint in the bucket -> a directory `transformers` loads as `GPT2LMHeadModel`
and `AutoTokenizer` (GPT2TokenizerFast; GPT2Tokenizer from vocab.json + merges.txt), with no code of ours.
Laptop side: numpy, `safetensors` and `tokenizers`; no TensorFlow, no Keras, no torch.

Files: `model.safetensors` (float32, Hugging Face's names), `config.json`, `vocab.json`, `merges.txt`,
`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`.

The mapping is exact because model.py builds the original GPT-2: pre-LayerNorm blocks (`ln_1`, attention,
residual, `ln_2`, MLP, residual), the tanh GELU (Hugging Face's "gelu_new"), learned positions, a final
LayerNorm (`ln_f`), logits from the token embedding itself (tied `lm_head`, no bias), attention scaled by
1/sqrt(head_dim) under a lower-triangular mask. Layouts:
- GPT-2's Conv1D keeps weights as [in, out], Keras' Dense kernel layout: MLP kernels are copied as they are (not
  transposed, unlike a torch Linear).
- `c_attn` is Q, K and V side by side on the output axis: our three [hidden, heads, head_dim] kernels, each
  flattened to [hidden, hidden] (heads outermost, as Hugging Face splits them), concatenated to [hidden, 3 hidden];
  their biases likewise. `c_proj` is the attention output kernel [heads, head_dim, hidden] flattened.
- positions: ours has exactly `seq_len` rows, so `n_positions` is `seq_len`.
- `lm_head.weight` is not written: Hugging Face ties it to `transformer.wte.weight` on load, as in its own files.
`<|endoftext|>` (the only special token, which ends every document) is bos, eos and unk, as in GPT-2.
"""

from __future__ import annotations

from pathlib import Path

from .prepare import EOT, FILES, FORMAT, MANIFEST_NAME, Manifest
from .shared import lmkit

_export = lmkit("hf_export")
join = _export.join


def hf_tensors(weights: dict, task: dict) -> dict:
    """GPT2LMHeadModel's state dict (Hugging Face names and layouts) from our Keras variables. Raises ValueError
    when a variable is missing or has another shape."""
    import numpy as np

    h = task["hidden_size"]
    for name, shape in _keras_shapes(task).items():
        _export.take(weights, name, shape)
    out = {
        "transformer.wte.weight": weights["token_embedding/embeddings"],
        "transformer.wpe.weight": weights["position_embedding/positions"],
        "transformer.ln_f.weight": weights["final_norm/gamma"],
        "transformer.ln_f.bias": weights["final_norm/beta"],
    }
    for layer in range(task["num_layers"]):
        ours, theirs = f"layer{layer}", f"transformer.h.{layer}"
        attention = f"{ours}_attention"
        out[f"{theirs}.ln_1.weight"] = weights[f"{ours}_attention_norm/gamma"]
        out[f"{theirs}.ln_1.bias"] = weights[f"{ours}_attention_norm/beta"]
        out[f"{theirs}.attn.c_attn.weight"] = np.concatenate(
            [_export.dense(weights, f"{attention}/{part}/kernel", h, h) for part in ("query", "key", "value")], axis=1)
        out[f"{theirs}.attn.c_attn.bias"] = np.concatenate(
            [weights[f"{attention}/{part}/bias"].reshape(h) for part in ("query", "key", "value")])
        out[f"{theirs}.attn.c_proj.weight"] = weights[f"{attention}/attention_output/kernel"].reshape(h, h)
        out[f"{theirs}.attn.c_proj.bias"] = weights[f"{attention}/attention_output/bias"]
        out[f"{theirs}.ln_2.weight"] = weights[f"{ours}_mlp_norm/gamma"]
        out[f"{theirs}.ln_2.bias"] = weights[f"{ours}_mlp_norm/beta"]
        out[f"{theirs}.mlp.c_fc.weight"] = weights[f"{ours}_mlp_in/kernel"]
        out[f"{theirs}.mlp.c_fc.bias"] = weights[f"{ours}_mlp_in/bias"]
        out[f"{theirs}.mlp.c_proj.weight"] = weights[f"{ours}_mlp_out/kernel"]
        out[f"{theirs}.mlp.c_proj.bias"] = weights[f"{ours}_mlp_out/bias"]
    return out


def _keras_shapes(task: dict) -> dict:
    """Every variable model.py creates for `task`, with its shape."""
    h, v, L = task["hidden_size"], task["vocab_size"], task["seq_len"]
    return {"token_embedding/embeddings": (v, h), "position_embedding/positions": (L, h),
            "final_norm/gamma": (h,), "final_norm/beta": (h,),
            **_export.layer_shapes(task, norms=("attention_norm", "mlp_norm"), mlp=("mlp_in", "mlp_out"))}


def hf_config(task: dict, manifest: Manifest) -> dict:
    """config.json of GPT2LMHeadModel for `task`."""
    eot = manifest.special_ids[EOT]
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": task["vocab_size"],
        "n_positions": task["seq_len"], "n_embd": task["hidden_size"], "n_layer": task["num_layers"],
        "n_head": task["num_heads"], "n_inner": task["intermediate_size"], "activation_function": "gelu_new",
        "resid_pdrop": task["dropout"], "embd_pdrop": task["dropout"], "attn_pdrop": task["dropout"],
        "layer_norm_epsilon": task["layer_norm_epsilon"], "initializer_range": 0.02, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True, "torch_dtype": "float32",
    }


def tokenizer_files(run, out_dir: Path, seq_len: int) -> None:
    """vocab.json, merges.txt and tokenizer.json as prepared; tokenizer_config.json, special_tokens_map.json."""
    for name in FILES:
        (out_dir / name).write_bytes(run.read(join(run.data_dir, name)))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    # prepare.py's byte-level BPE adds no prefix space: the slow tokenizer must not either.
    _export.write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False, "errors": "replace",
        "model_max_length": seq_len, "clean_up_tokenization_spaces": False, **special})
    _export.write_json(out_dir / "special_tokens_map.json", special)


def to_hf(run, out_dir) -> list[str]:
    """Write the Hugging Face export of `run` (a contract.RunFiles) into `out_dir`; returns the file names.
    Raises FileNotFoundError (no checkpoint, run.json or data files) or ValueError (another model's checkpoint).
    Blocks for the reads; idempotent."""
    _export.require()
    out = Path(out_dir)
    task = _export.task_of(run)
    where = join(run.data_dir, MANIFEST_NAME)
    manifest = Manifest.from_json(run.read(where).decode("utf-8"), where=where, expect=FORMAT)
    step, weights = _export.latest_checkpoint(run)
    tensors = hf_tensors(weights, task)
    out.mkdir(parents=True, exist_ok=True)
    _export.write_safetensors(tensors, out / "model.safetensors")
    _export.write_json(out / "config.json", {**hf_config(task, manifest), "tpuctl_step": step})
    tokenizer_files(run, out, task["seq_len"])
    return sorted(p.name for p in out.iterdir())
