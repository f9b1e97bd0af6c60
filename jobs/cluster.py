"""A run as the jobs layer sees it in the cloud: its TPU node, its workers' SSH targets, its bucket, and the
two small JSON records kept there (`runs/RUN/launch.json`: what was launched; `runs/RUN/status.json`: how
the job is doing, written by the worker agents and by `tpuctl run`; its schema is `agent/status.py`).

Everything cloud-side goes through `tpuctl.provision`; this module adds no API calls of its own besides
reading and writing those two objects.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from tpuctl import provision
from tpuctl.events import EventSink, Warn, ignore
from tpuctl.errors import CloudError, NotFound, from_google
from tpuctl.provision import Kind, Resource, State

if TYPE_CHECKING:
    from tpuctl.provision import Clients

from .agent.status import CorruptStatus, RunStatus, object_name
from .agent.storage import merge_status
from .keys import KeyPair, ensure_keypair
from .remote import check_run_name
from .launch import targets_from_workers
from .ssh import Target

@dataclass(frozen=True)
class Located:
    run: str
    zone: str
    node: str
    bucket: str | None
    state: State


@dataclass(frozen=True)
class LaunchRecord:
    """What `tpuctl run` launched, so `--attach`, `job status` and recovery can find it again."""

    run: str
    zone: str
    node: str
    bucket: str
    bundle_object: str
    bundle_sha: str
    python: str
    workers: int
    max_recoveries: int
    launched: float


def locate(clients: Clients, run: str) -> Located:
    """The run's TPU node (and bucket) by label. Raises NotFound when the run has no TPU node. Read-only."""
    check_run_name(run)
    found = provision.list_resources(clients, run)
    tpu = next((r for r in found if r.kind is Kind.TPU), None)
    bucket = next((r.name for r in found if r.kind is Kind.BUCKET), None)
    if tpu is None:
        raise NotFound(f"run {run} has no TPU node", field="run",
                       hint="see `tpuctl list`; a finished run's logs and status stay in its bucket")
    # A multislice's slices (RUN-0 ..) are one TPU to the jobs layer, named after their queued resource.
    queued = tpu.detail.get("queued_resource", "").rsplit("/", 1)[-1]
    return Located(run=run, zone=tpu.location, node=queued or tpu.name, bucket=bucket, state=tpu.state)


def authorize(clients: Clients, zone: str, node: str) -> tuple[KeyPair, list[Target]]:
    """Make sure our key can log in (idempotent: `ssh-keys` metadata, or the OS Login profile on OS Login
    projects) and return it with the login name to use, and the workers' SSH targets with the host keys the
    node publishes. Blocks for the metadata update."""
    key = ensure_keypair()
    login = provision.authorize_key(clients, zone, node, key.user, key.public_key)
    return replace(key, user=login), targets_from_workers(provision.workers(clients, zone, node))


def node_state(clients: Clients, zone: str, node: str) -> Resource | None:
    """The node, or None when it is gone. Read-only."""
    try:
        return provision.get_node(clients, zone, node)
    except NotFound:
        return None


# --- bucket records -------------------------------------------------------------------------------------

def _blob(clients: Clients, bucket: str, name: str):
    return clients.storage.bucket(bucket).blob(name)


def _read(clients: Clients, bucket: str, name: str) -> bytes | None:
    from google.api_core import exceptions as gexc

    try:
        return _blob(clients, bucket, name).download_as_bytes()
    except gexc.NotFound:
        return None
    except gexc.GoogleAPICallError as exc:
        raise from_google(exc, what=f"read gs://{bucket}/{name}") from exc


def read_json(clients: Clients, bucket: str, name: str) -> dict | None:
    raw = _read(clients, bucket, name)
    return None if raw is None else json.loads(raw)


def write_json(clients: Clients, bucket: str, name: str, doc: dict) -> None:
    from google.api_core import exceptions as gexc

    try:
        _blob(clients, bucket, name).upload_from_string(json.dumps(doc, sort_keys=True),
                                                        content_type="application/json")
    except gexc.GoogleAPICallError as exc:
        raise from_google(exc, what=f"write gs://{bucket}/{name}") from exc


def save_launch(clients: Clients, record: LaunchRecord) -> None:
    write_json(clients, record.bucket, f"runs/{record.run}/launch.json", asdict(record))


def load_launch(clients: Clients, bucket: str, run: str) -> LaunchRecord:
    doc = read_json(clients, bucket, f"runs/{run}/launch.json")
    if doc is None:
        raise NotFound(f"run {run} was not launched by `tpuctl run` (no gs://{bucket}/runs/{run}/launch.json)",
                       field="run", hint=f"start it with `tpuctl run SPEC --name {run}`")
    return LaunchRecord(**doc)


def read_status(clients: Clients, bucket: str, run: str) -> RunStatus | None:
    """The run's status record, or None when there is none yet. CloudError, with what to do, when the object
    is not a status record."""
    name = object_name(run)
    raw = _read(clients, bucket, name)
    try:
        return None if raw is None else RunStatus.from_json(raw)
    except CorruptStatus as exc:
        raise CloudError(f"gs://{bucket}/{name} is not a status record: {exc}",
                         hint=f"the next `tpuctl run SPEC --name {run}` writes a new one; or delete it "
                              f"(`gcloud storage rm gs://{bucket}/{name}`) to start the run's account afresh") from None


def open_status(clients: Clients, bucket: str, run: str, *, recovering: bool, on_event: EventSink = ignore) -> None:
    """A launch starts a new account of the job: the last one's verdict (and its `final`) goes. Written before
    the workers start, so their agents merge into it; `recovering` stays set through a recovery's relaunch, so
    gc leaves the run alone until `update_status(recovering=False)` once the job runs again."""
    fresh = RunStatus(state="running", recovering=recovering, heartbeat=int(time.time()))
    try:
        write_json(clients, bucket, object_name(run), fresh.to_doc())
    except Exception as exc:  # noqa: BLE001 - best effort, as `update_status`
        on_event(Warn(f"could not update gs://{bucket}/{object_name(run)}: {exc}"))


def update_status(clients: Clients, bucket: str, run: str, *, on_event: EventSink = ignore,
                  **fields) -> RunStatus | None:
    """Merge `fields` (RunStatus field names) into status.json, never losing what the agents write meanwhile
    (`agent.storage.merge_status`); the record written. Best effort: a status write must never stop a
    teardown, so failures are a Warn event (and None)."""
    try:
        return merge_status(clients.storage.bucket(bucket), object_name(run), {**fields, "heartbeat": int(time.time())})
    except Exception as exc:  # noqa: BLE001 - see the docstring: best effort
        on_event(Warn(f"could not update gs://{bucket}/{object_name(run)}: {exc}"))
        return None


def close_status(clients: Clients, bucket: str, run: str, *, state: str, on_event: EventSink = ignore,
                 **fields) -> RunStatus | None:
    """The laptop's verdict on how the run ended (`state` and why): marked `final`, so the agents of a job that is
    still stopping (or of a TPU Google is deleting) cannot overwrite it. The next launch opens a new account.
    A field given as None is one the caller did not see (a supervisor that attached as the job ended saw no
    step line): the agents' value stays."""
    known = {k: v for k, v in fields.items() if v is not None}
    return update_status(clients, bucket, run, state=state, recovering=False, final=True, on_event=on_event,
                         **known)
