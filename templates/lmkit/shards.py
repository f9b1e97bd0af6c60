"""The tf.data input pipeline: prepared shards -> dynamically masked, fixed-shape MLM batches.

Per pipeline (one per worker host on a pod slice): the shard list is split across pipelines (by file when
there are at least as many shards as pipelines, else by record), shuffled and repeated, read with a parallel
interleave, shuffled, batched with `drop_remainder` (static shapes for XLA), decoded from raw uint16/uint32
bytes and masked *in TF ops after batching* (vectorised), so every epoch sees new masks.

The order is a function of the seed alone (seeded shuffles, deterministic interleave and map, masks drawn with
stateless random ops keyed by the seed and the batch's index), so a resumed run continues it exactly: `skip`
(the examples this pipeline consumed before, from the checkpoint) drops that many sequences before batching,
without decoding or masking them, and the batches after are those the uninterrupted run would have had.

Each element: ({"input_ids": int32[B, L], "input_mask": int32[B, L], "masked_positions": int32[B, P]},
labels int32[B, P], weights float32[B, P]), P = `max_predictions` (static): the model projects to the
vocabulary only at those positions. `weights` is 1.0 at the selected positions and 0.0 in the padding slots:
the loss and accuracy multiply by it (no boolean gather, no dynamic shape).
"""

from __future__ import annotations

import posixpath

import tensorflow as tf

from .shared import lmkit

DataError = lmkit("errors").DataError
from .manifest import FORMAT, MANIFEST_NAME, Manifest

MASK_FRACTION = 0.8  # of the selected tokens: replaced by [MASK]
RANDOM_FRACTION = 0.1  # replaced by a random token; the remaining 10% stay unchanged


def join(base: str, name: str) -> str:
    """Path join for local paths and gs:// URLs alike (posix separators on both)."""
    return posixpath.join(base, name)


def read_manifest(data_dir: str, *, expect: str = FORMAT, prepare_hint: str = "") -> Manifest:
    """The manifest of a prepared data directory (local or gs://) of format `expect`. Raises DataError if
    absent, unreadable or another template's; `prepare_hint` (`--template NAME `) completes the fix it names."""
    path = join(data_dir, MANIFEST_NAME)
    if not tf.io.gfile.exists(path):
        raise DataError(f"{path}: no manifest; prepare the data first "
                        f"(`tpuctl data prepare CORPUS {prepare_hint}--out DIR`)", path=path)
    with tf.io.gfile.GFile(path, "r") as f:
        return Manifest.from_json(f.read(), where=path, expect=expect)


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

    return batches(data_dir, manifest, batch_size, example, shuffle_buffer=shuffle_buffer,
                   input_context=input_context, seed=seed, skip=skip)


def batches(data_dir: str, manifest: Manifest, batch_size: int, example, *, shuffle_buffer: int,
            input_context: tf.distribute.InputContext | None = None, seed: int = 0,
            skip: int = 0) -> tf.data.Dataset:
    """An infinite dataset of `example(ids, batch_seed)` over batches of the prepared sequences: ids
    int32[batch_size, seq_len], split per input pipeline, shuffled, decoded and prefetched as the module says,
    after this pipeline's first `skip` sequences. `batch_seed` (int64 [2]) is the batch's own key for stateless
    random ops. Shared by the templates whose data is packed token ids (GPT-2's causal LM too); `example`
    returns the model's element."""
    files = [join(data_dir, s.path) for s in manifest.shards]
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline = input_context.input_pipeline_id if input_context else 0
    by_file = pipelines > 1 and len(files) >= pipelines
    if by_file:
        files = files[pipeline::pipelines]
    # Epoch e's file order is a stateless shuffle keyed by (seed, e), and the record shuffle does not reshuffle
    # per iteration: every iterator of this dataset yields the same stream (Keras' JAX fit iterates it once to
    # build the model, then again to train; a reshuffle would make the run's order depend on that).
    names = tf.constant(files)
    ds = tf.data.Dataset.range(tf.int64.max).flat_map(lambda epoch: tf.data.Dataset.from_tensor_slices(
        tf.random.experimental.stateless_shuffle(names, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))))
    ds = ds.interleave(lambda f: tf.data.TFRecordDataset(f, buffer_size=1 << 20),
                       cycle_length=min(len(files), 16), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if pipelines > 1 and not by_file:
        ds = ds.shard(pipelines, pipeline)
    # Skipped raw, before batching: a resume re-reads what the run consumed but decodes and masks none of it.
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=False).skip(skip)
    ds = ds.batch(batch_size, drop_remainder=True)
    ds = ds.enumerate(start=skip // batch_size)  # the batch's index in this pipeline's stream
    seq_len, id_dtype = manifest.seq_len, tf.dtypes.as_dtype(manifest.id_dtype)

    def parse(index, records):
        ids = tf.reshape(tf.cast(tf.io.decode_raw(records, id_dtype), tf.int32), [batch_size, seq_len])
        return example(ids, tf.stack([tf.constant(seed, tf.int64), index * pipelines + pipeline]))

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # Infinite, and said so: flat_map over epochs hides it (cardinality unknown), and a tf.distribute strategy
    # then plans for a partial last batch, splitting it unevenly, so each replica's batch dimension becomes None
    # and the step's static shapes are lost.
    ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
