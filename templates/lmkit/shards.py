"""The tf.data input pipeline both templates share: prepared shards of packed token ids -> fixed-shape batches
of the template's examples (`batches`; BERT's masked ones in bert/data.py, GPT-2's next-token ones in
gpt2/data.py).

Per pipeline (one per worker host on a pod slice): the shard list is split across pipelines (by file when
there are at least as many shards as pipelines, else by record), shuffled and repeated, read with a parallel
interleave, shuffled, batched with `drop_remainder` (static shapes for XLA), decoded from raw uint16/uint32
bytes and made into the template's example *in TF ops after batching* (vectorised; BERT masks there, so every
epoch sees new masks).

The order is a function of the seed alone (seeded shuffles, deterministic interleave and map, each batch given
its own key for stateless random ops, from the seed and the batch's index), so a resumed run continues it
exactly: `skip` (the examples this pipeline consumed before, from the checkpoint) drops that many sequences
before batching, without decoding them, and the batches after are those the uninterrupted run would have had.
"""

from __future__ import annotations

import posixpath

import tensorflow as tf

from .errors import DataError
from .manifest import MANIFEST_NAME, Manifest


def join(base: str, name: str) -> str:
    """Path join for local paths and gs:// URLs alike (posix separators on both)."""
    return posixpath.join(base, name)


def read_manifest(data_dir: str, *, expect: str, prepare_hint: str = "") -> Manifest:
    """The manifest of a prepared data directory (local or gs://) of format `expect`. Raises DataError if
    absent, unreadable or another template's; `prepare_hint` (`--template NAME `) completes the fix it names."""
    path = join(data_dir, MANIFEST_NAME)
    if not tf.io.gfile.exists(path):
        raise DataError(f"{path}: no manifest; prepare the data first "
                        f"(`tpuctl data prepare CORPUS {prepare_hint}--out DIR`)", path=path)
    with tf.io.gfile.GFile(path, "r") as f:
        return Manifest.from_json(f.read(), where=path, expect=expect)


def batches(data_dir: str, manifest: Manifest, batch_size: int, example, *, shuffle_buffer: int,
            input_context: tf.distribute.InputContext | None = None, seed: int = 0,
            skip: int = 0) -> tf.data.Dataset:
    """An infinite dataset of `example(ids, batch_seed)` over batches of the prepared sequences: ids
    int32[batch_size, seq_len], split per input pipeline, shuffled, decoded and prefetched as the module says,
    after this pipeline's first `skip` sequences. `batch_seed` (int64 [2]) is the batch's own key for stateless
    random ops. `example` returns the model's element."""
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
