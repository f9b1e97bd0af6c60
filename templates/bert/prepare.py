"""Data preparation for BERT: text corpus -> WordPiece vocabulary -> packed, sharded TFRecords + manifest.

Used on the laptop by `tpuctl data prepare` and `tpuctl run`; needs `tokenizers`, `numpy` and
`google-crc32c`, not TensorFlow. Reading, documents, sampling, streaming, shard framing and upload are lmkit's
(lmkit/prepare.py: inputs local or gs://, flat memory, atomic shards, manifest last).

Tokenizer: WordPiece trained with HF `tokenizers` on a bounded sample of the corpus (`tokenizer_sample_bytes`,
default 64 MiB), BERT normaliser and pre-tokeniser, special tokens [PAD] [UNK] [CLS] [SEP] [MASK] with ids 0-4;
or an existing vocab.txt (`vocab_file`).

Packing (RoBERTa "full sentences" style): the token stream of all documents, a [SEP] after each document,
is cut into `seq_len - 1` token chunks, each prefixed with [CLS]; a sequence may span a document boundary
(the [SEP] marks it), and only the very last sequence is padded with [PAD]. No static masking and no dupe
factor: the trainer masks each epoch afresh.

Output directory: `train-NNNNN.tfrecord` shards of `shard_sequences` records, `vocab.txt`, `tokenizer.json`,
and `manifest.json` last.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .manifest import FORMAT, SPECIAL_TOKENS, TOKENIZER_NAME, VOCAB_NAME
from .shared import lmkit

_kit = lmkit("prepare")
DataError = lmkit("errors").DataError
Manifest, MANIFEST_NAME = lmkit("manifest").Manifest, lmkit("manifest").MANIFEST_NAME
Progress = _kit.Progress


@dataclass(frozen=True)
class PrepareOptions:
    vocab_size: int = 30522
    seq_len: int = 128
    lowercase: bool = True
    strip_accents: bool | None = None  # None: follow `lowercase` (BERT's rule); False keeps Hangul syllables whole
    limit_alphabet: int = 4000  # 1000 (the library default) leaves many [UNK] in Korean/CJK text
    min_frequency: int = 2
    vocab_file: str | None = None  # an existing vocab.txt instead of training one
    doc_format: str = "blank"
    tokenizer_sample_bytes: int = 64 << 20
    shard_sequences: int = 65536
    batch_bytes: int = 1 << 20

    def validate(self) -> None:
        checks = [
            (self.seq_len in (128, 256, 512), "seq_len", "must be 128, 256 or 512"),
            (len(SPECIAL_TOKENS) < self.vocab_size <= 1 << 24, "vocab_size", "must be between 6 and 16777216"),
            (self.limit_alphabet > 0, "limit_alphabet", "must be > 0"),
            (self.min_frequency > 0, "min_frequency", "must be > 0"),
            (self.doc_format in ("blank", "line"), "doc_format", "must be 'blank' or 'line'"),
            (self.tokenizer_sample_bytes >= _kit.SAMPLE_BLOCK, "tokenizer_sample_bytes", "must be >= 1 MiB"),
            (self.shard_sequences > 0, "shard_sequences", "must be > 0"),
            (self.batch_bytes > 0, "batch_bytes", "must be > 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise DataError(f"{name}: {rule}")


def _bert_tokenizer(model, opts: PrepareOptions):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=opts.strip_accents, lowercase=opts.lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def build_tokenizer(sources: list[_kit.Source], opts: PrepareOptions, *, storage_client=None,
                    progress: Progress | None = None):
    """Train a WordPiece tokenizer on a bounded sample (or load `opts.vocab_file`). Raises DataError."""
    from tokenizers import models, trainers

    if opts.vocab_file:
        vocab = Path(opts.vocab_file)
        try:
            model = models.WordPiece.from_file(str(vocab), unk_token="[UNK]")
        except Exception as exc:  # the Rust side raises a bare Exception for unreadable vocab files
            raise DataError(f"{vocab}: cannot read the vocabulary ({exc})", path=str(vocab)) from exc
        tok = _bert_tokenizer(model, opts)
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if missing:
            raise DataError(f"{vocab}: vocabulary lacks the special token(s) {missing}", path=str(vocab))
        return tok
    tok = _bert_tokenizer(models.WordPiece(unk_token="[UNK]"), opts)
    trainer = trainers.WordPieceTrainer(
        vocab_size=opts.vocab_size, min_frequency=opts.min_frequency, limit_alphabet=opts.limit_alphabet,
        special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix="##", show_progress=False)
    _kit.train_on_sample(tok, trainer, sources, opts.tokenizer_sample_bytes, storage_client=storage_client,
                         progress=progress)
    return tok


class _Packer:
    """Packs token-id pieces into [CLS]-prefixed fixed-length sequences (see the module docstring)."""

    def __init__(self, writer, seq_len: int, dtype: str, special: dict[str, int]):
        import numpy as np

        self.np, self.writer, self.seq_len = np, writer, seq_len
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.cls, self.sep, self.pad, self.unk = (special[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]"))
        self.carry = np.empty(0, dtype=np.int64)
        self.sequences = self.tokens = self.unk_tokens = self.documents = 0

    def add(self, encodings: list, ends: list[bool]) -> None:
        """Append a batch of `tokenizers.Encoding`s; `.ids` is read here, not in the thread that encodes,
        so the encoder's next batch runs on all cores while this one is converted and written."""
        buf, ended = _kit.stream_ids(self.carry, encodings, ends, self.sep)
        self.documents += ended
        body = self.seq_len - 1
        n = len(buf) // body
        self._emit(buf[: n * body].reshape(n, body))
        self.carry = buf[n * body:]

    def finish(self) -> None:
        if len(self.carry):
            row = self.np.full((1, self.seq_len - 1), self.pad, dtype=self.np.int64)
            row[0, : len(self.carry)] = self.carry
            self._emit(row, real=len(self.carry))
            self.carry = self.carry[:0]
        self.writer.close()

    def _emit(self, bodies, real: int | None = None) -> None:
        np = self.np
        if not len(bodies):
            return
        seqs = np.empty((len(bodies), self.seq_len), dtype=self.dtype)
        seqs[:, 0] = self.cls
        seqs[:, 1:] = bodies
        self.sequences += len(seqs)
        self.tokens += seqs.size if real is None else real + 1
        counted = bodies if real is None else bodies[:, :real]
        self.unk_tokens += int((counted == self.unk).sum())
        for row in seqs:
            self.writer.write(row.tobytes())


def prepare(corpus: Iterable[str], out_dir: str | Path, opts: PrepareOptions = PrepareOptions(), *,
            storage_client=None, progress: Progress | None = None) -> Manifest:
    """Tokenizer + shards + manifest in `out_dir` (a local directory, created if needed).

    Re-running with unchanged inputs rewrites the same data. On failure the shards written by this call
    are removed (and `out_dir` itself if this call created it) and no manifest is written. Blocks until
    done. Raises DataError naming the file at fault.
    """
    return _kit.prepare_with(_prepare, corpus, out_dir, opts, storage_client=storage_client, progress=progress)


def _prepare(sources: list[_kit.Source], out: Path, opts: PrepareOptions, storage_client,
             progress: Progress | None) -> Manifest:
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # a directory without a manifest is incomplete
    tok = build_tokenizer(sources, opts, storage_client=storage_client, progress=progress)
    tok.model.save(str(out))
    tok.save(str(out / TOKENIZER_NAME))
    vocab_size = tok.get_vocab_size()
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    writer = _kit.ShardWriter(out, opts.shard_sequences)
    packer = _Packer(writer, opts.seq_len, dtype, special)
    _kit.encode_into(packer, writer, lambda texts, ends: (tok.encode_batch_fast(texts, add_special_tokens=False), ends),
                     sources, opts, storage_client, progress)
    if packer.sequences == 0:
        raise DataError(f"corpus is empty: {_kit.source_names(sources)} has no text", path=sources[0].url)
    return _kit.write_manifest(out, Manifest(
        seq_len=opts.seq_len, vocab_size=vocab_size,
        vocab_sha256=hashlib.sha256((out / VOCAB_NAME).read_bytes()).hexdigest(),
        record_format=f"raw-{dtype}-le", special_ids=special,
        tokenizer={"type": "wordpiece", "vocab_file": opts.vocab_file, "requested_vocab_size": opts.vocab_size,
                   "lowercase": opts.lowercase, "strip_accents": opts.strip_accents,
                   "limit_alphabet": opts.limit_alphabet, "min_frequency": opts.min_frequency,
                   "sample_bytes": opts.tokenizer_sample_bytes},
        doc_format=opts.doc_format, documents=packer.documents, sequences=packer.sequences,
        tokens=packer.tokens, unk_tokens=packer.unk_tokens, raw_bytes=_kit.total_bytes(sources),
        shards=tuple(writer.shards), format=FORMAT))


def upload(local_dir: str | Path, url: str, *, storage_client=None, workers: int = 8,
           progress: Progress | None = None) -> tuple[int, int]:
    """lmkit's upload with BERT's tokenizer files and manifest format (idempotent; manifest last)."""
    return _kit.upload(local_dir, url, extra_files=(VOCAB_NAME, TOKENIZER_NAME), manifest_format=FORMAT,
                       storage_client=storage_client, workers=workers, progress=progress)
