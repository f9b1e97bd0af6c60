"""GPT-2 in backend-agnostic Keras 3 (keras.ops only: runs on TensorFlow and JAX).

Pre-LayerNorm decoder blocks (LN -> causal self-attention -> residual, LN -> MLP with GPT-2's tanh GELU ->
residual), learned positions, final LayerNorm, and logits from the token embedding itself (tied input/output
embeddings, no output bias), as in the original GPT-2: the gpt2-small preset has exactly its 124,439,808 weights.
Causal attention applies a fixed lower-triangular mask (lmkit/layers.py's SelfAttention, which also gives
dropout its random bytes): static shapes, no padding mask (the prepared blocks are full). Logits are float32
under mixed_bfloat16 so the softmax cross-entropy is exact.
"""

from __future__ import annotations

import math

import keras
from keras import layers

from .config import TaskConfig
from .shared import lmkit

_layers = lmkit("layers")
Dropout, LayerNormalization, SelfAttention = _layers.Dropout, _layers.LayerNormalization, _layers.SelfAttention
TokenLoss, tied_softmax_cross_entropy = _layers.TokenLoss, _layers.tied_softmax_cross_entropy
HeadInput, LayerInput, PositionEmbedding = _layers.HeadInput, _layers.LayerInput, _layers.PositionEmbedding

STDDEV = 0.02


def _init(stddev: float = STDDEV):
    return keras.initializers.TruncatedNormal(stddev=stddev)


@keras.saving.register_keras_serializable(package="gpt2")
def gelu_tanh(x):
    """GPT-2's GELU (the tanh approximation, Hugging Face's "gelu_new")."""
    return keras.activations.gelu(x, approximate=True)


def build_model(task: TaskConfig, *, vocab_size: int) -> keras.Model:
    """The causal LM for `task` (dtype policy: whatever is global when called). Creates variables: call in scope.
    Input {"input_ids": int32[B, L]}; output float32 logits [B, L, vocab]: position t predicts token t + 1."""
    h, L, eps = task.hidden_size, task.seq_len, task.layer_norm_epsilon
    ids = keras.Input((L,), dtype="int32", name="input_ids")
    # Keras' ReversibleEmbedding: the token embedding, and with reverse=True its transpose maps hidden states to
    # logits (tied, no output bias), in the compute dtype (its embeddings are not autocast: without reverse_dtype
    # the projection would run in float32 under mixed_bfloat16).
    embedding = layers.ReversibleEmbedding(vocab_size, h, embeddings_initializer=_init(), name="token_embedding",
                                           reverse_dtype=keras.config.dtype_policy().compute_dtype)
    x = PositionEmbedding(L, initializer=_init(0.01), name="position_embedding")(embedding(ids))
    x = Dropout(task.dropout)(x)
    for i in range(task.num_layers):
        x = LayerInput(name=f"layer{i}_input")(x)
        a = LayerNormalization(epsilon=eps, name=f"layer{i}_attention_norm")(x)
        a = SelfAttention(task.num_heads, h // task.num_heads, dropout=task.dropout, causal=True,
                          kernel_initializer=_init(), name=f"layer{i}_attention")(a)
        x = x + Dropout(task.dropout)(a)
        f = LayerNormalization(epsilon=eps, name=f"layer{i}_mlp_norm")(x)
        f = layers.Dense(task.intermediate_size, activation=gelu_tanh, kernel_initializer=_init(),
                         name=f"layer{i}_mlp_in")(f)
        residual = _init(STDDEV / math.sqrt(2 * task.num_layers))  # GPT-2's scaled init of residual projections
        f = layers.Dense(h, kernel_initializer=residual, name=f"layer{i}_mlp_out")(f)
        x = x + Dropout(task.dropout)(f)
    x = HeadInput(name="head_input")(x)
    x = LayerNormalization(epsilon=eps, name="final_norm")(x)
    # The logits in the compute dtype, then float32 (an Activation of dtype float32 casts its input, as Keras'
    # mixed-precision guide does for the last layer): the softmax cross-entropy's precision under mixed_bfloat16.
    logits = layers.Activation("linear", dtype="float32", name="logits")(embedding(x, reverse=True))
    return keras.Model({"input_ids": ids}, logits, name="gpt2_clm")


class CausalLMTrainer(_layers.TiedHeadTrainer):
    """What `fit` trains for a GPT-2 model (lmkit's TiedHeadTrainer on its final hidden states). Off a TPU the loss
    differentiates straight into the hidden states and the tied embedding (layers.tied_softmax_cross_entropy)
    instead of through a [tokens, vocab] logits gradient."""

    def __init__(self, model: keras.Model, **kwargs):
        super().__init__(model, "final_norm", **kwargs)

    def per_token_loss(self, y, y_pred):
        return tied_softmax_cross_entropy(y, y_pred["logits"], y_pred["hidden"], self.embedding.embeddings)
