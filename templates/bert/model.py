"""A compact BERT encoder with a tied masked-LM head, in Keras 3.

Why not keras-hub's BertBackbone: it would serve from-scratch pretraining (random init needs no download),
but keras-hub pulls tensorflow-text and with it the full `tensorflow` wheel (+0.9 GB next to
tensorflow-cpu), and on the reference laptop a hand-written encoder trained faster under bf16 (181 vs 137
examples/s, ../shared/api-notes.md) and saves with its optimizer state intact. This one is the published
architecture: learned positions, post-LayerNorm blocks, GELU, tied input/output embeddings with an output bias.
Attention, dropout and GELU are layers.py's (MultiHeadAttention's variables and maths with one fused Q/K/V
projection; dropout on random bytes, its rate rounded to 1/256, hashed in place under XLA; the exact GELU through
erf under XLA): bench/peers.py measures them against keras-hub's BERT on the reference CPU (bench/RESULTS.md).

Inputs are int32 `input_ids` and `input_mask` [B, L] (no bool inputs: Keras averages inputs across
replicas and AddN has no bool kernel) and int32 `masked_positions` [B, P]. The MLM head (transform, norm,
vocabulary projection) runs only at those P positions, gathered with static shapes as in google-research/bert's
`get_masked_lm_output` (GatherPositions says how the gather itself differs): at seq 128 and P = 20 that skips
108/128 of the head's FLOPs and the [B, L, V] logits tensor. Output: float32 logits [B, P, V] whatever the
compute dtype.
"""

from __future__ import annotations

import keras
from keras import layers, ops

from .config import TaskConfig
from .shared import lmkit

_layers = lmkit("layers")
Dropout, LayerNormalization, SelfAttention = _layers.Dropout, _layers.LayerNormalization, _layers.SelfAttention
gelu, tensorflow_without_xla = _layers.gelu, _layers.tensorflow_without_xla
HeadInput, LayerInput, PositionEmbedding = _layers.HeadInput, _layers.LayerInput, _layers.PositionEmbedding

_INIT = {"class_name": "TruncatedNormal", "config": {"stddev": 0.02}}


@keras.saving.register_keras_serializable(package="bert")
class ReversibleEmbedding(layers.ReversibleEmbedding):
    """Keras' ReversibleEmbedding (tied input/output embeddings) with BERT's output bias on the logits, which
    are float32 (the softmax cross-entropy's precision under mixed_bfloat16). Build it with `reverse_dtype` the
    compute dtype: its embeddings are not autocast, so the projection would otherwise run in float32."""

    def build(self, input_shape=None):
        super().build(input_shape)
        self.output_bias = self.add_weight(shape=(self.input_dim,), initializer="zeros", name="output_bias")

    def call(self, inputs, reverse=False):
        if not reverse:
            return super().call(inputs)
        # On a TPU the loss does not read the logits: lmkit's TiedHeadTrainer fuses this projection into it.
        logits = super().call(inputs, reverse=True) + ops.cast(self.output_bias, self.compute_dtype)
        return ops.cast(logits, "float32")

    # Embedding's own (quantisation-aware) save/load knows only `embeddings`; the generic one saves every variable.
    def save_own_variables(self, store):
        layers.Layer.save_own_variables(self, store)

    def load_own_variables(self, store):
        layers.Layer.load_own_variables(self, store)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), dtype="float32")
        return super().compute_output_spec(inputs)


@keras.saving.register_keras_serializable(package="bert")
class GatherPositions(layers.Layer):
    """x [B, L, H] at positions [B, P] -> [B, P, H].

    A batched gather (take_along_axis), not google-research/bert's flat one (positions + row offsets into
    [B x L, H]): under JAX's SPMD data parallelism XLA partitions the batched gather per device, while the flat
    one compiles to an all-gather of the hidden states across the slice (checked in the compiled HLO). Without
    XLA it is a one-hot matmul instead (`call`)."""

    def call(self, x, positions):
        if tensorflow_without_xla():
            # One-hot rows [B, P, L] times x: exact (one 1 per row), and its gradient is the transposed product,
            # where take_along_axis's is transposes and an UnsortedSegmentSum into zeros (bert-tiny without XLA,
            # TF profiler: 5.6 ms of op time per step, this 0.7).
            return ops.matmul(ops.one_hot(positions, x.shape[1], dtype=x.dtype), x)
        return ops.take_along_axis(x, ops.expand_dims(positions, -1), axis=1)

    def compute_output_spec(self, x, positions):
        return keras.KerasTensor((x.shape[0], positions.shape[1], x.shape[2]), dtype=x.dtype)


def build_model(task: TaskConfig, *, vocab_size: int) -> keras.Model:
    """The MLM model for `task` (dtype policy: whatever is global when called). Creates variables: call in scope."""
    h, L = task.hidden_size, task.seq_len
    ids = keras.Input((L,), dtype="int32", name="input_ids")
    mask = keras.Input((L,), dtype="int32", name="input_mask")
    positions = keras.Input((task.predictions_per_seq,), dtype="int32", name="masked_positions")
    embedding = ReversibleEmbedding(vocab_size, h, embeddings_initializer=keras.initializers.get(_INIT),
                                    name="token_embedding",
                                    reverse_dtype=keras.config.dtype_policy().compute_dtype)
    x = PositionEmbedding(L, initializer=keras.initializers.get(_INIT), name="position_embedding")(embedding(ids))
    x = LayerNormalization(epsilon=1e-12, name="embedding_norm")(x)
    x = Dropout(task.dropout)(x)
    for i in range(task.num_layers):
        x = LayerInput(name=f"layer{i}_input")(x)
        a = SelfAttention(task.num_heads, h // task.num_heads, dropout=task.dropout,
                          kernel_initializer=keras.initializers.get(_INIT), name=f"layer{i}_attention")(x, mask)
        a = Dropout(task.dropout)(a)
        x = LayerNormalization(epsilon=1e-12, name=f"layer{i}_attention_norm")(x + a)
        f = layers.Dense(task.intermediate_size, activation=gelu, kernel_initializer=keras.initializers.get(_INIT),
                         name=f"layer{i}_intermediate")(x)
        f = layers.Dense(h, kernel_initializer=keras.initializers.get(_INIT), name=f"layer{i}_output")(f)
        f = Dropout(task.dropout)(f)
        x = LayerNormalization(epsilon=1e-12, name=f"layer{i}_output_norm")(x + f)
    x = HeadInput(name="head_input")(x)
    x = GatherPositions(name="masked_positions_gather")(x, positions)
    x = layers.Dense(h, activation=gelu, kernel_initializer=keras.initializers.get(_INIT), name="mlm_transform")(x)
    x = LayerNormalization(epsilon=1e-12, name="mlm_norm")(x)
    logits = embedding(x, reverse=True)
    return keras.Model({"input_ids": ids, "input_mask": mask, "masked_positions": positions}, logits, name="bert_mlm")

