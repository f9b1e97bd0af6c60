"""lmkit/layers.py on both Keras backends: SelfAttention is Keras MultiHeadAttention (same variables under the same
names, same outputs for a padding mask and for the causal mask), and Dropout on random bytes drops the rounded
rate, keeps the expectation, draws a new mask per call and is the identity outside training, with either
generator (the hash under XLA, TensorFlow's Philox without); the hash's bytes are uniform and independent
between neighbours and between seeds; gelu is the exact GELU with its derivative, with or without XLA; the
loss and accuracy are Keras' sparse cross-entropy (value and gradient) and accuracy, ties included, on every
path (eager, graph, XLA)."""

from __future__ import annotations

import contextlib

import pytest

from conftest import in_fresh_interpreter, on_jax_each

pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.tf, pytest.mark.timeout(180)]

JAX_CHECKS = ("check_layer_norm", "check_loss_and_accuracy", "check_tied_loss", "check_layers", "check_hashed_bytes")


@pytest.fixture(scope="module")
def jax_checks() -> dict[str, str]:
    """Every check of this module on JAX, in one fresh interpreter (Keras fixes its backend at import) rather
    than one each: check -> "jax", or the traceback it raised."""
    return on_jax_each("test_template_layers", JAX_CHECKS)


@contextlib.contextmanager
def as_on_a_tpu():
    """lmkit's layers pick their TPU forms (tpu_target), on this host's devices."""
    from tpuctl.templates.lmkit import layers

    own, layers.tpu_target = layers.tpu_target, lambda: True
    try:
        yield
    finally:
        layers.tpu_target = own


def check_layers() -> str:
    """Raises AssertionError on any difference; returns the backend it ran on."""
    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import Dropout, SelfAttention, quantized_rate

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
        # The same gradients too, for the input and for every variable by name (the queries' scale is applied
        # to their kernel, the output projection is one matmul: neither may change what is learned).
        ours_grads = gradients(lambda v: ours(v, None if causal else key_mask), x, ours.trainable_weights)
        theirs_grads = gradients(lambda v: keras_mha(v, v, attention_mask=mask, use_causal_mask=causal), x,
                                 keras_mha.trainable_weights)
        np.testing.assert_allclose(ours_grads.pop("input"), theirs_grads.pop("input"), rtol=1e-4, atol=1e-5)
        for path, grad in ours_grads.items():
            np.testing.assert_allclose(grad, theirs_grads[path], rtol=1e-4, atol=1e-5, err_msg=path)
        # Training draws dropout on the probabilities: outputs differ from inference, and between calls.
        first, second = (np.asarray(ours(x, None if causal else key_mask, training=True)) for _ in range(2))
        assert not np.allclose(first, got) and not np.allclose(first, second)

    assert quantized_rate(0.1) == 26 / 256 and quantized_rate(0.001) == 0.0
    layer = Dropout(0.1)
    ones = np.ones((64, 1001), "float32")  # 64064 elements: not a whole number of 32-bit draws per row
    assert np.array_equal(np.asarray(layer(ones)), ones)  # inference: the identity
    calls = [lambda x: layer(x, training=True)]  # eager: JAX hashes, TensorFlow draws Philox bytes
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        calls.append(tf.function(calls[0], jit_compile=True))  # TensorFlow under XLA hashes
    for call in calls:
        first, second = (np.asarray(call(ones)) for _ in range(2))
        dropped = (first == 0).mean()
        assert abs(dropped - quantized_rate(0.1)) < 0.006, dropped  # 5 sigma at n = 64064
        np.testing.assert_allclose(first[first != 0], 256 / 230, rtol=1e-6)
        assert abs(first.mean() - 1) < 0.01
        assert (first != second).mean() > 0.1  # a fresh mask every call
    assert np.array_equal(np.asarray(Dropout(0.001)(ones, training=True)), ones)  # rounds to no dropout
    check_gelu()
    return keras.backend.backend()


def gradients(fn, x, variables, *, wrap=None) -> dict:
    """d sum(fn(x) * fixed random weights) / d x and / d each variable (by path), on either backend; on TensorFlow
    `wrap` (e.g. tf.function) wraps the computation, which is eager without it."""
    import keras
    import numpy as np

    upstream = np.random.default_rng(1).normal(size=np.shape(fn(x))).astype("float32")
    if keras.backend.backend() == "jax":
        import jax

        def loss(values, v):
            for variable, value in zip(variables, values):
                variable.assign(value)
            return (fn(v) * upstream).sum()

        saved = [variable.value for variable in variables]
        grads, grad_x = jax.grad(loss, argnums=(0, 1))(saved, x)
        for variable, value in zip(variables, saved):
            variable.assign(value)
    else:
        import tensorflow as tf

        def compute(v):
            with tf.GradientTape() as tape:
                tape.watch(v)
                y = tf.reduce_sum(fn(v) * upstream)
            return tape.gradient(y, [v, *variables])

        grad_x, *grads = (wrap or (lambda f: f))(compute)(tf.convert_to_tensor(x))
    found = {"input": np.asarray(grad_x), **{var.path: np.asarray(g) for var, g in zip(variables, grads)}}
    assert all(np.abs(g).max() > 0 for g in found.values()), "a gradient that is all zeros compares trivially"
    return found


def check_gelu() -> None:
    """`gelu` is x Phi(x) with derivative Phi(x) + x phi(x), eagerly and (TensorFlow) under XLA, where it is
    computed another way (erf, not TensorFlow's erfc kernel)."""
    import math

    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import gelu

    x = np.linspace(-9, 9, 721).astype("float32")
    phi = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.astype("float64")])
    want, want_grad = x * phi, phi + x * np.exp(-0.5 * x.astype("float64") ** 2) / math.sqrt(2 * math.pi)
    if keras.backend.backend() == "jax":
        import jax

        calls = [(lambda v: (gelu(v), jax.grad(lambda u: gelu(u).sum())(v)), True)]
    else:
        import tensorflow as tf

        def value_and_grad(v):
            v = tf.convert_to_tensor(v)
            with tf.GradientTape() as tape:
                tape.watch(v)
                y = gelu(v)
            return y, tape.gradient(y, v)

        calls = [(value_and_grad, False), (tf.function(value_and_grad, jit_compile=True), True)]
    if keras.backend.backend() == "jax":  # and as on a TPU in bfloat16, where its backward pass is written out
        import jax

        half = keras.ops.cast(x, "bfloat16")
        with as_on_a_tpu():
            got, grad = gelu(half), jax.grad(lambda u: keras.ops.cast(gelu(u), "float32").sum())(half)
        got, grad = (np.asarray(keras.ops.cast(t, "float32")) for t in (got, grad))
        rounded = np.asarray(keras.ops.cast(half, "float32"), "float64")
        cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in rounded])
        np.testing.assert_allclose(got, rounded * cdf, rtol=2**-7, atol=1e-6)
        np.testing.assert_allclose(grad, cdf + rounded * np.exp(-0.5 * rounded**2) / math.sqrt(2 * math.pi),
                                   rtol=2**-7, atol=1e-3)
    for call, compiled in calls:
        got, grad = (np.asarray(t) for t in call(x))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
        if not compiled:
            continue  # TensorFlow's own kernel, whatever its bfloat16 rounding (up to ~5% near x = -4)
        # bfloat16 (TPU training): within its rounding everywhere, negative tail included (-0.004 at x = -3).
        half = x[np.abs(x) <= 4]
        got = np.asarray(keras.ops.cast(call(keras.ops.cast(half, "bfloat16"))[0], "float32"))
        exact = np.asarray(keras.ops.cast(keras.ops.cast(half, "bfloat16"), "float32"), "float64")
        exact = exact * np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in exact])
        np.testing.assert_allclose(got, exact, rtol=2**-7, atol=1e-6)


def check_hashed_bytes() -> str:
    """The hash's bytes: uniform over 0-255 (chi-square), neighbours independent, and two seeds' streams
    unrelated at every offset up to 64 (a hash keyed by adding the seed to the index would make them shifted
    copies of each other)."""
    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import _hashed_bytes

    n, rate = 1 << 16, 26 / 256
    seeds = [np.array(s, "uint32" if keras.backend.backend() == "jax" else "int64") for s in ((1, 2), (1, 3), (2, 2))]
    streams = [np.asarray(_hashed_bytes((n,), s)).astype(np.int64) for s in seeds]
    for b in streams:
        assert b.min() >= 0 and b.max() <= 255
        counts = np.bincount(b, minlength=256)
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
        assert chi2 < 255 + 6 * (2 * 255) ** 0.5, chi2  # 255 degrees of freedom, 6 sigma
        drop = b < 26
        assert abs(drop.mean() - rate) < 0.006
        assert abs((drop[1:] & drop[:-1]).mean() - rate**2) < 0.003  # neighbours: rate^2, not rate
    a, *others = [b < 26 for b in streams]
    for other in others:
        for shift in range(-64, 65):
            both = (a[max(shift, 0):n + min(shift, 0)] & other[max(-shift, 0):n - max(shift, 0)]).mean()
            assert abs(both - rate**2) < 0.004, (shift, both)
    return keras.backend.backend()


def check_loss_and_accuracy() -> str:
    """SparseSoftmaxCrossEntropy and TopOneAccuracy against Keras' SparseCategoricalCrossentropy(from_logits=True)
    and SparseCategoricalAccuracy, weighted, on [B, L, V] logits with ties at the top; raises AssertionError on a
    difference, returns the backend."""
    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import SparseSoftmaxCrossEntropy, TopOneAccuracy

    rng = np.random.default_rng(5)
    batch, length, vocab = 4, 7, 300
    logits = (rng.normal(size=(batch, length, vocab)) * 4).astype("float32")
    labels = rng.integers(0, vocab, size=(batch, length)).astype("int32")
    top = logits.max(axis=-1)
    # Ties at the maximum: the first index wins, so (0, 0)'s label loses to index 3 and (0, 1)'s wins over 250.
    logits[0, 0, [3, labels[0, 0] % 200 + 10]] = top[0, 0] + 1
    labels[0, 0] = labels[0, 0] % 200 + 10
    logits[0, 1, [7, 250]] = top[0, 1] + 1
    labels[0, 1] = 7
    labels[1] = logits[1].argmax(axis=-1)  # a row of right answers
    weights = rng.integers(0, 2, size=(batch, length)).astype("float32")
    weights[:2, :2] = 1

    def run(ours: bool):
        loss = (SparseSoftmaxCrossEntropy() if ours else keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"))
        accuracy = TopOneAccuracy() if ours else keras.metrics.SparseCategoricalAccuracy()
        if keras.backend.backend() == "jax":
            import jax

            def value(x):
                return loss(labels, x, sample_weight=weights)

            def both(x):
                return jax.value_and_grad(value)(x), accuracy.stateless_update_state(
                    [v.value for v in accuracy.variables], labels, x, sample_weight=weights)

            return [((float(v), np.asarray(g)), float(t / c)) for (v, g), (t, c) in (both(logits),
                                                                                      jax.jit(both)(logits))]
        import tensorflow as tf

        def step():
            x = tf.constant(logits)
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(labels, x, sample_weight=weights)
            accuracy.reset_state()
            accuracy.update_state(labels, x, sample_weight=weights)
            return value, tape.gradient(value, x), accuracy.result()

        return [((float(v), np.asarray(g)), float(a)) for v, g, a in
                (step(), tf.function(step)(), tf.function(step, jit_compile=True)())]

    want = run(ours=False)[0]
    assert want[1] == ((labels == logits.argmax(axis=-1)) * weights).sum() / weights.sum()
    runs = run(ours=True)
    if keras.backend.backend() == "jax":  # and as on a TPU, the label's logit a select instead of a gather
        with as_on_a_tpu():
            runs += run(ours=True)
    for (value, gradient), accuracy in runs:
        np.testing.assert_allclose(value, want[0][0], rtol=1e-6)
        np.testing.assert_allclose(gradient, want[0][1], rtol=1e-5, atol=1e-9)
        assert accuracy == want[1], (accuracy, want[1])
    return keras.backend.backend()


def check_tied_loss() -> str:
    """tied_softmax_cross_entropy(labels, logits, hidden, E) against Keras' SparseCategoricalCrossentropy on
    logits = hidden @ E^T, weighted (zero weights included): the same loss and the same gradients for hidden and
    E, though it never forms the logits' gradient; eager, graph and XLA (TensorFlow), jit (JAX). Returns the
    backend."""
    import keras
    import numpy as np
    from keras import ops

    from tpuctl.templates.lmkit.layers import TokenLoss, tied_softmax_cross_entropy

    rng = np.random.default_rng(11)
    batch, length, width, vocab = 3, 8, 16, 300
    hidden = rng.normal(size=(batch, length, width)).astype("float32")
    table = (rng.normal(size=(vocab, width)) * 0.5).astype("float32")
    labels = rng.integers(0, vocab, size=(batch, length)).astype("int32")
    labels[0, :3] = 7  # repeated labels: their embedding row's gradient sums every token's
    weights = rng.integers(0, 2, size=(batch, length)).astype("float32")
    weights[0, :3] = 1
    keras_loss, token_loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"), TokenLoss()

    def theirs(h, e):
        return keras_loss(labels, ops.matmul(h, ops.transpose(e)), sample_weight=weights)

    def ours(h, e):
        logits = ops.matmul(h, ops.transpose(e))  # what the model's head computed: no gradient flows through it
        return token_loss(labels, tied_softmax_cross_entropy(labels, logits, h, e), sample_weight=weights)

    if keras.backend.backend() == "jax":
        import jax

        def run(fn):
            both = jax.value_and_grad(fn, argnums=(0, 1))
            return [both(hidden, table), jax.jit(both)(hidden, table)]
    else:
        import tensorflow as tf

        variable = keras.Variable(table)  # as the model's embedding: its gradient reaches the variable

        def run(fn):
            def both(h):
                h = tf.convert_to_tensor(h)
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    value = fn(h, variable)
                return value, tape.gradient(value, [h, variable.value])

            return [both(hidden), tf.function(both)(hidden), tf.function(both, jit_compile=True)(hidden)]

    (want, (want_h, want_e)), *_ = run(theirs)
    for value, (grad_h, grad_e) in run(ours):
        np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(grad_h), np.asarray(want_h), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad_e), np.asarray(want_e), rtol=1e-4, atol=1e-7)
    assert np.abs(np.asarray(want_h)).max() > 1e-3 and np.abs(np.asarray(want_e)).max() > 1e-3  # not vacuous
    # Mixed precision (TPU training): bfloat16 hidden states and head, float32 logits, loss and embedding gradient,
    # within bfloat16's rounding of the float32 gradients.
    def mixed(h, e):
        h = ops.cast(h, "bfloat16")
        logits = ops.cast(ops.matmul(h, ops.transpose(ops.cast(e, "bfloat16"))), "float32")
        return token_loss(labels, tied_softmax_cross_entropy(labels, logits, h, e), sample_weight=weights)

    for value, (grad_h, grad_e) in run(mixed):
        np.testing.assert_allclose(float(value), float(want), rtol=2e-2)
        for grad, exact in ((grad_h, want_h), (grad_e, want_e)):
            grad, exact = np.asarray(ops.cast(grad, "float32")), np.asarray(exact)
            assert np.abs(grad - exact).max() <= 2**-6 * np.abs(exact).max(), np.abs(grad - exact).max()
    return keras.backend.backend()


def check_layer_norm() -> str:
    """LayerNormalization is Keras': the same variables, outputs and gradients (input, gamma, beta) eagerly, in a
    plain tf.function (its own gradient) and under XLA (Keras' path), in float32 and from bfloat16 inputs."""
    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import LayerNormalization

    x = (np.random.default_rng(2).normal(size=(3, 5, 64)) * 3 + 1).astype("float32")
    ours, theirs = (cls(epsilon=1e-12, name="norm") for cls in (LayerNormalization, keras.layers.LayerNormalization))
    ours.build(x.shape), theirs.build(x.shape)
    assert [v.path for v in ours.weights] == [v.path for v in theirs.weights]  # checkpoints read them as before
    rng = np.random.default_rng(3)
    for a, b in zip(ours.weights, theirs.weights):
        value = rng.normal(size=a.shape).astype("float32")
        a.assign(value), b.assign(value)
    want = gradients(theirs, x, theirs.trainable_weights)
    wraps = [None]
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        wraps += [tf.function, lambda f: tf.function(f, jit_compile=True)]
    for wrap in wraps:
        got = gradients(ours, x, ours.trainable_weights, wrap=wrap)
        for name, grad in want.items():
            np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs(x)), rtol=1e-5, atol=1e-5)
    half = keras.ops.cast(x, "bfloat16")
    np.testing.assert_allclose(np.asarray(keras.ops.cast(ours(half), "float32")),
                               np.asarray(keras.ops.cast(theirs(half), "float32")), rtol=1e-5, atol=1e-5)
    return keras.backend.backend()


def test_layer_norm_matches_keras_on_tensorflow():
    assert check_layer_norm() == "tensorflow"


@pytest.mark.slow  # ~30 s to start JAX once; each check runs on TensorFlow in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
@pytest.mark.timeout(400)  # whichever runs first starts the interpreter and waits for all of JAX_CHECKS
def test_layer_norm_matches_keras_on_jax(jax_checks):
    assert jax_checks["check_layer_norm"] == "jax"


def fit_small_model(optimizer_class, *, jit: bool = False, scope=None) -> list:
    """A 16-32-4 model fitted 20 steps on fixed data with `optimizer_class` (a decaying learning rate, weight decay
    but not on biases, global clipping), built in `scope` (e.g. a strategy's) if given; returns the model's and
    the optimizer's variables."""
    import contextlib

    import keras
    import numpy as np

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
    with scope or contextlib.nullcontext():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        schedule = keras.optimizers.schedules.PolynomialDecay(3e-3, 20, 1e-4)
        optimizer = optimizer_class(learning_rate=schedule, weight_decay=0.01, beta_2=0.98, global_clipnorm=1.0)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
    model.fit(x, y, epochs=5, batch_size=16, verbose=0, shuffle=False)
    return model.weights + optimizer.variables


def test_adamw_is_keras_adamw_in_one_kernel_without_xla():
    """AdamW trains a small model to Keras' AdamW's weights and slots (weight decay, bias exclusion, a decaying
    learning rate and clipping included), without XLA through TensorFlow's ResourceApplyAdam and under XLA
    through Keras' own update."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tpuctl.templates.lmkit.layers import AdamW

    for jit in (False, True):
        got, want = ([v.numpy() for v in fit_small_model(cls, jit=jit)] for cls in (AdamW, keras.optimizers.AdamW))
        assert len(got) == len(want) > 8  # 4 weights, 2 slots each, the step counter
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def update_ops(jit: bool) -> set[str]:
        optimizer, variable = AdamW(1e-3), keras.Variable(np.ones((4, 4), "float32"))
        optimizer.build([variable])
        step = tf.function(lambda g: optimizer.apply([g], [variable]), jit_compile=jit)
        return {op.type for op in step.get_concrete_function(tf.TensorSpec((4, 4))).graph.get_operations()}

    assert "ResourceApplyAdam" in update_ops(jit=False)
    assert "ResourceApplyAdam" not in update_ops(jit=True)  # XLA fuses Keras' own ops


def check_adamw_mirrored() -> str:
    """In a fresh interpreter: AdamW under a 2-replica MirroredStrategy (how the template trains on several GPUs
    or rehearses a TPU on CPUs) updates every replica's copy of every variable alike, to Keras' AdamW's values."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    from tpuctl.templates.lmkit.layers import AdamW

    found = []
    for optimizer_class in (AdamW, keras.optimizers.AdamW):
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")],
                                                  cross_device_ops=tf.distribute.ReductionToOneDevice())
        variables = fit_small_model(optimizer_class, scope=strategy.scope())
        for variable in variables:
            copies = [c.numpy() for c in getattr(variable.value, "values", ())]
            assert len(copies) in (0, 2) and all(np.array_equal(c, copies[0]) for c in copies), variable.path
        assert sum(len(getattr(v.value, "values", ())) == 2 for v in variables) >= 12  # weights and slots mirrored
        found.append([v.numpy() for v in variables])
    for a, b in zip(*found):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return keras.backend.backend()


@pytest.mark.slow  # fast tier: AdamW: test_adamw_is_keras_adamw_in_one_kernel_without_xla
def test_adamw_keeps_mirrored_replicas_equal():
    assert in_fresh_interpreter("test_template_layers", "check_adamw_mirrored", backend="tensorflow") == "tensorflow"


def test_loss_and_accuracy_match_keras_on_tensorflow():
    assert check_loss_and_accuracy() == "tensorflow"


@pytest.mark.slow  # ~30 s to start JAX once; each check runs on TensorFlow in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
@pytest.mark.timeout(400)  # whichever runs first starts the interpreter and waits for all of JAX_CHECKS
def test_loss_and_accuracy_match_keras_on_jax(jax_checks):
    assert jax_checks["check_loss_and_accuracy"] == "jax"


def test_tied_loss_matches_keras_loss_through_the_logits_on_tensorflow():
    assert check_tied_loss() == "tensorflow"


@pytest.mark.slow  # ~30 s to start JAX once; each check runs on TensorFlow in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
@pytest.mark.timeout(400)  # whichever runs first starts the interpreter and waits for all of JAX_CHECKS
def test_tied_loss_matches_keras_loss_through_the_logits_on_jax(jax_checks):
    assert jax_checks["check_tied_loss"] == "jax"


def test_layers_match_keras_on_tensorflow():
    assert check_layers() == "tensorflow"


@pytest.mark.slow  # ~30 s to start JAX once; each check runs on TensorFlow in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
@pytest.mark.timeout(400)  # whichever runs first starts the interpreter and waits for all of JAX_CHECKS
def test_layers_match_keras_on_jax(jax_checks):
    assert jax_checks["check_layers"] == "jax"


def test_hashed_bytes_are_uniform_and_independent_on_tensorflow():
    assert check_hashed_bytes() == "tensorflow"


@pytest.mark.slow  # ~30 s to start JAX once; each check runs on TensorFlow in the fast tier
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax"), reason="jax not installed")
@pytest.mark.timeout(400)  # whichever runs first starts the interpreter and waits for all of JAX_CHECKS
def test_hashed_bytes_are_uniform_and_independent_on_jax(jax_checks):
    assert jax_checks["check_hashed_bytes"] == "jax"


def test_tpu_replicated_steps_take_the_xla_paths():
    """On a TPU, TPUStrategy builds the step inside a TPUReplicateContext (tensorflow/python/tpu/tpu.py,
    split_compile_and_replicate), an XLAControlFlowContext: there the layers must hash dropout's bytes and write
    GELU with erf, as under jit_compile. Checked by entering that context the way TensorFlow does; a plain
    tf.function (no XLA) keeps TensorFlow's kernels."""
    import tensorflow as tf
    from tensorflow.python.tpu import tpu_replication

    from tpuctl.templates.lmkit.layers import _compiled

    seen = {}

    @tf.function
    def step():
        context = tpu_replication.TPUReplicateContext(name="cluster", num_replicas=1, pivot=tf.no_op())
        context.Enter()
        try:
            seen["replicated"] = _compiled()
        finally:
            context.Exit()
        seen["plain"] = _compiled()
        return tf.constant(0)

    step()
    assert seen == {"replicated": True, "plain": False}
    tf.function(lambda: seen.__setitem__("jit", _compiled()) or tf.constant(0), jit_compile=True)()
    assert seen["jit"] is True
