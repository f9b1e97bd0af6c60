"""Cloud Storage emulation driven by the official google-cloud-storage client over real HTTP, strict mode."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from tpuctl.localcloud.schema import Validator
from tpuctl.localcloud.storage import StorageServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return tmp_path / "gcs"


@pytest.fixture
def server(data_dir, monkeypatch):
    server = StorageServer(data_dir, validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    yield server
    server.stop()


def client(project: str = "proj-a") -> storage.Client:
    return storage.Client(project=project, credentials=AnonymousCredentials())


def _create(gcs: storage.Client, name: str, location: str = "us-central1", **labels: str) -> storage.Bucket:
    bucket = gcs.bucket(name)
    bucket.labels = labels or {"tpuctl-run": "r1"}
    bucket.iam_configuration.uniform_bucket_level_access_enabled = True
    bucket.iam_configuration.public_access_prevention = "enforced"
    return gcs.create_bucket(bucket, location=location)


def _assert_created_shape(bucket: storage.Bucket, labels: dict) -> None:
    assert bucket.location == "US-CENTRAL1"
    assert bucket.location_type == "region"
    assert bucket.labels == labels
    assert bucket.iam_configuration.uniform_bucket_level_access_enabled is True
    assert bucket.iam_configuration.uniform_bucket_level_access_locked_time is not None
    assert bucket.iam_configuration.public_access_prevention == "enforced"


def test_bucket_metadata_round_trips_on_create_get_and_list(server):
    gcs = client()
    created = _create(gcs, "tpuctl-r1-data", **{"tpuctl-run": "r1", "tpuctl-owner": "ann"})
    labels = {"tpuctl-run": "r1", "tpuctl-owner": "ann"}
    _assert_created_shape(created, labels)
    _assert_created_shape(gcs.get_bucket("tpuctl-r1-data"), labels)
    (listed,) = list(gcs.list_buckets())
    _assert_created_shape(listed, labels)

    plain = gcs.create_bucket("plain-bucket")
    assert (plain.location, plain.location_type) == ("US", "multi-region")
    assert plain.iam_configuration.uniform_bucket_level_access_enabled is False
    assert plain.iam_configuration.public_access_prevention == "inherited"


def test_list_buckets_is_per_project_and_honours_prefix(server):
    _create(client("proj-a"), "a-one")
    _create(client("proj-a"), "a-two")
    _create(client("proj-b"), "b-one")
    assert [b.name for b in client("proj-a").list_buckets()] == ["a-one", "a-two"]
    assert [b.name for b in client("proj-b").list_buckets()] == ["b-one"]
    assert [b.name for b in client("proj-a").list_buckets(prefix="a-t")] == ["a-two"]


def test_label_patch_merges_and_deletes_keys(server):
    gcs = client()
    bucket = _create(gcs, "labelled", **{"keep": "1", "drop": "2"})
    bucket.labels = {"keep": "1", "added": "3"}  # the client sends drop: null
    bucket.patch()
    assert gcs.get_bucket("labelled").labels == {"keep": "1", "added": "3"}
    bucket.iam_configuration.public_access_prevention = "inherited"
    bucket.patch()
    fresh = gcs.get_bucket("labelled")
    assert fresh.iam_configuration.public_access_prevention == "inherited"
    assert fresh.iam_configuration.uniform_bucket_level_access_enabled is True


def test_not_found_conflict_and_bad_input_semantics(server):
    gcs = client()
    bucket = _create(gcs, "semantics")
    with pytest.raises(exceptions.Conflict):
        _create(gcs, "semantics")
    with pytest.raises(exceptions.NotFound, match="bucket does not exist"):
        gcs.get_bucket("missing-bucket")
    assert gcs.lookup_bucket("missing-bucket") is None
    with pytest.raises(exceptions.NotFound):
        gcs.bucket("missing-bucket").delete()
    with pytest.raises(exceptions.NotFound, match="No such object"):
        bucket.blob("nope").reload()
    assert bucket.get_blob("nope") is None
    with pytest.raises(exceptions.NotFound):
        bucket.blob("nope").download_as_bytes()

    bucket.blob("x").upload_from_string(b"x")
    with pytest.raises(exceptions.Conflict, match="not empty"):
        bucket.delete()
    bucket.delete(force=True)
    assert gcs.lookup_bucket("semantics") is None

    with pytest.raises(exceptions.BadRequest, match="Invalid bucket name"):
        gcs.create_bucket("Upper-Case")
    with pytest.raises(exceptions.BadRequest, match="location"):
        gcs.create_bucket("fine-name", location="moon-base1x")
    with pytest.raises(exceptions.BadRequest, match="Invalid label tpuctl-owner='Ann@example.com'"):
        _create(gcs, "fine-name", **{"tpuctl-owner": "Ann@example.com"})
    assert list(gcs.list_buckets()) == []
    labelled = _create(gcs, "fine-name")
    labelled.labels = {"Upper": "x"}
    with pytest.raises(exceptions.BadRequest, match="Invalid label Upper"):
        labelled.patch()
    assert gcs.get_bucket("fine-name").labels == {"tpuctl-run": "r1"}


def test_strict_mode_rejects_a_misspelled_bucket_field(server):
    # storage.v1 marks no field output-only, so a misspelling is what strict mode can catch here.
    field = "locaton"
    body = {"name": "strict-bucket", "location": "us-central1", field: "us-east1"}
    reply = requests.post(f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b", params={"project": "proj-a"},
                          json=body, timeout=10)
    assert reply.status_code == 400
    assert field in reply.json()["error"]["message"]
    assert client().lookup_bucket("strict-bucket") is None


class _FlagsBucketResponses(Validator):
    """The real validator, plus drift in every Bucket response: what an emulator upgrade could cause."""

    def check_response(self, schema_name, body):
        problems = super().check_response(schema_name, body)
        return problems + (["bucket.drift: unknown field"] if schema_name == "Bucket" else [])


def test_strict_mode_turns_emulator_response_drift_into_a_server_error(data_dir, monkeypatch):
    server = StorageServer(data_dir, validator_factory=_FlagsBucketResponses)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    try:
        # Raw HTTP: the client would retry a 500 and then report the retry's 409.
        reply = requests.post(f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b", params={"project": "proj-a"},
                              json={"name": "drifting"}, timeout=10)
        assert reply.status_code == 500 and "bucket.drift" in reply.json()["error"]["message"]
        assert [b.name for b in client().list_buckets()] == ["drifting"]  # Buckets responses still pass
    finally:
        server.stop()


def test_iam_policy_round_trips_with_etag_concurrency(server):
    bucket = _create(client(), "iam-bucket")
    policy = bucket.get_iam_policy(requested_policy_version=3)
    first_etag = policy.etag
    policy.bindings.append({"role": "roles/storage.objectAdmin",
                            "members": {"serviceAccount:123-compute@developer.gserviceaccount.com"}})
    updated = bucket.set_iam_policy(policy)
    assert updated.etag != first_etag

    again = bucket.get_iam_policy(requested_policy_version=3)
    assert again.etag == updated.etag
    assert {"role": "roles/storage.objectAdmin",
            "members": {"serviceAccount:123-compute@developer.gserviceaccount.com"}} in again.bindings

    policy.bindings.append({"role": "roles/storage.objectViewer", "members": {"user:x@example.com"}})
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.set_iam_policy(policy)  # still carries the first etag
    with pytest.raises(exceptions.NotFound):
        client().bucket("no-such-bucket").get_iam_policy()


def test_iam_etags_count_writes_and_never_come_back():
    """GCS's IAM etag is base64 of a protobuf varint holding the write count: CAE= (1), CAI= (2), CIAB (128)."""
    from tpuctl.localcloud.storage import _next_etag

    etags = [_next_etag(None)]
    for _ in range(299):
        etags.append(_next_etag(etags[-1]))
    assert etags[:2] == ["CAE=", "CAI="] and etags[127] == "CIAB" and len(set(etags)) == 300


def test_concurrent_iam_writers_with_the_same_etag_one_wins(server):
    bucket = _create(client(), "contended")
    policies = [bucket.get_iam_policy(requested_policy_version=3) for _ in range(6)]
    for i, policy in enumerate(policies):
        policy.bindings.append({"role": "roles/storage.objectViewer", "members": {f"user:u{i}@example.com"}})

    def attempt(policy) -> bool:
        try:
            client().bucket("contended").set_iam_policy(policy)
            return True
        except exceptions.PreconditionFailed:
            return False

    with ThreadPoolExecutor(len(policies)) as pool:
        assert sorted(pool.map(attempt, policies)) == [False] * 5 + [True]


def test_objects_upload_download_list_delete(server):
    bucket = _create(client(), "objects")
    bucket.blob("runs/r1/config.json").upload_from_string(b'{"a": 1}', content_type="application/json")
    bucket.blob("runs/r1/shard-0.tfrecord").upload_from_string(os.urandom(300_000))
    bucket.blob("runs/r2/config.json").upload_from_string(b"{}")

    blob = bucket.get_blob("runs/r1/config.json")
    assert (blob.size, blob.content_type) == (8, "application/json")
    assert blob.download_as_bytes() == b'{"a": 1}'
    assert [b.name for b in client().list_blobs("objects", prefix="runs/r1/")] == [
        "runs/r1/config.json", "runs/r1/shard-0.tfrecord"]
    listing = client().list_blobs("objects", prefix="runs/", delimiter="/")
    assert list(listing) == [] and listing.prefixes == {"runs/r1/", "runs/r2/"}

    bucket.blob("runs/r1/config.json").delete()
    with pytest.raises(exceptions.NotFound):
        bucket.blob("runs/r1/config.json").delete()
    assert [b.name for b in bucket.list_blobs()] == ["runs/r1/shard-0.tfrecord", "runs/r2/config.json"]


def test_client_pointed_by_api_endpoint_instead_of_env(server, monkeypatch):
    url = os.environ["STORAGE_EMULATOR_HOST"]
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    gcs = storage.Client(project="proj-a", credentials=AnonymousCredentials(), client_options={"api_endpoint": url})
    bucket = _create(gcs, "by-endpoint")
    bucket.blob("x/y").upload_from_string(b"via api_endpoint")
    assert gcs.bucket("by-endpoint").blob("x/y").download_as_bytes() == b"via api_endpoint"
    assert [b.name for b in gcs.list_blobs("by-endpoint")] == ["x/y"]


def test_everything_persists_across_restart(data_dir, monkeypatch):
    first = StorageServer(data_dir, validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", first.start())
    try:
        bucket = _create(client(), "durable")
        policy = bucket.get_iam_policy(requested_policy_version=3)
        policy.bindings.append({"role": "roles/storage.objectViewer", "members": {"user:a@example.com"}})
        etag = bucket.set_iam_policy(policy).etag
        bucket.blob("model/ckpt-1").upload_from_string(b"weights")
    finally:
        first.stop()

    second = StorageServer(data_dir, validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", second.start())
    try:
        assert [b.name for b in client().list_buckets()] == ["durable"]
        _assert_created_shape(client().get_bucket("durable"), {"tpuctl-run": "r1"})
        restored = client().bucket("durable").get_iam_policy(requested_policy_version=3)
        assert restored.etag == etag
        assert {"role": "roles/storage.objectViewer", "members": {"user:a@example.com"}} in restored.bindings
        assert client().bucket("durable").blob("model/ckpt-1").download_as_bytes() == b"weights"
    finally:
        second.stop()


def test_in_memory_server_starts_empty_each_time(monkeypatch):
    server = StorageServer(None)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    try:
        client().create_bucket("ephemeral")
    finally:
        server.stop()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    try:
        assert list(client().list_buckets()) == []
    finally:
        server.stop()
    server.stop()  # idempotent


def test_bucket_summary_feeds_the_meter(server):
    bucket = _create(client(), "metered")
    bucket.blob("a").upload_from_string(b"x" * 1000)
    bucket.blob("b").upload_from_string(b"y" * 24)
    client().create_bucket("empty-one")
    summary = {b["name"]: b for b in server.buckets()}
    assert summary["metered"]["objects"] == 2
    assert summary["metered"]["bytes"] == 1024
    assert summary["metered"]["project"] == "proj-a"
    assert summary["metered"]["location"] == "US-CENTRAL1"
    assert summary["metered"]["labels"] == {"tpuctl-run": "r1"}
    assert summary["metered"]["iamConfiguration"]["publicAccessPrevention"] == "enforced"
    assert {b["role"] for b in summary["metered"]["iam_policy"]["bindings"]} >= {"roles/storage.legacyBucketOwner"}
    assert (summary["empty-one"]["objects"], summary["empty-one"]["bytes"]) == (0, 0)


def test_the_meters_summary_leaves_out_a_bucket_an_insert_is_still_making(server, monkeypatch):
    """The meter samples on its own thread; a bucket seen between the emulator's create and the metadata write has
    no location yet and would be billed at the default multi-region for its whole life."""
    backend, seen = server._backend, []
    original = backend.call

    def call(method, path, body=None):
        if method == "PATCH" and path.endswith("/b/metered"):
            seen.append({b["name"]: b for b in server.buckets()})
        return original(method, path, body)

    monkeypatch.setattr(backend, "call", call)
    _create(client(), "metered")
    assert seen and "metered" not in seen[0]
    assert {b["name"]: b["location"] for b in server.buckets()} == {"metered": "US-CENTRAL1"}


def _write_big_file(path: Path, size: int) -> str:
    """Write ``size`` pseudo-random bytes in 1 MiB blocks; returns their sha256 (never all in memory)."""
    digest = hashlib.sha256()
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for i in range(size // len(block)):
            chunk = i.to_bytes(8, "big") + block[8:]
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.slow
def test_resumable_upload_of_200_mb_streams_through(server, tmp_path):
    size = 200 * (1 << 20)
    source, copy = tmp_path / "big.bin", tmp_path / "big.copy"
    try:
        expected = _write_big_file(source, size)
        bucket = _create(client(), "big-objects")
        blob = bucket.blob("corpus/big.bin")
        blob.upload_from_filename(source)  # > 8 MiB: the client uses a resumable upload in 100 MiB chunks
        assert bucket.get_blob("corpus/big.bin").size == size
        blob.download_to_filename(copy)
        assert _sha256_of(copy) == expected
        assert {b["name"]: b["bytes"] for b in server.buckets()}["big-objects"] == size
    finally:
        source.unlink(missing_ok=True)
        copy.unlink(missing_ok=True)


def test_a_bucket_is_never_seen_half_created(server):
    """GCS creates a bucket with its location and labels at once; readers racing the create see all or nothing."""
    gcs = client()
    names = [f"race-{i}" for i in range(12)]
    seen: dict[str, tuple[str, dict]] = {}

    def watch(name: str) -> None:
        reader = client()
        for _ in range(2000):
            b = reader.lookup_bucket(name)
            if b is not None:
                seen[name] = (b.location, dict(b.labels or {}))
                return

    with ThreadPoolExecutor(max_workers=len(names) * 2) as pool:
        watchers = [pool.submit(watch, n) for n in names]
        creators = [pool.submit(_create, gcs, n, "europe-west4", run=n) for n in names]
        for f in creators + watchers:
            f.result()
    assert seen == {n: ("EUROPE-WEST4", {"run": n}) for n in names}


def test_an_upload_with_if_generation_match_writes_only_over_the_generation_it_names(server):
    """storage/docs/request-preconditions: ifGenerationMatch makes an upload conditional on the live object's
    generation (0: no live object), else 412; a download reports the generation it served
    (x-goog-generation, which the client keeps as Blob.generation), and a read of a replaced generation is 404."""
    bucket = _create(client(), "tpuctl-r1-gen")
    bucket.blob("s.json").upload_from_string("{}", if_generation_match=0)
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("s.json").upload_from_string('{"late": 1}', if_generation_match=0)
    first = bucket.get_blob("s.json")
    read = bucket.blob("s.json")
    assert read.download_as_bytes() == b"{}" and read.generation == first.generation
    bucket.blob("s.json").upload_from_string('{"a": 1}', if_generation_match=read.generation)
    with pytest.raises(exceptions.PreconditionFailed):  # the generation it read is gone
        bucket.blob("s.json").upload_from_string('{"b": 1}', if_generation_match=read.generation)
    with pytest.raises(exceptions.NotFound):  # `first` names its generation; the bucket keeps no old ones
        first.download_as_bytes()
    assert bucket.blob("s.json").download_as_bytes() == b'{"a": 1}'


def test_a_resumable_uploads_if_generation_match_is_checked_when_it_completes(server, data_dir, monkeypatch):
    """The precondition is given when the session starts and checked when its last chunk arrives (Google's
    storage-testbench `gcs/upload.py`; google-cloud-cpp's StreamingWriteFailure against GCS): the session opens
    whatever the object is then, only the completing chunk gets 412, and the object is left as it was. The
    session keeps its precondition across a restart of the server, as the engine keeps its upload."""
    bucket = _create(client(), "tpuctl-r1-resumable-pre")
    bucket.blob("ckpt").upload_from_string(b"ckpt-10")
    read = bucket.get_blob("ckpt")
    stale = bucket.blob("ckpt").create_resumable_upload_session(size=14, if_generation_match=read.generation)
    taken = bucket.blob("ckpt").create_resumable_upload_session(size=7, if_generation_match=0)  # opens: unchecked
    bucket.blob("ckpt").upload_from_string(b"ckpt-20")  # another writer gets there first
    assert requests.put(stale, data=b"ckpt-30", headers={"Content-Range": "bytes 0-6/14"}).status_code == 308
    server.stop()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())  # a new port: same sessions, same objects
    stale, taken = (urlsplit(url)._replace(netloc=urlsplit(server.url).netloc).geturl() for url in (stale, taken))
    bucket = client().bucket("tpuctl-r1-resumable-pre")
    refused = requests.put(stale, data=b"-resume", headers={"Content-Range": "bytes 7-13/14"})
    assert refused.status_code == 412 and refused.json()["error"]["errors"][0]["reason"] == "conditionNotMet"
    assert requests.put(taken, data=b"ckpt-40", headers={"Content-Range": "bytes 0-6/7"}).status_code == 412
    assert bucket.blob("ckpt").download_as_bytes() == b"ckpt-20"
    live = bucket.get_blob("ckpt").generation
    with pytest.raises(exceptions.PreconditionFailed):  # the client's own chunked upload, checked at the end
        bucket.blob("ckpt", chunk_size=256 << 10).upload_from_string(b"x" * (600 << 10), if_generation_match=0)
    bucket.blob("ckpt", chunk_size=256 << 10).upload_from_string(b"y" * (600 << 10), if_generation_match=live)
    assert bucket.blob("ckpt").download_as_bytes() == b"y" * (600 << 10)
    assert sorted(json.loads((data_dir / "localcloud-upload-sessions.json").read_text())) == sorted(
        parse_qs(urlsplit(url).query)["upload_id"][0] for url in (stale, taken))  # the refused ones stay open


def test_a_precondition_localcloud_does_not_emulate_is_refused_not_ignored(server):
    bucket = _create(client(), "tpuctl-r1-pre")
    bucket.blob("o").upload_from_string("x")
    live = bucket.get_blob("o")
    with pytest.raises(exceptions.MethodNotImplemented):
        bucket.blob("o").upload_from_string("y", if_metageneration_match=1)
    with pytest.raises(exceptions.MethodNotImplemented):
        bucket.blob("o").delete(if_generation_match=live.generation)
    assert bucket.blob("o").download_as_bytes() == b"x"


def test_concurrent_conditional_writers_never_lose_each_others_keys(server):
    """Eight writers merge their own key into one JSON object at once (`jobs.agent.storage.update_object`: read,
    write if the generation is unchanged, read again on 412): every key is there at the end."""
    from tpuctl.jobs.agent.storage import update_object

    def merge_json(bucket, name, fields):
        return update_object(bucket, name, lambda raw: json.dumps({**json.loads(raw or b"{}"), **fields}))

    bucket = _create(client(), "tpuctl-r1-merge")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: [merge_json(bucket, "status.json", {f"w{i}-{n}": n}) for n in range(3)], range(8)))
    doc = json.loads(bucket.blob("status.json").download_as_bytes())
    assert doc == {f"w{i}-{n}": n for i in range(8) for n in range(3)}


def test_reads_of_one_object_share_its_lock_and_a_write_waits_for_them():
    """The generation checks hold a per-object lock through the transfer: two downloads of one object (four
    workers staging one shard) do not queue, an upload over it waits for both, and no lock outlives its use."""

    from tpuctl.localcloud.storage import _ObjectLocks

    locks, written = _ObjectLocks(), threading.Event()

    def upload() -> None:
        with locks.held("b", "shard", shared=False):
            written.set()

    with locks.held("b", "shard", shared=True):
        with locks.held("b", "shard", shared=True), locks.held("b", "other", shared=False):
            writer = threading.Thread(target=upload)
            writer.start()
            assert not written.wait(0.3), "an upload replaced the object while it was being read"
        assert not written.wait(0.3)
    writer.join(5)
    assert written.is_set() and locks._held == {}


def test_a_resumable_uploads_last_chunk_waits_for_readers_of_its_object(server):
    """The object a resumable session writes is replaced in one write, as on GCS: its chunks take the object's
    lock like a single-request upload, so a download in flight never gets the new bytes under the old
    generation's headers (the lock is held here as a download holds it)."""
    bucket = _create(client(), "resumable-lock")
    bucket.blob("ckpt/checkpoint").upload_from_string(b"ckpt-10")
    session = bucket.blob("ckpt/checkpoint").create_resumable_upload_session(size=7)
    done = threading.Event()

    def put_all() -> None:
        assert requests.put(session, data=b"ckpt-20", headers={"Content-Range": "bytes 0-6/7"}).status_code == 200
        done.set()

    with server._front.object_locks.held("resumable-lock", "ckpt/checkpoint", shared=True):
        writer = threading.Thread(target=put_all)
        writer.start()
        assert not done.wait(0.5)  # the completing chunk waits for the reader
        assert bucket.blob("ckpt/checkpoint").download_as_bytes() == b"ckpt-10"  # readers share the lock
    writer.join(10)
    assert done.is_set() and bucket.blob("ckpt/checkpoint").download_as_bytes() == b"ckpt-20"
    assert len(server._front.upload_sessions) == 0  # a completed session is forgotten
