"""Data preparation for the BERT template: tokenizer, packing, shards, manifest, malformed input, gs:// I/O.

No TensorFlow here (the prepare step does not need it); test_bert_data.py reads the shards with tf.data.
Corpora are generated: English-like and Korean words walked through a small Markov chain, so the text has
structure a model can learn (test_bert_train.py) and a realistic long-tailed vocabulary.
"""

from __future__ import annotations

import io
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tpuctl import console
from tpuctl.cli import cli
from tpuctl.templates.bert import prepare as prep
from tpuctl.templates.lmkit import prepare as shared_prep
from tpuctl.templates.lmkit.errors import DataError
from tpuctl.templates.bert.manifest import FORMAT, SPECIAL_TOKENS
from tpuctl.templates.lmkit.manifest import Manifest

pytestmark = pytest.mark.timeout(120)

CLS, SEP, PAD = SPECIAL_TOKENS.index("[CLS]"), SPECIAL_TOKENS.index("[SEP]"), SPECIAL_TOKENS.index("[PAD]")


def _lexicon(rng: random.Random, n: int, korean: bool) -> list[str]:
    if korean:  # Hangul syllables composed from (initial, medial, final) jamo indices
        syllable = lambda: chr(0xAC00 + (rng.randrange(19) * 21 + rng.randrange(21)) * 28 + rng.randrange(28))  # noqa: E731
        return ["".join(syllable() for _ in range(rng.randint(1, 3))) for _ in range(n)]
    parts = ["ka", "to", "ri", "ne", "mo", "sa", "lu", "pe", "di", "ch", "st", "an", "er", "on", "ing"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def write_corpus(path: Path, *, documents: int, seed: int = 0, korean_share: float = 0.5) -> Path:
    """Blank-line separated documents of 1-5 sentence lines, each sentence a walk through a word chain."""
    rng = random.Random(seed)
    chains = {}
    for korean in (False, True):
        words = _lexicon(rng, 300, korean)
        chains[korean] = (words, {w: rng.sample(words, 3) for w in words})
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(documents):
            words, successors = chains[rng.random() < korean_share]
            for _ in range(rng.randint(1, 5)):
                w = rng.choice(words)
                sentence = [w]
                for _ in range(rng.randint(4, 30)):
                    w = rng.choice(successors[w])
                    sentence.append(w)
                f.write(" ".join(sentence) + ".\n")
            f.write("\n")
    return path


def read_records(path: Path, seq_len: int) -> np.ndarray:
    """Parse TFRecord framing by hand (length, masked CRC, payload, masked CRC) into [N, seq_len] ids."""
    data, rows, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        rows.append(np.frombuffer(data, dtype="<u2", count=length // 2, offset=at + 12))
        at += 12 + length + 4
    assert all(len(r) == seq_len for r in rows)
    return np.stack(rows)


@pytest.fixture
def console_err(monkeypatch) -> io.StringIO:
    """What the CLI printed to stderr (the console module holds its own stderr stream)."""
    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr(console, "err", Console(file=buf, width=300, no_color=True))
    return buf


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "mixed.txt", documents=1500)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("prepared")
    opts = prep.PrepareOptions(vocab_size=1000, strip_accents=False, shard_sequences=256, batch_bytes=64 << 10)
    return out, prep.prepare([str(corpus)], out, opts)


def test_packed_sequences_have_cls_fixed_length_and_padding_only_at_the_very_end(prepared, corpus):
    out, manifest = prepared
    ids = np.concatenate([read_records(out / s.path, 128) for s in manifest.shards])
    assert ids.shape == (manifest.sequences, 128) and manifest.record_format == "raw-uint16-le"
    assert (ids[:, 0] == CLS).all()
    assert not (ids[:-1] == PAD).any(), "only the last sequence may be padded"
    assert (ids == SEP).sum() == manifest.documents == corpus.read_text().count("\n\n")
    assert int((ids != PAD).sum()) == manifest.tokens
    assert ids.max() < manifest.vocab_size


def test_manifest_records_shards_counts_and_vocab_hash(prepared):
    out, manifest = prepared
    on_disk = Manifest.from_json((out / "manifest.json").read_text(), where="m", expect=FORMAT)
    assert on_disk == manifest
    assert len(manifest.shards) > 1 and all(s.sequences <= 256 for s in manifest.shards)
    assert sum(s.sequences for s in manifest.shards) == manifest.sequences
    assert manifest.special_ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    import hashlib

    assert manifest.vocab_sha256 == hashlib.sha256((out / "vocab.txt").read_bytes()).hexdigest()
    assert all(s.crc32c == shared_prep.file_crc32c(out / s.path) for s in manifest.shards)
    assert manifest.tokenizer["limit_alphabet"] == 4000 and manifest.tokenizer["strip_accents"] is False
    assert not list(out.glob(".*partial"))


def test_prepared_is_compact_and_korean_is_mostly_known_tokens(prepared):
    _, manifest = prepared
    assert manifest.prepared_bytes / manifest.raw_bytes <= 1.0
    assert manifest.unk_tokens / manifest.tokens < 0.01


def test_one_document_per_line_marks_every_line_as_a_document(tmp_path, corpus):
    manifest = prep.prepare([str(corpus)], tmp_path / "o", prep.PrepareOptions(vocab_size=500, doc_format="line"))
    lines = [ln for ln in corpus.read_text().splitlines() if ln.strip()]
    assert manifest.documents == len(lines)


def test_an_existing_vocab_file_is_used_as_is(tmp_path, prepared, corpus):
    out, first = prepared
    opts = prep.PrepareOptions(vocab_file=str(out / "vocab.txt"), strip_accents=False)
    again = prep.prepare([str(corpus)], tmp_path / "o", opts)
    assert again.vocab_sha256 == first.vocab_sha256 and again.sequences == first.sequences


def test_tokenizer_sample_is_bounded_and_spread_over_all_files(tmp_path):
    files = [write_corpus(tmp_path / f"c{i}.txt", documents=3000, seed=i) for i in range(3)]
    sources = shared_prep.expand([str(tmp_path / "c*.txt")])
    assert [s.url for s in sources] == [str(f) for f in files]
    budget = shared_prep.SAMPLE_BLOCK
    assert sum(s.size for s in sources) > 2 * budget
    lines = list(shared_prep.sample_lines(sources, budget))
    assert sum(len(ln.encode()) + 1 for ln in lines) <= budget
    for f in files:
        own = set(f.read_text().splitlines())
        assert sum(ln in own for ln in lines) > len(lines) / 6, f"{f} is under-sampled"
    whole = {ln for f in files for ln in f.read_text().splitlines()}
    assert set(lines) <= whole, "blocks are cut to whole lines"


def test_huge_lines_are_cut_into_bounded_pieces(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text(" ".join(["word"] * 40000) + "\n")
    pieces = list(shared_prep.iter_pieces(shared_prep.Source(str(f), f.stat().st_size), "blank"))
    assert len(pieces) > 1 and all(len(t) <= shared_prep.MAX_PIECE_CHARS for t, _ in pieces)
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary file"),
    ("caf\u00e9 cr\u00e8me\n".encode("latin-1"), "not UTF-8"),
    (b"\n\n   \n", "corpus is empty"),
])
def test_malformed_input_is_refused_naming_the_file_and_creating_nothing(tmp_path, console_err, content, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["data", "prepare", str(bad), "--out", str(out), "--vocab-size", "100"])
    assert result.exit_code == 2, result.output
    assert message in console_err.getvalue() and str(bad) in console_err.getvalue()
    assert not out.exists()


def test_bad_utf8_deep_inside_a_file_is_refused_with_its_offset(tmp_path):
    good = "a perfectly fine line of text\n" * 10000
    bad = tmp_path / "late.txt"
    bad.write_bytes(good.encode() + b"broken \xff byte\n")
    with pytest.raises(DataError, match=f"{bad}: not UTF-8 text .*offset {len(good) + 7}"):
        prep.prepare([str(bad)], tmp_path / "out", prep.PrepareOptions(vocab_size=100))
    assert not (tmp_path / "out").exists()


def test_missing_input_is_refused(tmp_path, console_err):
    result = CliRunner().invoke(cli, ["data", "prepare", str(tmp_path / "nope*.txt"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "matches nothing" in console_err.getvalue()


def test_cli_prints_a_summary(tmp_path, corpus):
    result = CliRunner().invoke(cli, ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                                      "--vocab-size", "800", "--seq-len", "512", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["seq_len"] == 512 and summary["prepared_over_raw"] <= 1.0 and summary["sequences"] > 0


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from tpuctl.localcloud.schema import Validator
    from tpuctl.localcloud.storage import StorageServer

    server = StorageServer(tmp_path / "gcs", validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    client = storage.Client(project="proj-a", credentials=AnonymousCredentials())
    client.create_bucket("corpus-bucket", location="us-central1")
    yield client
    server.stop()


def test_gs_inputs_are_read_and_uploads_skip_unchanged_shards(gcs, tmp_path, corpus):
    gcs.bucket("corpus-bucket").blob("text/part-0.txt").upload_from_filename(str(corpus))
    out = tmp_path / "prepared"
    manifest = prep.prepare(["gs://corpus-bucket/text/*.txt"], out,
                            prep.PrepareOptions(vocab_size=500, shard_sequences=256), storage_client=gcs)
    assert manifest.raw_bytes == corpus.stat().st_size and manifest.documents > 0
    files = len(manifest.shards) + 2  # shards, vocab.txt, tokenizer.json (+ the manifest, always re-sent)
    assert prep.upload(out, "gs://corpus-bucket/data", storage_client=gcs) == (files + 1, 0)
    assert prep.upload(out, "gs://corpus-bucket/data/", storage_client=gcs) == (1, files)
    names = {b.name for b in gcs.list_blobs("corpus-bucket", prefix="data/")}
    assert names == {f"data/{s.path}" for s in manifest.shards} | {
        "data/vocab.txt", "data/tokenizer.json", "data/manifest.json"}


def test_prepare_corpus_to_a_bucket_stages_locally_and_uploads(gcs, corpus):
    from tpuctl.cli.data import prepare_corpus

    manifest = prepare_corpus([str(corpus)], "gs://corpus-bucket/prepared", prep.PrepareOptions(vocab_size=500),
                              storage_client=gcs)
    names = {b.name for b in gcs.list_blobs("corpus-bucket", prefix="prepared/")}
    assert "prepared/manifest.json" in names and {f"prepared/{s.path}" for s in manifest.shards} <= names
