"""The tf.data input pipeline: prepared blocks -> fixed-shape next-token batches.

Shards are split per input pipeline, shuffled, read interleaved and batched with `drop_remainder` by
lmkit/shards.py's `batches`. Each element: ({"input_ids": int32[B, L]}, labels int32[B, L], weights float32[B, L]) where
labels are the ids shifted left by one and the last position (whose next token is in the next block) has
weight 0: every block trains L-1 predictions with static shapes.
"""

from __future__ import annotations

import tensorflow as tf

from .prepare import FORMAT, Manifest
from .shared import lmkit

_shards = lmkit("shards")


def read_manifest(data_dir: str) -> Manifest:
    """The manifest of a prepared GPT-2 data directory (local or gs://). Raises DataError if absent or another kind."""
    return _shards.read_manifest(data_dir, expect=FORMAT, prepare_hint="--template gpt2 ")


def shift(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(labels, weights) for int32 ids [B, L]: labels[:, t] = ids[:, t + 1]; the last position weighs 0."""
    labels = tf.concat([ids[:, 1:], tf.zeros_like(ids[:, :1])], axis=1)
    length = ids.shape[1]
    weights = tf.broadcast_to(tf.concat([tf.ones([length - 1]), tf.zeros([1])], axis=0), tf.shape(ids))
    return labels, weights


def make_dataset(data_dir: str, manifest: Manifest, batch_size: int, *, shuffle_buffer: int,
                 input_context: tf.distribute.InputContext | None = None, seed: int = 0,
                 skip: int = 0) -> tf.data.Dataset:
    """An infinite dataset of batches of `batch_size` blocks (per replica when `input_context` is given), after
    the first `skip` blocks of this pipeline (a resume's: lmkit/shards.py `batches`)."""

    def example(ids, batch_seed):  # nothing random: the seed is for templates that draw (BERT's masks)
        labels, weights = shift(ids)
        return {"input_ids": ids}, labels, weights

    return _shards.batches(data_dir, manifest, batch_size, example, shuffle_buffer=shuffle_buffer,
                           input_context=input_context, seed=seed, skip=skip)
