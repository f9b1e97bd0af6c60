"""Data preparation both templates share: text corpus -> the template's tokenizer -> token ids packed into sharded
TFRecords + manifest. A template's prepare.py brings its tokenizer, its packer and its manifest's contents, and
runs them through `prepare_with` and `encode_into` (bert/prepare.py, gpt2/prepare.py).

Used on the laptop by `tpuctl data prepare` and `tpuctl run`; needs `tokenizers`, `numpy` and
`google-crc32c`, not TensorFlow (records are framed here; the trainer reads them with tf.data).

Input: UTF-8 text files, local paths, globs or `gs://bucket/path` (globs allowed after the bucket; read
with google-cloud-storage, imported only when a gs:// input is given).

Documents (`doc_format`): "blank" (default) - consecutive non-empty lines form one document, a blank line
ends it; the usual BERT corpus layout (one sentence or paragraph per line). "line" - every non-empty line is
a document (one-document-per-line dumps such as Wikipedia extractions). A line is never held whole if it is
huge: it is cut at whitespace into pieces of at most 64k characters.

Tokenizer training memory is bounded by *sampling*, not by the corpus (`train_on_sample`): when the corpus is
larger than the template's `tokenizer_sample_bytes`, the trainer sees that many bytes read as evenly spaced 1 MiB
blocks across all files (cut to whole lines), so its word-count table scales with the sample, never with the
corpus.

Encoding streams (`encode_into`): a reader thread cuts the text into batches of ~`batch_bytes` of pieces,
`encode_batch_fast` encodes each batch on all cores (the Rust side releases the GIL and fans out over its thread
pool), and the main thread packs and writes while the next batch encodes. Memory is a few batches, whatever the
corpus size.

Output directory: `train-NNNNN.tfrecord` shards of `shard_sequences` records (each written under a
temporary name and renamed when complete, `ShardWriter`), the template's tokenizer files, and `manifest.json`
last (`write_manifest`). `upload` copies it to Cloud Storage, the manifest last.
"""

from __future__ import annotations

import base64
import codecs
import fnmatch
import glob
import itertools
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .errors import DataError
from .manifest import MANIFEST_NAME, Manifest, Shard

READ_CHUNK = 4 << 20
SAMPLE_BLOCK = 1 << 20
MAX_PIECE_CHARS = 64 << 10
SNIFF_BYTES = 64 << 10

Progress = Callable[[str, int, int], None]
"""progress(stage, done_bytes, total_bytes); stages: "tokenizer", "encode"."""


# ---------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """One input file: a local path or a gs:// URL, with its size in bytes."""

    url: str
    size: int

    @property
    def remote(self) -> bool:
        return self.url.startswith("gs://")


def expand(patterns: Iterable[str], *, storage_client=None) -> list[Source]:
    """Resolve paths, globs and gs:// URLs/globs to files in a stable order. Raises DataError if one matches nothing."""
    sources: list[Source] = []
    for pattern in patterns:
        found = _expand_gs(pattern, storage_client) if pattern.startswith("gs://") else _expand_local(pattern)
        if not found:
            raise DataError(f"{pattern}: no such file (or the glob matches nothing)", path=pattern)
        sources.extend(found)
    return sources


def _expand_local(pattern: str) -> list[Source]:
    paths = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(Source(p, os.path.getsize(p)))
        elif os.path.exists(p) and not glob.has_magic(pattern):
            raise DataError(f"{p}: is not a regular file", path=p)
    return out


def _split_gs(url: str) -> tuple[str, str]:
    bucket, _, name = url[len("gs://"):].partition("/")
    if not bucket:
        raise DataError(f"{url}: expected gs://BUCKET/PATH", path=url)
    return bucket, name


def _storage(client):
    if client is not None:
        return client
    from google.cloud import storage  # lazy: a local-only user never needs it loaded

    return storage.Client()


def _expand_gs(url: str, client) -> list[Source]:
    bucket, name = _split_gs(url)
    client = _storage(client)
    if not glob.has_magic(name):
        blob = client.bucket(bucket).get_blob(name)
        return [Source(url, blob.size)] if blob is not None else []
    prefix = name[: min(name.index(c) for c in "*?[" if c in name)]
    blobs = client.list_blobs(bucket, prefix=prefix)
    return sorted((Source(f"gs://{bucket}/{b.name}", b.size) for b in blobs if fnmatch.fnmatchcase(b.name, name)),
                  key=lambda s: s.url)


def _open(source: Source, client) -> BinaryIO:
    if source.remote:
        bucket, name = _split_gs(source.url)
        return _storage(client).bucket(bucket).blob(name).open("rb")
    return open(source.url, "rb")


def _read_range(source: Source, start: int, length: int, client) -> bytes:
    if source.remote:
        bucket, name = _split_gs(source.url)
        return _storage(client).bucket(bucket).blob(name).download_as_bytes(start=start, end=start + length - 1)
    with open(source.url, "rb") as f:
        f.seek(start)
        return f.read(length)


def _check_text(source: Source, data: bytes, offset: int) -> None:
    """Reject binary data (NUL bytes); UTF-8 errors are caught where the bytes are decoded."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{source.url}: looks like a binary file (NUL byte at offset {offset + nul}); "
                        "expected UTF-8 text", path=source.url)


def _decode_error(source: Source, exc: UnicodeDecodeError, offset: int) -> DataError:
    return DataError(f"{source.url}: not UTF-8 text (invalid byte at offset {offset + exc.start}); "
                     "convert it with e.g. `iconv -t UTF-8`", path=source.url)


def sniff(sources: Iterable[Source], *, storage_client=None) -> None:
    """Fail fast on an obviously wrong file (binary, not UTF-8) before any long work. Raises DataError."""
    for s in sources:
        head = _read_range(s, 0, SNIFF_BYTES, storage_client) if s.size else b""
        _check_text(s, head, 0)
        cut = head.rfind(b"\n") + 1 if len(head) == SNIFF_BYTES else len(head)
        try:
            head[:cut or len(head)].decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            if cut or exc.reason != "unexpected end of data":
                raise _decode_error(s, exc, 0) from exc


def iter_lines(source: Source, *, storage_client=None) -> Iterator[str]:
    """Stream a file's lines (without newline), decoding strictly. Raises DataError naming the file."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    offset = 0
    carry = ""
    with _open(source, storage_client) as f:
        while True:
            data = f.read(READ_CHUNK)
            _check_text(source, data, offset)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise _decode_error(source, exc, offset) from exc
            offset += len(data)
            if not data:
                break
            lines = (carry + text).split("\n")
            carry = lines.pop()
            yield from lines
    if carry:
        yield carry


def iter_pieces(source: Source, doc_format: str, *, storage_client=None) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces of one file, each at most MAX_PIECE_CHARS; see the module docstring."""
    pending: str | None = None
    for raw in iter_lines(source, storage_client=storage_client):
        line = raw.strip()
        if not line:
            if pending is not None:
                yield from _cut(pending, True)
                pending = None
            continue
        if doc_format == "line":
            yield from _cut(line, True)
            continue
        if pending is not None:
            yield from _cut(pending, False)
        pending = line
    if pending is not None:
        yield from _cut(pending, True)


def _cut(line: str, ends: bool) -> Iterator[tuple[str, bool]]:
    while len(line) > MAX_PIECE_CHARS:
        at = line.rfind(" ", 0, MAX_PIECE_CHARS)
        at = at if at > 0 else MAX_PIECE_CHARS
        yield line[:at], False
        line = line[at:].lstrip()
    if line:
        yield line, ends


def sample_lines(sources: list[Source], budget: int, *, storage_client=None) -> Iterator[str]:
    """The tokenizer's training text: everything if it fits `budget` bytes, else at most `budget` bytes read
    as blocks of <= SAMPLE_BLOCK evenly spaced through every file (each file's share follows its size),
    each cut to whole lines."""
    total = sum(s.size for s in sources)
    if total <= budget:
        for s in sources:
            yield from iter_lines(s, storage_client=storage_client)
        return
    for s in sources:
        share = budget * s.size // total  # this file's part of the budget, read as evenly spaced blocks
        n = -(-share // SAMPLE_BLOCK)
        for i in range(n):
            start, length = s.size * i // n, share // n
            data = _read_range(s, start, length, storage_client)
            _check_text(s, data, start)
            first = 0 if start == 0 else data.find(b"\n") + 1
            last = len(data) if start + len(data) >= s.size else data.rfind(b"\n")
            if first <= 0 and start != 0 or last <= first:
                continue  # a block inside one very long line: nothing whole to take
            try:
                text = data[first:last].decode("utf-8-sig" if start == 0 else "utf-8")
            except UnicodeDecodeError as exc:
                raise _decode_error(s, exc, start + first) from exc
            yield from text.split("\n")


# -------------------------------------------------------------------------------------------- tokenizer


def train_on_sample(tok, trainer, sources: list[Source], sample_bytes: int, *, storage_client=None,
                    progress: Progress | None = None) -> None:
    """Train `tok` with `trainer` on at most `sample_bytes` of the corpus (`sample_lines`, non-blank lines).
    Blocks. Raises DataError when the corpus has no text.

    The sample is written to a temporary file and trained with `Tokenizer.train(files)`: the Rust side then
    reads and counts words on every core, where `train_from_iterator` is fed one Python batch at a time
    (measured on 32 MiB of the peers corpus, 2 cores: 3.8 s instead of 5.2 s)."""
    budget = min(sample_bytes, sum(s.size for s in sources))
    written = 0
    with tempfile.TemporaryDirectory(prefix="tpuctl-tokenizer-") as tmp:
        path = Path(tmp) / "sample.txt"
        with path.open("wb") as f:
            for line in sample_lines(sources, sample_bytes, storage_client=storage_client):
                if line.strip():
                    data = (line + "\n").encode("utf-8")  # train(files) keeps the line break, as encoding does
                    f.write(data)
                    if progress and (written + len(data)) >> 22 != written >> 22:  # every 4 MiB
                        progress("tokenizer", written + len(data), budget)
                    written += len(data)
        if not written:
            raise DataError(f"corpus is empty: {source_names(sources)} has no text", path=sources[0].url if sources else None)
        tok.train([str(path)], trainer=trainer)
    if progress:
        progress("tokenizer", budget, budget)


def source_names(sources: list[Source]) -> str:
    names = [s.url for s in sources[:3]]
    return ", ".join(names) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")


# ------------------------------------------------------------------------------------ records and shards


def _masked_crc(data: bytes) -> bytes:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8 & 0xFFFFFFFF).to_bytes(4, "little")


class ShardWriter:
    """TFRecord shards of fixed-size records, rotated every `per_shard` records; renamed into place when full."""

    def __init__(self, out: Path, per_shard: int):
        self.out, self.per_shard = out, per_shard
        self.shards: list[Shard] = []
        self._file: BinaryIO | None = None
        self._count = 0
        self._crc = None

    def write(self, record: bytes) -> None:
        import google_crc32c

        if self._file is None:
            self._file = open(self._tmp(), "wb")
            self._count, self._crc = 0, google_crc32c.Checksum()
        length = len(record).to_bytes(8, "little")
        framed = b"".join((length, _masked_crc(length), record, _masked_crc(record)))
        self._file.write(framed)
        self._crc.update(framed)
        self._count += 1
        if self._count == self.per_shard:
            self.close()

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        name = f"train-{len(self.shards):05d}.tfrecord"
        final = self.out / name
        os.replace(self._tmp(), final)
        self.shards.append(Shard(name, self._count, final.stat().st_size,
                                 base64.b64encode(self._crc.digest()).decode("ascii")))
        self._file = None

    def discard(self) -> None:
        """Remove everything this writer produced (after a failure)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        Path(self._tmp()).unlink(missing_ok=True)
        for s in self.shards:
            (self.out / s.path).unlink(missing_ok=True)
        self.shards = []

    def _tmp(self) -> str:
        return str(self.out / f".train-{len(self.shards):05d}.tfrecord.partial")


def stream_ids(carry, encodings: list, ends: list[bool], separator: int):
    """(`carry` followed by each encoding's ids, `separator` after each that ends its document, as int64 numpy;
    how many documents ended): the token stream the packers cut into sequences."""
    import numpy as np

    sep = (separator,)
    # One pass from the encodings' id lists into numpy (no intermediate Python list): this runs on the main
    # thread beside the encoder's, and costs ~40% less than extend + asarray.
    pieces = ((e.ids, sep) if end else (e.ids,) for e, end in zip(encodings, ends, strict=True))
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(pieces)), dtype=np.int64)
    return np.concatenate((carry, flat)), sum(ends)


# ------------------------------------------------------------------------------------------ the pipeline


def _background(items: Iterable[Any], depth: int) -> Iterator[Any]:
    """Produce `items` in a daemon thread, `depth` ahead; re-raise its exception here; stop it if we stop."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def run() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((done, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            q.put((done, exc))

    thread = threading.Thread(target=run, daemon=True, name="prepare-stage")
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _text_batches(sources: list[Source], opts,
                  storage_client) -> Iterator[tuple[list[str], list[bool], int]]:
    """Pieces grouped into batches of ~batch_bytes characters, each with the bytes read so far (for progress)."""
    texts: list[str] = []
    ends: list[bool] = []
    # Characters stand in for bytes (exact for ASCII, low for Hangul) until a file ends: progress only.
    size = finished = 0  # characters in this batch; bytes of the sources already read to the end
    for s in sources:
        read = 0
        for text, end in iter_pieces(s, opts.doc_format, storage_client=storage_client):
            texts.append(text)
            ends.append(end)
            n = len(text) + 1
            size, read = size + n, read + n
            if size >= opts.batch_bytes:
                yield texts, ends, finished + min(read, s.size)
                texts, ends, size = [], [], 0
        finished += s.size
    if texts:
        yield texts, ends, finished


def prepare_with(write, corpus: Iterable[str], out_dir: str | Path, opts, *, storage_client=None,
                 progress: Progress | None = None):
    """The contract of `prepare` for any template's `write(sources, out, opts, storage_client, progress) ->
    manifest`: options validated, the corpus expanded and sniffed before anything is written, `out_dir`
    created, and removed again if this call created it and `write` fails."""
    opts.validate()
    out = Path(out_dir)
    corpus = list(corpus)
    if storage_client is None and any(c.startswith("gs://") for c in corpus):
        storage_client = _storage(None)  # one client for every listing and read
    sources = expand(corpus, storage_client=storage_client)
    sniff(sources, storage_client=storage_client)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return write(sources, out, opts, storage_client, progress)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def encode_into(packer, writer: ShardWriter, encode, sources: list[Source], opts, storage_client,
                progress: Progress | None = None):
    """Stream the corpus through `encode(texts, ends) -> (encodings, ends)` (one encoding per text, or per run of
    texts it joined, with whether each ends its document) into `packer.add(encodings, ends)`, reading
    and encoding in background threads (the module's pipeline), and return `packer.finish()`. On any failure the
    shards `writer` wrote are removed. Blocks."""
    total = total_bytes(sources)

    def encoded(batches):
        for texts, ends, done in batches:
            yield *encode(texts, ends), done

    try:
        for encodings, ends, done in _background(encoded(_background(
                _text_batches(sources, opts, storage_client), depth=4)), depth=2):
            packer.add(encodings, ends)
            if progress:
                progress("encode", done, total)
        return packer.finish()
    except BaseException:
        writer.discard()
        raise


def total_bytes(sources: list[Source]) -> int:
    return sum(s.size for s in sources)


def write_manifest(out: Path, manifest: Manifest) -> Manifest:
    """Write `manifest` into `out`, last and atomically (a directory with one is complete); returns it."""
    tmp = out / (MANIFEST_NAME + ".partial")
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, out / MANIFEST_NAME)
    return manifest


# ---------------------------------------------------------------------------------------------- upload


def file_crc32c(path: Path) -> str:
    """base64 big-endian CRC32C of a file, as Cloud Storage reports it for objects."""
    import google_crc32c

    crc = google_crc32c.Checksum()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_CHUNK), b""):
            crc.update(block)
    return base64.b64encode(crc.digest()).decode("ascii")


def upload(local_dir: str | Path, url: str, *, extra_files: Iterable[str], manifest_format: str, storage_client=None,
           workers: int = 8, progress: Progress | None = None) -> tuple[int, int]:
    """Copy a prepared directory to `gs://bucket/prefix`; returns (uploaded, skipped) file counts.

    Idempotent: objects already there with the same CRC32C are skipped. Shards and `extra_files` (the template's
    tokenizer files) go up in parallel; the manifest goes last, so a reader that sees it sees complete data. Blocks.
    """
    from concurrent.futures import ThreadPoolExecutor

    local = Path(local_dir)
    manifest = Manifest.from_json((local / MANIFEST_NAME).read_text(encoding="utf-8"), where=str(local / MANIFEST_NAME),
                                  expect=manifest_format)
    bucket_name, prefix = _split_gs(url.rstrip("/"))
    prefix = f"{prefix}/" if prefix else ""
    client = _storage(storage_client)
    bucket = client.bucket(bucket_name)
    existing = {b.name: b.crc32c for b in client.list_blobs(bucket_name, prefix=prefix)}
    files = [(s.path, s.crc32c, s.bytes) for s in manifest.shards]
    files += [(n, file_crc32c(local / n), (local / n).stat().st_size) for n in extra_files]
    todo = [(name, size) for name, crc, size in files if existing.get(prefix + name) != crc]
    total = sum(size for _, _, size in files)
    done = total - sum(size for _, size in todo)
    lock = threading.Lock()

    def put(item: tuple[str, int]) -> None:
        nonlocal done
        name, size = item
        bucket.blob(prefix + name).upload_from_filename(str(local / name), checksum="crc32c")
        with lock:
            done += size
            if progress:
                progress("upload", done, total)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(put, todo))
    bucket.blob(prefix + MANIFEST_NAME).upload_from_filename(str(local / MANIFEST_NAME), checksum="crc32c")
    return len(todo) + 1, len(files) - len(todo)
