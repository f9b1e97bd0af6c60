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

# status.json has two writers: worker 0's agent (the job's account: state, step, exit_code, heartbeat) and the
# laptop's `tpuctl run` (recovering; and, when it decides how the run ended, `final` with its verdict). Keys the
# agent does not write are never touched by it, and it leaves a final status alone.
STATUS = "status.json"
RACE_ATTEMPTS = 10  # a read-modify-write, or a listing, that another writer keeps invalidating: tries


def merge_json(bucket, name: str, fields: dict, *, unless=None) -> dict | None:
    """Merge `fields` into the JSON object `name` of `bucket` (a google.cloud.storage Bucket) without losing
    a concurrent writer's keys: read the object and its generation, write the merge only while that generation
    is still the live one (`ifGenerationMatch`, 0 when there is no object yet), and read again on 412
    (cloud.google.com/storage/docs/request-preconditions), after a jittered backoff. Returns what was written, or
    None when `unless(current document)` says to leave it as it is. Blocks for a few requests (seconds at worst
    under contention); idempotent. RuntimeError when it lost the race RACE_ATTEMPTS times."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    for attempt in range(RACE_ATTEMPTS):
        if attempt:  # jittered backoff: writers that collided do not collide again in lockstep
            time.sleep(random.uniform(0, min(1.0, 0.05 * 2 ** attempt)))
        blob = bucket.blob(name)
        try:
            current = json.loads(blob.download_as_bytes())
            generation = blob.generation  # from the download's x-goog-generation
        except NotFound:
            current, generation = {}, 0
        except ValueError:  # not JSON: replaced like a missing object, but only this generation of it
            current, generation = {}, blob.generation
        if not isinstance(current, dict):
            current = {}
        if unless is not None and unless(current):
            return None
        doc = {**current, **fields}
        try:
            bucket.blob(name).upload_from_string(json.dumps(doc, sort_keys=True), content_type="application/json",
                                                 if_generation_match=generation)
            return doc
        except PreconditionFailed:
            continue  # another writer got in between: merge onto theirs
    raise RuntimeError(f"gs://{bucket.name}/{name} kept changing: {RACE_ATTEMPTS} writes lost the race")


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
        merge_json(self.bucket, f"{self.prefix}/{STATUS}", fields, unless=lambda doc: bool(doc.get("final")))

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
