"""The masked-LM head projects to the vocabulary only at the gathered masked positions, on both Keras backends,
with the same loss and accuracy (the template's and Keras' own) as projecting every position and weighting by the
mask."""

from __future__ import annotations

import pytest

from conftest import on_jax

pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.tf, pytest.mark.timeout(180)]

VOCAB, BATCH, PREDICTIONS = 300, 8, 20


def check_gathered_head_matches_full_sequence() -> str:
    """Builds bert-tiny (random weights), masks one batch, and compares the model's gathered [B, P, V] head with
    the same weights applied at all L positions; raises AssertionError on a mismatch. Returns the backend."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tpuctl.templates.bert import config
    from tpuctl.templates.bert.data import mask_tokens
    from tpuctl.templates.lmkit.layers import SparseSoftmaxCrossEntropy, TopOneAccuracy
    from tpuctl.templates.bert.model import build_model

    keras.utils.set_random_seed(3)
    task = config.build({"preset": "bert-tiny"}).task
    assert task.predictions_per_seq == PREDICTIONS
    model = build_model(task, vocab_size=VOCAB)
    ids = np.random.default_rng(0).integers(5, VOCAB, size=(BATCH, task.seq_len)).astype("int32")
    ids[:, 0], ids[:, 100], ids[:, 101:] = 2, 3, 0  # [CLS] ... [SEP] [PAD]...
    masked, positions, labels, weights = (np.asarray(t) for t in mask_tokens(
        tf.constant(ids), vocab_size=VOCAB, special_ids=[0, 1, 2, 3, 4], mask_id=4, rate=0.15,
        max_predictions=PREDICTIONS, seed=[3, 0]))
    inputs = {"input_ids": masked, "input_mask": (ids != 0).astype("int32"), "masked_positions": positions}

    logits = np.asarray(model(inputs))
    assert logits.shape == (BATCH, PREDICTIONS, VOCAB), logits.shape

    gather = model.get_layer("masked_positions_gather")
    hidden = keras.Model(model.inputs, gather.input[0])(inputs)  # [B, L, H]: the encoder's output
    head = model.get_layer("mlm_norm")(model.get_layer("mlm_transform")(hidden))
    full_logits = np.asarray(model.get_layer("token_embedding")(head, reverse=True))
    assert full_logits.shape == (BATCH, task.seq_len, VOCAB)
    full_weights = np.zeros(ids.shape, "float32")
    np.put_along_axis(full_weights, positions, weights, axis=1)  # weight-0 slots add nothing
    assert full_weights.sum() == weights.sum() > 0

    def loss_and_accuracy(y, p, w, *, ours: bool):
        """What the template compiles (lmkit/layers.py) or Keras' own."""
        loss = (SparseSoftmaxCrossEntropy() if ours else keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"))
        accuracy = TopOneAccuracy() if ours else keras.metrics.SparseCategoricalAccuracy()
        accuracy.update_state(y, p, sample_weight=w)
        return float(loss(y, p, sample_weight=w)), float(accuracy.result())

    gathered = loss_and_accuracy(labels, logits, weights, ours=True)
    for ours in (True, False):
        full = loss_and_accuracy(ids, full_logits, full_weights, ours=ours)
        np.testing.assert_allclose(gathered, full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits[weights == 1],
                               np.take_along_axis(full_logits, positions[..., None], axis=1)[weights == 1],
                               rtol=1e-4, atol=1e-5)
    return keras.backend.backend()


def test_gathered_head_matches_the_full_sequence_head_on_tensorflow():
    assert check_gathered_head_matches_full_sequence() == "tensorflow"


@pytest.mark.slow  # ~22 s (a fresh JAX interpreter); the same check on TensorFlow stays in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
def test_gathered_head_matches_the_full_sequence_head_on_jax():
    assert on_jax("test_bert_head", "check_gathered_head_matches_full_sequence") == "jax"


def test_gather_positions_is_take_along_axis_with_or_without_xla():
    """Without XLA the gather is a one-hot matmul (its gradient a matmul too, not a scatter into zeros); with
    XLA take_along_axis. Both give the rows at the positions exactly, and a position gathered twice (padding
    slots repeat position 0) gets both rows' gradients."""
    import numpy as np
    import tensorflow as tf

    from tpuctl.templates.bert.model import GatherPositions

    rng = np.random.default_rng(6)
    x = tf.constant(rng.normal(size=(3, 16, 8)).astype("float32"))
    positions = tf.constant([[1, 5, 0, 0], [15, 2, 3, 4], [7, 7, 0, 9]], "int32")
    upstream = tf.constant(rng.normal(size=(3, 4, 8)).astype("float32"))
    want = np.take_along_axis(x.numpy(), positions.numpy()[..., None], axis=1)
    want_grad = np.zeros(x.shape, "float32")
    for b, row in enumerate(positions.numpy()):
        for p, position in enumerate(row):
            want_grad[b, position] += upstream[b, p].numpy()
    layer = GatherPositions()

    def gathered(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = layer(v, positions)
        return y, tape.gradient(y, v, output_gradients=upstream)

    for call in (gathered, tf.function(gathered), tf.function(gathered, jit_compile=True)):
        got, grad = call(x)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-6, atol=1e-7)
