"""Hugging Face export: the latest checkpoint in the bucket -> a directory `transformers` loads as `BertForMaskedLM`
and `AutoTokenizer`, with no code of ours. Laptop side: numpy, `safetensors` and `tokenizers`; no TensorFlow, no
Keras, no torch.

Files: `model.safetensors` (float32, Hugging Face's parameter names), `config.json`, `vocab.txt`, `tokenizer.json`
(the prepared WordPiece tokenizer plus BERT's `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` post-processor),
`tokenizer_config.json` and `special_tokens_map.json`.

The mapping is exact, layer for layer, because model.py builds the published BERT: post-LayerNorm blocks with
epsilon 1e-12, exact (erf) GELU ("gelu"), learned absolute positions, an MLM head of dense + GELU + LayerNorm and
a decoder tied to the word embeddings with its own bias. Differences, and why they change no logit:
- our encoder has no token type embeddings; Hugging Face always adds `token_type_embeddings[token_type_ids]`, so
  they are exported as zeros (type_vocab_size 2, the usual BERT shape): adding zeros is exact, and fine-tuning
  on sentence pairs learns them from there.
- layers.SelfAttention keeps Keras MultiHeadAttention's Q/K/V kernels as [hidden, heads, head_dim] and the output kernel as
  [heads, head_dim, hidden]; Hugging Face's Linear weights are [out, in]: reshaped to [hidden, hidden] (heads
  outermost in both) and transposed.
- positions: ours has exactly `seq_len` rows, so `max_position_embeddings` is `seq_len`.
- the tied decoder weight is not written (Hugging Face ties it to the word embeddings on load, as in its own
  checkpoints); its bias is `cls.predictions.bias`.
The tokenizer keeps the casing and accent choices the vocabulary was built with (manifest `tokenizer.lowercase`,
`tokenizer.strip_accents`; None follows lowercase, as in both BertNormalizer and BertTokenizer).
"""

from __future__ import annotations

from pathlib import Path

from .manifest import FORMAT, TOKENIZER_NAME, VOCAB_NAME
from .shared import lmkit

_export = lmkit("hf_export")
join = _export.join
Manifest, MANIFEST_NAME = lmkit("manifest").Manifest, lmkit("manifest").MANIFEST_NAME

LAYER_NORM_EPSILON = 1e-12  # model.py's LayerNormalization epsilon everywhere (the published BERT's)
TYPE_VOCAB_SIZE = 2


def hf_tensors(weights: dict, task: dict) -> dict:
    """BertForMaskedLM's state dict (Hugging Face names, torch layouts) from our Keras variables. Raises
    ValueError when a variable is missing or has another shape."""
    import numpy as np

    h = task["hidden_size"]
    for name, shape in _keras_shapes(task).items():
        _export.take(weights, name, shape)
    out = {
        "bert.embeddings.word_embeddings.weight": weights["token_embedding/embeddings"],
        "bert.embeddings.position_embeddings.weight": weights["position_embedding/positions"],
        "bert.embeddings.token_type_embeddings.weight": np.zeros((TYPE_VOCAB_SIZE, h), np.float32),
        "bert.embeddings.LayerNorm.weight": weights["embedding_norm/gamma"],
        "bert.embeddings.LayerNorm.bias": weights["embedding_norm/beta"],
        "cls.predictions.transform.dense.weight": weights["mlm_transform/kernel"].T,
        "cls.predictions.transform.dense.bias": weights["mlm_transform/bias"],
        "cls.predictions.transform.LayerNorm.weight": weights["mlm_norm/gamma"],
        "cls.predictions.transform.LayerNorm.bias": weights["mlm_norm/beta"],
        "cls.predictions.bias": weights["token_embedding/output_bias"],
    }
    for layer in range(task["num_layers"]):
        ours, theirs = f"layer{layer}", f"bert.encoder.layer.{layer}"
        for part in ("query", "key", "value"):
            out[f"{theirs}.attention.self.{part}.weight"] = _export.dense(weights, f"{ours}_attention/{part}/kernel", h, h).T
            out[f"{theirs}.attention.self.{part}.bias"] = weights[f"{ours}_attention/{part}/bias"].reshape(h)
        out[f"{theirs}.attention.output.dense.weight"] = \
            weights[f"{ours}_attention/attention_output/kernel"].reshape(h, h).T
        out[f"{theirs}.attention.output.dense.bias"] = weights[f"{ours}_attention/attention_output/bias"]
        out[f"{theirs}.attention.output.LayerNorm.weight"] = weights[f"{ours}_attention_norm/gamma"]
        out[f"{theirs}.attention.output.LayerNorm.bias"] = weights[f"{ours}_attention_norm/beta"]
        out[f"{theirs}.intermediate.dense.weight"] = weights[f"{ours}_intermediate/kernel"].T
        out[f"{theirs}.intermediate.dense.bias"] = weights[f"{ours}_intermediate/bias"]
        out[f"{theirs}.output.dense.weight"] = weights[f"{ours}_output/kernel"].T
        out[f"{theirs}.output.dense.bias"] = weights[f"{ours}_output/bias"]
        out[f"{theirs}.output.LayerNorm.weight"] = weights[f"{ours}_output_norm/gamma"]
        out[f"{theirs}.output.LayerNorm.bias"] = weights[f"{ours}_output_norm/beta"]
    return out


def _keras_shapes(task: dict) -> dict:
    """Every variable model.py creates for `task`, with its shape."""
    h, v, L = task["hidden_size"], task["vocab_size"], task["seq_len"]
    return {"token_embedding/embeddings": (v, h), "token_embedding/output_bias": (v,),
            "position_embedding/positions": (L, h), "embedding_norm/gamma": (h,), "embedding_norm/beta": (h,),
            "mlm_transform/kernel": (h, h), "mlm_transform/bias": (h,), "mlm_norm/gamma": (h,),
            "mlm_norm/beta": (h,),
            **_export.layer_shapes(task, norms=("attention_norm", "output_norm"), mlp=("intermediate", "output"))}


def hf_config(task: dict, manifest: Manifest) -> dict:
    """config.json of BertForMaskedLM for `task`."""
    return {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": task["vocab_size"],
        "hidden_size": task["hidden_size"], "num_hidden_layers": task["num_layers"],
        "num_attention_heads": task["num_heads"], "intermediate_size": task["intermediate_size"],
        "hidden_act": "gelu",  # Keras' "gelu" is the exact (erf) one, as Hugging Face's "gelu"
        "hidden_dropout_prob": task["dropout"], "attention_probs_dropout_prob": task["dropout"],
        "max_position_embeddings": task["seq_len"], "type_vocab_size": TYPE_VOCAB_SIZE,
        "initializer_range": 0.02, "layer_norm_eps": LAYER_NORM_EPSILON, "position_embedding_type": "absolute",
        "pad_token_id": manifest.special_ids["[PAD]"], "tie_word_embeddings": True, "torch_dtype": "float32",
        "use_cache": True,
    }


def tokenizer_files(run, out_dir: Path, manifest: Manifest, seq_len: int) -> None:
    """vocab.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    from tokenizers import Tokenizer, processors

    vocab = run.read(join(run.data_dir, VOCAB_NAME))
    (out_dir / VOCAB_NAME).write_bytes(vocab)
    tok = Tokenizer.from_str(run.read(join(run.data_dir, TOKENIZER_NAME)).decode("utf-8"))
    ids = manifest.special_ids
    # BertTokenizer's special tokens: what transformers' own converter gives a BERT vocabulary.
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.save(str(out_dir / TOKENIZER_NAME))
    lowercase = bool(manifest.tokenizer.get("lowercase", True))
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    _export.write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizer", "do_lower_case": lowercase,
        "strip_accents": manifest.tokenizer.get("strip_accents"), "tokenize_chinese_chars": True,
        "do_basic_tokenize": True, "never_split": None, "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False, **special})
    _export.write_json(out_dir / "special_tokens_map.json", special)


def to_hf(run, out_dir) -> list[str]:
    """Write the Hugging Face export of `run` (a contract.RunFiles: model_dir, data_dir, read) into `out_dir`.
    Returns the file names written. Raises FileNotFoundError (no checkpoint, no run.json, no data files) or
    ValueError (a checkpoint of another model). Blocks for the reads; idempotent (files are overwritten)."""
    _export.require()
    out = Path(out_dir)
    task = _export.task_of(run)
    manifest = Manifest.from_json(run.read(join(run.data_dir, MANIFEST_NAME)).decode("utf-8"),
                                  where=join(run.data_dir, MANIFEST_NAME), expect=FORMAT)
    step, weights = _export.latest_checkpoint(run)
    tensors = hf_tensors(weights, task)
    out.mkdir(parents=True, exist_ok=True)
    _export.write_safetensors(tensors, out / "model.safetensors")
    _export.write_json(out / "config.json", {**hf_config(task, manifest), "tpuctl_step": step})
    tokenizer_files(run, out, manifest, task["seq_len"])
    return sorted(p.name for p in out.iterdir())
