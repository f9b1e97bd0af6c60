"""The GPT-2 template: byte-level BPE and packing (no TensorFlow), the causal model, training with resume, and
one end-to-end gpt2-tiny run on the local cloud."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from test_data_prepare import read_records, write_corpus
from tpuctl.templates.gpt2 import config
from tpuctl.templates.gpt2 import prepare as prep

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step=(\d+) loss=(\S+) accuracy=(\S+) learning_rate=(\S+) examples_per_sec=(\S+) time=[\d.]+$")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("gpt2-corpus") / "corpus.txt", documents=600, seed=3)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, prep.Manifest]:
    out = tmp_path_factory.mktemp("gpt2-data") / "prepared"
    manifest = prep.prepare([str(corpus)], out, prep.PrepareOptions(vocab_size=600, seq_len=32, shard_sequences=100))
    return out, manifest


def documents(path: Path) -> list[str]:
    return [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]


# ---------------------------------------------------------------------------------------- data (no TF)

def test_bpe_files_are_gpt2s_and_round_trip_any_text(prepared):
    from tokenizers import Tokenizer, models

    out, manifest = prepared
    vocab = json.loads((out / "vocab.json").read_text())
    assert vocab[prep.EOT] == manifest.special_ids[prep.EOT] and len(vocab) == manifest.vocab_size
    assert (out / "merges.txt").read_text().startswith("#version")
    # vocab.json + merges.txt alone (what GPT2Tokenizer reads) load as the same BPE model.
    assert models.BPE.from_file(str(out / "vocab.json"), str(out / "merges.txt")) is not None
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("plain words.\nA second line", "  spaces, tabs\tand ünïcödé 한국어 🙂", "never seen: qzxj"):
        assert tok.decode(tok.encode(text).ids) == text  # byte-level: nothing is unknown, nothing is lost


def test_packing_joins_documents_with_eot_into_full_blocks(prepared, corpus):
    from tokenizers import Tokenizer

    out, manifest = prepared
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = manifest.special_ids[prep.EOT]
    rows = np.concatenate([read_records(out / s.path, 32) for s in manifest.shards])
    assert rows.shape == (manifest.sequences, 32) and manifest.record_format == "raw-uint16-le"
    assert [s.sequences for s in manifest.shards][:-1] == [100] * (len(manifest.shards) - 1)
    expected: list[int] = []
    for doc in documents(corpus):
        expected += tok.encode(doc).ids + [eot]
    n = len(expected) // 32
    assert manifest.sequences == n and manifest.documents == len(documents(corpus))
    assert rows.reshape(-1).tolist() == expected[: n * 32]  # blocks cross documents; only the tail is dropped
    assert manifest.tokenizer["dropped_tail_tokens"] == len(expected) - n * 32


def test_runs_of_lines_encode_to_the_ids_of_their_lines_and_of_the_whole_document(prepared):
    """The encoder gets runs of a document's lines (fewer, longer inputs): every cut, whatever run size, must give
    the ids of the lines encoded one by one, which are the ids of the document encoded whole."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(prepared[0] / "tokenizer.json"))
    docs = [["First line.", "'s a contraction", "42 is a number", "한국어 줄", "- a dash", "tab\tinside", "🙂 last"],
            ["single line"], ["x", "y", "z"]]
    texts = [line for doc in docs for line in doc]
    ends = [i == len(doc) - 1 for doc in docs for i in range(len(doc))]
    per_line = [tok.encode(t if end else t + "\n").ids for t, end in zip(texts, ends)]
    whole = [tok.encode("\n".join(doc)).ids for doc in docs]
    def flat(id_lists):
        return [i for ids in id_lists for i in ids]

    assert flat(per_line) == flat(whole)
    for run_chars in (1, 12, 40, 1 << 10):
        runs, run_ends = prep.document_runs(texts, ends, run_chars)
        assert sum(run_ends) == len(docs) and run_ends[-1]
        assert "".join(runs) == "".join(t if end else t + "\n" for t, end in zip(texts, ends))
        assert flat(e.ids for e in tok.encode_batch_fast(runs, add_special_tokens=False)) == flat(per_line)
    assert len(prep.document_runs(texts, ends, 1 << 10)[0]) == len(docs)  # one run per short document


def test_prepared_bytes_are_at_most_half_the_raw_text(tmp_path):
    corpus = REPO / "examples" / "data" / "corpus.txt"
    m = prep.prepare([str(corpus)], tmp_path / "p", prep.PrepareOptions(vocab_size=8000, seq_len=128))
    assert m.prepared_bytes <= 0.5 * m.raw_bytes, (m.prepared_bytes, m.raw_bytes)


def test_a_corpus_smaller_than_one_block_is_refused(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("just a few words.\n")
    with pytest.raises(prep.DataError, match="fewer than one 1024-token block"):
        prep.prepare([str(small)], tmp_path / "out", prep.PrepareOptions(vocab_size=300))
    assert not (tmp_path / "out").exists()


def test_presets_and_config_rules():
    assert config.build({"preset": "gpt2-small"}).task.seq_len == 1024
    assert config.parameter_count("gpt2-small") == 124_439_808  # GPT-2 small, tied embeddings
    with pytest.raises(config.ConfigError, match="per_replica_batch_size"):
        config.build({"preset": "gpt2-tiny", "trainer": {"per_replica_batch_size": 20}})
    with pytest.raises(config.ConfigError, match="task.seq_len"):
        config.build({"task": {"seq_len": 100}})


# ------------------------------------------------------------------------------------------- model (TF)

def _task(**kw) -> config.TaskConfig:
    return config.with_overrides(config.build({"preset": "gpt2-tiny"}), task={
        "seq_len": 16, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
        "dropout": 0.0, **kw}).task


@pytest.mark.tf
def test_model_shapes_tied_embeddings_and_causal_mask():
    pytest.importorskip("tensorflow")
    from tpuctl.templates.gpt2.model import build_model

    model = build_model(_task(), vocab_size=50)
    ids = np.random.default_rng(0).integers(0, 50, size=(2, 16)).astype("int32")
    logits = np.asarray(model({"input_ids": ids}))
    assert logits.shape == (2, 16, 50) and logits.dtype == np.float32
    # Tied: the only [vocab, hidden] weight is the token embedding; the count is GPT-2's formula.
    assert [tuple(w.shape) for w in model.weights if 50 in tuple(w.shape)] == [(50, 32)]
    h, i, L = 32, 64, 16
    assert model.count_params() == 50 * h + L * h + 2 * (4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h) + 2 * h
    changed = ids.copy()
    changed[:, 9:] = (changed[:, 9:] + 1) % 50  # change every token from position 9 on
    after = np.asarray(model({"input_ids": changed}))
    np.testing.assert_allclose(after[:, :9], logits[:, :9], atol=1e-5)  # earlier positions cannot see it
    assert not np.allclose(after[:, 9:], logits[:, 9:])


def check_trainer() -> str:
    """CausalLMTrainer (the tied head's loss differentiated straight into the hidden states and the embedding)
    trains exactly as the model with the cross-entropy of its logits: the same losses, accuracies and weights
    after 12 AdamW steps, with each block's last position weighted 0 (TensorFlow without and with XLA; JAX).
    On JAX also the TPU's loss and accuracy (the head's Pallas kernels, in Pallas' interpreter; the TPU's
    attention kernel is not for a CPU). Returns the backend."""
    import keras

    from tpuctl.templates.lmkit import layers
    from tpuctl.templates.lmkit.layers import AdamW, SparseSoftmaxCrossEntropy, TopOneAccuracy
    from tpuctl.templates.gpt2.model import CausalLMTrainer, TokenLoss, build_model

    rng = np.random.default_rng(2)
    ids = rng.integers(0, 50, size=(8, 16)).astype("int32")
    labels, weights = np.roll(ids, -1, axis=1), np.ones(ids.shape, "float32")
    weights[:, -1] = 0
    tensorflow = keras.backend.backend() == "tensorflow"
    policy = keras.config.dtype_policy()  # process-global: pinned here, put back after
    keras.config.set_dtype_policy("float32")  # the equality is float32's: bfloat16 rounds the two paths apart
    try:
        for jit in (False, True) if tensorflow else (True,):
            runs = []
            for variant in ("logits", "fused", *(() if tensorflow else ("tpu",))):
                if variant == "tpu":  # the TPU's head kernels, in Pallas' interpreter
                    layers.tpu_target = lambda: True
                keras.utils.set_random_seed(0)
                model = build_model(_task(), vocab_size=50)
                trainer, loss = ((model, SparseSoftmaxCrossEntropy()) if variant == "logits" else
                                 (CausalLMTrainer(model), TokenLoss()))
                trainer.compile(optimizer=AdamW(1e-2), loss=loss, weighted_metrics=[TopOneAccuracy()], jit_compile=jit)
                history = trainer.fit({"input_ids": ids}, labels, sample_weight=weights, batch_size=4, epochs=6,
                                      shuffle=False, verbose=0).history
                runs.append((history, [np.asarray(w) for w in model.weights]))
            (want, want_weights), *others = runs
            assert want["loss"][-1] < want["loss"][0] - 0.5  # it learned: the comparison is not of two idle models
            for got, got_weights in others:
                np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
                np.testing.assert_allclose(got["accuracy"], want["accuracy"], atol=1e-6)
                for a, b in zip(got_weights, want_weights):
                    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    finally:
        keras.config.set_dtype_policy(policy)
    return keras.backend.backend()


@pytest.mark.slow  # ~25 s; GPT-2 trains in the fast tier: test_training_lowers_the_loss_and_resumes_from_the_checkpoint
@pytest.mark.tf
def test_the_trainer_trains_as_the_cross_entropy_of_the_logits_on_tensorflow():
    pytest.importorskip("tensorflow")
    assert check_trainer() == "tensorflow"


@pytest.mark.slow  # ~20 s (a fresh interpreter with JAX); see its TensorFlow twin above
def test_the_trainer_trains_as_the_cross_entropy_of_the_logits_on_jax():
    pytest.importorskip("jax")
    from conftest import on_jax

    assert on_jax("test_gpt2", "check_trainer", timeout=300) == "jax"  # three trainings, one the TPU's head


def fused_head_matches_the_cross_entropy() -> str:
    """(In a fresh JAX interpreter.) The TPU head's Pallas kernels (fused_head), run in Pallas' interpreter, give
    the cross-entropy, the first-argmax accuracy and the gradients of the logits hidden @ embeddings^T computed
    whole, without a bias (GPT-2's head) and with one (BERT's): with tiles of 128 (the gradient's: 256 vocabulary
    rows), 300 tokens and a vocabulary of 1000 span 3 x 8 tiles, both padded (the online softmax rescales across
    vocabulary tiles), and duplicated embedding rows make ties, which the first index wins."""
    from tpuctl.templates import aot

    aot.compile_only()  # before JAX: where libtpu is installed, its lock must not stop another process's compile
    import jax
    import jax.numpy as jnp

    from tpuctl.templates.lmkit import fused_head

    tiles = fused_head.Tiles(tokens=128, vocab=128, grad_tokens=128, grad_vocab=256)
    tokens, width, vocab = 300, 32, 1000
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(vocab, width)).astype("float32")
    embeddings[500:510] = embeddings[990:1000] = embeddings[0:10]  # ties across tiles: indices 0-9 must win
    hidden = rng.normal(size=(tokens, width)).astype("float32") * 2
    hidden[:60] = embeddings[rng.integers(0, 10, 60)] * 4  # confidently one of the tied rows
    labels = rng.integers(0, vocab, tokens).astype("int32")
    labels[:20], labels[20:40], labels[40:60] = np.arange(20) % 10, 500 + np.arange(20) % 10, 990 + np.arange(20) % 10
    weights = rng.uniform(size=tokens).astype("float32")
    bias = rng.normal(size=vocab).astype("float32")
    bias[500:510] = bias[990:1000] = bias[0:10]  # the ties stay ties

    def whole(hidden, embeddings, bias):
        logits = hidden @ embeddings.T + (0.0 if bias is None else bias)
        loss = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        # The copies' logits made the originals' exactly: a CPU's matmul may sum one column's products in another
        # order than another's (a vector tail), and the first index can only win a tie that is one.
        tied = jnp.asarray(logits).at[:, 500:510].set(logits[:, 0:10]).at[:, 990:1000].set(logits[:, 0:10])
        return loss, (jnp.argmax(tied, -1) == labels).astype("float32")  # argmax: the first index wins

    def fused(hidden, embeddings, bias):
        return fused_head.fused_softmax_cross_entropy(jnp.asarray(labels), hidden, embeddings, bias, tiles, True,
                                                      bias is not None)  # and the gradients behind the barrier

    for b in (None, bias):
        (want_loss, want_correct), (loss, correct) = whole(hidden, embeddings, b), fused(hidden, embeddings, b)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(correct, want_correct)
        assert 0 < want_correct[:60].sum() < 60  # the tied rows' labels: the first index right, the copies wrong
        want, got = (jax.grad(lambda h, e, b: jnp.sum(f(h, e, b)[0] * weights), argnums=(0, 1, 2))(
                         hidden, embeddings, b) for f in (whole, fused))
        assert (got[2] is None) == (b is None)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    return "jax"


def head_lowered_for_a_tpu() -> str:
    """(In a fresh JAX interpreter.) GPT-2's TPU head (fused_softmax_cross_entropy) and its gradient lowered for a
    v5e 2x2 that is not there at gpt2-tiny's sizes (seq 128, vocab 8000, batch 64 a chip): two Pallas kernels
    (forward; the embeddings' gradient), and no tensor in the program anywhere near the [tokens, vocab] logits
    (with the head as XLA ops they were 375 of the step's 458 MiB of temporaries)."""
    from tpuctl.templates import aot

    aot.compile_only()
    import jax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpuctl.templates.lmkit import layers

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    mesh = Mesh(np.array(devices), ("batch",))
    layers.use_tpu_kernels(mesh)
    batch, length, hidden, vocab = 64 * len(devices), 128, 128, 8000
    split, replicated = NamedSharding(mesh, PartitionSpec("batch")), NamedSharding(mesh, PartitionSpec())

    def loss(h, embeddings, labels):
        return layers.fused_softmax_cross_entropy(labels, h, embeddings)[0].sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        jax.ShapeDtypeStruct((batch, length, hidden), "bfloat16", sharding=split),
        jax.ShapeDtypeStruct((vocab, hidden), "float32", sharding=replicated),
        jax.ShapeDtypeStruct((batch, length), "int32", sharding=split)).as_text()
    assert text.count("@tpu_custom_call") == 2, "not the head's two kernels"
    largest = max(math.prod(int(d) for d in dims.split("x")) for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)
                  for dims in [dims.rstrip("x")])
    assert largest < 64 * length * vocab // 4, f"a tensor of {largest} elements: the logits are in the program"
    return "jax"


def tpu_attention_matches_xlas() -> str:
    """(In a fresh JAX interpreter.) SelfAttention's TPU form (use_tpu_kernels: its projections as einsums into and
    out of heads-first [B, heads, L, head_dim], the splash kernel in Pallas' interpreter) computes what its XLA
    form does, causal and with a key mask, and so do the gradients of its input and of its eight weights: with
    q, k and v three einsums, and one of the stacked kernels (FUSED_QKV: a tpu7x's form, here on the CPU). The keys'
    bias is not in the TPU form."""
    from tpuctl.templates import aot

    aot.compile_only()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from tpuctl.templates.lmkit import layers

    batch, length, heads, head_dim = 2, 128, 2, 64
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, length, heads * head_dim)), "float32")
    key_mask = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [90]]), "int32")  # one padded
    fused_kinds = layers.FUSED_QKV
    cases = [(causal, mask, fused) for fused in ((), (jax.devices()[0].device_kind,))
             for causal, mask in ((True, None), (False, key_mask))]
    for causal, mask, fused in cases:
        layers.FUSED_QKV = fused
        layer = layers.SelfAttention(heads, head_dim, causal=causal, seed=1)
        layer.build(x.shape)
        weights = [jnp.asarray(rng.normal(size=v.shape) * 0.1, "float32") for v in layer.trainable_variables]
        seeds = [v.value for v in layer.non_trainable_variables]

        def loss(weights, x):
            out, _ = layer.stateless_call(weights, seeds, x, key_mask=mask)
            real = 1.0 if mask is None else mask[:, :, None]  # a padding position's output is nobody's
            return jnp.sum(out * real * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

        try:
            layers.use_tpu_kernels(Mesh(np.array(jax.devices()[:1]), ("batch",)))
            tpu = jax.value_and_grad(loss, argnums=(0, 1))(weights, x)
        finally:
            layers.use_tpu_kernels(None)
        xla = jax.value_and_grad(loss, argnums=(0, 1))(weights, x)
        for a, b in zip(jax.tree.leaves(tpu), jax.tree.leaves(xla)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4, err_msg=f"causal={causal}, fused={fused}")
        # The TPU form leaves the keys' bias out (the softmax cancels it): its gradient is 0, not rounding noise.
        key_bias = [v.path for v in layer.trainable_variables].index(layer.key.bias.path)
        assert not np.any(tpu[1][0][key_bias]), f"the keys' bias is in the TPU form (fused={fused})"
    layers.FUSED_QKV = fused_kinds
    return "jax"


def no_kernels_where_mosaic_has_no_bfloat16_matmul() -> str:
    """(In a fresh JAX interpreter.) On TPU v2 and v3 the Pallas kernels are off (their Mosaic refuses a bfloat16
    matmul: compiling gpt2-tiny's step with splash attention for a v3-8 failed so), on v4 they are on."""
    from tpuctl.templates import aot

    aot.compile_only()
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from tpuctl.templates.lmkit import layers

    try:
        for topology, kernels in (("v2:2x2", False), ("v3:2x2", False), ("v4:2x2x1", True)):
            devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
            layers.use_tpu_kernels(Mesh(np.array(devices), ("batch",)))
            assert layers.tpu_target() is kernels, topology
    finally:
        layers.use_tpu_kernels(None)
    return "jax"


@pytest.fixture(scope="module")
def tpu_head() -> dict[str, str]:
    from conftest import on_jax_each

    return on_jax_each("test_gpt2", ("fused_head_matches_the_cross_entropy", "head_lowered_for_a_tpu",
                                     "no_kernels_where_mosaic_has_no_bfloat16_matmul", "tpu_attention_matches_xlas"))


def test_the_tpu_attention_computes_what_xlas_does(tpu_head):
    assert tpu_head["tpu_attention_matches_xlas"] == "jax", tpu_head["tpu_attention_matches_xlas"]


def test_the_tpu_heads_kernels_compute_the_cross_entropy_and_its_gradients(tpu_head):
    assert tpu_head["fused_head_matches_the_cross_entropy"] == "jax", tpu_head["fused_head_matches_the_cross_entropy"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the TPU compiler (libtpu) is not installed")
def test_on_a_tpu_the_head_never_holds_the_whole_logits(tpu_head):
    assert tpu_head["head_lowered_for_a_tpu"] == "jax", tpu_head["head_lowered_for_a_tpu"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the TPU compiler (libtpu) is not installed")
def test_no_pallas_kernels_on_tpu_v2_and_v3(tpu_head):
    check = "no_kernels_where_mosaic_has_no_bfloat16_matmul"
    assert tpu_head[check] == "jax", tpu_head[check]


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_training_lowers_the_loss_and_resumes_from_the_checkpoint(prepared, tmp_path):
    pytest.importorskip("tensorflow")
    from tpuctl.templates.gpt2 import train

    data, _ = prepared

    def cfg(max_steps):
        return config.build({"preset": "gpt2-tiny", "task": {"seq_len": 32, "hidden_size": 64, "num_heads": 2},
                             "trainer": {"max_steps": max_steps, "per_replica_batch_size": 16, "steps_per_execution": 10,
                                         "log_every": 10, "checkpoint_every": 20, "warmup_steps": 5,
                                         "learning_rate": 3e-3, "base_batch_size": 16, "shuffle_buffer": 256},
                             "runtime": {"data_dir": str(data), "model_dir": str(tmp_path / "model"), "seed": 1}})

    first: list[str] = []
    m1 = train.run(cfg(40), log=first.append)
    losses = [float(m[2]) for m in map(STEP.match, first) if m]
    assert first[0].startswith("start ") and " step=0 " in first[0] and losses[-1] < losses[0]
    assert "checkpoint step=20 " in "\n".join(first) and m1["final_step"] == 40
    second: list[str] = []
    m2 = train.run(cfg(60), log=second.append)  # a rerun (after preemption, or with more steps) continues
    assert " step=40 " in second[0] and m2["final_step"] == 60
    assert [int(m[1]) for m in map(STEP.match, second) if m] == [50, 60]
    export = tmp_path / "model" / "export"
    assert {"model.keras", "vocab.json", "merges.txt", "tokenizer.json", "metrics.json"} <= {p.name for p in export.iterdir()}


def _worker_run(data: Path, model_dir: Path, framework: str, max_steps: int) -> list[str]:
    """One `python -m gpt2.train --replicas 2` from the templates directory, as a worker starts it (Keras fixes
    its backend at import, so each backend needs its own process)."""
    import subprocess
    import sys

    from test_bert_train import _worker_env

    cfg = model_dir.parent / f"{framework}-{max_steps}.json"
    cfg.write_text(json.dumps({
        "preset": "gpt2-tiny", "task": {"seq_len": 32, "hidden_size": 64},
        "trainer": {"max_steps": max_steps, "per_replica_batch_size": 8, "steps_per_execution": 10, "log_every": 10,
                    "checkpoint_every": 20, "warmup_steps": 5, "learning_rate": 3e-3, "base_batch_size": 16,
                    "shuffle_buffer": 256},
        "runtime": {"data_dir": str(data), "model_dir": str(model_dir), "framework": framework, "seed": 1}}))
    proc = subprocess.run([sys.executable, "-m", "gpt2.train", "--config", str(cfg), "--replicas", "2"],
                          cwd=model_dir.parent, env=_worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_on_jax_it_trains_checkpoints_and_resumes_across_backends(prepared, tmp_path):
    pytest.importorskip("jax")
    data, _ = prepared
    model_dir = tmp_path / "model"
    first = _worker_run(data, model_dir, "jax", 40)
    assert first[0].startswith("start backend=jax strategy=cpu processes=1 hosts=1 devices=2 per_replica_batch=8 "
                               "global_batch=16 step=0 max_steps=40 "), first[0]
    losses = {int(m[1]): float(m[2]) for m in map(STEP.match, first) if m}
    assert sorted(losses) == [10, 20, 30, 40] and losses[40] < losses[10] - 0.3, losses
    assert "checkpoint step=20 " in "\n".join(first)
    assert re.match(r"done step=40 loss=\S+ accuracy=\S+ export_dir=", first[-1]), first[-1]
    # The same checkpoints resume on the other backend: weights and optimizer state, not a fresh model.
    second = _worker_run(data, model_dir, "tensorflow", 50)
    assert second[0].startswith("start backend=tensorflow ") and " step=40 max_steps=50 " in second[0], second[0]
    resumed = {int(m[1]): float(m[2]) for m in map(STEP.match, second) if m}
    assert list(resumed) == [50] and resumed[50] < losses[10] - 0.3, (losses, resumed)
    metrics = json.loads((model_dir / "export" / "metrics.json").read_text())
    assert metrics["final_step"] == 50 and metrics["backend"] == "tensorflow" and "accuracy" in metrics
    assert {"ckpt-40.npz", "ckpt-50.npz", "checkpoint"} <= {p.name for p in (model_dir / "checkpoints").iterdir()}


# --------------------------------------------------------------------------------------- local cloud

@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.parametrize("where", [
    {},  # the example as written: TensorFlow on a v3-8
    # JAX on a v6e (no TensorFlow runtime there): the JAX base image, jax[tpu] from requirements-jax.txt
    {"accelerator": "v6e-4", "zone": "us-east5-a", "framework": "jax"},
], ids=["tensorflow-v3", "jax-v6e"])
def test_gpt2_tiny_runs_end_to_end_on_the_local_cloud(cloud, tmp_path, monkeypatch, where):
    from conftest import new_project
    from google.auth.credentials import AnonymousCredentials

    from tpuctl import spec as spec_mod
    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.provision.clients import build

    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    project = new_project()
    clients = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                    storage_host=cloud.storage_host, local=True)
    raw = yaml.safe_load((REPO / "examples" / "gpt2-tiny.yaml").read_text())
    raw["job"]["data"] = {"corpus": [str(REPO / "examples" / "data" / "*.txt")], "vocab_size": 2000}
    raw["job"]["config"] = {"trainer": {"max_steps": 20, "checkpoint_every": 10}}
    raw.update({k: v for k, v in where.items() if k != "framework"})
    if "framework" in where:
        raw["job"]["framework"] = where["framework"]
    spec = spec_mod.from_mapping(raw)
    p = Pipeline(clients, spec, options=RunOptions(yes=True, poll_s=1.0, export=("hf",)))
    o = p.run()
    assert o.state == "succeeded" and o.step == 20
    metrics = json.loads(clients.storage.bucket(o.bucket).blob(f"runs/{p.plan.run}/model/export/metrics.json")
                         .download_as_text())
    assert p.plan.framework == metrics["backend"] == where.get("framework", "tensorflow"), metrics
    assert any(a.startswith("checkpoints/ckpt-20") for a in o.artifacts), o.artifacts
    # --export hf: written from the bucket's checkpoint next to the other artifacts
    assert {"hf/model.safetensors", "hf/config.json", "hf/vocab.json", "hf/merges.txt", "hf/tokenizer.json",
            "hf/tokenizer_config.json"} <= set(o.artifacts)
    assert {"export/model.keras", "export/vocab.json", "export/merges.txt", "export/metrics.json"} <= set(o.artifacts)


# Hugging Face's gpt2-medium/-large/-xl config.json (OpenAI's GPT-2 sizes) and GPT2LMHeadModel.num_parameters()
# of each (tied lm_head, so counted once): the 355M, 774M and 1.5B of OpenAI's model cards.
PUBLISHED = {"gpt2-medium": (24, 1024, 16, 354_823_168), "gpt2-large": (36, 1280, 20, 774_030_080),
             "gpt2-xl": (48, 1600, 25, 1_557_611_200)}


def test_the_larger_gpt2_presets_have_the_published_sizes_and_export_as_them(prepared):
    """No model is built (gpt2-xl is 6 GB of float32): the count is checked against the variables export.py
    expects model.py to create, whose names and shapes the end-to-end export checks on a real checkpoint."""
    from click.testing import CliRunner

    from tpuctl.cli import cli
    from tpuctl.templates.gpt2 import export

    listed = json.loads(CliRunner().invoke(cli, ["templates", "--json"]).output)
    listed = {r["preset"]: r["parameters"] for r in listed if r["template"] == "gpt2"}
    for preset, (n_layer, n_embd, n_head, count) in PUBLISHED.items():
        task = vars(config.build({"preset": preset}).task)
        shapes = export._keras_shapes(task)
        assert sum(int(np.prod(s)) for s in shapes.values()) == config.parameter_count(preset) == count, preset
        assert listed[preset] == count
        hf = export.hf_config(task, prepared[1])
        assert (hf["n_layer"], hf["n_embd"], hf["n_head"], hf["vocab_size"], hf["n_positions"], hf["n_inner"]) == (
            n_layer, n_embd, n_head, 50257, 1024, 4 * n_embd), preset
