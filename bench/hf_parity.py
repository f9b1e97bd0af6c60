"""Hugging Face export parity: our Keras models vs `transformers` loading the export, on this CPU.

    .venv/bin/python bench/hf_parity.py [--venv ~/.cache/tpuctl-bench/hf] [--tolerance 1e-4]

For each case (BERT with a lowercasing vocabulary, BERT with a cased, accent-keeping one, GPT-2): prepares a
small generated corpus with the template's own data preparation, builds the tiny preset's Keras model with every
weight drawn at random (biases and LayerNorm parameters too, so a misplaced one shows), writes it as the
template's portable checkpoint with run.json beside it, exports it with the template's `hf` exporter (what
`tpuctl export` runs), then in a separate virtualenv with `transformers` and the CPU build of `torch` (created on
first use; neither ever enters tpuctl's own install) loads the export as BertForMaskedLM / GPT2LMHeadModel and
AutoTokenizer (from tokenizer.json, and again from the vocabulary files and tokenizer_config.json alone) and
compares:

- logits on the same token ids (BERT: with a padded tail and its attention mask), float32: max |difference|
  must be <= --tolerance (1e-4);
- tokenizer ids on the same texts (casing, accents, Hangul, punctuation, digits, whitespace): identical to our
  tokenizer's, without special tokens and (BERT) with [CLS] ... [SEP].

Prints one JSON document; exit status 1 when a case misses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
DEFAULT_VENV = Path.home() / ".cache" / "tpuctl-bench" / "hf"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TEXTS = [
    "Hello World! The Café on Main St. opened in 1999; its naïve owner said: \"Déjà vu\".",
    "UPPER lower MiXeD ÀÉÎÕÜ straße façade — em-dash, ellipsis… and tabs\tand  double  spaces.",
    "안녕하세요 세계. 한국어 문장과 English words together, 12345 and 3.14!",
    "katori nemo saluing chstan: erpe dion? kato-ri (ne) [mo] {sa}",
]
CASES = {"bert": ("bert", {"lowercase": True}), "bert-cased": ("bert", {"lowercase": False}), "gpt2": ("gpt2", {})}


def ensure_venv(venv: Path) -> Path:
    """The virtualenv with transformers and CPU torch (created on first use). Returns its python."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import torch, transformers, safetensors"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if subprocess.run([*pip, "torch", "--index-url", TORCH_CPU_INDEX]).returncode != 0:
        subprocess.run([*pip, "torch"], check=True)  # the CPU index is unreachable: PyPI's build
    subprocess.run([*pip, "transformers", "safetensors", "tokenizers", "numpy"], check=True)
    return python


def randomize(model, seed: int) -> None:
    """Every weight random: LayerNorm scales around 1, everything else N(0, 0.1^2), so no mapping hides."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for v in model.weights:
        noise = rng.normal(0.0, 0.1, v.shape).astype("float32")
        v.assign(noise + 1.0 if v.path.endswith("/gamma") else noise)


def keras_side(name: str, work: Path) -> dict:
    """Prepare data, build + randomize + checkpoint the tiny model, export it, run it on fixed ids."""
    import numpy as np

    from test_data_prepare import write_corpus
    from tpuctl.templates import contract

    template_name, data_options = CASES[name]
    template = contract.find(template_name)
    task_mod = __import__(f"tpuctl.templates.{template_name}.config", fromlist=["build"])
    model_mod = __import__(f"tpuctl.templates.{template_name}.model", fromlist=["build_model"])
    from tpuctl.templates.lmkit import checkpoints

    import keras

    case = work / name
    case.mkdir(parents=True)
    corpus = write_corpus(case / "corpus.txt", documents=600, seed=3, korean_share=0.3)
    with open(corpus, "a", encoding="utf-8") as f:
        f.write("\n".join(TEXTS) + "\n")
    data_dir, model_dir, out = case / "data", case / "model", case / "hf"
    manifest = template.data.prepare([str(corpus)], data_dir,
                                     template.data.make_options(vocab_size=2000, seq_len=128, **data_options))
    preset = template.default_preset
    # BERT's head gathers `max_predictions_per_seq` positions: all of them here, for logits at every position.
    every = {"max_predictions_per_seq": 128} if template_name == "bert" else {}
    task = task_mod.build({"preset": preset, "task": {"vocab_size": manifest.vocab_size, **every}}).task
    keras.config.set_dtype_policy("float32")
    model = model_mod.build_model(task, vocab_size=manifest.vocab_size)
    randomize(model, seed=len(name))
    optimizer = keras.optimizers.AdamW()
    optimizer.build(model.trainable_variables)
    checkpoints.save(str(model_dir / "checkpoints"), 7, model, optimizer, keep=1, examples=0)
    (model_dir / "run.json").write_text(json.dumps({"vocab_sha256": manifest.vocab_sha256, "task": asdict(task)}))
    files = template.exporter("hf")(contract.RunFiles(model_dir=str(model_dir), data_dir=str(data_dir),
                                                      read=lambda url: Path(url).read_bytes()), out)

    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    ids = [e.ids for e in ours.encode_batch(TEXTS, add_special_tokens=False)]
    L, rng = task.seq_len, np.random.default_rng(0)
    batch = rng.integers(0, manifest.vocab_size, size=(2, L)).astype("int32")
    inputs = {"input_ids": batch}
    mask = np.ones((2, L), "int32")
    if template_name == "bert":
        special = manifest.special_ids
        first = [special["[CLS]"], *ids[0][: L - 2], special["[SEP]"]]
        batch[0] = special["[PAD]"]
        batch[0, : len(first)] = first
        mask[0, len(first):] = 0
        inputs["input_mask"] = mask
        inputs["masked_positions"] = np.tile(np.arange(L, dtype="int32"), (2, 1))
    logits = np.asarray(model(inputs, training=False), dtype="float32")
    np.savez(case / "keras.npz", input_ids=batch, attention_mask=mask, logits=logits)
    return {"case": name, "template": template_name, "export_dir": str(out), "files": files, "ids": ids,
            "special": manifest.special_ids, "lowercase": data_options.get("lowercase"),
            "parameters": int(sum(np.prod(v.shape) for v in model.weights)), "npz": str(case / "keras.npz")}


HF_SIDE = r'''
import json, pathlib, shutil, sys
import numpy as np, torch, transformers
from transformers import AutoTokenizer, BertForMaskedLM, GPT2LMHeadModel

cases, tolerance, texts = json.loads(sys.stdin.read())
out = []
for c in cases:
    cls = BertForMaskedLM if c["template"] == "bert" else GPT2LMHeadModel
    model, info = cls.from_pretrained(c["export_dir"], output_loading_info=True, attn_implementation="eager")
    model.eval()
    data = np.load(c["npz"])
    with torch.no_grad():
        args = {"input_ids": torch.tensor(data["input_ids"], dtype=torch.long)}
        if c["template"] == "bert":
            args["attention_mask"] = torch.tensor(data["attention_mask"], dtype=torch.long)
        logits = model(**args).logits.float().numpy()
    diff = float(np.abs(logits - data["logits"]).max())  # every position, padded ones too
    fast = AutoTokenizer.from_pretrained(c["export_dir"])
    # The vocabulary files and tokenizer_config.json alone (no tokenizer.json): what casing/accent flags and
    # transformers' own converter make of them must give the same ids.
    bare = pathlib.Path(c["export_dir"] + "-vocab-only")
    shutil.copytree(c["export_dir"], bare)
    (bare / "tokenizer.json").unlink()
    from_vocab = AutoTokenizer.from_pretrained(bare)
    token_checks = {}
    for label, tok in (("tokenizer_json", fast), ("vocab_files", from_vocab)):
        plain = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        token_checks[label] = plain == c["ids"]
        if c["template"] == "bert":
            s = c["special"]
            framed = [tok(t)["input_ids"] for t in texts]
            token_checks[label + "_with_special"] = framed == [[s["[CLS]"], *i, s["[SEP]"]] for i in c["ids"]]
    out.append({"case": c["case"], "class": cls.__name__, "auto_tokenizer": type(fast).__name__,
                "max_abs_logit_diff": diff, "logits_ok": diff <= tolerance,
                "missing_keys": sorted(info["missing_keys"]), "unexpected_keys": sorted(info["unexpected_keys"]),
                "tokenizer_ids_identical": token_checks, "parameters": c["parameters"]})
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "cases": out}))
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="virtualenv with transformers + CPU torch")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    python = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory(prefix="tpuctl-hf-parity-") as tmp:
        cases = [keras_side(name, Path(tmp)) for name in CASES]
        proc = subprocess.run([str(python), "-c", HF_SIDE], input=json.dumps([cases, args.tolerance, TEXTS]),
                              capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = all(c["logits_ok"] and all(c["tokenizer_ids_identical"].values()) and not c["missing_keys"]
             and not c["unexpected_keys"] for c in result["cases"])
    summary = {"max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in result["cases"]),
               "tolerance": args.tolerance,
               "tokenizer_ids_identical": all(all(c["tokenizer_ids_identical"].values()) for c in result["cases"]),
               "ok": ok}
    print(json.dumps({**summary, **result}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
