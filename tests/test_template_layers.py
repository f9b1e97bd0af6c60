"""bert/layers.py on both Keras backends: SelfAttention is Keras MultiHeadAttention (same variables under the same
names, same outputs for a padding mask and for the causal mask), and Dropout on random bytes drops the rounded
rate, keeps the expectation, draws a new mask per call and is the identity outside training."""

from __future__ import annotations

import pytest

from conftest import on_jax

pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.tf, pytest.mark.timeout(180)]


def check_layers() -> str:
    """Raises AssertionError on any difference; returns the backend it ran on."""
    import keras
    import numpy as np

    from tpuctl.templates.bert.layers import Dropout, SelfAttention, quantized_rate

    keras.utils.set_random_seed(7)
    batch, length, hidden, heads = 3, 12, 16, 4
    x = np.random.default_rng(0).normal(size=(batch, length, hidden)).astype("float32")
    key_mask = np.ones((batch, length), "int32")
    key_mask[1, 5:] = 0  # a padded sequence: its queries may look only at the first 5 keys
    for causal in (False, True):
        ours = SelfAttention(heads, hidden // heads, dropout=0.1, causal=causal, name="attention")
        keras_mha = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=0.1, name="attention")
        got = np.asarray(ours(x, None if causal else key_mask))
        mask = None if causal else key_mask[:, None, :].astype(bool)
        keras_mha(x, x, attention_mask=mask, use_causal_mask=causal)
        theirs = {v.path: v for v in keras_mha.weights}
        assert sorted(v.path for v in ours.weights) == sorted(theirs)  # checkpoints and exports read them as before
        for v in ours.weights:
            assert tuple(v.shape) == tuple(theirs[v.path].shape), v.path
            theirs[v.path].assign(v.numpy())
        want = np.asarray(keras_mha(x, x, attention_mask=mask, use_causal_mask=causal))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # Training draws dropout on the probabilities: outputs differ from inference, and between calls.
        first, second = (np.asarray(ours(x, None if causal else key_mask, training=True)) for _ in range(2))
        assert not np.allclose(first, got) and not np.allclose(first, second)

    assert quantized_rate(0.1) == 26 / 256 and quantized_rate(0.001) == 0.0
    layer = Dropout(0.1)
    ones = np.ones((64, 1001), "float32")  # 64064 elements: not a whole number of 32-bit draws per row
    assert np.array_equal(np.asarray(layer(ones)), ones)  # inference: the identity
    first, second = (np.asarray(layer(ones, training=True)) for _ in range(2))
    dropped = (first == 0).mean()
    assert abs(dropped - quantized_rate(0.1)) < 0.006, dropped  # 5 sigma at n = 64064
    np.testing.assert_allclose(first[first != 0], 256 / 230, rtol=1e-6)
    assert abs(first.mean() - 1) < 0.01
    assert (first != second).mean() > 0.1  # a fresh mask every call
    assert np.array_equal(np.asarray(Dropout(0.001)(ones, training=True)), ones)  # rounds to no dropout
    return keras.backend.backend()


def test_layers_match_keras_on_tensorflow():
    assert check_layers() == "tensorflow"


@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
def test_layers_match_keras_on_jax():
    assert on_jax("test_template_layers", "check_layers") == "jax"
