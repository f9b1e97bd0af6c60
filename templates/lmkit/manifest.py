"""The prepared data set's manifest: what the shards hold, so a run can check that data and model agree.

`manifest.json` sits next to the shards and the template's tokenizer files, and is written last: a directory
with a manifest is complete. Records are raw little-endian token ids, `seq_len` of them per record, in
TFRecord framing (`record_format` "raw-uint16-le" when the vocabulary fits 16 bits, else "raw-uint32-le"):
no tf.train.Example wrapper, nothing derived (BERT's input pipeline masks dynamically). Each template's data has
its own `format` (bert/manifest.py, gpt2/prepare.py), which a reader names (`expect`): one template's data is
refused by another's program.

Pure stdlib, readable from local paths; the trainer reads gs:// manifests through tf.io.gfile and passes
the text to `Manifest.from_json`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import DataError

MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class Shard:
    path: str  # relative to the manifest's directory
    sequences: int
    bytes: int
    crc32c: str  # base64 of the big-endian CRC32C, the form Cloud Storage reports for objects


@dataclass(frozen=True)
class Manifest:
    seq_len: int
    vocab_size: int
    vocab_sha256: str
    record_format: str
    special_ids: dict[str, int]
    tokenizer: dict[str, Any]  # how the vocabulary was made (trained options or the vocab file used)
    doc_format: str  # "blank" (blank-line separated documents) or "line" (one document per line)
    documents: int
    sequences: int
    tokens: int  # non-padding tokens, the template's special tokens included
    unk_tokens: int
    raw_bytes: int
    format: str  # the template's data format, e.g. "tpuctl-bert-mlm/1"
    shards: tuple[Shard, ...] = field(default_factory=tuple)

    @property
    def prepared_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def id_dtype(self) -> str:
        return "uint16" if self.record_format == "raw-uint16-le" else "uint32"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["shards"] = [dataclasses.asdict(s) for s in self.shards]
        return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str, expect: str) -> Manifest:
        """Parse a manifest of format `expect` (the reading template's); `where` names it in errors. Raises
        DataError."""
        try:
            data = json.loads(text)
            if data.get("format") != expect:
                raise DataError(f"{where}: not a {expect} manifest (format={data.get('format')!r})", path=where)
            data["shards"] = tuple(Shard(**s) for s in data["shards"])
            return cls(**data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DataError(f"{where}: unreadable manifest ({exc})", path=where) from exc

    def check_compatible(self, *, seq_len: int, vocab_size: int, vocab_sha256: str | None, where: str) -> None:
        """Refuse data that does not match the model: different sequence length, vocabulary size or vocabulary.

        `vocab_size` 0 and `vocab_sha256` None mean "not fixed yet" (a fresh run takes the manifest's).
        """
        problems = []
        if seq_len != self.seq_len:
            problems.append(f"seq_len: data has {self.seq_len}, config wants {seq_len}")
        if vocab_size and vocab_size != self.vocab_size:
            problems.append(f"vocab_size: data has {self.vocab_size}, config wants {vocab_size}")
        if vocab_sha256 and vocab_sha256 != self.vocab_sha256:
            problems.append("vocabulary: the data was tokenised with a different vocab.txt than this model's")
        if not self.shards or self.sequences <= 0:
            problems.append("no sequences")
        if problems:
            raise DataError(f"{where}: data and model disagree: {'; '.join(problems)}", path=where)
