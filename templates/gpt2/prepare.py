"""Data preparation for GPT-2: text corpus -> byte-level BPE -> fixed blocks of token ids in TFRecord shards.

Laptop side (`tpuctl data prepare --template gpt2`, `tpuctl run` with `template: gpt2`); needs `tokenizers`,
`numpy`, `google-crc32c`, not TensorFlow. Reading, documents, sampling, streaming, shard framing and upload are
lmkit's (lmkit/prepare.py: inputs local or gs://, flat memory, atomic shards, manifest last), as BERT's are.

Tokenizer: byte-level BPE (what `tokenizers.ByteLevelBPETokenizer` builds: BPE over the 256-byte alphabet, GPT-2's
pre-tokeniser, no prefix space, no normalisation, so every byte sequence round-trips) trained on a bounded sample, with one special token
`<|endoftext|>`. Written as `vocab.json` + `merges.txt` (what Hugging Face's `GPT2Tokenizer` loads) and
`tokenizer.json` (`GPT2TokenizerFast`).

Packing (GPT-2 / `run_clm` "group_texts"): every document's ids followed by `<|endoftext|>`, concatenated and
cut into blocks of exactly `seq_len` tokens; the final partial block is dropped (static shapes, no padding and
no mask needed). Lines inside a document are joined by a newline. Records are raw little-endian uint16 ids
(uint32 above 65536 tokens): 2 bytes per token, about 0.5 bytes or less per byte of text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .shared import lmkit

_kit = lmkit("prepare")
DataError = lmkit("errors").DataError
Manifest, MANIFEST_NAME = lmkit("manifest").Manifest, lmkit("manifest").MANIFEST_NAME

FORMAT = "tpuctl-gpt2-clm/1"
EOT = "<|endoftext|>"
VOCAB_NAME, MERGES_NAME, TOKENIZER_NAME = "vocab.json", "merges.txt", "tokenizer.json"
FILES = (VOCAB_NAME, MERGES_NAME, TOKENIZER_NAME)
RUN_CHARS = 1 << 10  # characters per encoder input (document_runs)


@dataclass(frozen=True)
class PrepareOptions:
    vocab_size: int = 50257  # GPT-2's: 256 bytes + 50000 merges + <|endoftext|>
    seq_len: int = 1024
    min_frequency: int = 2
    doc_format: str = "blank"
    # Half BERT's: on bench/peers.py's 100 MB corpus a 32 MiB sample trains 50257-token BPE in ~4 s instead of
    # ~6.5 s and encodes the corpus into 0.19% more tokens than a 64 MiB one (--sample-mb raises it).
    tokenizer_sample_bytes: int = 32 << 20
    shard_sequences: int = 16384
    # Text per encode_batch call. Byte-level BPE's Encoding objects cost ~80 bytes a token and up to four
    # batches are in flight (queues of 2 + encode + pack): 256 KiB keeps the peak ~40 MB lower than 1 MiB at
    # the same throughput on 2 cores (bench/peers.py).
    batch_bytes: int = 1 << 18

    def validate(self) -> None:
        checks = [
            (self.seq_len >= 8 and self.seq_len % 8 == 0, "seq_len", "must be a positive multiple of 8 (1024 for GPT-2)"),
            (257 < self.vocab_size <= 1 << 24, "vocab_size", "must be between 258 (256 bytes + <|endoftext|> + 1) and 16777216"),
            (self.min_frequency > 0, "min_frequency", "must be > 0"),
            (self.doc_format in ("blank", "line"), "doc_format", "must be 'blank' or 'line'"),
            (self.tokenizer_sample_bytes >= _kit.SAMPLE_BLOCK, "tokenizer_sample_bytes", "must be >= 1 MiB"),
            (self.shard_sequences > 0, "shard_sequences", "must be > 0"),
            (self.batch_bytes > 0, "batch_bytes", "must be > 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise DataError(f"{name}: {rule}")


def build_tokenizer(sources, opts: PrepareOptions, *, storage_client=None, progress=None):
    """Train byte-level BPE on a bounded sample of the corpus. Raises DataError on an empty corpus."""
    # ByteLevelBPETokenizer's own pipeline, built on a plain Tokenizer for its encode_batch_fast.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=opts.vocab_size, min_frequency=opts.min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    _kit.train_on_sample(tok, trainer, sources, opts.tokenizer_sample_bytes, storage_client=storage_client,
                         progress=progress)
    return tok


class Packer:
    """Documents' ids, each followed by <|endoftext|>, cut into `seq_len`-token blocks; the tail is carried to
    the next batch and the final partial block dropped."""

    def __init__(self, writer, seq_len: int, dtype: str, eot: int):
        import numpy as np

        self.writer, self.seq_len, self.eot = writer, seq_len, eot
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.carry = np.empty(0, dtype=np.int64)
        self.sequences = self.tokens = self.documents = 0

    def add(self, encodings: list, ends: list[bool]) -> None:
        buf, ended = _kit.stream_ids(self.carry, encodings, ends, self.eot)
        self.documents += ended
        n = len(buf) // self.seq_len
        for row in buf[: n * self.seq_len].reshape(n, self.seq_len).astype(self.dtype):
            self.writer.write(row.tobytes())
        self.sequences += n
        self.tokens += n * self.seq_len
        self.carry = buf[n * self.seq_len:]

    def finish(self) -> int:
        """Close the last shard; returns the tokens dropped with the partial final block."""
        self.writer.close()
        return len(self.carry)


def document_runs(texts: list[str], ends: list[bool], run_chars: int = RUN_CHARS) -> tuple[list[str], list[bool]]:
    """Consecutive lines of one document joined into runs of about `run_chars`, each line but a document's last
    keeping its line break (byte-level BPE encodes it), with whether each run ends its document.

    Lines arrive stripped, so a line break is always its own pre-token between two non-blank lines: a run
    encodes to exactly the ids of its lines encoded one by one, in fewer, longer inputs (on bench/peers.py's
    corpus, 2 cores: ~20% less encoding time than one input per line)."""
    runs: list[str] = []
    run_ends: list[bool] = []
    run: list[str] = []
    size = 0
    for text, end in zip(texts, ends, strict=True):
        run.append(text)
        size += len(text) + 1
        if end or size >= run_chars:
            runs.append("\n".join(run) + ("" if end else "\n"))
            run_ends.append(end)
            run, size = [], 0
    if run:
        runs.append("\n".join(run) + "\n")
        run_ends.append(False)
    return runs, run_ends


def prepare(corpus: Iterable[str], out_dir: str | Path, opts: PrepareOptions = PrepareOptions(), *,
            storage_client=None, progress=None) -> Manifest:
    """Tokenizer files + shards + manifest in `out_dir` (created if needed); lmkit's contract (prepare_with):
    idempotent for unchanged inputs, cleans up after a failure, no manifest unless complete. Blocks.
    Raises DataError naming the file at fault."""
    return _kit.prepare_with(_prepare, corpus, out_dir, opts, storage_client=storage_client, progress=progress)


def _prepare(sources, out: Path, opts: PrepareOptions, storage_client, progress) -> Manifest:
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    tok = build_tokenizer(sources, opts, storage_client=storage_client, progress=progress)
    tok.model.save(str(out))  # vocab.json + merges.txt
    tok.save(str(out / TOKENIZER_NAME))
    vocab_size = tok.get_vocab_size()
    eot = tok.token_to_id(EOT)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    writer = _kit.ShardWriter(out, opts.shard_sequences)
    packer = Packer(writer, opts.seq_len, dtype, eot)

    def encode(texts, ends):
        runs, run_ends = document_runs(texts, ends)
        return tok.encode_batch_fast(runs, add_special_tokens=False), run_ends

    dropped = _kit.encode_into(packer, writer, encode, sources, opts, storage_client, progress)
    if packer.sequences == 0:
        raise DataError(f"corpus too small: {_kit.source_names(sources)} holds {dropped} tokens, fewer than one "
                        f"{opts.seq_len}-token block", path=sources[0].url)
    return _kit.write_manifest(out, Manifest(
        seq_len=opts.seq_len, vocab_size=vocab_size,
        vocab_sha256=hashlib.sha256((out / VOCAB_NAME).read_bytes() + (out / MERGES_NAME).read_bytes()).hexdigest(),
        record_format=f"raw-{dtype}-le", special_ids={EOT: eot},
        tokenizer={"type": "byte-level-bpe", "requested_vocab_size": opts.vocab_size, "add_prefix_space": False,
                   "min_frequency": opts.min_frequency, "sample_bytes": opts.tokenizer_sample_bytes,
                   "dropped_tail_tokens": dropped},
        doc_format=opts.doc_format, documents=packer.documents, sequences=packer.sequences,
        tokens=packer.tokens, unk_tokens=0, raw_bytes=_kit.total_bytes(sources), shards=tuple(writer.shards),
        format=FORMAT))


def upload(local_dir: str | Path, url: str, *, storage_client=None, workers: int = 8, progress=None) -> tuple[int, int]:
    """lmkit's upload with GPT-2's tokenizer files and manifest format (idempotent; manifest last)."""
    return _kit.upload(local_dir, url, extra_files=FILES, manifest_format=FORMAT, storage_client=storage_client,
                       workers=workers, progress=progress)
