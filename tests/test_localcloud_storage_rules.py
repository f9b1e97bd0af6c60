"""Cloud Storage as Google enforces it: names, locations, the global namespace, a new bucket's IAM policy, soft
delete (kept, listed and billed), and bucket IAM for requests that carry a worker's service account token.
Official google-cloud-storage client over real HTTP, strict mode."""

from __future__ import annotations

import time

import pytest
import requests
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.oauth2.credentials import Credentials

from tpuctl.localcloud import facts
from tpuctl.localcloud.schema import Validator
from tpuctl.localcloud.storage import StorageServer
from tpuctl.localcloud.tokens import Tokens

pytestmark = pytest.mark.timeout(120)

SA = "123-compute@developer.gserviceaccount.com"


@pytest.fixture
def tokens() -> Tokens:
    return Tokens()


@pytest.fixture
def server(tmp_path, monkeypatch, tokens):
    server = StorageServer(tmp_path / "gcs", validator_factory=Validator, tokens=tokens)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.start())
    yield server
    server.stop()


def owner(project: str = "proj-a") -> storage.Client:
    return storage.Client(project=project, credentials=AnonymousCredentials())


def worker(tokens: Tokens, email: str = SA, project: str = "proj-a") -> storage.Client:
    return storage.Client(project=project, credentials=Credentials(tokens.issue(email, project)))


def _bucket(name: str = "rules-b", *, project: str = "proj-a", retention: int | None = None) -> storage.Bucket:
    bucket = owner(project).bucket(name)
    bucket.iam_configuration.uniform_bucket_level_access_enabled = True
    if retention is not None:
        bucket.soft_delete_policy.retention_duration_seconds = retention
    return owner(project).create_bucket(bucket, location="us-central1")


def _grant(bucket: storage.Bucket, *roles: str, who: str = SA) -> None:
    policy = bucket.get_iam_policy(requested_policy_version=3)
    for role in roles:
        policy.bindings.append({"role": role, "members": {f"serviceAccount:{who}"}})
    bucket.set_iam_policy(policy)


@pytest.mark.parametrize("name", ["192.168.5.4", "my-google-data", "my-g00gle-data", "my-g00gl3", "goog-data", "ab",
                                  "Upper-case", "a" * 64, "dots." + "a" * 64 + ".x"])
def test_bucket_names_google_refuses(server, name):
    with pytest.raises(exceptions.BadRequest, match="Invalid bucket name"):
        owner().create_bucket(name, location="us-central1")
    assert list(owner().list_buckets()) == []


def test_listing_buckets_needs_a_project(server):
    """buckets.list's `project` parameter is required (storage v1 discovery document)."""
    answer = requests.get(f"{server.url}/storage/v1/b")
    assert answer.status_code == 400 and answer.json()["error"]["errors"][0]["reason"] == "required"


def test_dotted_names_may_reach_222_characters(server):
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 30])
    assert len(name) == 222
    assert owner().create_bucket(name, location="us-central1").name == name


@pytest.mark.parametrize("location", ["us-central9", "europe-west99", "mars-north1", "NAM9"])
def test_only_real_locations(server, location):
    with pytest.raises(exceptions.BadRequest, match="location constraint is not valid"):
        owner().create_bucket("located", location=location)


def test_every_tpu_region_can_hold_the_runs_bucket():
    regions = {facts.region_of(z).upper() for zones in facts.ZONES_BY_GENERATION.values() for z in zones}
    assert regions <= facts.GCS_REGIONS


@pytest.mark.parametrize("location", ["us-central2", "europe-west4", "EU", "nam4", "africa-south1"])
def test_real_locations_are_accepted(server, location):
    assert owner().create_bucket("located", location=location).location == location.upper()


def test_one_namespace_for_every_project(server):
    _bucket("shared-name", project="proj-a")
    with pytest.raises(exceptions.Conflict, match="bucket namespace is shared by all users"):
        owner("proj-b").create_bucket("shared-name", location="us-central1")
    with pytest.raises(exceptions.Conflict, match="You already own this bucket"):
        owner("proj-a").create_bucket("shared-name", location="us-central1")
    # The bucket says whose it is: the project number of the project that created it.
    assert owner("proj-b").get_bucket("shared-name").project_number == int(facts.project_number("proj-a"))


def test_a_new_bucket_gets_the_project_convenience_bindings(server):
    policy = _bucket("fresh-policy").get_iam_policy(requested_policy_version=3)
    got = {b["role"]: set(b["members"]) for b in policy.bindings}
    owners, viewers = {"projectEditor:proj-a", "projectOwner:proj-a"}, {"projectViewer:proj-a"}
    assert got == {"roles/storage.legacyBucketOwner": owners, "roles/storage.legacyBucketReader": viewers,
                   "roles/storage.legacyObjectOwner": owners, "roles/storage.legacyObjectReader": viewers}
    plain = owner().create_bucket("fine-grained", location="us-central1").get_iam_policy()
    assert {b["role"] for b in plain.bindings} == {"roles/storage.legacyBucketOwner",
                                                   "roles/storage.legacyBucketReader"}


def test_soft_delete_is_on_for_seven_days_by_default(server):
    bucket = _bucket()
    assert bucket.soft_delete_policy.retention_duration_seconds == 7 * 86400
    assert bucket.soft_delete_policy.effective_time is not None
    assert _bucket("off", retention=0).soft_delete_policy.retention_duration_seconds == 0


@pytest.mark.parametrize("seconds", [1, 3600, 6 * 86400, 91 * 86400])
def test_soft_delete_retention_is_zero_or_7_to_90_days(server, seconds):
    with pytest.raises(exceptions.BadRequest, match="0 .* or between 604800"):
        _bucket(retention=seconds)
    bucket = _bucket(retention=0)
    bucket.soft_delete_policy.retention_duration_seconds = seconds
    with pytest.raises(exceptions.BadRequest, match="retentionDurationSeconds"):
        bucket.patch()
    bucket.soft_delete_policy.retention_duration_seconds = 90 * 86400
    bucket.patch()
    assert owner().get_bucket(bucket.name).soft_delete_policy.retention_duration_seconds == 90 * 86400


def test_deleted_and_overwritten_objects_stay_soft_deleted_until_their_hard_delete_time(server):
    bucket = _bucket()
    bucket.blob("ckpt/1").upload_from_string(b"a" * 1000)
    bucket.blob("ckpt/1").upload_from_string(b"b" * 300)  # an overwrite soft-deletes the replaced generation
    bucket.blob("ckpt/1").delete()
    bucket.blob("keep").upload_from_string(b"k")
    assert [b.name for b in bucket.list_blobs()] == ["keep"]
    soft = list(bucket.list_blobs(soft_deleted=True))
    assert sorted(b.size for b in soft) == [300, 1000]
    for blob in soft:
        assert (blob.hard_delete_time - blob.soft_delete_time).total_seconds() == pytest.approx(7 * 86400, abs=1)
    bucket.delete(force=True)
    # The bucket is gone; its soft-deleted bytes are not (and keep billing).
    assert server.soft_deleted()["rules-b"]["bytes"] == 1301


def test_a_recreated_bucket_does_not_list_the_old_ones_soft_deleted_objects(server):
    """storage/docs/use-soft-deleted-buckets: a deleted bucket's soft-deleted objects are listed only after the
    bucket is restored; a new bucket of the same name starts empty. The old bytes still bill."""
    bucket = _bucket()
    bucket.blob("old").upload_from_string(b"o" * 50)
    bucket.blob("old").delete()
    bucket.delete()
    again = _bucket()
    assert list(again.list_blobs(soft_deleted=True)) == []
    again.blob("new").upload_from_string(b"n" * 7)
    again.blob("new").delete()
    assert [b.name for b in again.list_blobs(soft_deleted=True)] == ["new"]
    assert server.soft_deleted()["rules-b"]["bytes"] == 57


def test_an_unfinished_upload_does_not_keep_a_bucket_but_an_object_does(server):
    """Only live objects keep a bucket from being deleted (Google's storage-testbench, database.delete_bucket):
    a resumable upload a preempted worker left half-done does not, and its session goes with the bucket. The
    409 says what GCS says: "The bucket you tried to delete was not empty."."""
    bucket = _bucket()
    bucket.blob("keep").upload_from_string(b"k")
    with pytest.raises(exceptions.Conflict, match="The bucket you tried to delete was not empty."):
        bucket.delete()
    bucket.blob("keep").delete()
    session = bucket.blob("ckpt/big").create_resumable_upload_session(size=1 << 20)
    assert requests.put(session, data=b"x" * (256 << 10),
                        headers={"Content-Range": f"bytes 0-{(256 << 10) - 1}/{1 << 20}"}).status_code == 308
    bucket.delete()
    assert list(owner().list_buckets()) == [] and len(server._front.upload_sessions) == 0
    assert server._backend.storage.resumable == {}


def test_no_soft_delete_with_retention_zero(server):
    bucket = _bucket(retention=0)
    bucket.blob("x").upload_from_string(b"x" * 100)
    bucket.blob("x").upload_from_string(b"y" * 100)
    bucket.blob("x").delete()
    assert list(bucket.list_blobs(soft_deleted=True)) == []
    assert server.soft_deleted() == {}


def test_soft_deleted_bytes_survive_a_restart(tmp_path, monkeypatch):
    first = StorageServer(tmp_path / "gcs", validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", first.start())
    bucket = _bucket()
    bucket.blob("x").upload_from_string(b"x" * 10)
    bucket.blob("x").delete()
    first.stop()
    second = StorageServer(tmp_path / "gcs", validator_factory=Validator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", second.start())
    try:
        assert second.soft_deleted()["rules-b"]["bytes"] == 10
    finally:
        second.stop()


def test_the_meter_bills_soft_deleted_bytes_after_the_bucket_is_gone(cloud, clients):
    bucket = clients.storage.bucket(f"sd-{clients.project}")
    bucket = clients.storage.create_bucket(bucket, location="europe-west4")
    bucket.blob("big").upload_from_string(b"z" * 2_000_000)
    bucket.blob("big").delete()
    bucket.delete()
    deadline = time.monotonic() + 10
    row = None
    while time.monotonic() < deadline:
        rows = {r["resource"]: r for r in cloud.meter_report()["resources"]}
        row = rows.get(f"buckets/{bucket.name}/soft-deleted")
        if row and row["running"] and row["gb_seconds"] > 0:
            break
        time.sleep(0.3)
    assert row is not None and row["running"], "soft-deleted bytes must keep billing after the bucket is deleted"
    assert row["sku"] == "bucket/europe-west4/standard/soft-deleted"
    assert row["usd_per_hour"] == pytest.approx(facts.STORAGE_PRICE_PER_GB_MONTH / 730)


# ---- bucket IAM for a worker's service account token

def test_requests_without_a_worker_token_act_as_the_project_owner(server):
    bucket = _bucket()
    bucket.reload()
    bucket.blob("x").upload_from_string(b"x")
    assert owner().get_bucket(bucket.name).name == bucket.name


def test_a_worker_token_without_a_binding_is_refused_in_googles_shape(server, tokens):
    _bucket()
    gcs = worker(tokens)
    with pytest.raises(exceptions.Forbidden, match=f"{SA} does not have storage.objects.create access"):
        gcs.bucket("rules-b").blob("x").upload_from_string(b"x")
    with pytest.raises(exceptions.Forbidden, match="storage.objects.list") as denied:
        list(gcs.list_blobs("rules-b"))
    assert denied.value.errors[0]["reason"] == "forbidden"
    with pytest.raises(exceptions.Forbidden, match="storage.buckets.create access to the Google Cloud project"):
        gcs.create_bucket("by-the-worker", location="us-central1")


def test_object_admin_does_not_grant_buckets_get(server, tokens):
    bucket = _bucket()
    _grant(bucket, "roles/storage.objectAdmin")
    gcs = worker(tokens)
    blob = gcs.bucket("rules-b").blob("ckpt/1")
    blob.upload_from_string(b"1")
    blob.upload_from_string(b"2")
    assert blob.download_as_bytes() == b"2"
    assert [b.name for b in gcs.list_blobs("rules-b")] == ["ckpt/1"]
    blob.delete()
    with pytest.raises(exceptions.Forbidden, match="storage.buckets.get access to the Google Cloud Storage bucket"):
        gcs.get_bucket("rules-b")
    with pytest.raises(exceptions.Forbidden, match="storage.buckets.getIamPolicy"):
        gcs.bucket("rules-b").get_iam_policy()


def test_object_user_and_legacy_bucket_reader_cover_what_a_training_job_does(server, tokens):
    bucket = _bucket()
    _grant(bucket, "roles/storage.objectUser", "roles/storage.legacyBucketReader")
    gcs = worker(tokens)
    assert gcs.get_bucket("rules-b").name == "rules-b"  # TensorFlow's gs:// filesystem checks the bucket
    blob = gcs.bucket("rules-b").blob("model/ckpt-1.index")
    blob.upload_from_string(b"1")
    blob.upload_from_string(b"2")
    assert [b.name for b in gcs.list_blobs("rules-b", prefix="model/")] == ["model/ckpt-1.index"]
    blob.delete()
    with pytest.raises(exceptions.Forbidden, match="storage.buckets.update"):
        gcs.bucket("rules-b").patch()


def test_overwriting_needs_delete_as_well_as_create(server, tokens):
    bucket = _bucket()
    _grant(bucket, "roles/storage.objectCreator")
    gcs = worker(tokens)
    gcs.bucket("rules-b").blob("new").upload_from_string(b"1")
    with pytest.raises(exceptions.Forbidden, match="storage.objects.delete"):
        gcs.bucket("rules-b").blob("new").upload_from_string(b"2")


def test_another_accounts_binding_grants_nothing_and_a_forged_token_is_unauthenticated(server, tokens):
    bucket = _bucket()
    _grant(bucket, "roles/storage.objectAdmin", who="other@proj-a.iam.gserviceaccount.com")
    with pytest.raises(exceptions.Forbidden):
        worker(tokens).bucket("rules-b").blob("x").upload_from_string(b"x")
    answer = requests.get(f"{server.url}/storage/v1/b/rules-b/o",
                          headers={"Authorization": "Bearer ya29.lcsa.forged"}, timeout=10)
    assert answer.status_code == 401
    assert answer.json()["error"]["errors"][0]["reason"] == "authError"
