"""`tpuctl board RUN...`: the real TensorBoard on the event files of one or more runs, live while they train and
after the TPU is gone.

Every template writes its TensorBoard files under `{model_dir}/tensorboard` (templates/contract.py `outputs`),
and `model_dir` is `gs://BUCKET/runs/RUN/model` (jobs/bundle.py). TensorBoard's gs:// reader ignores
STORAGE_EMULATOR_HOST and needs TensorFlow's GCS filesystem, so tpuctl reads the bucket through its own storage
client instead, everywhere: it keeps a mirror under TPUCTL_HOME/board/PROJECT/RUNS/RUN (one directory per run,
which TensorBoard shows as one run named by the tpuctl run) and copies what changed every `interval_s`. Event
files only grow, and GCS rewrites an object whole, so a changed object is downloaded again whole and swapped in
atomically; TensorBoard goes on reading from its offset.

Beside each run's own scalars, a companion TensorBoard run `RUN/tpuctl-record` shows the run's record: for each
TPU incarnation (a recovery recreates the node) its billed hours, cost and whether it was preempted (a Spot TPU
that stopped billing while it existed, as tpuctl.cost infers it), from this machine's ledger, and the run's
status.json with its total cost as text, at the training step it reached. It is written locally, append-only
(TensorBoard reads event files forward), afresh each time a board starts.

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
    """TensorBoard answers at `url`, reading `logdir` (one subdirectory per run)."""

    type: ClassVar[str] = "board_ready"
    url: str
    logdir: str
    runs: tuple[str, ...]


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
    """The run's record as TensorBoard events in `src.local/RECORD`, appended as it changes."""

    def __init__(self, clients: Clients, src: Source):
        # TensorBoard's RecordWriter on a plain file: its EventFileWriter would import TensorFlow (seconds, and
        # TensorFlow's log lines on tpuctl's stderr) for tf.io.gfile.
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.clients, self.src = clients, src
        folder = src.local / RECORD
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():  # an earlier board's record: this one starts over, before TensorBoard reads it
            old.unlink()
        self.file = open(folder / f"events.out.tfevents.{int(time.time())}.tpuctl", "wb")  # noqa: SIM115 - close()
        self.writer = RecordWriter(self.file)
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.nodes_written = 0
        self.last_text = ""

    def add_event(self, event) -> None:
        self.writer.write(event.SerializeToString())

    def update(self, now: float | None = None) -> None:
        """Append what changed. Raises TpuctlError when status.json cannot be read."""
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        from tpuctl import catalog as catalog_mod
        from tpuctl import cost, ledger

        from . import cluster

        now = time.time() if now is None else now
        run, prices = self.src.run, catalog_mod.load()
        try:
            entries = [e for e in ledger.Ledger().entries() if e.run == run and e.project == self.clients.project]
        except OSError:
            entries = []
        nodes = sorted((e for e in entries if e.kind == "tpu"), key=lambda e: e.created)

        def summary(*parts) -> summary_pb2.Summary:
            return summary_pb2.Summary(value=[v for part in parts for v in part.value])

        for i, node in enumerate(nodes[self.nodes_written:], start=self.nodes_written):
            if node.deleted is None:
                break  # an incarnation's numbers are final once it is gone
            preempted = node.billed_until is not None and node.spot
            self.add_event(event_pb2.Event(wall_time=node.deleted, step=i, summary=summary(
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
            self.add_event(event_pb2.Event(wall_time=now, step=step or 0, summary=summary(
                scalar_pb("tpuctl/cost_usd", total), text_pb("tpuctl/record", text))))
            self.last_text = text
        self.file.flush()

    def close(self) -> None:
        self.file.close()


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


def _start_tensorboard(logdir: Path, port: int | None) -> tuple[subprocess.Popen, str, deque]:
    """TensorBoard on 127.0.0.1 reading `logdir`, and the URL it printed. Raises BadInput (port taken),
    TpuctlError (it exited) or WaitTimeout (no URL within START_DEADLINE_S)."""
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
           # "default": 6006, or the next free port above it (TensorBoard's own search); 0: any free port.
           "--port", "default" if port is None else str(port), "--reload_interval", "5"]
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
          interval_s: float = 10.0, stop: threading.Event | None = None, on_event: EventSink = ignore) -> Path:
    """Mirror the runs' TensorBoard files, start TensorBoard on them, report BoardReady, then keep the mirror in
    sync every `interval_s` until `stop` is set (or KeyboardInterrupt) or TensorBoard exits. Returns the logdir.

    Raises BadInput (bad run names, no `tensorboard` package, port in use), NotFound (a run without a bucket),
    TpuctlError (TensorBoard failed, or exited on its own)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise BadInput("`tpuctl board` needs the Python package tensorboard", field="board",
                       hint="pip install 'tpuctl[train]' (or: pip install tensorboard)")
    found = sources(clients, runs, bucket=bucket)
    logdir = found[0].local.parent
    for src in found:
        src.local.mkdir(parents=True, exist_ok=True)  # an empty run shows up, and fills in once it trains
    mirror = Mirror(clients, found, on_event)
    mirror.sync()  # the first failure is the caller's: a wrong bucket or no access must not pass for "no events"
    records = [Record(clients, src) for src in found]
    for record in records:
        record.update()
    for src in found:
        if not any(p.is_file() for p in src.local.rglob("*")):
            on_event(Note(f"run {src.run}: no TensorBoard files in {src.url} yet; they appear as it trains"))
    stop = stop or threading.Event()
    proc, url, tail = _start_tensorboard(logdir, port)
    try:
        on_event(BoardReady(url=url, logdir=str(logdir), runs=tuple(s.run for s in found)))
        failures = 0
        while not stop.wait(min(interval_s * 2 ** failures, 300.0)):  # back off while storage keeps failing
            if proc.poll() is not None:
                raise TpuctlError(f"TensorBoard exited ({proc.returncode}): {' / '.join(tail)[-400:]}")
            try:
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
