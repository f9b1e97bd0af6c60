"""The run's Cloud Storage bucket and its one IAM binding (on the bucket, never on the project)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from google.api_core import exceptions as gexc

from tpuctl.errors import BadInput, NotFound, TpuctlError
from tpuctl.provision import labels as L
from tpuctl.provision import waits
from tpuctl.provision.clients import Clients
from tpuctl.provision.resources import Kind, Resource, State

# What the job on the TPU VM does with the bucket: fetch the bundle, read data, write (and overwrite, which
# needs storage.objects.delete) checkpoints, events, logs and status, list and delete old checkpoints.
# roles/storage.objectUser is the smallest predefined role with objects get/list/create/delete; objectAdmin
# would add setting object IAM, which the job never does. No bucket-level permission is needed: the job never
# reads the bucket's metadata (TensorFlow's gs:// makedirs stops at the run's prefix, which holds the bundle).
ROLE = "roles/storage.objectUser"
# Roles earlier versions granted; revoke removes them too.
FORMER_ROLES = ("roles/storage.objectAdmin",)
Progress = Callable[[State, str], None]
CROSS_REGION_WHY = ("reads from another region are billed per GB (inter-region egress) and starve the TPU's "
                    "input pipeline")


@dataclass(frozen=True)
class Contents:
    objects: int
    bytes: int
    sample: tuple[str, ...]


def member(service_account: str) -> str:
    return f"serviceAccount:{service_account}"


def default_service_account(clients: Clients) -> str:
    """The project's default compute service account: `NUMBER-compute@developer.gserviceaccount.com`."""
    return f"{project_number(clients)}-compute@developer.gserviceaccount.com"


def lookup(clients: Clients, name: str):
    """The bucket, or None. Retries 429/503. A bucket of another project is refused (BadInput), never adopted:
    bucket names are one namespace shared by every project."""
    try:
        b = waits.call(lambda: clients.storage.lookup_bucket(name), what=f"look up bucket {name}")
    except TpuctlError as exc:
        if isinstance(exc.__cause__, gexc.Forbidden):  # someone else's bucket: we may not even read it
            raise taken(name) from exc
        raise
    if b is not None and b.project_number is not None and str(b.project_number) != project_number(clients):
        raise taken(name)
    return b


def taken(name: str) -> BadInput:
    return BadInput(f"bucket name {name} is taken by another project (bucket names are global)", field="bucket",
                    hint="pick another name, or use bucket: auto (its name includes a hash of project and run)")


def project_number(clients: Clients) -> str:
    """The project's number: what a bucket's projectNumber says, and part of the default service account."""
    project = waits.call(lambda: clients.projects.get_project(name=f"projects/{clients.project}"),
                         what=f"read project {clients.project}")
    return project.name.rsplit("/", 1)[-1]


def check_region(bucket, region: str, *, allow_cross_region: bool) -> None:
    """Refuse an existing bucket outside the TPU's region unless explicitly allowed."""
    where = (bucket.location or "").lower()
    if where != region.lower() and not allow_cross_region:
        raise BadInput(f"bucket {bucket.name} is in {where or 'an unknown location'}, the TPU in {region}: "
                       f"{CROSS_REGION_WHY}", field="bucket",
                       hint=f"use a bucket in {region} (or bucket: auto), or pass --allow-cross-region")


def to_resource(bucket, *, project: str) -> Resource:
    labels = dict(bucket.labels or {})
    return Resource(kind=Kind.BUCKET, name=bucket.name, project=project, location=(bucket.location or "").lower(),
                    state=State.READY, labels=labels, created=bucket.time_created, run=labels.get(L.RUN),
                    detail={"url": f"gs://{bucket.name}"})


def ensure(clients: Clients, name: str, region: str, labels: Mapping[str, str], *,
           allow_cross_region: bool = False, soft_delete_s: int = 0, cancel: threading.Event | None = None,
           progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Create the bucket in `region` with uniform access, public access prevention, labels and a soft delete
    retention of `soft_delete_s` (0: off; Google's default would be 7 days), or adopt it.

    Idempotent. An existing bucket keeps its own run label (it may hold another run's checkpoints) and its own
    soft delete policy; missing tpuctl labels are added. Refuses a bucket in another region unless
    `allow_cross_region`, and another project's bucket always.
    """
    what = f"create bucket {name} in {region}"
    b = lookup(clients, name)
    if b is None:
        if on_issued is not None:
            on_issued()
        if progress:
            progress(State.CREATING, "requested")
        b = clients.storage.bucket(name)
        b.iam_configuration.uniform_bucket_level_access_enabled = True
        b.iam_configuration.public_access_prevention = "enforced"
        b.labels = dict(labels)
        b.soft_delete_policy.retention_duration_seconds = soft_delete_s
        try:
            b = waits.call(lambda: clients.storage.create_bucket(b, location=region), what=what, cancel=cancel)
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.Conflict):
                raise
            b = lookup(clients, name)  # ours after all (a lost response), or BadInput when another project's
            if b is None:
                raise taken(name) from exc
    check_region(b, region, allow_cross_region=allow_cross_region)
    missing = {k: v for k, v in labels.items() if k not in (b.labels or {})}
    iam = b.iam_configuration
    if missing or not iam.uniform_bucket_level_access_enabled or iam.public_access_prevention != "enforced":
        # Some storage backends ignore these at create; a patch sets them (and adopts pre-existing buckets).
        b.labels = {**(b.labels or {}), **missing}
        b.iam_configuration.uniform_bucket_level_access_enabled = True
        b.iam_configuration.public_access_prevention = "enforced"
        waits.call(b.patch, what=f"label bucket {name}", cancel=cancel)
    return to_resource(b, project=clients.project)


def grant(clients: Clients, name: str, service_account: str, *, run: str, region: str,
          cancel: threading.Event | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Grant ROLE on bucket `name` (only) to `service_account`. Idempotent; retries etag races.

    `on_issued` runs just before the policy write (not at all when the binding already exists)."""
    b = clients.storage.bucket(name)
    who = member(service_account)

    def read_modify_write() -> None:
        policy = b.get_iam_policy(requested_policy_version=3)
        for binding in policy.bindings:
            if binding["role"] == ROLE and not binding.get("condition") and who in binding["members"]:
                return
        policy.version = 3
        policy.bindings.append({"role": ROLE, "members": {who}})
        if on_issued is not None:
            on_issued()
        b.set_iam_policy(policy)

    for _ in range(5):
        try:
            waits.call(read_modify_write, what=f"grant {ROLE} on bucket {name}", cancel=cancel)
            break
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.PreconditionFailed):
                raise
    return iam_resource(clients.project, name, service_account, run=run, region=region)


def revoke(clients: Clients, name: str, service_account: str, *, cancel: threading.Event | None = None) -> None:
    """Remove ROLE for `service_account` from bucket `name`. Idempotent: no binding, or no bucket, is done."""
    b = clients.storage.bucket(name)
    who = member(service_account)

    def read_modify_write() -> None:
        policy = b.get_iam_policy(requested_policy_version=3)
        changed = False
        for binding in policy.bindings:
            if binding["role"] in (ROLE, *FORMER_ROLES) and who in binding["members"]:
                binding["members"].discard(who)
                changed = True
        if changed:
            policy.bindings = [bd for bd in policy.bindings if bd["members"]]
            b.set_iam_policy(policy)

    for _ in range(5):
        try:
            waits.call(read_modify_write, what=f"revoke {ROLE} on bucket {name}", cancel=cancel)
            return
        except NotFound:
            return
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.PreconditionFailed):
                raise


def iam_resource(project: str, bucket: str, service_account: str, *, run: str | None, region: str) -> Resource:
    return Resource(kind=Kind.IAM, name=f"{bucket}/{service_account}", project=project, location=region,
                    state=State.READY, labels={L.RUN: run} if run else {}, created=None, run=run,
                    detail={"bucket": bucket, "role": ROLE, "member": member(service_account)})


def bindings(clients: Clients, name: str) -> list[tuple[str, str]]:
    """(role, member) pairs on the bucket."""
    policy = waits.call(lambda: clients.storage.bucket(name).get_iam_policy(requested_policy_version=3),
                        what=f"read IAM policy of bucket {name}")
    return [(bd["role"], m) for bd in policy.bindings for m in sorted(bd["members"])]


def list_labelled(clients: Clients, run: str | None = None) -> list:
    """Buckets in the project carrying the tpuctl run label (of `run` when given)."""
    return [b for b in waits.call(lambda: list(clients.storage.list_buckets(project=clients.project)),
                                  what="list buckets") if L.matches(b.labels, run)]


def contents(clients: Clients, name: str, *, sample: int = 10) -> Contents:
    n = size = 0
    names: list[str] = []
    for blob in waits.call(lambda: list(clients.storage.list_blobs(name)), what=f"list objects in {name}"):
        n += 1
        size += blob.size or 0
        if len(names) < sample:
            names.append(blob.name)
    return Contents(objects=n, bytes=size, sample=tuple(names))


def _remember_soft_deleted(clients: Clients, b, cancel: threading.Event | None) -> None:
    """Record the bucket's soft-deleted objects (rotated checkpoints, the objects just deleted) as one ledger
    entry whose GB x hours equal theirs. Best effort: the ledger never decides anything."""
    from tpuctl import ledger

    soft = waits.call(lambda: list(clients.storage.list_blobs(b.name, soft_deleted=True)),
                      what=f"list soft-deleted objects in {b.name}", cancel=cancel)
    now = time.time()
    gb_hours = gb = 0.0
    for blob in soft:
        left_h = max(0.0, blob.hard_delete_time.timestamp() - now) / 3600 if blob.hard_delete_time else 0.0
        gb += (blob.size or 0) / 1e9
        gb_hours += (blob.size or 0) / 1e9 * left_h
    if not gb_hours:
        return
    labels = dict(b.labels or {})
    entry = ledger.Entry(kind=ledger.SOFT_DELETED, name=b.name, project=clients.project,
                         location=(b.location or "").lower(), run=labels.get(L.RUN), owner=labels.get(L.OWNER),
                         created=now, deleted=now + gb_hours / gb * 3600, gb=gb)
    try:
        ledger.Ledger().record([entry])
    except OSError:
        pass  # the cost report misses it; nothing else depends on it


def delete(clients: Clients, name: str, *, cancel: threading.Event | None = None,
           progress: Progress | None = None) -> None:
    """Delete every object, then the bucket. Idempotent: a missing bucket is success. Blocks.

    Under a soft delete policy the deleted objects keep billing until their hard delete time; what they will
    cost is recorded in the local ledger (`tpuctl cost` counts it)."""
    try:
        b = waits.call(lambda: clients.storage.get_bucket(name), what=f"read bucket {name}", cancel=cancel)
        blobs = waits.call(lambda: list(clients.storage.list_blobs(name)), what=f"list objects in {name}",
                           cancel=cancel)
    except NotFound:
        return
    if progress:
        progress(State.DELETING, f"{len(blobs)} objects")

    def drop(blob) -> None:
        try:
            waits.call(blob.delete, what=f"delete gs://{name}/{blob.name}", cancel=cancel)
        except NotFound:
            pass

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(drop, blobs))
    if b.soft_delete_policy.retention_duration_seconds:
        _remember_soft_deleted(clients, b, cancel)
    try:
        waits.call(lambda: clients.storage.bucket(name).delete(), what=f"delete bucket {name}", cancel=cancel)
    except NotFound:
        pass

