"""The BERT input pipeline: dynamic masking statistics, static shapes, per-worker sharding, data/model checks."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from test_data_prepare import write_corpus  # noqa: E402

from tpuctl.templates.bert import prepare as prep  # noqa: E402
from tpuctl.templates.bert.data import make_dataset, mask_tokens, read_manifest  # noqa: E402
from tpuctl.templates.bert.errors import DataError  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.timeout(180)]

VOCAB, PAD, CLS, SEP, MASK = 1000, 0, 2, 3, 4
SPECIAL = [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert-data")
    corpus = write_corpus(tmp / "corpus.txt", documents=800, seed=3)
    out = tmp / "prepared"
    prep.prepare([str(corpus)], out, prep.PrepareOptions(vocab_size=600, strip_accents=False, shard_sequences=64))
    return str(out)


def _batch(rows=1024, seq_len=128, seed=0):
    g = tf.random.Generator.from_seed(seed)
    ids = g.uniform((rows, seq_len), minval=5, maxval=VOCAB, dtype=tf.int32)
    ids = tf.concat([tf.fill((rows, 1), CLS), ids[:, 1:-16], tf.fill((rows, 1), SEP), tf.zeros((rows, 15), tf.int32)],
                    axis=1)
    return ids


def test_masking_selects_15_percent_of_real_tokens_split_80_10_10():
    ids = _batch()
    masked, labels, weights = mask_tokens(ids, vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK, rate=0.15)
    ids, masked, labels, weights = ids.numpy(), masked.numpy(), labels.numpy(), weights.numpy()
    maskable = ids >= 5
    selected = weights == 1.0
    assert weights.dtype == "float32" and masked.dtype == labels.dtype == "int32"
    assert not selected[~maskable].any(), "specials and padding are never selected"
    assert (masked[~maskable] == ids[~maskable]).all()
    assert abs(selected.sum() / maskable.sum() - 0.15) < 0.005
    assert (labels == ids).all()
    n = selected.sum()
    as_mask = (masked[selected] == MASK).sum() / n
    unchanged = (masked[selected] == ids[selected]).sum() / n
    random_ = 1 - as_mask - unchanged
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 and abs(random_ - 0.1) < 0.01
    replaced = masked[selected & (masked != MASK) & (masked != ids)]
    assert replaced.min() >= 5 and replaced.max() < VOCAB, "random replacements are real tokens"
    assert (masked[~selected] == ids[~selected]).all()


def test_masks_are_drawn_afresh_each_time():
    ids = _batch(rows=64)
    a = mask_tokens(ids, vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK, rate=0.15)[2]
    b = mask_tokens(ids, vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK, rate=0.15)[2]
    assert not bool(tf.reduce_all(a == b))


def test_pipeline_yields_static_int32_batches_with_padding_mask(data_dir):
    manifest = read_manifest(data_dir)
    ds = make_dataset(data_dir, manifest, 16, mask_rate=0.15, shuffle_buffer=64)
    features, labels, weights = ds.element_spec
    assert features["input_ids"].shape == features["input_mask"].shape == labels.shape == (16, 128)
    assert features["input_ids"].dtype == tf.int32 and weights.dtype == tf.float32
    batches = list(ds.take(manifest.sequences // 16 + 2))  # more than one pass: the dataset repeats
    for x, y, _ in batches:
        assert (x["input_mask"].numpy() == (y.numpy() != PAD)).all()
        assert (y.numpy()[:, 0] == CLS).all()
    total_w = sum(float(tf.reduce_sum(w)) for _, _, w in batches)
    real = sum(float(tf.reduce_sum(tf.cast((y >= 5), tf.float32))) for _, y, _ in batches)
    assert 0.12 < total_w / real < 0.18


def test_each_worker_reads_its_own_shards(data_dir):
    manifest = read_manifest(data_dir)
    assert len(manifest.shards) >= 2
    seen = []
    for worker in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker, num_replicas_in_sync=2)
        ds = make_dataset(data_dir, manifest, 8, mask_rate=0.15, shuffle_buffer=8, input_context=ctx)
        seen.append({tuple(r) for _, y, _ in ds.take(manifest.sequences // 8) for r in y.numpy()})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_data_that_disagrees_with_the_model_is_refused(data_dir):
    manifest = read_manifest(data_dir)
    manifest.check_compatible(seq_len=128, vocab_size=0, vocab_sha256=None, where=data_dir)
    with pytest.raises(DataError, match="seq_len: data has 128, config wants 512"):
        manifest.check_compatible(seq_len=512, vocab_size=0, vocab_sha256=None, where=data_dir)
    with pytest.raises(DataError, match="vocab_size"):
        manifest.check_compatible(seq_len=128, vocab_size=manifest.vocab_size + 1, vocab_sha256=None, where=data_dir)
    with pytest.raises(DataError, match="different vocab.txt"):
        manifest.check_compatible(seq_len=128, vocab_size=0, vocab_sha256="0" * 64, where=data_dir)


def test_a_directory_without_manifest_is_refused(tmp_path):
    with pytest.raises(DataError, match="no manifest; prepare the data first"):
        read_manifest(str(tmp_path))
