"""The tf.data input pipeline: prepared shards -> dynamically masked, fixed-shape MLM batches.

Per pipeline (one per worker host on a pod slice): the shard list is split across pipelines (by file when
there are at least as many shards as pipelines, else by record), shuffled and repeated, read with a parallel
non-deterministic interleave, shuffled, batched with `drop_remainder` (static shapes for XLA), decoded from
raw uint16/uint32 bytes and masked *in TF ops after batching* (vectorised), so every epoch sees new masks.

Each element: ({"input_ids": int32[B, L], "input_mask": int32[B, L]}, labels int32[B, L], weights float32[B, L]).
`weights` is 1.0 exactly at the selected positions: the loss and accuracy multiply by it (no boolean gather).
"""

from __future__ import annotations

import posixpath

import tensorflow as tf

from .errors import DataError
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


def mask_tokens(ids: tf.Tensor, *, vocab_size: int, special_ids: list[int], mask_id: int,
                rate: float) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Dynamic BERT masking of int32 ids [B, L]: returns (masked ids, labels, float32 weights).

    Each non-special token is selected with probability `rate`; a selected token becomes [MASK] (80%), a
    random non-special token (10%; a draw that hits a special id keeps the original) or stays (10%).
    """
    shape = tf.shape(ids)
    specials = tf.constant(special_ids, dtype=tf.int32)

    def is_special(t):
        return tf.reduce_any(tf.equal(t[..., None], specials), axis=-1)

    selected = tf.logical_and(tf.random.uniform(shape) < rate, tf.logical_not(is_special(ids)))
    choice = tf.random.uniform(shape)
    random_ids = tf.random.uniform(shape, maxval=vocab_size, dtype=tf.int32)
    random_ids = tf.where(is_special(random_ids), ids, random_ids)
    masked = tf.where(tf.logical_and(selected, choice < MASK_FRACTION), tf.fill(shape, mask_id), ids)
    to_random = tf.logical_and(selected, tf.logical_and(choice >= MASK_FRACTION,
                                                        choice < MASK_FRACTION + RANDOM_FRACTION))
    masked = tf.where(to_random, random_ids, masked)
    return masked, ids, tf.cast(selected, tf.float32)


def make_dataset(data_dir: str, manifest: Manifest, batch_size: int, *, mask_rate: float, shuffle_buffer: int,
                 input_context: tf.distribute.InputContext | None = None, seed: int | None = None) -> tf.data.Dataset:
    """An infinite dataset of masked batches of `batch_size` (per replica when `input_context` is given)."""
    special = sorted(set(manifest.special_ids.values()))
    pad, mask_id = manifest.special_ids["[PAD]"], manifest.special_ids["[MASK]"]

    def example(ids):
        masked, labels, weights = mask_tokens(ids, vocab_size=manifest.vocab_size, special_ids=special,
                                              mask_id=mask_id, rate=mask_rate)
        features = {"input_ids": masked, "input_mask": tf.cast(tf.not_equal(ids, pad), tf.int32)}
        return features, labels, weights

    return batches(data_dir, manifest, batch_size, example, shuffle_buffer=shuffle_buffer,
                   input_context=input_context, seed=seed)


def batches(data_dir: str, manifest: Manifest, batch_size: int, example, *, shuffle_buffer: int,
            input_context: tf.distribute.InputContext | None = None, seed: int | None = None) -> tf.data.Dataset:
    """An infinite dataset of `example(ids)` over batches of the prepared sequences: ids int32[batch_size,
    seq_len], split per input pipeline, shuffled, decoded and prefetched as the module says. Shared by the
    templates whose data is packed token ids (GPT-2's causal LM too); `example` returns the model's element."""
    files = [join(data_dir, s.path) for s in manifest.shards]
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline = input_context.input_pipeline_id if input_context else 0
    by_file = pipelines > 1 and len(files) >= pipelines
    if by_file:
        files = files[pipeline::pipelines]
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed).repeat()
    ds = ds.interleave(lambda f: tf.data.TFRecordDataset(f, buffer_size=1 << 20),
                       cycle_length=min(len(files), 16), num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    if pipelines > 1 and not by_file:
        ds = ds.shard(pipelines, pipeline)
    ds = ds.shuffle(shuffle_buffer, seed=seed).batch(batch_size, drop_remainder=True)
    seq_len, id_dtype = manifest.seq_len, tf.dtypes.as_dtype(manifest.id_dtype)

    def parse(records):
        return example(tf.reshape(tf.cast(tf.io.decode_raw(records, id_dtype), tf.int32), [batch_size, seq_len]))

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
