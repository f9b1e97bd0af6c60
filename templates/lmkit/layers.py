"""What BERT and GPT-2 use where Keras' own is slower: dropout on random bytes, fused self-attention, exact GELU,
layer normalisation, the loss and accuracy over the vocabulary, and AdamW.

Measured on the reference CPU (bench/peers.py, bert-tiny, TensorFlow + XLA), Keras' dropout was ~20% of a
training step: `keras.random.dropout` draws one 32-bit Philox (TensorFlow) or Threefry (JAX) number per element,
and a transformer drops out every hidden state and every attention probability. Both layers here keep the
published models' maths; what changes is how much random-number and projection work a step does.

- `Dropout` decides with 8 random bits per element. The rate is therefore rounded to a multiple of 1/256
  (0.1 -> 26/256 = 0.1016) and kept values are scaled by 256 / (256 - 26), so the layer's expectation is
  exactly the identity, as inverted dropout's is. Under XLA (always on JAX, and TensorFlow's jit-compiled
  steps, which is how TPUs run) the byte is the top of a keyed integer hash of the element's index that XLA
  fuses into the select: no generator pass, no random buffer (bert-tiny +4% steps/s over Philox bytes). Without
  XLA each of the hash's dozen ops would be its own pass over memory, so TensorFlow's Philox kernel makes four
  bytes per 32-bit draw. TensorFlow and JAX backends only (the templates' two); another gets Keras' dropout.
- `SelfAttention` is Keras `MultiHeadAttention` for the self-attention case with the very same variables
  (`query`/`key`/`value` kernels [hidden, heads, head_dim] and biases [heads, head_dim], `attention_output`
  [heads, head_dim, hidden] and [hidden], under the same names, so checkpoints and the Hugging Face exports read
  them unchanged), computed as one [hidden, 3 x hidden] projection instead of three (the queries' scale folded
  into their kernel) and one [hidden, hidden] projection out, with the softmax in float32 and its probabilities
  dropped out by `dropout` above. Masked scores get -1e9 added, as Keras' `Softmax` masks them.
- `gelu` is the exact GELU. Under XLA it is written 0.5 x (1 + erf(x / sqrt 2)), the published formula (and
  Hugging Face's), in float32: TensorFlow's and JAX's `gelu` write it with erfc, which XLA lowers to two
  rational approximations and an exp, selected per element, where erf is one (bert-tiny +2.4% steps/s on
  TensorFlow). Without XLA it stays `tf.nn.gelu`, which is no fused kernel either (the TF profiler shows its
  Neg, Erfc and Mul ops): it stays that erfc form, with its derivative written out for the backward pass. On
  a TPU (JAX, bfloat16) its derivative is written out too, so the backward pass keeps the bfloat16 input, not
  a float32 copy the TPU compiler would keep for it (`_gelu_keeping_its_input`).
- `LayerNormalization` is Keras' layer (same variables, same maths); without XLA its gradient is written out.
- `SparseSoftmaxCrossEntropy` is Keras' `SparseCategoricalCrossentropy(from_logits=True)`, the same per-token
  loss and gradient (softmax - one-hot), in fewer passes over the [tokens, vocab] logits: TensorFlow's fused
  kernel takes 78 ms forward and backward on gpt2-tiny's [2048, 8000] on the reference CPU (23 ms under XLA),
  this one 33 ms (13 ms). Forward: max, exp(logits - max), sum; the exp is kept and the backward scales it and
  subtracts the upstream gradient at each label, a scatter of one value per token (under XLA a select that
  fuses into the scaling).
- `tied_softmax_cross_entropy` is that loss where the logits are hidden states times a tied embedding (GPT-2's
  head), differentiated straight into both: its gradient's two matmuls read the forward's exp and scale rows,
  and the one-hot part is a gather and a segment sum, so the [tokens, vocab] logits gradient is never written
  (gpt2-tiny on the reference CPU, in-process A/Bs: +6-10% steps/s without XLA, +1-2% under XLA). `TokenLoss`
  reduces the per-token losses it returns as any Keras loss.
- `TopOneAccuracy` is Keras' `SparseCategoricalAccuracy` (the label is the argmax; among equal logits the
  first index wins), without the five extra passes Keras' TensorFlow `argmax` makes to order -0.0 below 0.0:
  without XLA TensorFlow's own ArgMax (30 -> 5-8 ms on gpt2-tiny's logits); under XLA, where ArgMax is a slow
  two-value reduction (21 ms), "no token beats the label": none scores higher, none ties it at a lower index
  (7 ms). Keras' loss and metric were 45% of the summed op time of gpt2-tiny's step without XLA.
- `AdamW` is Keras' optimizer (same variables, arguments and updates); without XLA each variable's update is
  TensorFlow's one `ResourceApplyAdam` kernel (Keras' Adam formula, term for term) instead of Keras' nine ops.

On a TPU (`use_tpu_kernels`: the trainer declares it there, `tpuctl fit` when it compiles for one), where the
TPU compiler is the judge (bench/tpu_compile.py): attention runs Pallas' splash attention kernel, its
probabilities not dropped out (use_tpu_kernels says why), so the [B, heads, L, L] scores never reach HBM, without
the keys' bias, which its softmax cancels (`SelfAttention._tpu_call`), and
GPT-2's loss and accuracy (and BERT's, under a remat policy) run the tied head through two Pallas kernels
(`TiedHeadTrainer`, `fused_softmax_cross_entropy`), so the [tokens, vocab] logits never reach HBM. Under a remat
policy there, `projection` has each projection's gradients computed together as soon as they can be, so that no
layer's upstream gradient waits in HBM for the optimizer.
Everything written for TensorFlow without XLA below is off there by construction.

Without XLA (TensorFlow's graph mode: its CPU and GPU training) every op is a pass over memory and autodiff of a
composite is as many more: there GELU and layer normalisation take hand-written gradients and AdamW one kernel.
Under XLA, which fuses all of these itself, Keras' own code runs. On bert-tiny without XLA, these, the folded
query scale, the single output projection and the head's one-hot gather (model.py) took tpuctl's training step
from 1.20x to 1.37x keras-hub's on a 2-core AMD EPYC (bench/peers.py; bench/RESULTS.md).
"""

from __future__ import annotations

import contextvars
import functools
import math

import keras
from keras import layers, ops

_BYTE = 256


def quantized_rate(rate: float) -> float:
    """The drop probability `dropout` really applies: `rate` rounded to the nearest multiple of 1/256."""
    return round(rate * _BYTE) / _BYTE


_FMIX = (0x85EBCA6B, 0xC2B2AE35)  # MurmurHash3's 32-bit finaliser, fmix32: a bijection with full avalanche
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio; odd, so i -> i * _GOLDEN is a bijection that spreads counters


def _tf_seed(seed):
    """int32 seeds, as Keras' own TensorFlow random ops use (XLA needs them): the state is an int64 variable."""
    import tensorflow as tf

    return tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)


def _hashed_bytes(shape, seed):
    """A uniform byte (as uint32 0-255) per element of `shape`: the top 8 bits of a keyed hash of the element's
    index, fmix32(fmix32(index * golden ^ k0) ^ k1). Like Philox or Threefry it is counter-based, but it is a
    dozen integer ops that XLA fuses into the consumer, where a generator is a separate pass and a buffer. The
    key enters between the two rounds, so distinct seeds give unrelated streams, not shifted copies."""
    n = math.prod(shape)
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        u32, xor, shr, index = jnp.uint32, jnp.bitwise_xor, jnp.right_shift, jnp.arange(n, dtype=jnp.uint32)
        key = seed.astype(u32)  # Keras' JAX seeds are raw uint32[2] keys
    else:
        import tensorflow as tf

        u32, xor, shr = tf.uint32, tf.bitwise.bitwise_xor, tf.bitwise.right_shift
        index = tf.bitcast(tf.range(n, dtype=tf.int32), u32)
        key = tf.bitcast(_tf_seed(seed), u32)

    def const(value):
        return ops.convert_to_tensor(value, u32)

    def fmix(x):
        x = xor(x, shr(x, const(16))) * const(_FMIX[0])
        x = xor(x, shr(x, const(13))) * const(_FMIX[1])
        return xor(x, shr(x, const(16)))

    k0, k1 = fmix(xor(key[0], const(_GOLDEN))), fmix(key[1] + const(_FMIX[0]))
    return ops.reshape(shr(fmix(xor(fmix(xor(index * const(_GOLDEN), k0)), k1)), const(24)), shape)


def _philox_bytes(shape, seed):
    """A uniform uint8 per element of `shape`, four from each 32-bit Philox draw of TensorFlow's kernel."""
    import tensorflow as tf

    n = math.prod(shape)
    bits = tf.random.stateless_uniform([-(-n // 4)], seed=_tf_seed(seed), minval=None, maxval=None, dtype=tf.uint32)
    return tf.reshape(tf.reshape(tf.bitcast(bits, tf.uint8), [-1])[:n], shape)


def _compiled() -> bool:
    """Whether this call is being traced for XLA: always on JAX; on TensorFlow inside a jit-compiled function or
    a TPUStrategy step (its TPUReplicateContext is an XLA context), the test tf.keras itself used to pick its
    XLA-friendly paths."""
    if keras.backend.backend() == "jax":
        return True
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph())


def dropout(x, rate: float, seed_generator: keras.random.SeedGenerator):
    """Inverted dropout of `x` at `quantized_rate(rate)`; the identity when that rounds to 0."""
    dropped = round(rate * _BYTE)
    if dropped == 0:
        return x
    if keras.backend.backend() not in ("tensorflow", "jax"):
        return keras.random.dropout(x, rate, seed=seed_generator)
    # Each generator where it is fastest (bench/peers.py): under XLA the hash, fused into this select; without
    # XLA, where every op is a pass over memory, TensorFlow's one Philox kernel. Both give uniform bytes.
    compiled = _compiled()
    keep = (_hashed_bytes if compiled else _philox_bytes)(tuple(x.shape), seed_generator.next()) >= dropped
    scale = ops.cast(_BYTE / (_BYTE - dropped), x.dtype)
    if compiled:
        return ops.where(keep, x * scale, ops.zeros_like(x))
    # Without XLA, x times a mask of scale-or-0 is two passes forward and one backward (the mask is kept), where
    # the select is three and two (bert-tiny +2.7% steps/s). The two differ only for an infinite or NaN x.
    return x * ops.where(keep, scale, ops.zeros_like(scale))


def _with_gradient(forward):
    """`ops.custom_gradient` for a `forward(*xs)` that returns (value, gradient of the upstream gradient: one per x,
    a tuple where there are several): Keras hands the upstream gradient over positionally on TensorFlow and as
    `upstream=` on JAX; this takes either."""

    @ops.custom_gradient
    def wrapped(*xs):
        value, gradient = forward(*xs)

        def grad(*args, upstream=None):
            return gradient(args[0] if upstream is None else upstream)

        return value, grad

    return wrapped


def tensorflow_without_xla() -> bool:
    """TensorFlow running op by op, where every op is its own pass over memory and autodiff's gradient of a
    composite is as many more: the case for hand-written gradients."""
    return keras.backend.backend() == "tensorflow" and not _compiled()


def _float32(x):
    """x in at least float32 (half-precision inputs are upcast), as Keras' normalisations compute."""
    return ops.cast(x, "float32") if keras.backend.standardize_dtype(x.dtype) in ("bfloat16", "float16") else x


@keras.saving.register_keras_serializable(package="tpuctl")
def gelu(x):
    """The exact GELU, x * Phi(x): Keras' `gelu(approximate=False)`, Hugging Face's "gelu" (module docstring)."""
    if tensorflow_without_xla():
        return ops.cast(_gelu_with_gradient(_float32(x)), x.dtype)
    if not _compiled():
        return keras.activations.gelu(x, approximate=False)
    if tpu_target() and keras.backend.standardize_dtype(x.dtype) in ("bfloat16", "float16"):
        return _gelu_keeping_its_input()(x)
    return _exact_gelu(x)


def _exact_gelu(x):
    """0.5 x (1 + erf(x / sqrt 2)) in float32, rounded to x's dtype: in bfloat16, 1 + erf(x / sqrt 2) would keep
    only a bit or two for x < -2.5."""
    y = _float32(x)
    return ops.cast(0.5 * y * (1.0 + ops.erf(y * (1.0 / math.sqrt(2.0)))), x.dtype)


@functools.cache
def _gelu_keeping_its_input():
    """`_exact_gelu` for half-precision x on a TPU (JAX), whose backward pass keeps x itself, not a float32 copy.
    Differentiated by autodiff, the float32 x is what the backward reads, and the TPU compiler (libtpu 0.0.42,
    v4) then writes it out in the forward as a second result of the first feed-forward matmul, kept until the
    backward: a float32 [tokens, intermediate] a layer, twice the bfloat16 x. Here the backward recomputes the
    float32 x from x behind an optimization barrier, which keeps XLA from merging the two conversions into that
    one saved tensor (bert-128's step on a v4-8: 37.6 -> 32.2 GB of HBM traffic; bench/RESULTS.md, tpu_compile)."""
    import jax

    @jax.custom_vjp
    def gelu_(x):
        return _exact_gelu(x)

    def forward(x):
        return _exact_gelu(x), x

    def backward(x, upstream):
        y = _float32(jax.lax.optimization_barrier(x))
        phi = ops.exp(-0.5 * y * y) * (1.0 / math.sqrt(2.0 * math.pi))
        cdf = 0.5 * (1.0 + ops.erf(y * (1.0 / math.sqrt(2.0))))
        return (ops.cast(_float32(upstream) * (cdf + y * phi), x.dtype),)

    gelu_.defvjp(forward, backward)
    return gelu_


def _gelu_with_gradient(x):
    """x * Phi(x) as tf.nn.gelu writes it (0.5 erfc(-x / sqrt 2)), with its derivative Phi(x) + x phi(x) written
    out: autodiff differentiates the erfc form op by op (the TF profiler's Square, Neg+Exp, five Muls and an
    AddN); this reuses the forward's Phi (bert-tiny's [4096, 512], forward and backward: about 7.6 -> 6.4 ms)."""
    import tensorflow as tf  # TensorFlow only; keras.ops gained erfc only in later Keras 3 releases

    @_with_gradient
    def forward(x):
        cdf = 0.5 * tf.math.erfc(x * (-1.0 / math.sqrt(2.0)))
        return x * cdf, lambda upstream: upstream * (cdf + x * ops.exp(x * x * -0.5) * (1.0 / math.sqrt(2.0 * math.pi)))

    return forward(x)


@keras.saving.register_keras_serializable(package="tpuctl")
class LayerNormalization(layers.LayerNormalization):
    """`keras.layers.LayerNormalization` (same variables, same maths), whose gradient is written out where
    TensorFlow runs without XLA (`_layer_norm_core`); elsewhere, and for any other axis or option, Keras' own."""

    def call(self, inputs):
        if keras.backend.backend() == "jax":  # what remat policy "save_residuals" saves (REMAT); else a no-op
            import jax

            inputs = jax.ad_checkpoint.checkpoint_name(inputs, "norm_input")
        rank = len(inputs.shape)
        axes = [a % rank for a in (self.axis if isinstance(self.axis, (list, tuple)) else [self.axis])]
        own = tensorflow_without_xla() and axes == [rank - 1] and self.center and self.scale and not self.rms_scaling
        if not own:
            return super().call(inputs)
        # In float32, then rounded to the input's dtype and cast to the layer's, as Keras' layer_normalization.
        normalised = _layer_norm_core(_float32(inputs), self.epsilon) * self.gamma + self.beta
        return ops.cast(ops.cast(normalised, inputs.dtype), self.compute_dtype)


def _layer_norm_core(x, epsilon: float):
    """(x - mean) / sqrt(var + epsilon) over the last axis, with the textbook gradient
    inv x (g - mean(g) - x_hat mean(g x_hat)): autodiff of Keras' moments and broadcasts makes about twice the
    passes (the TF profiler's Tile, Sub, Mul and Sum; bert-tiny's [4096, 128] forward and backward 2.1 -> 1.7 ms)."""

    @_with_gradient
    def forward(x):
        centred = x - ops.mean(x, axis=-1, keepdims=True)
        inv = ops.rsqrt(ops.mean(ops.square(centred), axis=-1, keepdims=True) + epsilon)
        normalised = centred * inv

        def grad(g):
            return (g - ops.mean(g, axis=-1, keepdims=True)
                    - normalised * ops.mean(g * normalised, axis=-1, keepdims=True)) * inv

        return normalised, grad

    return forward(x)


@keras.saving.register_keras_serializable(package="tpuctl")
class Dropout(layers.Layer):
    """`keras.layers.Dropout` on random bytes (module docstring): active only when training."""

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.rate, self.seed = rate, seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.supports_masking = True

    def call(self, x, training=False):
        return dropout(x, self.rate, self.seed_generator) if training else x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


@keras.saving.register_keras_serializable(package="tpuctl")
class SelfAttention(layers.Layer):
    """Multi-head self-attention of x [B, L, hidden], optionally causal or with `key_mask` [B, L]
    (1: attend to that key).

    Keras MultiHeadAttention's variables and maths (module docstring): queries scaled by 1/sqrt(head_dim),
    masked scores pushed to a large negative number before the softmax, dropout on the probabilities."""

    def __init__(self, num_heads: int, head_dim: int, *, dropout: float = 0.0, causal: bool = False,
                 kernel_initializer="glorot_uniform", seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.head_dim, self.rate = num_heads, head_dim, dropout
        self.causal, self.seed = causal, seed
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, x_shape, key_mask_shape=None):
        hidden, n, d = x_shape[-1], self.num_heads, self.head_dim

        def projection(name, equation, output_shape, bias_axes, input_shape):
            # A fresh initializer per kernel, as MultiHeadAttention does: a seeded one would repeat its values.
            initializer = type(self.kernel_initializer).from_config(self.kernel_initializer.get_config())
            dense = layers.EinsumDense(equation, output_shape=output_shape, bias_axes=bias_axes, name=name,
                                       kernel_initializer=initializer, dtype=self.dtype_policy)
            dense.build(input_shape)
            return dense

        self.query, self.key, self.value = (projection(name, "abc,cde->abde", (None, n, d), "de", x_shape)
                                            for name in ("query", "key", "value"))
        self.attention_output = projection("attention_output", "abcd,cde->abe", (None, hidden), "e",
                                           (*x_shape[:-1], n, d))

    def call(self, x, key_mask=None, training=False):
        if _tpu_mesh is not None:
            return self._tpu_call(x, key_mask)
        dt, (length, hidden), (n, d) = self.compute_dtype, x.shape[1:], (self.num_heads, self.head_dim)
        # One [hidden, 3 hidden] matmul, split on its last axis: as fast as a 5-d einsum under XLA and ~15%
        # faster without it (TensorFlow's graph mode on CPU/GPU), where the einsum's strided slices are copies.
        # The queries' 1/sqrt(head_dim) scales their kernel and bias, not every query: where ops are not fused,
        # that saves a pass over [B, L, hidden] each way.
        scale = ops.cast(1.0 / math.sqrt(self.head_dim), dt)
        kernels = [ops.reshape(ops.cast(p.kernel, dt), (hidden, n * d)) for p in (self.query, self.key, self.value)]
        biases = [ops.reshape(ops.cast(p.bias, dt), (n * d,)) for p in (self.query, self.key, self.value)]
        kernel = ops.concatenate([kernels[0] * scale, *kernels[1:]], axis=1)
        bias = ops.concatenate([biases[0] * scale, *biases[1:]], axis=0)
        q, k, v = (ops.reshape(t, (-1, length, n, d)) for t in ops.split(ops.matmul(x, kernel) + bias, 3, axis=-1))
        out = self._attention(q, k, v, key_mask, training)
        # A [B x L, hidden] matmul, as the projection in: einsum("bqnd,ndh->bqh") runs on TensorFlow as a batched
        # matmul broadcasting the kernel, whose gradient is B per-sequence kernels, then summed.
        kernel = ops.reshape(ops.cast(self.attention_output.kernel, dt), (n * d, hidden))
        return ops.matmul(ops.reshape(out, (-1, length, n * d)), kernel) + ops.cast(self.attention_output.bias, dt)

    def _tpu_call(self, x, key_mask):
        """`call` on a TPU (use_tpu_kernels): the splash kernel, whose probabilities are not dropped out
        (use_tpu_kernels says why). The projections are einsums straight into or out of the kernel's [B, heads, L,
        head_dim], as MultiHeadAttention writes them: the TPU compiler lays a matmul's output out as its consumer
        wants, where the one [hidden, 3 hidden] matmul's split, reshape and transpose to heads-first were layout
        copies of [B, L, hidden], forward and backward. Where the compiler moves fewer bytes for one einsum of x
        with the three kernels stacked, [3, hidden, heads, head_dim], into [3, B, heads, L, head_dim] (q, k and v
        are slices of its major axis, not copies: FUSED_QKV), that one; elsewhere three (bench/RESULTS.md,
        tpu_compile).
        The keys' bias is left out: it adds q . b_key to every score in a query's row, which the softmax cancels, so
        the output and every other gradient are the same without it, and its own gradient is 0 (in exact
        arithmetic; added, it gets rounding noise). Its variable stays, for checkpoints and the Hugging Face
        export, whose models add it to no effect. The backward pass then has no sum of the keys' gradient, an output
        of splash's backward kernel that no matmul fusion absorbs: a reduction fewer a layer, and for bert-base and
        gpt2-small the compiler's cycles 1.5-7.5% fewer a step on five topologies, HBM at most 0.15% more (4% less
        for gpt2-small on a tpu7x; bench/RESULTS.md, tpu_compile)."""
        dt, scale = self.compute_dtype, 1.0 / math.sqrt(self.head_dim)
        kernels = [ops.cast(self.query.kernel, dt) * ops.cast(scale, dt), ops.cast(self.key.kernel, dt),
                   ops.cast(self.value.kernel, dt)]
        query_bias, value_bias = ops.cast(self.query.bias, dt) * ops.cast(scale, dt), ops.cast(self.value.bias, dt)
        if _tpu_mesh.devices.flat[0].device_kind in FUSED_QKV:
            biases = ops.stack([query_bias, ops.zeros_like(value_bias), value_bias])  # the keys' a zero slice
            q, k, v = projection("blc,kcnd->kbnld", x, ops.stack(kernels), biases[:, None, :, None, :])
        else:
            q = projection("blc,cnd->bnld", x, kernels[0], query_bias[:, None, :])
            k = projection("blc,cnd->bnld", x, kernels[1])
            v = projection("blc,cnd->bnld", x, kernels[2], value_bias[:, None, :])
        out = _splash_attention(q, k, v, causal=self.causal, key_mask=key_mask)
        return projection("bnld,ndh->blh", out, ops.cast(self.attention_output.kernel, dt),
                          ops.cast(self.attention_output.bias, dt))

    def _attention(self, q, k, v, key_mask, training):
        """softmax(q k^T + mask) v for q, k, v [B, L, heads, head_dim] (q already scaled), its probabilities
        dropped out: the [B, heads, L, L] scores in memory, as XLA or TensorFlow computes them."""
        dt, length = self.compute_dtype, q.shape[1]
        scores = ops.einsum("bqnd,bknd->bnqk", q, k)
        scores = ops.cast(scores, "float32")
        # Masks add -1e9 (0 where attended), as Keras' Softmax does: the gradient then passes through unchanged,
        # where a select would be one more pass over the scores each way.
        if self.causal:
            scores = scores + ops.where(ops.tril(ops.ones((length, length), "bool")), 0.0, -1e9)[None, None]
        if key_mask is not None:
            scores = scores + (ops.cast(key_mask, "float32") - 1.0)[:, None, None, :] * 1e9
        probs = ops.cast(ops.softmax(scores, axis=-1), dt)
        if training:
            probs = dropout(probs, self.rate, self.seed_generator)
        return ops.einsum("bnqk,bknd->bqnd", probs, v)

    def compute_output_shape(self, x_shape, key_mask_shape=None):
        return x_shape

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "dropout": self.rate, "causal": self.causal, "seed": self.seed,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


_tpu_mesh = None  # use_tpu_kernels
NO_PALLAS = ("TPU v2", "TPU v3")  # device kinds whose Mosaic compiles no bfloat16 matmul (use_tpu_kernels)
# Device kinds on which SelfAttention projects q, k and v in one einsum (`_tpu_call`): the TPU compiler's bytes a
# step (libtpu 0.0.42) on a tpu7x-8, 12% fewer for bert-512 and 9% fewer for bert-128 than three einsums; on v5e
# and v6e bert-512 moves 5-6% more that way, on v5p and v4 about the same (bench/RESULTS.md, tpu_compile).
FUSED_QKV = ("TPU7x",)


def use_tpu_kernels(mesh) -> None:
    """Declare the run's target a TPU whose devices are `mesh`'s (a jax.sharding.Mesh whose axis "batch" splits
    the batch, as Keras' DataParallel names it), or no TPU (None). The trainer declares it on a TPU, and the fit
    (tpuctl fit, which compiles for a TPU that is not there, where jax.devices() is the host's CPU and Keras'
    own choice of kernel would be the CPU's). With it, SelfAttention always runs Pallas' splash attention kernel
    (`_splash_attention`), which has no dropout: the attention probabilities are not dropped out on a TPU, while
    the hidden states' dropout (the `Dropout` layers) stays. That is the TPU practice: Keras' MultiHeadAttention
    uses its fused kernel only when its dropout is 0 and refuses `flash_attention=True` with dropout
    (keras/src/layers/attention/multi_head_attention.py), and MaxText's attention has no dropout at all, its
    `dropout_rate` (0 by default, MaxText/configs/base.yml) applying to hidden states only. The compiler's
    figures agree: with dropout 0.1 the XLA path writes [B, heads, L, L] scores, probabilities and their mask
    to HBM in every layer (bench/RESULTS.md, tpu_compile). JAX backend only.

    Not on TPU v2 and v3, where the Pallas TPU compiler (Mosaic) refuses the kernels' bfloat16 matmuls
    ("CompileTimeMosaicUnsupportedRhsType: Unsupported matmul RHS type on target: vector<128x128xbf16>",
    compiling splash attention for a v3 2x2): there attention and the loss stay XLA's, as on a CPU."""
    global _tpu_mesh
    _tpu_mesh = None if mesh is None or mesh.devices.flat[0].device_kind in NO_PALLAS else mesh


def _splash_attention(q, k, v, *, causal: bool, key_mask):
    """SelfAttention's softmax(q k^T + mask) v for q, k, v [B, heads, L, head_dim] (q already scaled) through the
    TPU's fused attention kernel: JAX's Pallas splash attention, the kernel Keras' `dot_product_attention` picks
    on a TPU (keras/src/backend/jax/nn.py), block by block in the TPU's on-chip memory, so the [B, heads, L, L]
    scores and probabilities never reach HBM (forward or backward; the backward recomputes them per block).
    Run per device under shard_map over the mesh's batch axis: XLA cannot partition a Pallas kernel and would
    otherwise gather the whole batch onto every device. `key_mask` [B, L] becomes the kernel's segment ids:
    a query attends the keys of its own segment, so real tokens attend real tokens, exactly as the -1e9 mask
    does; a padding position's output (which nothing reads) attends the padding instead."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.sharding import PartitionSpec

    _, heads, length, _ = q.shape
    block = min(512, length)  # MaxText's default blocks; the sequence itself when shorter
    one = masks.CausalMask((length, length)) if causal else masks.FullMask((length, length))
    # q, k and v sequence-minor (MaxText's sa_q_layout/sa_k_layout/sa_v_layout: SEQ_MINOR): a TPU tiles an
    # array's last axis over 128 lanes, so head_dim 64 last would pad every query, key and value the backward
    # pass keeps to twice its size; the sequence last fills the lanes (bert-128 on a v5e: 9% less HBM and 5%
    # fewer bytes a step; bench/RESULTS.md, tpu_compile). The kernel's interface stays head-minor.
    seq_minor = splash.QKVLayout.SEQ_MINOR
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1,
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
                                      q_layout=seq_minor, k_layout=seq_minor, v_layout=seq_minor),
        interpret=_tpu_mesh.devices.flat[0].platform != "tpu")  # Pallas' interpreter off a TPU (tests)

    def per_device(q, k, v, segments):
        ids = None if segments is None else splash.SegmentIds(q=segments, kv=segments)
        return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(q, k, v, ids)

    split = PartitionSpec("batch")
    if key_mask is None:
        out = jax.shard_map(lambda q, k, v: per_device(q, k, v, None), mesh=_tpu_mesh, in_specs=(split,) * 3,
                            out_specs=split, check_vma=False)(q, k, v)
    else:
        out = jax.shard_map(per_device, mesh=_tpu_mesh, in_specs=(split,) * 4, out_specs=split,
                            check_vma=False)(q, k, v, jnp.asarray(key_mask, jnp.int32))
    # MaxText's name for the attention's output, which its remat policies "minimal_with_context" save (REMAT).
    return jax.ad_checkpoint.checkpoint_name(out, "context")


# Remat (activation checkpointing) policies a run can name in trainer.remat_policy, fastest (most HBM) first:
# MaxText's names and meanings (MaxText/configs/base.yml `remat_policy`, MaxText/layers/decoders.py
# get_remat_policy), each applied, as MaxText's, to every layer under its own checkpoint (use_remat): "minimal"
# saves the matmuls without batch dimensions (the projections and the MLP's) and recomputes everything else for
# the backward pass (normalisation, GELU, dropout masks, attention); "minimal_with_context" also saves the
# attention's output ("context"); "full" saves nothing inside a layer: only what each layer starts from (its
# checkpoint's input, LayerInput: one [B, L, hidden] tensor a layer) is kept and the rest recomputed, every matmul
# included. Between them, tpuctl's "save_residuals" saves the residual stream at each sublayer's boundary (every
# LayerNormalization's input: GPT-2's stream before each pre-norm, BERT's sums before each post-norm), two such
# tensors a layer, so that each sublayer's last matmul is not recomputed (bench/RESULTS.md, tpu_compile:
# bert-128 needs about 10% fewer FLOPs and 3% fewer bytes than under "full"). templates/lmkit/config.py lists
# the names.
REMAT = {
    "none": None,
    "minimal_with_context": lambda cp: cp.save_from_both_policies(cp.checkpoint_dots_with_no_batch_dims,
                                                                  cp.save_only_these_names("context")),
    "minimal": lambda cp: cp.checkpoint_dots_with_no_batch_dims,
    "save_residuals": lambda cp: cp.save_only_these_names("norm_input"),
    "full": lambda cp: cp.nothing_saveable,
}


_rematted = contextvars.ContextVar("rematted", default=False)  # use_remat's forward pass is being traced


def use_remat(trainer: keras.Model, policy: str) -> None:
    """Train `trainer` (Keras' JAX trainer, a functional model whose transformer layers each start at a
    LayerInput, the head at a HeadInput) with remat `policy` (a REMAT name): its forward pass runs one checkpoint
    a layer (the graph's nodes from one LayerInput up to the next, or the HeadInput), each under jax.checkpoint
    with that policy, so the backward pass recomputes what the policy does not save instead of reading it from
    HBM, as MaxText checkpoints each decoder layer.
    A checkpoint's recomputation waits for the gradient of its own output (JAX's transpose of a checkpoint puts
    its saved inputs and that gradient behind one optimization barrier), so a layer is recomputed when the
    backward pass reaches it. Under one checkpoint over the model, which saves the same values, the compiler may
    recompute any layer as soon as the backward pass begins, and tpu7x's did: layer 10 beside layer 11 near the
    limit, all twelve at once further from it (bert-128 under "full" at 9216 a device: 107.6 GB of HBM with one
    checkpoint, 97.2 GB with one a layer; bench/RESULTS.md, tpu_compile). The embeddings and the head stay
    outside, as MaxText's: in a checkpoint the embeddings cost that step 5% more FLOPs, the head 1.5 GB more HBM.
    The loss stays outside too: Keras builds its compiled loss on the first call and keeps what it saw, which
    inside a checkpoint would leak the trace (GPT-2's TPU head recomputes its tiles itself). "none" restores
    Keras' own. JAX backend only."""
    import jax
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    trainer.remat_policy = policy
    trainer.__dict__.pop("_run_through_graph", None)  # Keras' own walk of the graph
    if REMAT[policy] is None:
        return
    saved = REMAT[policy](jax.checkpoint_policies)
    own = trainer._run_through_graph
    segments = _layer_segments(trainer)

    def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
        # A symbolic walk (Keras building or inferring shapes), or a call outside Keras' stateless training step
        # (where no gradient is taken): nothing to recompute.
        if call_fn is not None or get_stateless_scope() is None:
            return own(inputs, operation_fn, call_fn)
        token = _rematted.set(True)  # while the forward pass is traced under the checkpoints (projection)
        try:
            return _run_in_checkpoints(trainer, segments, inputs, operation_fn, saved)
        finally:
            _rematted.reset(token)

    trainer._run_through_graph = run_through_graph


def _layer_segments(functional) -> list[tuple[bool, list, list, list]]:
    """`functional`'s nodes in Keras' order of execution, cut before each LayerInput and the HeadInput: per segment
    whether it is a transformer layer (it starts at a LayerInput), its nodes, the ids of the tensors it reads from
    before it (the model's inputs among them) and of those it makes that a later segment or the model's outputs
    read."""
    nodes = [node for depth in sorted(functional._nodes_by_depth, reverse=True)
             for node in functional._nodes_by_depth[depth] if node.operation and not node.is_input]
    cuts = [i for i, node in enumerate(nodes) if isinstance(node.operation, (LayerInput, HeadInput))]
    if not cuts:
        raise ValueError(f"{functional.name} has no LayerInput: remat checkpoints one transformer layer at a time")
    bounds = [0, *(c for c in cuts if c), len(nodes)]
    parts = [nodes[a:b] for a, b in zip(bounds, bounds[1:])]
    made = [{id(t) for node in part for t in node.outputs} for part in parts]
    read = [list(dict.fromkeys(id(t) for node in part for t in node.input_tensors)) for part in parts]
    wanted = {id(t) for t in functional.outputs}
    segments = []
    for i, part in enumerate(parts):
        later = wanted.union(*read[i + 1:])
        segments.append((isinstance(part[0].operation, LayerInput), part, [t for t in read[i] if t not in made[i]],
                         [t for t in dict.fromkeys(id(t) for node in part for t in node.outputs) if t in later]))
    return segments


def _run_in_checkpoints(functional, segments, inputs, operation_fn, policy):
    """Keras' Functional._run_through_graph (the same nodes, in the same order, each called through
    `operation_fn`) with each transformer layer (_layer_segments) under jax.checkpoint(policy), inside a Keras
    stateless scope (a trainer's stateless call). A variable a layer assigns (a dropout layer's seed) leaves its
    checkpoint as an output and is assigned again outside it, or the scope would keep a value of the checkpoint's
    trace."""
    import jax
    from keras import tree
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    values = {id(x): y for x, y in zip(functional.inputs, tree.flatten(inputs))}
    scope = get_stateless_scope()
    for layer, nodes, reads, makes in segments:

        def segment(*given, nodes=nodes, reads=reads, makes=makes):
            local, before = dict(zip(reads, given)), dict(scope.state_mapping)
            for node in nodes:
                args, kwargs = node.arguments.fill_in(local)
                outputs = operation_fn(node.operation)(*args, **kwargs)
                local.update(zip((id(t) for t in node.outputs), tree.flatten(outputs)))
            assigned = {k: v for k, v in scope.state_mapping.items() if before.get(k) is not v}
            return [local[t] for t in makes], assigned

        made, assigned = (jax.checkpoint(segment, policy=policy) if layer else segment)(*(values[t] for t in reads))
        values.update(zip(makes, made))
        scope.state_mapping.update(assigned)
    return tree.pack_sequence_as(functional._outputs_struct, [values[id(x)] for x in functional.outputs])


def _scatter_sub(x, labels, values):
    """x [..., V] with `values` [...] subtracted at index `labels` [...] of the last axis."""
    if _compiled():  # a select XLA fuses into the pass that made x
        return ops.where(ops.arange(x.shape[-1], dtype="int32") == labels[..., None], x - values[..., None], x)
    import tensorflow as tf  # without XLA: one scatter of a value per row instead of a pass over x

    rows = tf.reshape(x, [-1, x.shape[-1]])
    indices = tf.stack([tf.range(tf.shape(rows)[0]), tf.reshape(labels, [-1])], axis=1)
    return tf.reshape(tf.tensor_scatter_nd_sub(rows, indices, tf.reshape(values, [-1])), tf.shape(x))


def softmax_cross_entropy(labels, logits):
    """Per-token -log softmax(logits)[label] for int `labels` [...] and float32 `logits` [..., V]; its gradient is
    (softmax - one_hot(label)) x upstream, as TensorFlow's and JAX's own."""
    labels = ops.cast(labels, "int32")

    @_with_gradient
    def per_token(logits):
        loss, exp, total = _softmax_loss(labels, logits)
        return loss, lambda upstream: _scatter_sub(exp * (upstream[..., None] / total), labels, upstream)

    return per_token(logits)


def _softmax_loss(labels, logits):
    """(-log softmax(logits)[label], exp(logits - max), its sum): the loss and what its gradient reuses."""
    top = ops.max(logits, axis=-1, keepdims=True)
    exp = ops.exp(logits - top)
    total = ops.sum(exp, axis=-1, keepdims=True)
    return (ops.log(total) + top - _picked(labels, logits))[..., 0], exp, total


def _picked(labels, logits):
    """logits [..., V] at int `labels` [...], as [..., 1]. On a TPU (tpu_target), a select summed in the pass
    that reads the logits for their maximum, not a gather: the TPU compiler (libtpu 0.0.42) emits that gather
    for a tpu7x's SparseCore and fails on some shapes (gpt2-small's [80, 1024, 50257] logits a device:
    "RET_CHECK failure (platforms/xla/sparse_core/gather_emitter.cc) ... Expected packed element gather indices
    to either be 1 dimensional or to be bitpacked"). Elsewhere the gather of one value a row."""
    if tpu_target():
        hit = ops.arange(logits.shape[-1], dtype="int32") == labels[..., None]
        return ops.sum(ops.where(hit, logits, ops.zeros((), logits.dtype)), axis=-1, keepdims=True)
    return ops.take_along_axis(logits, labels[..., None], axis=-1)


def tied_softmax_cross_entropy(labels, logits, hidden, embeddings):
    """`softmax_cross_entropy(labels, logits)` where `logits` = `hidden` [..., h] @ `embeddings` [V, h]^T (a tied
    output embedding, no bias): the same per-token loss, differentiated straight into `hidden` and `embeddings`
    (`logits` itself gets no gradient). The logits' gradient (softmax - one_hot) x upstream is never written
    out: its two matmuls read the forward's exp(logits - max) and scale rows instead (exp @ E by upstream/total
    per token, exp^T @ (hidden x upstream/total)), and the one-hot part is a gather and a segment sum of
    embedding rows. That drops a pass over [tokens, V] each way and the [tokens, V] gradient buffer."""
    labels = ops.cast(labels, "int32")
    hidden_shape, (vocab, width) = hidden.shape, embeddings.shape
    dtype = hidden.dtype  # the head's compute dtype (bfloat16 under mixed precision), as its matmuls ran

    @_with_gradient
    def per_token(hidden, embeddings, logits):
        loss, exp, total = _softmax_loss(labels, logits)

        def grad(upstream):
            upstream = ops.reshape(upstream, (-1, 1))
            scale = ops.cast(upstream / ops.reshape(total, (-1, 1)), dtype)
            rows, tokens = ops.cast(ops.reshape(exp, (-1, vocab)), dtype), ops.reshape(hidden, (-1, width))
            kernel, ids, weight = ops.cast(embeddings, dtype), ops.reshape(labels, (-1,)), ops.cast(upstream, dtype)
            d_hidden = ops.matmul(rows, kernel) * scale - ops.take(kernel, ids, axis=0) * weight
            # The segment sum in float32: a frequent label sums thousands of tokens, which bfloat16 would round.
            d_embeddings = (ops.cast(ops.matmul(ops.transpose(rows), tokens * scale), "float32")
                            - ops.segment_sum(ops.cast(tokens, "float32") * upstream, ids, num_segments=vocab))
            return (ops.reshape(d_hidden, hidden_shape), ops.cast(d_embeddings, embeddings.dtype),
                    ops.zeros_like(logits))  # dropped by the caller's stop_gradient

        return loss, grad

    return per_token(hidden, ops.convert_to_tensor(embeddings), ops.stop_gradient(logits))


def tpu_target() -> bool:
    """Whether the run's target is a TPU (use_tpu_kernels)."""
    return _tpu_mesh is not None


def projection(equation: str, x, kernel, bias=None):
    """einsum(equation, x, kernel) (+ bias), its gradients autodiff's. On a TPU (tpu_target) under a remat
    policy (use_remat) they are computed before any of them is used. Left to itself, the TPU compiler (libtpu
    0.0.42) schedules a bias's gradient (a sum of its upstream gradient over batch and length) late, near the
    optimizer, so each keeps its upstream gradient in HBM through the rest of the backward pass: the queries',
    keys' and values' [B, L, hidden] of every attention layer (and BERT's [B, predictions, vocab] logits', before
    its head was fused_head's). Under remat that is where the step's memory peaks (bert-128 on a v5e under
    `save_residuals`, then named `full`: 17.0 -> 9.5 MB a sequence; `minimal` unchanged); without remat the peak
    comes before these gradients exist, and the barrier would only cost bytes (bench/RESULTS.md, tpu_compile)."""
    if not (tpu_target() and _rematted.get()):
        out = ops.einsum(equation, x, kernel)
        return out if bias is None else out + bias
    return _projection_with_early_gradients()(equation, x, kernel, bias)


@functools.cache
def _projection_with_early_gradients():
    import jax
    import jax.numpy as jnp

    def project(equation, x, kernel, bias):
        out = jnp.einsum(equation, x, kernel)
        return out if bias is None else out + bias

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def projected(equation, x, kernel, bias):
        return project(equation, x, kernel, bias)

    def forward(equation, x, kernel, bias):
        return project(equation, x, kernel, bias), (x, kernel, bias)

    def backward(equation, operands, upstream):
        # The pullback's forward einsum is unused, and XLA drops it: only the gradients are computed.
        _, pullback = jax.vjp(functools.partial(project, equation), *operands)
        return jax.lax.optimization_barrier(pullback(upstream))

    projected.defvjp(forward, backward)
    return projected


def fused_softmax_cross_entropy(labels, hidden, embeddings, bias=None, early_gradients=False):
    """(`softmax_cross_entropy(labels, logits)`, `top_one_correct(labels, logits)`) per token of `hidden`
    [B, L, h], where logits = hidden @ embeddings^T (+ `bias` [V], a tied head's output bias, if any), by
    fused_head's Pallas kernels (`early_gradients`: under remat, fused_head says why): each tile of logits stays
    in the TPU's on-chip memory, so the [B, L, V] logits (gpt2-small's largest tensor, 1.6 GB in float32 per
    device at batch 8) and their gradient never reach HBM.
    What the TPU runs (tpu_target). Per device under shard_map over the mesh's batch axis, as splash attention
    (XLA cannot partition a Pallas kernel); in Pallas' interpreter where the devices are not a TPU's (tests).
    JAX only."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from . import fused_head

    def per_device(labels, hidden, embeddings, bias, interpret=False):
        from jax.experimental.pallas import tpu as pltpu

        batch, length, width = hidden.shape
        # Inside shard_map over the run's TPU mesh Pallas reports the target's VMEM, also when compiling for a
        # TPU that is not there (tpuctl fit); the interpreter has none.
        vmem = None if interpret else pltpu.get_tpu_info().vmem_capacity_bytes
        loss, correct = fused_head.fused_softmax_cross_entropy(
            jnp.reshape(labels, (-1,)).astype(jnp.int32), jnp.reshape(hidden, (-1, width)), embeddings, bias,
            fused_head.tiles_for(batch * length, width, vmem), interpret, early_gradients)
        return jnp.reshape(loss, (batch, length)), jnp.reshape(correct, (batch, length))

    embeddings = ops.convert_to_tensor(embeddings)
    bias = None if bias is None else ops.convert_to_tensor(bias)
    if _tpu_mesh is None or _tpu_mesh.devices.flat[0].platform != "tpu":
        return per_device(labels, hidden, embeddings, bias, interpret=True)
    split, whole = PartitionSpec("batch"), PartitionSpec()
    return jax.shard_map(per_device, mesh=_tpu_mesh, in_specs=(split, split, whole, whole),
                         out_specs=(split, split), check_vma=False)(labels, hidden, embeddings, bias)


def top_one_correct(labels, logits):
    """1.0 where int `labels` [...] is the argmax of `logits` [..., V] (the first index among equal maxima),
    else 0.0."""
    labels = ops.cast(labels, "int32")
    if not _compiled():
        import tensorflow as tf

        return ops.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels), "float32")
    picked = _picked(labels, logits)
    earlier = ops.arange(logits.shape[-1], dtype="int32") < labels[..., None]
    beaten = ops.logical_or(logits > picked, ops.logical_and(logits == picked, earlier))
    return ops.cast(ops.logical_not(ops.any(beaten, axis=-1)), "float32")


@keras.saving.register_keras_serializable(package="tpuctl")
class SparseSoftmaxCrossEntropy(keras.losses.Loss):
    """Keras' SparseCategoricalCrossentropy(from_logits=True) in fewer passes (module docstring); by default the
    mean over the tokens weighted by the sample weights."""

    def __init__(self, reduction="mean_with_sample_weight", name="sparse_softmax_cross_entropy", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return softmax_cross_entropy(y_true, y_pred)


@keras.saving.register_keras_serializable(package="tpuctl")
class TokenLoss(keras.losses.Loss):
    """Per-token losses a model computed itself (`tied_softmax_cross_entropy`), reduced as any Keras loss is: by
    default the mean over the tokens weighted by the sample weights, scaled for the distribution strategy."""

    def __init__(self, reduction="mean_with_sample_weight", name="token_loss", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return y_pred


class TiedHeadTrainer(keras.Model):
    """What `fit` trains for a model whose logits come from its tied `token_embedding` (and its output bias, if
    it has one): the same layers and variables, with the hidden states the head projects (`hidden`, a layer's
    name) beside the logits. Compile it with `TokenLoss` (which reduces the per-token losses this computes) and
    metrics on the logits. On a TPU (use_tpu_kernels) the loss and accuracy come from the head's fused kernels
    (fused_softmax_cross_entropy), so the [tokens, vocab] logits never reach HBM, nor the logits output, which
    nothing reads there (XLA drops it); elsewhere from the logits (`per_token_loss`). With `fused_under_remat_only`
    the kernels serve only under a remat policy (use_remat), where the compiler's figures say they pay (BERT's).
    Save, export and serve the model it was made from: that one maps inputs to logits."""

    def __init__(self, model: keras.Model, hidden: str, *, fused_under_remat_only: bool = False, **kwargs):
        super().__init__(model.inputs, {"logits": model.outputs[0], "hidden": model.get_layer(hidden).output},
                         **kwargs)
        self.embedding = model.get_layer("token_embedding")
        self.fused_under_remat_only = fused_under_remat_only
        self.remat_policy = "none"  # use_remat's

    def per_token_loss(self, y, y_pred):
        """The per-token cross-entropy off a TPU."""
        return softmax_cross_entropy(y, y_pred["logits"])

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if tpu_target() and not (self.fused_under_remat_only and self.remat_policy == "none"):
            # The accuracy from the same kernel, handed to compute_metrics in y_pred (Keras' JAX trainer returns
            # it from the differentiated function as it is, this dict).
            per_token, y_pred["correct"] = fused_softmax_cross_entropy(
                y, y_pred["hidden"], self.embedding.embeddings, getattr(self.embedding, "output_bias", None),
                early_gradients=self.remat_policy != "none")
        else:
            per_token = self.per_token_loss(y, y_pred)
        return super().compute_loss(x, y, per_token, sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if "correct" not in y_pred:
            return super().compute_metrics(x, y, y_pred["logits"], sample_weight)
        # The top-one metric on two-class logits [correct, 1 - correct] against label 0: its top one is label 0
        # exactly where the token was predicted.
        correct = y_pred["correct"]
        return super().compute_metrics(x, ops.zeros_like(y), ops.stack([correct, 1.0 - correct], axis=-1),
                                       sample_weight)


@keras.saving.register_keras_serializable(package="tpuctl")
class TopOneAccuracy(keras.metrics.MeanMetricWrapper):
    """Keras' SparseCategoricalAccuracy on logits, without its extra passes (module docstring)."""

    def __init__(self, name="accuracy", dtype=None):
        super().__init__(fn=top_one_correct, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="tpuctl")
class AdamW(keras.optimizers.AdamW):
    """`keras.optimizers.AdamW`: the same variables, arguments and update, which where TensorFlow runs without XLA
    is TensorFlow's one `ResourceApplyAdam` kernel per variable instead of Keras' nine ops (module docstring).
    `split_slots` (runtime.sharding zero1: strategy.slot_layouts) places each weight's slots by its shape, where
    Keras gives them their weight's layout."""

    def __init__(self, *args, split_slots=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._split_slots = split_slots

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        layout = self._split_slots(reference_variable.shape) if self._split_slots else None
        if layout is None:
            return super().add_variable_from_reference(reference_variable, name, initializer)
        # Keras' own name for the slot (checkpoints store slots by it), with the split layout instead.
        return self.add_variable(shape=reference_variable.shape, initializer=initializer,
                                 dtype=reference_variable.dtype,
                                 name=f"{reference_variable.path.replace('/', '_')}_{name or 'var'}", layout=layout)

    def update_step(self, gradient, variable, learning_rate):
        if not tensorflow_without_xla() or self.amsgrad:
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf  # here only: a JAX program (a TPU compile) need not have TensorFlow at all

        if not isinstance(gradient, tf.Tensor):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        step = ops.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = ops.cast(self.beta_1, dtype), ops.cast(self.beta_2, dtype)
        index = self._get_variable_index(variable)
        # Keras' Adam.update_step, term for term: m += (g - m)(1 - beta_1), v += (g^2 - v)(1 - beta_2),
        # var -= m lr sqrt(1 - beta_2^t) / (1 - beta_1^t) / (sqrt(v) + epsilon), with t the 1-based step.
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=self._momentums[index].handle, v=self._velocities[index].handle,
            beta1_power=ops.power(beta_1, step), beta2_power=ops.power(beta_2, step),
            lr=ops.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2, epsilon=ops.cast(self.epsilon, dtype),
            grad=ops.cast(gradient, dtype))


@keras.saving.register_keras_serializable(package="tpuctl")
class LayerInput(layers.Layer):
    """The identity, on what a transformer layer starts from: where use_remat begins a layer's checkpoint, so the
    one value of a layer that remat policy "full" keeps for the backward pass (REMAT), which recomputes
    everything else of the layer from it."""

    def call(self, inputs):
        return inputs


@keras.saving.register_keras_serializable(package="tpuctl")
class HeadInput(layers.Layer):
    """The identity, on what the last transformer layer hands the head: where use_remat ends that layer's
    checkpoint."""

    def call(self, inputs):
        return inputs


@keras.saving.register_keras_serializable(package="tpuctl")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding per position to x [B, L, H]; the sequence length is fixed (static shapes). The
    one both templates use (keras-hub's PositionEmbedding would do, but keras-hub is not a dependency; Keras 3
    core has none). Weight `positions` [seq_len, H]: checkpoints name it `position_embedding/positions`."""

    def __init__(self, seq_len: int, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.seq_len = seq_len
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(self.seq_len, input_shape[-1]), initializer=self.initializer,
                                         name="positions")

    def call(self, x):
        return x + ops.cast(self.positions, x.dtype)[None]

    def get_config(self):
        return {**super().get_config(), "seq_len": self.seq_len,
                "initializer": keras.initializers.serialize(self.initializer)}


# Registered as "bert>": the name the model.keras files BERT exported before this moved to lmkit carry.
@keras.saving.register_keras_serializable(package="bert")
class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak` over `warmup_steps`, then linear decay to `end` at `total_steps`."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, end: float):
        self.peak, self.warmup_steps, self.total_steps, self.end = peak, warmup_steps, total_steps, end

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warm = self.peak * step / max(self.warmup_steps, 1)
        frac = ops.clip((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 0.0, 1.0)
        decay = self.peak + (self.end - self.peak) * frac
        return ops.where(step < self.warmup_steps, warm, decay)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps, "end": self.end}
