"""The tf.data input pipeline: prepared blocks -> fixed-shape next-token batches.

Shards are split per input pipeline, shuffled, read interleaved and batched with `drop_remainder`, as in
bert/data.py. Each element: ({"input_ids": int32[B, L]}, labels int32[B, L], weights float32[B, L]) where
labels are the ids shifted left by one and the last position (whose next token is in the next block) has
weight 0: every block trains L-1 predictions with static shapes.
"""

from __future__ import annotations

import tensorflow as tf

from .prepare import FORMAT, MANIFEST_NAME, DataError, Manifest
from .shared import bert

join = bert("data").join


def read_manifest(data_dir: str) -> Manifest:
    """The manifest of a prepared GPT-2 data directory (local or gs://). Raises DataError if absent or another kind."""
    path = join(data_dir, MANIFEST_NAME)
    if not tf.io.gfile.exists(path):
        raise DataError(f"{path}: no manifest; prepare the data first "
                        "(`tpuctl data prepare CORPUS --template gpt2 --out DIR`)", path=path)
    with tf.io.gfile.GFile(path, "r") as f:
        return Manifest.from_json(f.read(), where=path, expect=FORMAT)


def shift(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(labels, weights) for int32 ids [B, L]: labels[:, t] = ids[:, t + 1]; the last position weighs 0."""
    labels = tf.concat([ids[:, 1:], tf.zeros_like(ids[:, :1])], axis=1)
    length = ids.shape[1]
    weights = tf.broadcast_to(tf.concat([tf.ones([length - 1]), tf.zeros([1])], axis=0), tf.shape(ids))
    return labels, weights


def make_dataset(data_dir: str, manifest: Manifest, batch_size: int, *, shuffle_buffer: int,
                 input_context: tf.distribute.InputContext | None = None, seed: int | None = None) -> tf.data.Dataset:
    """An infinite dataset of batches of `batch_size` blocks (per replica when `input_context` is given)."""
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
        ids = tf.reshape(tf.cast(tf.io.decode_raw(records, id_dtype), tf.int32), [batch_size, seq_len])
        labels, weights = shift(ids)
        return {"input_ids": ids}, labels, weights

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
