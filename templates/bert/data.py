"""BERT's input pipeline: lmkit's prepared-shard batches (lmkit/shards.py: split per pipeline, shuffled, decoded,
resumable exactly) -> dynamically masked, fixed-shape MLM batches.

Masking runs *in TF ops after batching* (vectorised), drawn with stateless random ops keyed by the seed and the
batch's index, so every epoch sees new masks and a resumed run gets the masks the uninterrupted run would have had.

Each element: ({"input_ids": int32[B, L], "input_mask": int32[B, L], "masked_positions": int32[B, P]},
labels int32[B, P], weights float32[B, P]), P = `max_predictions` (static): the model projects to the
vocabulary only at those positions. `weights` is 1.0 at the selected positions and 0.0 in the padding slots:
the loss and accuracy multiply by it (no boolean gather, no dynamic shape).
"""

from __future__ import annotations

import tensorflow as tf

from .manifest import FORMAT
from .shared import lmkit

_shards = lmkit("shards")
Manifest = lmkit("manifest").Manifest

MASK_FRACTION = 0.8  # of the selected tokens: replaced by [MASK]
RANDOM_FRACTION = 0.1  # replaced by a random token; the remaining 10% stay unchanged


def read_manifest(data_dir: str) -> Manifest:
    """The manifest of a prepared BERT data directory (local or gs://). Raises DataError if absent or another kind."""
    return _shards.read_manifest(data_dir, expect=FORMAT)


def mask_tokens(ids: tf.Tensor, *, vocab_size: int, special_ids: list[int], mask_id: int, rate: float,
                max_predictions: int, seed) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Dynamic BERT masking of int32 ids [B, L]: returns (masked ids [B, L], positions int32 [B, P],
    labels int32 [B, P], float32 weights [B, P]) with P = `max_predictions`.

    Per row, min(P, max(1, round(n x `rate`))) of its n non-special tokens are drawn uniformly without
    replacement (google-research/bert's create_pretraining_data.py); their positions fill the first slots,
    the other slots point at position 0 with weight 0. A selected token becomes [MASK] (80%), a random
    non-special token (10%; a draw that hits a special id keeps the original) or stays (10%). The draws are
    stateless, keyed by `seed` (int [2]): the same seed masks the same ids the same way.
    """
    shape = tf.shape(ids)
    score_seed, choice_seed, random_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
    seq_len = ids.shape[1]
    specials = tf.constant(special_ids, dtype=tf.int32)

    def is_special(t):
        return tf.reduce_any(tf.equal(t[..., None], specials), axis=-1)

    maskable = tf.logical_not(is_special(ids))
    count = tf.reduce_sum(tf.cast(maskable, tf.float32), axis=1)
    wanted = tf.minimum(tf.minimum(float(max_predictions), tf.maximum(1.0, tf.round(count * rate))), count)
    # Random scores, -1 where not maskable: the top P are a uniform draw of maskable positions first.
    scores = tf.where(maskable, tf.random.stateless_uniform(shape, score_seed), -1.0)
    drawn = tf.math.top_k(scores, k=max_predictions, sorted=True).indices
    weights = tf.cast(tf.range(max_predictions, dtype=tf.float32)[None, :] < wanted[:, None], tf.float32)
    positions = tf.where(weights > 0, drawn, 0)
    labels = tf.gather(ids, positions, batch_dims=1)
    selected = tf.reduce_max(tf.one_hot(positions, seq_len) * weights[..., None], axis=1) > 0  # [B, L]

    choice = tf.random.stateless_uniform(shape, choice_seed)
    random_ids = tf.random.stateless_uniform(shape, random_seed, minval=0, maxval=vocab_size, dtype=tf.int32)
    random_ids = tf.where(is_special(random_ids), ids, random_ids)
    masked = tf.where(tf.logical_and(selected, choice < MASK_FRACTION), tf.fill(shape, mask_id), ids)
    to_random = tf.logical_and(selected, tf.logical_and(choice >= MASK_FRACTION,
                                                        choice < MASK_FRACTION + RANDOM_FRACTION))
    masked = tf.where(to_random, random_ids, masked)
    return masked, positions, labels, weights


def make_dataset(data_dir: str, manifest: Manifest, batch_size: int, *, mask_rate: float, max_predictions: int,
                 shuffle_buffer: int, input_context: tf.distribute.InputContext | None = None,
                 seed: int = 0, skip: int = 0) -> tf.data.Dataset:
    """An infinite dataset of masked batches of `batch_size` (per replica when `input_context` is given), after
    the first `skip` sequences of this pipeline."""
    special = sorted(set(manifest.special_ids.values()))
    pad, mask_id = manifest.special_ids["[PAD]"], manifest.special_ids["[MASK]"]

    def example(ids, batch_seed):
        masked, positions, labels, weights = mask_tokens(ids, vocab_size=manifest.vocab_size, special_ids=special,
                                                         mask_id=mask_id, rate=mask_rate,
                                                         max_predictions=max_predictions, seed=batch_seed)
        features = {"input_ids": masked, "input_mask": tf.cast(tf.not_equal(ids, pad), tf.int32),
                    "masked_positions": positions}
        return features, labels, weights

    return _shards.batches(data_dir, manifest, batch_size, example, shuffle_buffer=shuffle_buffer,
                           input_context=input_context, seed=seed, skip=skip)
