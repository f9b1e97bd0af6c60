"""`tpuctl data prepare`: a text corpus -> the template's vocabulary + packed TFRecord shards + manifest.

The work is the template's own data preparation, reached through its contract (templates/contract.py; `tpuctl
run` calls the same for a spec's `job.data`); this layer parses flags, reaches Cloud Storage for gs://
inputs/outputs, renders progress and maps the template's data error to BadInput.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import click

from tpuctl import console
from tpuctl.errors import BadInput, TpuctlError
from tpuctl.templates import contract

SECTION = "Data"


class _Progress:
    """At most one plain stderr line per stage every few seconds: prep runs for minutes to hours."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.last = every_s, {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last.get(stage, -self.every_s) >= self.every_s or done >= total:
            self.last[stage] = now
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            console.note(f"{stage}: {done / 1e6:,.1f} / {total / 1e6:,.1f} MB{pct}")


def prepare_corpus(corpus: Sequence[str], out: str, options: Any, *, storage_client=None, progress=None,
                   template: str = "bert") -> Any:
    """Prepare `corpus` into `out` (a local directory, or gs://bucket/prefix via a local staging directory).

    Re-running with the same inputs rewrites the same data; uploads skip objects whose CRC32C already
    matches. `storage_client` is needed only when an input or `out` is gs:// (else built from the settings).
    Blocks until done. Returns the template's manifest. Raises BadInput naming the file or option at fault.
    """
    prep = _data_prep(template)
    if not corpus:
        raise BadInput("no corpus files given", field="corpus", hint="pass text files, globs or gs:// URLs")
    missing = [m for m in ("tokenizers", "numpy", "google_crc32c") if importlib.util.find_spec(m) is None]
    if missing:
        raise TpuctlError(f"data preparation needs {', '.join(missing)}, which this install lacks",
                          hint="pip install 'tpuctl[train]'")
    remote = out.startswith("gs://") or any(c.startswith("gs://") for c in corpus)
    client = storage_client if storage_client is not None or not remote else _storage_client()
    if out.startswith("gs://"):
        check_destination(client, out)
    try:
        if not out.startswith("gs://"):
            return prep.prepare(corpus, out, options, storage_client=client, progress=progress)
        with tempfile.TemporaryDirectory(prefix="tpuctl-data-") as staging:
            manifest = prep.prepare(corpus, staging, options, storage_client=client, progress=progress)
            prep.upload(staging, out, storage_client=client, progress=progress)
            return manifest
    except prep.error as exc:
        hint = ("corpus files must be UTF-8 text, one sentence or paragraph per line" if exc.path
                else "see `tpuctl data prepare --help`")
        raise BadInput(str(exc), hint=hint) from exc


WRITE_PERMISSION = "storage.objects.create"


def check_destination(client, out: str) -> None:
    """Refuse a gs:// destination that could not take the result, before any (possibly hours of) work: the
    bucket must exist and the caller must hold `storage.objects.create` on it (asked with the bucket's
    testIamPermissions, which writes nothing). Read-only; raises BadInput naming `out`."""
    from tpuctl.errors import PermissionDenied
    from tpuctl.provision import waits

    name = out[len("gs://"):].partition("/")[0]
    if not name:
        raise BadInput(f"{out!r} names no bucket", field="out", hint="write gs://BUCKET/PREFIX or a local directory")
    try:
        bucket = waits.call(lambda: client.lookup_bucket(name), what=f"look up bucket {name}")
        granted = [] if bucket is None else waits.call(lambda: bucket.test_iam_permissions([WRITE_PERMISSION]),
                                                       what=f"check write access to gs://{name}")
    except PermissionDenied as exc:
        raise BadInput(f"you have no access to bucket gs://{name}", field="out",
                       hint="ask for roles/storage.objectAdmin on it, or write to a local directory") from exc
    if bucket is None:
        raise BadInput(f"bucket gs://{name} does not exist; nothing was prepared", field="out",
                       hint="give an existing bucket (a run's: `tpuctl status RUN`), create it first, "
                            "or write to a local directory")
    if WRITE_PERMISSION not in granted:
        raise BadInput(f"you may not write to bucket gs://{name} (no {WRITE_PERMISSION}); nothing was prepared",
                       field="out", hint="ask for roles/storage.objectAdmin on it, or write to a local directory")


def _data_prep(template: str) -> contract.DataPrep:
    found = contract.find(template)
    if found.data is None:
        raise BadInput(f"template {found.name} prepares no data", field="template",
                       hint="choose a template that does (`tpuctl templates`)")
    return found.data


def _storage_client():
    from tpuctl import config
    from tpuctl.provision.clients import connect

    return connect(config.settings(on_event=console.report)).storage


@click.group("data")
def data_group() -> None:
    """Prepare training data: vocabulary, packed shards, manifest."""


# flag -> the template's options field; a flag the chosen template's options lack is refused when given.
_FLAG_FIELDS = {"vocab_size": "vocab_size", "seq_len": "seq_len", "vocab_file": "vocab_file", "lowercase": "lowercase",
                "strip_accents": "strip_accents", "limit_alphabet": "limit_alphabet", "min_frequency": "min_frequency",
                "doc_format": "doc_format", "sample_mb": "tokenizer_sample_bytes",
                "shard_sequences": "shard_sequences"}


@data_group.command("prepare")
@click.argument("corpus", nargs=-1, required=True)
@click.option("--out", required=True, help="output directory, or gs://bucket/prefix (staged locally, then uploaded)")
@click.option("--template", "template", default="bert", show_default=True,
              help="whose data to prepare: a template name (`tpuctl templates`) or directory")
@click.option("--vocab-size", type=click.IntRange(6, 1 << 24), default=None,
              help="vocabulary size to train [default: the template's: bert 30522, gpt2 50257]")
@click.option("--seq-len", type=click.IntRange(8), default=None,
              help="tokens per packed sequence [default: the template's: bert 128 (128|256|512), gpt2 1024]")
@click.option("--vocab", "vocab_file", type=click.Path(exists=True, dir_okay=False),
              help="bert: use this vocab.txt instead of training one")
@click.option("--lowercase/--cased", default=True, show_default=True, help="bert: lowercase before tokenising")
@click.option("--strip-accents/--keep-accents", default=None,
              help="bert: strip accents (default: when lowercasing); --keep-accents keeps Hangul syllables whole")
@click.option("--limit-alphabet", type=click.IntRange(1), default=4000, show_default=True,
              help="bert: max initial characters in the vocabulary (raise for CJK/Korean)")
@click.option("--min-frequency", type=click.IntRange(1), default=2, show_default=True,
              help="how often a pair of pieces must occur to be merged into the vocabulary")
@click.option("--doc-format", type=click.Choice(["blank", "line"]), default="blank", show_default=True,
              help="blank: a blank line ends a document; line: each line is a document")
@click.option("--sample-mb", type=click.IntRange(1), default=None,
              help="MiB of text the tokenizer trains on, sampled evenly across the corpus (bounds its time and "
                   "memory) [default: the template's: bert 64, gpt2 32]")
@click.option("--shard-sequences", type=click.IntRange(1), default=None,
              help="sequences per TFRecord shard [default: the template's: bert 65536, gpt2 16384]")
@click.option("--json", "as_json", is_flag=True, help="print the manifest summary as JSON")
@click.pass_context
def prepare_command(ctx: click.Context, corpus: tuple[str, ...], out: str, template: str, as_json: bool,
                    **flags: Any) -> None:
    """Tokenise CORPUS (UTF-8 files, globs or gs:// URLs) into the template's packed TFRecord shards."""
    prep = _data_prep(template)
    fields = {f.name for f in dataclasses.fields(prep.options)}
    values = {}
    for flag, value in flags.items():
        name = _FLAG_FIELDS[flag]
        given = ctx.get_parameter_source(flag) is not click.core.ParameterSource.DEFAULT
        if name not in fields:
            if given:
                raise BadInput(f"template {template} has no option {name}", field=f"--{flag.replace('_', '-')}",
                               hint="remove it (`tpuctl data prepare --help` marks template-specific flags)")
            continue
        if value is not None:
            values[name] = value << 20 if flag == "sample_mb" else value
    options = prep.options(**values)
    started = time.monotonic()
    manifest = prepare_corpus(list(corpus), out, options, progress=_Progress(), template=template)
    elapsed = time.monotonic() - started
    summary = {
        "out": out, "sequences": manifest.sequences, "documents": manifest.documents, "tokens": manifest.tokens,
        "unk_rate": round(manifest.unk_tokens / max(manifest.tokens, 1), 6), "vocab_size": manifest.vocab_size,
        "seq_len": manifest.seq_len, "shards": len(manifest.shards), "raw_bytes": manifest.raw_bytes,
        "prepared_bytes": manifest.prepared_bytes,
        "prepared_over_raw": round(manifest.prepared_bytes / max(manifest.raw_bytes, 1), 4),
        "seconds": round(elapsed, 2), "mb_per_s": round(manifest.raw_bytes / 1e6 / max(elapsed, 1e-9), 2),
    }
    if as_json:
        console.emit_json(summary)
    else:
        console.table(("field", "value"), summary.items())


data_group.section = SECTION
commands = [data_group]
