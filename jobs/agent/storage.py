"""The storage a worker's job reads and writes, behind one interface chosen when the bundle is built
(job.json's `storage`, `tpuctl.jobs.bundle.worker_storage`):

- `gcs`: Cloud Storage itself. The program reads and writes its gs:// locations directly (TensorFlow's and
  JAX's own GCS filesystems); the agent only writes the run's records (status, worker states, log copies).
- `mirror` (`mirror.Mirror`): a storage emulator, which TensorFlow's gs:// filesystem cannot reach. The agent
  mirrors the config's gs:// locations to local disk, restores them before the start and syncs the model
  directory back; the program only ever sees local paths.

Everything the supervisor asks of storage goes through `Gcs`'s methods; nothing else in the agent (or on the
laptop) asks which kind it is.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from .status import NAME, CorruptStatus, RunStatus

RACE_ATTEMPTS = 10  # a read-modify-write, or a listing, that another writer keeps invalidating: tries


def update_object(bucket, name: str, change: Callable[[bytes | None], bytes | str | None]) -> bytes | str | None:
    """Replace object `name` of `bucket` (a google.cloud.storage Bucket) by `change(its content, None when there is
    none)` without losing a concurrent writer's change: read the object and its generation, write only while that
    generation is still the live one (`ifGenerationMatch`, 0 when there is no object yet), and read again on 412
    (cloud.google.com/storage/docs/request-preconditions), after a jittered backoff. Returns what was written, or
    None when `change` returned None (leave it as it is). Blocks for a few requests (seconds at worst under
    contention). RuntimeError when it lost the race RACE_ATTEMPTS times."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    for attempt in range(RACE_ATTEMPTS):
        if attempt:  # jittered backoff: writers that collided do not collide again in lockstep
            time.sleep(random.uniform(0, min(1.0, 0.05 * 2 ** attempt)))
        blob = bucket.blob(name)
        try:
            current = blob.download_as_bytes()
            generation = blob.generation  # from the download's x-goog-generation
        except NotFound:
            current, generation = None, 0
        content = change(current)
        if content is None:
            return None
        try:
            bucket.blob(name).upload_from_string(content, content_type="application/json",
                                                 if_generation_match=generation)
            return content
        except PreconditionFailed:
            continue  # another writer got in between: change theirs
    raise RuntimeError(f"gs://{bucket.name}/{name} kept changing: {RACE_ATTEMPTS} writes lost the race")


def merge_status(bucket, name: str, fields: dict, *, unless_final: bool = False) -> RunStatus | None:
    """Merge `fields` (RunStatus field names) into the status record `name`, keeping every other field a
    concurrent writer wrote (`update_object`). A missing or unreadable record is replaced by one of `fields`
    (on a `running` record: its writers write a state when the run starts and when it ends). Returns the
    record written, or None when `unless_final` and the record is final (the laptop's verdict)."""
    def change(raw: bytes | None) -> str | None:
        try:
            current = RunStatus.from_json(raw) if raw is not None else None
        except CorruptStatus:
            current = None  # replaced like a missing object, but only this generation of it
        if unless_final and current is not None and current.final:
            return None
        return (current or RunStatus(state="running")).merged(fields).to_json()

    content = update_object(bucket, name, change)
    return None if content is None else RunStatus.from_json(content)


class Gcs:
    """The run's bucket prefix on Cloud Storage; the program reaches its gs:// locations itself."""

    def __init__(self, job: dict, worker: int):
        self.job = job
        self.worker = worker
        self.client = self._client(job["project"])
        self.bucket = self.client.bucket(job["bucket"])
        self.prefix = job["prefix"].rstrip("/")

    def _client(self, project: str):
        """A storage client acting as the VM's service account (the metadata server's token)."""
        from google.cloud import storage

        return storage.Client(project=project)

    # --- what the supervisor asks of the program's storage: nothing to do when the program reaches gs://
    def program_config(self, config: dict) -> dict:
        """The config the program gets."""
        return config

    def stage(self, say: Callable[[str], None]) -> None:
        """Before the program starts: make its data and latest checkpoint reachable."""

    def sync(self) -> None:
        """Worker 0, every heartbeat and at the end: make the program's outputs durable in the bucket."""

    def log_line(self, line: bytes) -> bytes:
        """A line of the program's output as the job log shows it."""
        return line

    # --- the run's records under gs://BUCKET/runs/RUN/
    def put_json(self, name: str, doc: dict) -> None:
        self.bucket.blob(f"{self.prefix}/{name}").upload_from_string(
            json.dumps(doc, sort_keys=True), content_type="application/json")

    def merge_status(self, fields: dict) -> None:
        """The job's account into status.json, unless the laptop has written its final verdict there."""
        merge_status(self.bucket, f"{self.prefix}/{NAME}", fields, unless_final=True)

    def get_json(self, name: str) -> dict | None:
        from google.api_core.exceptions import NotFound

        try:
            return json.loads(self.bucket.blob(f"{self.prefix}/{name}").download_as_bytes())
        except NotFound:
            return None

    def put_file(self, name: str, path: Path) -> None:
        if path.exists():
            self.bucket.blob(f"{self.prefix}/{name}").upload_from_filename(str(path), content_type="text/plain")


def open_storage(job: dict, worker: int, home: Path) -> Gcs:
    """The storage job.json names (`gcs` or `mirror`); a mirror keeps its files under `home/gcs`."""
    kind = job.get("storage")
    if kind == "gcs":
        return Gcs(job, worker)
    if kind == "mirror":
        from .mirror import Mirror  # only where the bundle chose it

        return Mirror(job, worker, home / "gcs")
    raise ValueError(f"job.json: storage {kind!r} is neither 'gcs' nor 'mirror'")
