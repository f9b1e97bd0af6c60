"""Hugging Face export (`tpuctl export RUN --format hf`): files present and well-formed, without torch/transformers.

A tiny BERT and GPT-2 with every weight random are checkpointed the way the templates do (portable .npz +
run.json) beside prepared data; the export must then (1) hold exactly Hugging Face's parameter names, shapes and
dtype for its config.json, (2) give the Keras model's logits when run with Hugging Face's semantics (a numpy
transcription of BertForMaskedLM / GPT2LMHeadModel's forward pass, reading only the exported files), and (3) ship
tokenizer files the `tokenizers` package loads into the same ids as ours. The CLI reads a run's bucket on the
local cloud; a bad run name or a missing checkpoint is one error line. bench/hf_parity.py runs transformers itself.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from conftest import tpuctl
from test_cli_errors import _one_error
from test_data_prepare import write_corpus
from tpuctl.templates import contract

pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]

TEXTS = ["Hello World! The Café on Main St. opened in 1999; naïve Déjà vu.",
         "안녕하세요 세계 katori nemo — UPPER lower MiXeD ÀÉÎÕÜ straße,  double  spaces."]
# BERT's head gathers `max_predictions_per_seq` positions: all of them here, for logits at every position.
TASKS = {"bert": {"seq_len": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                  "max_predictions_per_seq": 128},
         "gpt2": {"seq_len": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}}


def local_run(model_dir: Path, data_dir: Path) -> contract.RunFiles:
    return contract.RunFiles(model_dir=str(model_dir), data_dir=str(data_dir), read=lambda url: Path(url).read_bytes())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = write_corpus(tmp_path_factory.mktemp("hf-corpus") / "corpus.txt", documents=300, seed=5)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def trained(request, corpus, tmp_path_factory) -> dict:
    """A checkpointed model of template `param` with random weights: model_dir, data_dir, task, Keras logits."""
    pytest.importorskip("tensorflow")
    import keras

    name = request.param
    template = contract.find(name)
    config = __import__(f"tpuctl.templates.{name}.config", fromlist=["build"])
    model_mod = __import__(f"tpuctl.templates.{name}.model", fromlist=["build_model"])
    from tpuctl.templates.lmkit import checkpoints

    root = tmp_path_factory.mktemp(f"hf-{name}")
    data_dir, model_dir = root / "data", root / "model"
    manifest = template.data.prepare([str(corpus)], data_dir, template.data.make_options(
        vocab_size=400, seq_len=TASKS[name]["seq_len"]))
    task = config.build({"task": {**TASKS[name], "vocab_size": manifest.vocab_size}}).task
    keras.config.set_dtype_policy("float32")
    model = model_mod.build_model(task, vocab_size=manifest.vocab_size)
    rng = np.random.default_rng(1)
    for v in model.weights:  # every weight random, biases and LayerNorms too: a misplaced one changes the logits
        v.assign(rng.normal(1.0 if v.path.endswith("/gamma") else 0.0, 0.1, v.shape).astype("float32"))
    optimizer = keras.optimizers.AdamW()
    optimizer.build(model.trainable_variables)
    checkpoints.save(str(model_dir / "checkpoints"), 5, model, optimizer, keep=2, examples=0)
    (model_dir / "run.json").write_text(json.dumps({"vocab_sha256": manifest.vocab_sha256, "task": asdict(task)}))
    ids = rng.integers(0, manifest.vocab_size, size=(2, task.seq_len)).astype("int32")
    inputs = {"input_ids": ids}
    mask = np.ones_like(ids)
    if name == "bert":
        mask[1, task.seq_len // 3:] = 0  # a padded tail
        inputs["input_mask"] = mask
        inputs["masked_positions"] = np.tile(np.arange(task.seq_len, dtype="int32"), (2, 1))
    logits = np.asarray(model(inputs, training=False))
    return {"name": name, "template": template, "model_dir": model_dir, "data_dir": data_dir, "task": asdict(task),
            "manifest": manifest, "ids": ids, "mask": mask, "logits": logits}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"hf-out-{trained['name']}")
    trained["template"].exporter("hf")(local_run(trained["model_dir"], trained["data_dir"]), out)
    return out


def safetensors_header(path: Path) -> dict:
    """The safetensors header, parsed from its documented layout (u64 little-endian length, then JSON)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def hf_bert_shapes(c: dict) -> dict:
    """BertForMaskedLM's persistent parameters (transformers' modeling_bert), the tied decoder weight aside."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes = {"bert.embeddings.word_embeddings.weight": [v, h],
              "bert.embeddings.position_embeddings.weight": [c["max_position_embeddings"], h],
              "bert.embeddings.token_type_embeddings.weight": [c["type_vocab_size"], h],
              "bert.embeddings.LayerNorm.weight": [h], "bert.embeddings.LayerNorm.bias": [h],
              "cls.predictions.bias": [v], "cls.predictions.transform.dense.weight": [h, h],
              "cls.predictions.transform.dense.bias": [h], "cls.predictions.transform.LayerNorm.weight": [h],
              "cls.predictions.transform.LayerNorm.bias": [h]}
    for n in range(c["num_hidden_layers"]):
        p = f"bert.encoder.layer.{n}."
        for lin, (o, k) in {"attention.self.query": (h, h), "attention.self.key": (h, h),
                            "attention.self.value": (h, h), "attention.output.dense": (h, h),
                            "intermediate.dense": (i, h), "output.dense": (h, i)}.items():
            shapes[p + lin + ".weight"], shapes[p + lin + ".bias"] = [o, k], [o]
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + norm + ".weight"], shapes[p + norm + ".bias"] = [h], [h]
    return shapes


def hf_gpt2_shapes(c: dict) -> dict:
    """GPT2LMHeadModel's persistent parameters (modeling_gpt2; Conv1D weights are [in, out]), lm_head tied."""
    h, i = c["n_embd"], c["n_inner"]
    shapes = {"transformer.wte.weight": [c["vocab_size"], h], "transformer.wpe.weight": [c["n_positions"], h],
              "transformer.ln_f.weight": [h], "transformer.ln_f.bias": [h]}
    for n in range(c["n_layer"]):
        p = f"transformer.h.{n}."
        for conv, (k, o) in {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h), "mlp.c_fc": (h, i),
                             "mlp.c_proj": (i, h)}.items():
            shapes[p + conv + ".weight"], shapes[p + conv + ".bias"] = [k, o], [o]
        for norm in ("ln_1", "ln_2"):
            shapes[p + norm + ".weight"], shapes[p + norm + ".bias"] = [h], [h]
    return shapes


def test_weights_carry_hugging_faces_names_shapes_and_dtype_for_the_config(trained, exported):
    config = json.loads((exported / "config.json").read_text())
    task = trained["task"]
    header = safetensors_header(exported / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    if trained["name"] == "bert":
        assert (config["model_type"], config["architectures"], config["hidden_act"]) == ("bert", ["BertForMaskedLM"], "gelu")
        assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                config["intermediate_size"], config["max_position_embeddings"], config["layer_norm_eps"]) == (
            task["hidden_size"], task["num_layers"], task["num_heads"], task["intermediate_size"], task["seq_len"], 1e-12)
        expected = hf_bert_shapes(config)
    else:
        assert (config["model_type"], config["architectures"], config["activation_function"]) == (
            "gpt2", ["GPT2LMHeadModel"], "gelu_new")
        assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"], config["n_positions"],
                config["layer_norm_epsilon"]) == (task["hidden_size"], task["num_layers"], task["num_heads"],
                                                  task["intermediate_size"], task["seq_len"], 1e-5)
        assert config["eos_token_id"] == config["bos_token_id"] == trained["manifest"].special_ids["<|endoftext|>"]
        expected = hf_gpt2_shapes(config)
    assert config["vocab_size"] == trained["manifest"].vocab_size and config["tie_word_embeddings"] is True
    assert {k: v["shape"] for k, v in header.items()} == expected
    assert {v["dtype"] for v in header.values()} == {"F32"}
    assert config["tpuctl_step"] == 5


def _ln(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _attention(q, k, v, heads: int, bias):
    B, L, H = q.shape
    split = lambda t: t.reshape(B, L, heads, H // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(H // heads) + bias
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ split(v)).transpose(0, 2, 1, 3).reshape(B, L, H)


def hf_bert_logits(w: dict, c: dict, ids, mask):
    """BertForMaskedLM.forward (eval), transcribed: torch Linear is x @ W.T + b; GELU is erf's."""
    erf = np.vectorize(math.erf)
    gelu = lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2)))  # noqa: E731
    lin = lambda x, name: x @ w[name + ".weight"].T + w[name + ".bias"]  # noqa: E731
    eps, L = c["layer_norm_eps"], ids.shape[1]
    e = "bert.embeddings."
    x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:L] + w[e + "token_type_embeddings.weight"][0]
    x = _ln(x, w[e + "LayerNorm.weight"], w[e + "LayerNorm.bias"], eps)
    bias = ((1.0 - mask) * np.finfo(np.float64).min)[:, None, None, :]
    for n in range(c["num_hidden_layers"]):
        p = f"bert.encoder.layer.{n}."
        a = _attention(lin(x, p + "attention.self.query"), lin(x, p + "attention.self.key"),
                       lin(x, p + "attention.self.value"), c["num_attention_heads"], bias)
        x = _ln(x + lin(a, p + "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"], eps)
        f = lin(gelu(lin(x, p + "intermediate.dense")), p + "output.dense")
        x = _ln(x + f, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    t = "cls.predictions.transform."
    x = _ln(gelu(lin(x, t + "dense")), w[t + "LayerNorm.weight"], w[t + "LayerNorm.bias"], eps)
    return x @ w["bert.embeddings.word_embeddings.weight"].T + w["cls.predictions.bias"]


def hf_gpt2_logits(w: dict, c: dict, ids):
    """GPT2LMHeadModel.forward (eval), transcribed: Conv1D is x @ W + b; "gelu_new" is the tanh GELU."""
    gelu_new = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))  # noqa: E731
    conv = lambda x, name: x @ w[name + ".weight"] + w[name + ".bias"]  # noqa: E731
    norm = lambda x, name: _ln(x, w[name + ".weight"], w[name + ".bias"], c["layer_norm_epsilon"])  # noqa: E731
    L, h = ids.shape[1], c["n_embd"]
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:L]
    causal = np.where(np.tril(np.ones((L, L), bool)), 0.0, np.finfo(np.float64).min)
    for n in range(c["n_layer"]):
        p = f"transformer.h.{n}."
        qkv = conv(norm(x, p + "ln_1"), p + "attn.c_attn")
        a = _attention(qkv[..., :h], qkv[..., h:2 * h], qkv[..., 2 * h:], c["n_head"], causal)
        x = x + conv(a, p + "attn.c_proj")
        x = x + conv(gelu_new(conv(norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return norm(x, "transformer.ln_f") @ w["transformer.wte.weight"].T


def test_hugging_face_semantics_on_the_exported_files_give_the_keras_logits(trained, exported):
    from safetensors.numpy import load_file

    w = {k: v.astype(np.float64) for k, v in load_file(str(exported / "model.safetensors")).items()}
    if trained["name"] == "bert":  # the decoder is tied: no weight of its own in the file
        assert "cls.predictions.decoder.weight" not in w
    config = json.loads((exported / "config.json").read_text())
    ids, mask = trained["ids"], trained["mask"].astype(np.float64)
    logits = hf_bert_logits(w, config, ids, mask) if trained["name"] == "bert" else hf_gpt2_logits(w, config, ids)
    assert np.abs(logits - trained["logits"]).max() <= 1e-4


def test_tokenizer_files_load_in_tokenizers_and_give_our_ids(trained, exported):
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer

    ours = Tokenizer.from_file(str(trained["data_dir"] / "tokenizer.json"))
    want = [e.ids for e in ours.encode_batch(TEXTS, add_special_tokens=False)]
    theirs = Tokenizer.from_file(str(exported / "tokenizer.json"))
    assert [e.ids for e in theirs.encode_batch(TEXTS, add_special_tokens=False)] == want
    settings = json.loads((exported / "tokenizer_config.json").read_text())
    assert settings["model_max_length"] == trained["task"]["seq_len"]
    if trained["name"] == "bert":
        special = trained["manifest"].special_ids
        assert [e.ids for e in theirs.encode_batch(TEXTS)] == [[special["[CLS]"], *i, special["[SEP]"]] for i in want]
        assert (settings["tokenizer_class"], settings["do_lower_case"], settings["strip_accents"]) == (
            "BertTokenizer", True, None)
        rebuilt = BertWordPieceTokenizer(str(exported / "vocab.txt"), lowercase=settings["do_lower_case"],
                                         strip_accents=settings["strip_accents"])
    else:
        assert (settings["tokenizer_class"], settings["add_prefix_space"], settings["eos_token"]) == (
            "GPT2Tokenizer", False, "<|endoftext|>")
        rebuilt = ByteLevelBPETokenizer(str(exported / "vocab.json"), str(exported / "merges.txt"),
                                        add_prefix_space=settings["add_prefix_space"])
    # What a loader that only has the vocabulary files and tokenizer_config.json builds: the same ids.
    assert [e.ids for e in rebuilt.encode_batch(TEXTS, add_special_tokens=False)] == want


def test_a_cased_vocabulary_is_exported_as_cased(corpus, tmp_path):
    """tokenizer_config.json keeps the choices the vocabulary was built with: cased, accents kept."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    from tpuctl.templates.bert import export, prepare

    manifest = prepare.prepare([str(corpus)], tmp_path / "data", prepare.PrepareOptions(vocab_size=400, lowercase=False))
    export.tokenizer_files(local_run(tmp_path / "model", tmp_path / "data"), tmp_path, manifest, 128)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (settings["do_lower_case"], settings["strip_accents"]) == (False, None)
    want = [e.ids for e in Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json")).encode_batch(
        TEXTS, add_special_tokens=False)]
    rebuilt = BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lowercase=False, strip_accents=None)
    assert [e.ids for e in rebuilt.encode_batch(TEXTS, add_special_tokens=False)] == want
    assert want != [e.ids for e in BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lowercase=True)
                    .encode_batch(TEXTS, add_special_tokens=False)]  # the flag matters for this text


def test_a_template_without_the_format_is_refused_naming_those_it_has(tmp_path):
    from tpuctl.errors import BadInput

    with pytest.raises(BadInput, match="no 'onnx' exporter") as e:
        contract.find("gpt2").exporter("onnx")
    assert e.value.field == "format" and "hf" in e.value.hint


# ------------------------------------------------------------------------------------- the CLI on a bucket

@pytest.fixture
def cli(env, monkeypatch):
    """`tpuctl ARGS` in this process (seconds cheaper than a fresh interpreter), with `env`'s settings; returns
    what `_one_error` reads of a finished process."""
    import io
    import os
    from types import SimpleNamespace

    from click.testing import CliRunner
    from rich.console import Console

    from tpuctl import console
    from tpuctl.cli import cli as command

    for key in [k for k in os.environ if k.startswith(("TPUCTL_", "CLOUDSDK_", "GOOGLE_"))]:
        monkeypatch.delenv(key)
    for key in ("TPUCTL_API_ENDPOINT", "STORAGE_EMULATOR_HOST", "TPUCTL_PROJECT", "TPUCTL_HOME", "HOME"):
        monkeypatch.setenv(key, env[key])

    def run(*args):
        err = io.StringIO()
        monkeypatch.setattr(console, "err", Console(file=err, width=300, no_color=True))
        result = CliRunner().invoke(command, list(args))
        return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=err.getvalue())

    return run


def _bucket_run(pc, trained, run: str, *, checkpoint: bool = True, template: contract.Template | None = None,
                bundles: Path | None = None, labelled: bool = True) -> str:
    """A finished run as `tpuctl run` leaves it: its labelled bucket with launch.json, the job bundle, data and model."""
    from tpuctl.jobs import bundle, cluster

    template = template or trained["template"]
    name = f"{run}-{pc.project}"[:63]
    bucket = pc.storage.bucket(name)
    if labelled:
        bucket.labels = {"tpuctl-run": run}
    pc.storage.create_bucket(bucket, location="europe-west4")
    data = f"gs://{name}/runs/{run}/data"
    config = bundle.job_config({}, preset=None, bucket=name, run=run, data_url=data)
    job = bundle.JobDescription(run=run, project=pc.project, bucket=name, module=template.entry_module, config=config)
    b = bundle.build(template.root, job, bundles or Path(trained["model_dir"]).parent / "bundles",
                     packages=template.uses)
    bundle.upload(pc.storage, name, b)
    cluster.save_launch(pc, cluster.LaunchRecord(run=run, zone="europe-west4-a", node=run, bucket=name,
                                                 bundle_object=b.object_name, bundle_sha=b.sha256, python="python3",
                                                 workers=1, max_recoveries=0, launched=0.0))
    for local, prefix in ((trained["data_dir"], f"runs/{run}/data"), (trained["model_dir"], f"runs/{run}/model")):
        for f in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            if checkpoint or "checkpoints" not in f.parts:
                bucket.blob(f"{prefix}/{f.relative_to(local).as_posix()}").upload_from_filename(str(f))
    return name


def test_cli_exports_a_run_from_its_bucket_after_the_tpu_is_gone(trained, exported, env, pc, tmp_path):
    _bucket_run(pc, trained, "r1")
    p = tpuctl(env, "export", "r1", "--format", "hf", "--out", str(tmp_path / "hf"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["template"] == trained["name"] and set(doc["files"]) == {f.name for f in exported.iterdir()}
    for f in exported.iterdir():  # the same bytes as the export made from local files
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("trained", ["bert"], indirect=True)  # one template is enough here
def test_a_bucket_without_labels_is_found_in_the_ledger_or_given(trained, cli, pc, tmp_path):
    from tpuctl import ledger

    name = _bucket_run(pc, trained, "r5", labelled=False)
    _one_error(cli("export", "r5", "--out", str(tmp_path / "x")), 2, "error: run: run r5 has no bucket")
    for how in (("r5", "--bucket", name), (f"gs://{name}/runs/r5",)):
        p = cli("export", *how, "--out", str(tmp_path / how[-1][-6:]))
        assert p.returncode == 0, p.stderr
    ledger.Ledger().record([ledger.Entry(kind="bucket", name=name, project=pc.project, location="europe-west4",
                                         run="r5", owner=None, created=1.0)])
    p = cli("export", "r5", "--out", str(tmp_path / "ledger"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ledger" / "model.safetensors").is_file()
    ledger.Ledger().mark_deleted([f"{pc.project}/bucket/europe-west4/{name}"])
    _one_error(cli("export", "r5", "--out", str(tmp_path / "x")), 2, f"error: run: run r5's bucket {name} was deleted")


@pytest.mark.parametrize("trained", ["bert"], indirect=True)  # one template is enough here
def test_cli_bad_run_name_no_bucket_and_no_checkpoint_are_one_line_errors(trained, cli, pc, tmp_path):
    out = str(tmp_path / "hf")
    _one_error(cli("export", "Bad_Name", "--out", out), 2, "error: name: invalid run name 'Bad_Name'")
    _one_error(cli("export", "nobody", "--out", out), 2, "error: run: run nobody has no bucket")
    _bucket_run(pc, trained, "r2", checkpoint=False)
    line = _one_error(cli("export", "r2", "--out", out), 2, "error: run: run r2 has nothing to export yet")
    assert "runs/r2/model/checkpoints/checkpoint" in line
    _one_error(cli("export", "r2", "--format", "onnx", "--out", out), 2, "error: format:")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("trained", ["gpt2"], indirect=True)  # one template is enough here
def test_an_exporter_missing_its_libraries_says_which_to_install(trained, cli, pc, tmp_path, monkeypatch):
    import sys

    _bucket_run(pc, trained, "r6")
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # as on a base install without the train extra
    line = _one_error(cli("export", "r6", "--out", str(tmp_path / "hf")), 2, "error: format: the gpt2 template's hf "
                      "exporter needs the Python package safetensors")
    assert "Traceback" not in line and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("trained", ["bert"], indirect=True)  # one template is enough here
def test_a_user_templates_exporter_comes_from_this_machine_never_from_the_bucket(trained, cli, env, pc, tmp_path):
    """A user's template is not installed: the export loads the bundle this machine built for the run (checked by
    its sha256), or the directory given; a bundle only the bucket holds (the TPU's service account can write
    there) is never run. The template is a copy of bert declaring its exporter under a format the built-in lacks."""
    from test_templates_contract import copy_template

    mine = copy_template(tmp_path / "templates")
    meta = json.loads((mine / "template.json").read_text())
    meta["exporters"] = {"transformers": "export:to_hf"}
    (mine / "template.json").write_text(json.dumps(meta))
    _bucket_run(pc, trained, "r3", template=contract.load(mine), bundles=Path(env["TPUCTL_HOME"]) / "bundles")
    p = cli("export", "r3", "--format", "transformers", "--out", str(tmp_path / "hf"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "vocab.txt").is_file()
    _one_error(cli("export", "r3", "--format", "hf", "--out", str(tmp_path / "x")), 2,
               "error: format: template bert has no 'hf' exporter")

    _bucket_run(pc, trained, "r4", template=contract.load(mine))  # its bundle is in the bucket, not here
    _one_error(cli("export", "r4", "--format", "transformers", "--out", str(tmp_path / "x")), 2,
               "error: template: run r4 ran the template 'mine', which is not built in")
    p = cli("export", "r4", "--format", "transformers", "--template", str(mine), "--out", str(tmp_path / "y"))
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "x").exists()


def test_run_refuses_an_export_format_its_template_lacks_before_creating_anything(cli):
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "gpt2-tiny.yaml")
    _one_error(cli("run", spec, "--dry-run", "--export", "onnx"), 2,
               "error: format: template gpt2 has no 'onnx' exporter")
    p = cli("run", spec, "--dry-run", "--export", "hf", "--json")
    assert p.returncode == 0, p.stderr


def test_loading_the_exporters_imports_no_framework():
    """Every CLI command loads the templates' contract: their exporters must not pull TensorFlow, Keras, numpy or
    safetensors into it (an export imports what it needs when it runs)."""
    import subprocess
    import sys

    code = ("import sys; from tpuctl.templates import contract; ts = contract.builtins(); "
            "assert all('hf' in t.exporters for t in ts); "
            "print(sorted(m for m in ('tensorflow', 'keras', 'jax', 'numpy', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
