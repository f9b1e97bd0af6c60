"""The BERT input pipeline: dynamic masking statistics, static shapes, per-worker sharding, data/model checks."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from test_data_prepare import write_corpus  # noqa: E402

from tpuctl.templates.bert import prepare as prep  # noqa: E402
from tpuctl.templates.bert.data import make_dataset, mask_tokens, read_manifest  # noqa: E402
from tpuctl.templates.lmkit.errors import DataError  # noqa: E402

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


def _mask(ids, max_predictions=20, seed=(3, 0)):
    return mask_tokens(ids, vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK, rate=0.15,
                       max_predictions=max_predictions, seed=list(seed))


def test_masking_selects_15_percent_of_real_tokens_split_80_10_10():
    ids = _batch()
    masked, positions, labels, weights = _mask(ids)
    ids, masked, positions, labels, weights = (t.numpy() for t in (ids, masked, positions, labels, weights))
    assert positions.shape == labels.shape == weights.shape == (1024, 20)
    assert weights.dtype == "float32" and masked.dtype == labels.dtype == positions.dtype == "int32"
    maskable = ids >= 5
    rows = np.arange(len(ids))[:, None]
    selected = np.zeros_like(maskable)
    selected[np.broadcast_to(rows, positions.shape)[weights == 1], positions[weights == 1]] = True
    # 111 maskable tokens a row: round(111 x 0.15) = 17 real slots, then 3 weight-0 slots at position 0.
    assert (weights.sum(axis=1) == 17).all() and (weights[:, :17] == 1).all() and (positions[:, 17:] == 0).all()
    assert (selected.sum(axis=1) == 17).all(), "no position is drawn twice"
    assert not selected[~maskable].any(), "specials and padding are never selected"
    assert (masked[~maskable] == ids[~maskable]).all()
    assert (labels == np.take_along_axis(ids, positions, axis=1)).all()
    n = selected.sum()
    as_mask = (masked[selected] == MASK).sum() / n
    unchanged = (masked[selected] == ids[selected]).sum() / n
    random_ = 1 - as_mask - unchanged
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 and abs(random_ - 0.1) < 0.01
    replaced = masked[selected & (masked != MASK) & (masked != ids)]
    assert replaced.min() >= 5 and replaced.max() < VOCAB, "random replacements are real tokens"
    assert (masked[~selected] == ids[~selected]).all()


def test_masks_are_drawn_afresh_for_each_batch_and_again_the_same_on_a_resume():
    """Stateless draws keyed by (seed, batch index): each batch gets new masks, and a resumed run that reaches
    the same batch masks it as the uninterrupted run did."""
    ids = _batch(rows=64)
    a, again, b = _mask(ids)[1], _mask(ids)[1], _mask(ids, seed=(3, 1))[1]
    assert bool(tf.reduce_all(a == again)) and not bool(tf.reduce_all(a == b))


def test_a_short_row_pads_its_prediction_slots_and_a_long_one_is_capped():
    ids = _batch(rows=2).numpy()
    ids[0, 10:] = PAD  # 9 maskable tokens: round(1.35) = 1 slot
    _, positions, _, weights = _mask(tf.constant(ids), max_predictions=8)
    assert weights.numpy().sum(axis=1).tolist() == [1, 8], "at least one, at most max_predictions"
    assert 1 <= positions.numpy()[0, 0] < 10 and (positions.numpy()[0, 1:] == 0).all()


def test_pipeline_yields_static_int32_batches_with_padding_mask(data_dir):
    manifest = read_manifest(data_dir)
    ds = make_dataset(data_dir, manifest, 16, mask_rate=0.15, max_predictions=20, shuffle_buffer=64)
    features, labels, weights = ds.element_spec
    assert features["input_ids"].shape == features["input_mask"].shape == (16, 128)
    assert features["masked_positions"].shape == labels.shape == weights.shape == (16, 20)
    assert features["input_ids"].dtype == features["masked_positions"].dtype == tf.int32
    assert weights.dtype == tf.float32
    # Known to be infinite: with a cardinality tf.distribute cannot see, it plans for a partial last batch and
    # every replica's batch dimension becomes None (the step's static shapes are gone: gpt2's TF trainer failed).
    assert ds.cardinality() == tf.data.INFINITE_CARDINALITY
    batches = list(ds.take(manifest.sequences // 16 + 2))  # more than one pass: the dataset repeats
    total_w = real = 0.0
    for x, y, w in batches:
        ids = _unmasked(x, y)
        assert (x["input_mask"].numpy() == (ids != PAD)).all()
        assert (ids[:, 0] == CLS).all()
        real += float((ids >= 5).sum())
        total_w += float(tf.reduce_sum(w))
    assert 0.12 < total_w / real < 0.18


def _unmasked(features, labels):
    """The batch's original ids: the masked ids with each prediction slot's label put back at its position."""
    ids = features["input_ids"].numpy().copy()
    np.put_along_axis(ids, features["masked_positions"].numpy(), labels.numpy(), axis=1)
    return ids


def test_each_worker_reads_its_own_shards(data_dir):
    manifest = read_manifest(data_dir)
    assert len(manifest.shards) >= 2
    seen = []
    for worker in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker, num_replicas_in_sync=2)
        ds = make_dataset(data_dir, manifest, 8, mask_rate=0.15, max_predictions=20, shuffle_buffer=8,
                          input_context=ctx)
        seen.append({tuple(r) for x, y, _ in ds.take(manifest.sequences // 8) for r in _unmasked(x, y)})
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
