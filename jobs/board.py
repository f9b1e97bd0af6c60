"""`tpuctl board RUN...`: the real TensorBoard on the event files of one or more runs, live while they train and
after the TPU is gone.

Every template writes its TensorBoard files under `{model_dir}/tensorboard` (templates/contract.py `outputs`),
and `model_dir` is `gs://BUCKET/runs/RUN/model` (jobs/bundle.py). Where they are read from is `choose`'s choice:

- `bucket`: on Google, one run, and a gs:// reader installed: TensorBoard reads `gs://BUCKET/runs/RUN/model/
  tensorboard` itself, as `tensorboard --logdir gs://...` does. Its Python loader (`--load_fast=false`, so the
  reader is the one `gs_reader` found) reads through `tensorboard.compat.tf`: TensorFlow's `tf.io.gfile`, whose
  GCS filesystem registers the `gs` scheme, or without TensorFlow TensorBoard's stub gfile, which hands a
  scheme it does not know to fsspec (gs:// is gcsfs) (github.com/tensorflow/tensorboard: tensorboard/compat/
  __init__.py `tf`, tensorboard/compat/tensorflow_stub/io/gfile.py `get_filesystem`). The profile tab (XProf)
  reads the same --logdir.
- `mirror`: otherwise, through tpuctl's own storage client: the local cloud (neither reader honours
  STORAGE_EMULATOR_HOST), no gs:// reader, or several runs (TensorBoard's one --logdir, which the profile tab
  needs, holds one bucket's run, and each run has its own bucket). tpuctl keeps a mirror under
  TPUCTL_HOME/board/PROJECT/RUNS/RUN (one directory per run, which TensorBoard shows as one run named by the
  tpuctl run) and copies what changed every `interval_s`. Event files only grow, and GCS rewrites an object
  whole, so a changed object is downloaded again whole and swapped in atomically; TensorBoard goes on reading
  from its offset.

Beside each run's own scalars, a companion TensorBoard run `RUN/tpuctl-record` shows the run's record: for each
TPU incarnation (a recovery recreates the node) its billed hours, cost and whether it was preempted (a Spot TPU
that stopped billing while it existed, as tpuctl.cost infers it), from this machine's ledger, and the run's
status.json with its total cost as text, at the training step it reached. From the run's timeline
(runs/RUN/timeline.json, jobs/timeline.py): `tpuctl/preemptions`, the count of preemptions at the step each one
struck (0 at the start), and at the step reached its goodput, seconds and dollars per phase, with the phases
and marks as a text table. It is written locally, append-only (TensorBoard reads event files forward), afresh
each time a board starts; when TensorBoard reads the bucket, it is uploaded next to the run's events
(`.../tensorboard/tpuctl-record/`, a run TensorBoard names `tpuctl-record`), which the mirror never copies.

TensorBoard runs as a child process bound to 127.0.0.1 (`python -m tensorboard.main`); `serve` blocks until
`stop` is set or TensorBoard exits, and always stops it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, ClassVar

from tpuctl import paths
from tpuctl.errors import BadInput, TpuctlError, WaitTimeout, from_google
from tpuctl.events import Event, EventSink, Note, Warn, ignore

from .export import find_bucket, split_run

if TYPE_CHECKING:
    from tpuctl.provision import Clients

START_DEADLINE_S = 180.0  # TensorBoard imports TensorFlow when it is installed: tens of seconds on a busy laptop


@dataclass(frozen=True)
class Source:
    """Where a run's TensorBoard files are in its bucket, and where they are mirrored."""

    run: str
    bucket: str
    prefix: str  # runs/RUN/model/tensorboard/
    local: Path

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class BoardReady(Event):
    """TensorBoard answers at `url`, reading `logdir`: the run's gs:// directory (`source` "bucket"), or the local
    mirror, one subdirectory per run ("mirror"); `why` says why that one."""

    type: ClassVar[str] = "board_ready"
    url: str
    logdir: str
    runs: tuple[str, ...]
    source: str = "mirror"
    why: str = ""


GS_READERS = ("tensorflow", "gcsfs")
# Which gs:// reader TensorBoard's Python loader gets here (see the module docstring): tensorboard.compat.tf is
# TensorFlow when it imports, and then only its registered schemes count; else the stub gfile's fsspec fallback.
_GS_PROBE = """
try:
    import tensorflow as tf
except ImportError:
    tf = None
if tf is not None:
    print("tensorflow" if "gs" in getattr(tf.io.gfile, "get_registered_schemes", list)() else "")
else:
    try:
        import fsspec
        fsspec.get_filesystem_class("gs")
        print("gcsfs")
    except (ImportError, ValueError):
        print("")
"""


def gs_reader() -> str | None:
    """The gs:// reader (GS_READERS) TensorBoard would read with here, or None. Probed in a child process:
    importing TensorFlow takes seconds and writes its log lines to stderr."""
    try:
        r = subprocess.run([sys.executable, "-c", _GS_PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=START_DEADLINE_S, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except subprocess.TimeoutExpired:
        return None
    words = r.stdout.split()
    return words[-1] if words and words[-1] in GS_READERS else None


@dataclass(frozen=True)
class Choice:
    source: str  # "bucket" (TensorBoard reads gs:// itself) or "mirror"
    why: str


def choose(*, local: bool, runs: int, reader: Callable[[], str | None] = gs_reader) -> Choice:
    """Where TensorBoard reads the runs' events: their bucket itself, or tpuctl's mirror (module docstring).
    `local`: the bucket is a storage emulator's (the local cloud). `reader` (gs_reader) is asked only when the
    bucket could be read."""
    if local:
        return Choice("mirror", "the local cloud's storage emulator: TensorBoard's gs:// reader ignores "
                                "STORAGE_EMULATOR_HOST")
    if runs > 1:
        return Choice("mirror", "several runs: TensorBoard's one --logdir holds one bucket's run")
    found = reader()
    if found is None:
        return Choice("mirror", "no gs:// reader for TensorBoard here: pip install tensorflow (or gcsfs) "
                                "to read the bucket directly")
    return Choice("bucket", f"TensorBoard reads the bucket with {found}")


def logdir_for(project: str, runs: list[str]) -> Path:
    """The mirror of this set of runs: the same runs again reuse it (only what changed is copied)."""
    key = "+".join(sorted(set(runs)))
    if len(key) > 100:
        key = hashlib.sha256(key.encode()).hexdigest()[:16]
    return paths.home() / "board" / project / key


def sources(clients: Clients, runs: list[str], *, bucket: str | None = None) -> list[Source]:
    """Each run (a name or gs://BUCKET/runs/RUN) with its bucket, found as `tpuctl export` finds it. Raises
    BadInput (a bad name, the same run twice) or NotFound (no bucket)."""
    found = [split_run(run, bucket) for run in runs]
    names = [name for name, _ in found]
    if not names:
        raise BadInput("no run named", field="run", hint="tpuctl board RUN [RUN...] (see `tpuctl list`)")
    if len(set(names)) != len(names):
        raise BadInput(f"a run is named twice: {' '.join(names)}", field="run", hint="name each run once")
    root = logdir_for(clients.project, names)
    return [Source(run=name, bucket=where or find_bucket(clients, name), prefix=f"runs/{name}/model/tensorboard/",
                   local=root / name) for name, where in found]


RECORD = "tpuctl-record"


class Record:
    """The run's record as TensorBoard events in `src.local/RECORD`, appended as it changes; with `publish`
    (TensorBoard reads the bucket) also uploaded next to the run's events."""

    def __init__(self, clients: Clients, src: Source, *, publish: bool = False, on_event: EventSink = ignore):
        # TensorBoard's RecordWriter on a plain file: its EventFileWriter would import TensorFlow (seconds, and
        # TensorFlow's log lines on tpuctl's stderr) for tf.io.gfile.
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.clients, self.src, self.publish, self.on_event = clients, src, publish, on_event
        folder = src.local / RECORD
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():  # an earlier board's record: this one starts over, before TensorBoard reads it
            old.unlink()
        self.path = folder / f"events.out.tfevents.{int(time.time())}.tpuctl"
        if publish:
            self._unpublish()
        self.file = open(self.path, "wb")  # noqa: SIM115 - close()
        self.writer = RecordWriter(self.file)
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.nodes_written = 0
        self.preemptions_written = -1  # the start's point (0) not yet written
        self.last_text = ""
        self.last_phases: tuple = ()
        self.changed = True

    @property
    def object_prefix(self) -> str:
        return f"{self.src.prefix}{RECORD}/"

    def _unpublish(self) -> None:
        """An earlier board's record in the bucket goes: TensorBoard would show both."""
        from google.api_core import exceptions as gexc

        try:
            for blob in self.clients.storage.list_blobs(self.src.bucket, prefix=self.object_prefix):
                blob.delete()
        except gexc.NotFound:
            pass  # deleted meanwhile (another board)
        except gexc.Forbidden:
            self._read_only()
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=f"replace gs://{self.src.bucket}/{self.object_prefix}") from exc

    def _read_only(self) -> None:
        """Someone who may only read the bucket still gets the run's own curves: the record stays local."""
        self.publish = False
        self.on_event(Note(f"run {self.src.run}: no write access to gs://{self.src.bucket}, so its record (cost, "
                           "goodput, timeline) is not shown; the training curves are"))

    def add_event(self, event) -> None:
        self.writer.write(event.SerializeToString())
        self.changed = True

    def update(self, now: float | None = None) -> None:
        """Append what changed (and upload it when publishing). Raises TpuctlError when status.json or the
        timeline cannot be read, or the upload fails."""
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        from tpuctl import catalog as catalog_mod
        from tpuctl import cost, ledger

        from . import cluster, timeline

        now = time.time() if now is None else now
        run, prices = self.src.run, catalog_mod.load()
        try:
            entries = [e for e in ledger.Ledger().entries() if e.run == run and e.project == self.clients.project]
        except OSError:
            entries = []
        nodes = sorted((e for e in entries if e.kind == "tpu"), key=lambda e: e.created)

        for i, node in enumerate(nodes[self.nodes_written:], start=self.nodes_written):
            if node.deleted is None:
                break  # an incarnation's numbers are final once it is gone
            preempted = node.billed_until is not None and node.spot
            self.add_event(event_pb2.Event(wall_time=node.deleted, step=i, summary=_summary(
                scalar_pb("tpuctl/recoveries", float(i)),
                scalar_pb("tpuctl/tpu_hours", cost.lifetime_hours(node, since=0.0, now=now)),
                scalar_pb("tpuctl/tpu_cost_usd", cost.accrued(node, prices, now=now)),
                scalar_pb("tpuctl/preempted", 1.0 if preempted else 0.0))))
            self.nodes_written = i + 1
        status = cluster.read_status(self.clients, self.src.bucket, run)
        state, step = (status.state, status.step) if status else ("unknown", None)
        total = cost.accrued_by_run(entries, prices, now=now).get(run, 0.0)
        rows = "\n".join(
            f"| {i} | {n.accelerator} | {'spot' if n.spot else 'on-demand'} | {_when(n.created)} | "
            f"{_when(n.deleted) if n.deleted else 'up'} | {'yes' if n.billed_until and n.spot else 'no'} | "
            f"{cost.accrued(n, prices, now=now):.4f} |" for i, n in enumerate(nodes))
        text = (f"**{run}**: {state}, step {step}, "
                f"{max(len(nodes) - 1, 0)} recovery(ies), about ${total:.4f} "
                "(this machine's ledger)\n\n"
                "| TPU | accelerator | provisioning | created | deleted | preempted | USD |\n"
                "|---|---|---|---|---|---|---|\n" + rows)
        if text != self.last_text:
            self.add_event(event_pb2.Event(wall_time=now, step=step or 0, summary=_summary(
                scalar_pb("tpuctl/cost_usd", total), text_pb("tpuctl/record", text))))
            self.last_text = text
        found = timeline.load(self.clients, self.src.bucket, run)
        if found is not None and found.marks:
            self._timeline(found, step or 0, entries, prices, now)
        self.file.flush()
        if self.publish and self.changed:
            self._upload()
        self.changed = False

    def _timeline(self, found, step: int, entries, prices, now: float) -> None:
        """Preemptions where they struck, and the phases (goodput, seconds and dollars) at the step reached."""
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        from . import timeline

        marks = sorted(found.marks, key=lambda m: m.at)
        recovers = [m for m in marks if m.what == "recover"]
        # A preemption's step: the last step any mark before it names (the watch's `last_step`). Point 0 at the
        # first mark, so the count is a line from the start; steps only grow (a lower one would purge the tag).
        points = [(marks[0].at, 0, 0.0)] + [
            (m.at, max((x.step for x in marks if x.step is not None and x.at <= m.at), default=0), float(i))
            for i, m in enumerate(recovers, start=1)]
        for at, at_step, count in points[self.preemptions_written + 1:]:
            self.add_event(event_pb2.Event(wall_time=at, step=at_step, summary=scalar_pb("tpuctl/preemptions", count)))
        self.preemptions_written = len(points) - 1
        key = (step, len(marks))  # a new step or a new mark: not every sync, which would stack points on one step
        if key == self.last_phases:
            return
        self.last_phases = key
        account = timeline.account(found, now=now, entries=entries, catalog=prices)
        values = [scalar_pb("tpuctl/lost_to_preemption_usd", account.lost_to_preemption_usd)]
        if account.goodput is not None:
            values.append(scalar_pb("tpuctl/goodput", account.goodput))
        for category in timeline.CATEGORIES:
            values += [scalar_pb(f"tpuctl/phase_seconds/{category}", account.seconds[category]),
                       scalar_pb(f"tpuctl/phase_usd/{category}", account.usd[category])]
        goodput = "n/a" if account.goodput is None else f"{account.goodput:.1%}"
        text = (f"goodput {goodput}, {account.recoveries} preemption(s), ${account.lost_to_preemption_usd:.4f} "
                f"lost to preemption{'' if account.ended else ' (running)'}\n\n"
                "| phase | seconds | USD |\n|---|---|---|\n"
                + "\n".join(f"| {c} | {account.seconds[c]:.1f} | {account.usd[c]:.4f} |" for c in timeline.CATEGORIES)
                + "\n\n| time | mark | step | detail |\n|---|---|---|---|\n"
                + "\n".join(f"| {_when(m.at)} | {m.what} | {'' if m.step is None else m.step} | {m.detail} |"
                             for m in marks))
        self.add_event(event_pb2.Event(wall_time=now, step=step,
                                       summary=_summary(*values, text_pb("tpuctl/timeline", text))))

    def _upload(self) -> None:
        from google.api_core import exceptions as gexc

        name = self.object_prefix + self.path.name
        try:  # the whole file again: GCS objects are written whole, and TensorBoard reads on from its offset
            self.clients.storage.bucket(self.src.bucket).blob(name).upload_from_filename(str(self.path))
        except gexc.Forbidden:
            self._read_only()
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=f"write gs://{self.src.bucket}/{name}") from exc

    def close(self) -> None:
        self.file.close()


def _summary(*parts):
    """One Summary of the values of several (scalar_pb, text_pb, ...)."""
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary(value=[v for part in parts for v in part.value])


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class Mirror:
    """Copies what changed under each source's prefix into its local directory."""

    def __init__(self, clients: Clients, sources: list[Source], on_event: EventSink = ignore):
        self.clients, self.sources, self.on_event = clients, sources, on_event
        self.seen: dict[tuple[str, str], tuple[int | None, int | None]] = {}  # (bucket, name) -> generation, size

    def sync(self) -> int:
        """One pass over every source; returns how many files were copied. Raises TpuctlError on a storage
        failure (the caller retries at the next pass)."""
        from google.api_core import exceptions as gexc

        copied = 0
        for src in self.sources:
            try:
                blobs = list(self.clients.storage.list_blobs(src.bucket, prefix=src.prefix))
                for blob in blobs:
                    copied += self._copy(src, blob)
            except gexc.GoogleAPICallError as exc:
                raise from_google(exc, what=f"read {src.url}") from exc
        return copied

    def _copy(self, src: Source, blob) -> int:
        rel = PurePosixPath(blob.name[len(src.prefix):])
        # The bucket is writable by the TPU's service account: a name must not climb out of the mirror (nor
        # into the record tpuctl writes beside it).
        if not rel.parts or rel.is_absolute() or ".." in rel.parts or rel.parts[0] == RECORD or blob.name.endswith("/"):
            if rel.parts and not blob.name.endswith("/"):
                self.on_event(Warn(f"skipped gs://{src.bucket}/{blob.name}: a name tpuctl does not mirror"))
            return 0
        key, version = (src.bucket, blob.name), (blob.generation, blob.size)
        target = src.local.joinpath(*rel.parts)
        if self.seen.get(key) == version:
            return 0
        if key not in self.seen and target.is_file() and target.stat().st_size == blob.size:
            self.seen[key] = version  # mirrored by an earlier board: event files only grow
            return 0
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        blob.download_to_filename(str(partial))
        os.replace(partial, target)
        self.seen[key] = version
        return 1


def _start_tensorboard(logdir: str, port: int | None, *, python_loader: bool = False,
                       ) -> tuple[subprocess.Popen, str, deque]:
    """TensorBoard on 127.0.0.1 reading `logdir`, and the URL it printed; `python_loader`: its Python loader, the
    one whose gs:// reader `gs_reader` found, not the data server. Raises BadInput (port taken), TpuctlError (it
    exited) or WaitTimeout (no URL within START_DEADLINE_S)."""
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
           # "default": 6006, or the next free port above it (TensorBoard's own search); 0: any free port.
           "--port", "default" if port is None else str(port), "--reload_interval", "5",
           *(["--load_fast", "false"] if python_loader else [])]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, text=True, errors="replace")
    tail: deque = deque(maxlen=20)
    url: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # the pipe must be read for as long as TensorBoard writes to it
        for line in proc.stderr:
            tail.append(line.rstrip())
            if not url and " at http://" in line:
                url.append(line.split(" at ", 1)[1].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=drain, name="tensorboard-stderr", daemon=True).start()
    deadline = time.monotonic() + START_DEADLINE_S
    while not ready.wait(timeout=0.5):
        if time.monotonic() > deadline:
            _stop(proc)
            raise WaitTimeout(f"TensorBoard printed no URL within {START_DEADLINE_S:.0f}s",
                            hint="; ".join(tail) or "run `python -m tensorboard.main --help` to check it starts")
    if not url:
        proc.wait()
        said = " / ".join(line for line in tail if line)[-400:]
        if "could not bind" in said or "already in use" in said:
            raise BadInput(f"port {port or 6006} is in use", field="port", hint="pass another: --port N (0: any)")
        raise TpuctlError(f"TensorBoard exited ({proc.returncode}) before serving: {said}")
    return proc, url[0], tail


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(clients: Clients, runs: list[str], *, port: int | None = None, bucket: str | None = None,
          interval_s: float = 10.0, stop: threading.Event | None = None, on_event: EventSink = ignore,
          reader: Callable[[], str | None] = gs_reader) -> str:
    """Start TensorBoard on the runs' TensorBoard files, read from their bucket or mirrored (`choose`, asking
    `reader`), report BoardReady, then keep the mirror and the records in sync every `interval_s` until `stop`
    is set (or KeyboardInterrupt) or TensorBoard exits. Returns the logdir (gs://... or a local path).

    Raises BadInput (bad run names, no `tensorboard` package, port in use), NotFound (a run without a bucket),
    TpuctlError (TensorBoard failed, or exited on its own)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise BadInput("`tpuctl board` needs the Python package tensorboard", field="board",
                       hint="pip install 'tpuctl[train]' (or: pip install tensorboard)")
    found = sources(clients, runs, bucket=bucket)
    # The storage client follows STORAGE_EMULATOR_HOST whatever the target; TensorBoard's gs:// reader never does.
    emulated = clients.local or bool(os.environ.get("STORAGE_EMULATOR_HOST"))
    choice = choose(local=emulated, runs=len(found), reader=reader)
    direct = choice.source == "bucket"  # TensorBoard reads the bucket; the records go there too
    logdir = found[0].url if direct else str(found[0].local.parent)
    for src in found:
        src.local.mkdir(parents=True, exist_ok=True)  # an empty run shows up, and fills in once it trains
    mirror = None if direct else Mirror(clients, found, on_event)
    # The first failure is the caller's: a wrong bucket or no access must not pass for "no events".
    if mirror is None:
        empty = [src for src in found if not _has_events(clients, src)]
    else:
        mirror.sync()
        empty = [src for src in found if not _mirrored(src)]
    records = [Record(clients, src, publish=direct, on_event=on_event) for src in found]
    for record in records:
        record.update()
    for src in empty:
        on_event(Note(f"run {src.run}: no TensorBoard files in {src.url} yet; they appear as it trains"))
    stop = stop or threading.Event()
    proc, url, tail = _start_tensorboard(logdir, port, python_loader=direct)
    try:
        on_event(BoardReady(url=url, logdir=logdir, runs=tuple(s.run for s in found), source=choice.source,
                            why=choice.why))
        failures = 0
        while not stop.wait(min(interval_s * 2 ** failures, 300.0)):  # back off while storage keeps failing
            if proc.poll() is not None:
                raise TpuctlError(f"TensorBoard exited ({proc.returncode}): {' / '.join(tail)[-400:]}")
            try:
                if mirror is not None:
                    mirror.sync()
                for record in records:
                    record.update()
                failures = 0
            except (TpuctlError, OSError) as exc:  # OSError: requests' connection errors, a full disk
                failures = min(failures + 1, 5)
                on_event(Warn(f"sync from the bucket failed, retrying: {exc}"))
    finally:
        _stop(proc)
        for record in records:
            record.close()
    return logdir


def _mirrored(src: Source) -> bool:
    return any(p.is_file() for p in src.local.rglob("*") if RECORD not in p.relative_to(src.local).parts)


def _has_events(clients: Clients, src: Source) -> bool:
    """Whether the run's TensorBoard directory has an object (its record aside). Raises TpuctlError when the
    bucket cannot be read."""
    from google.api_core import exceptions as gexc

    try:
        return any(not b.name.startswith(f"{src.prefix}{RECORD}/")
                   for b in clients.storage.list_blobs(src.bucket, prefix=src.prefix, max_results=10))
    except gexc.GoogleAPICallError as exc:
        raise from_google(exc, what=f"read {src.url}") from exc
