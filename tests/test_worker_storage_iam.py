"""The job's storage calls act as the TPU VM's service account and meet the bucket's IAM policy, as on Google.

The worker agent (`jobs/agent/`, the code that fetches data, writes checkpoints, logs and status from each
worker) runs here in-process with a metadata server answering Google's metadata protocol for one service
account (its token minted by the local cloud, `cloud.tokens`), so its requests carry that account's token and
the local cloud checks them against the bucket's policy. tpuctl's own grant must be enough, and less must fail.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials

from tpuctl.jobs.agent.mirror import Mirror
from tpuctl.provision import bucket as B
from tpuctl.provision.clients import build

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def metadata(cloud, clients, pc, monkeypatch):
    """A metadata server for the default compute service account of `clients.project`."""
    email = B.default_service_account(pc)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "missing Metadata-Flavor header", "text/plain")
            path = self.path.split("?")[0].removeprefix("/computeMetadata/v1/")
            if path in ("", "/"):
                return self._send(200, "", "text/plain")
            if path == "project/project-id":
                return self._send(200, clients.project, "application/text")
            if path.startswith("instance/service-accounts/default/token"):
                token = cloud.tokens.issue(email, clients.project)
                return self._send(200, json.dumps({"access_token": token, "expires_in": 3599,
                                                   "token_type": "Bearer"}), "application/json")
            if path.startswith("instance/service-accounts/default"):
                info = {"email": email, "aliases": ["default"],
                        "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
                return self._send(200, json.dumps(info), "application/json")
            return self._send(404, "not found", "text/plain")

        def _send(self, status, body, content_type):
            data = body.encode()
            self.send_response(status)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setenv("GCE_METADATA_IP", host)
    # google-auth reads GCE_METADATA_HOST once, at import; a worker's process has it set before that.
    from google.auth.compute_engine import _metadata

    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no gcloud ADC file: the metadata server is the only source
    yield email
    server.shutdown()
    server.server_close()


@pytest.fixture
def pc(cloud, clients):
    """tpuctl's provision clients on the same project as `clients`."""
    return build(project=clients.project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                 storage_host=cloud.storage_host, local=True)


@pytest.fixture
def run_bucket(clients):
    b = clients.storage.bucket(f"job-{clients.project}")
    b.iam_configuration.uniform_bucket_level_access_enabled = True
    b.soft_delete_policy.retention_duration_seconds = 0
    b = clients.storage.create_bucket(b, location="europe-west4")
    b.blob("runs/r1/data/part-0.tfrecord").upload_from_string(b"d" * 100)
    return b


def _job(clients, bucket) -> dict:
    return {"project": clients.project, "bucket": bucket.name, "prefix": "runs/r1"}


def _train_like_a_job(store: Mirror, tmp_path) -> None:
    """What a worker does with the bucket: read the data, write and rotate checkpoints, publish status."""
    assert store.download_prefix(f"gs://{store.bucket.name}/runs/r1/data") == 1
    model = store.local(f"gs://{store.bucket.name}/runs/r1/model")
    model.mkdir(parents=True, exist_ok=True)
    (model / "ckpt-1").write_bytes(b"1")
    (model / "checkpoint").write_text("ckpt-1")
    assert store.upload_dir(f"gs://{store.bucket.name}/runs/r1/model") == 2
    (model / "checkpoint").write_text("ckpt-2 ")  # overwritten: needs storage.objects.delete as well
    (model / "ckpt-2").write_bytes(b"2")
    assert store.upload_dir(f"gs://{store.bucket.name}/runs/r1/model") == 2
    store.put_json("status.json", {"state": "running"})
    store.put_json("status.json", {"state": "succeeded"})
    assert store.get_json("status.json") == {"state": "succeeded"}


def test_the_job_runs_with_exactly_tpuctls_grant(cloud, clients, pc, metadata, run_bucket, tmp_path):
    B.grant(pc, run_bucket.name, metadata, run="r1", region="europe-west4")
    store = Mirror(_job(clients, run_bucket), 0, tmp_path / "gcs")
    _train_like_a_job(store, tmp_path)
    assert run_bucket.blob("runs/r1/model/checkpoint").download_as_bytes() == b"ckpt-2 "


def test_the_job_fails_without_a_grant(cloud, clients, metadata, run_bucket, tmp_path):
    store = Mirror(_job(clients, run_bucket), 0, tmp_path / "gcs")
    with pytest.raises(exceptions.Forbidden, match=f"{metadata} does not have storage.objects.list access"):
        _train_like_a_job(store, tmp_path)


def test_read_and_create_without_delete_is_not_enough(cloud, clients, metadata, run_bucket, tmp_path):
    policy = run_bucket.get_iam_policy(requested_policy_version=3)
    for role in ("roles/storage.objectViewer", "roles/storage.objectCreator"):
        policy.bindings.append({"role": role, "members": {f"serviceAccount:{metadata}"}})
    run_bucket.set_iam_policy(policy)
    store = Mirror(_job(clients, run_bucket), 0, tmp_path / "gcs")
    with pytest.raises(exceptions.Forbidden, match="storage.objects.delete"):
        _train_like_a_job(store, tmp_path)


def test_the_tpu_workers_metadata_token_is_its_service_account_for_storage(cloud, clients, pc, run_bucket):
    """No stand-in: the token a TPU worker's own metadata server hands out is checked against bucket IAM."""
    from google.cloud import storage, tpu_v2
    from google.oauth2.credentials import Credentials

    parent = f"projects/{clients.project}/locations/europe-west4-a"
    from tpuctl.localcloud import facts

    node = tpu_v2.Node(accelerator_type="v3-8", runtime_version=facts.RUNTIMES_BY_GENERATION["v3"][0])
    clients.tpu.create_node(parent=parent, node_id="iam-node", node=node).result(timeout=60)
    tree = cloud.tpu.guest_metadata(f"{parent}/nodes/iam-node", 0)
    account = tree["instance"]["service-accounts"]["default"]
    token = account["token"].value["access_token"]
    gcs = storage.Client(project=clients.project, credentials=Credentials(token))
    with pytest.raises(exceptions.Forbidden, match=f"{account['email']} does not have storage.objects.list"):
        list(gcs.list_blobs(run_bucket.name))
    B.grant(pc, run_bucket.name, account["email"], run="r1", region="europe-west4")
    assert [b.name for b in gcs.list_blobs(run_bucket.name)] == ["runs/r1/data/part-0.tfrecord"]


def test_a_guests_metadata_server_hands_out_one_token_until_it_has_five_minutes_left(monkeypatch):
    """Google's metadata server caches a token until 5 minutes before it expires (compute/docs/access/
    authenticate-workloads); the tree a held wait_for_change request is reread from every 50 ms mints nothing."""
    from tpuctl.localcloud import tokens as tokens_mod
    from tpuctl.localcloud.metadata import guest_tree

    now = [1000.0]
    tokens = tokens_mod.Tokens(clock=lambda: now[0])
    minted = []
    issue = tokens.issue
    monkeypatch.setattr(tokens, "issue", lambda *a, **kw: minted.append(issue(*a, **kw)) or minted[-1])

    def token(instance_id: str = "71") -> dict:
        tree = guest_tree(project="p", number="1", zone="z", name="w-0", instance_id=instance_id, attributes={},
                          service_account=("sa@p.iam.gserviceaccount.com", ["s"]), tokens=tokens)
        accounts = tree["instance"]["service-accounts"]
        assert accounts["default"]["token"] == accounts["sa@p.iam.gserviceaccount.com"]["token"]
        return accounts["default"]["token"].value

    first = token()
    assert [token() for _ in range(50)] == [first] * 50 and len(minted) == 1 and first["expires_in"] == 3600
    now[0] += 3000  # 600 s left: the same token, saying so
    assert token() == {**first, "expires_in": 600}
    other = token("72")  # another guest (worker) has its own
    assert other["access_token"] != first["access_token"]
    now[0] += 301  # 299 s left: a new one, while the old one still works until it expires
    renewed = token()
    assert renewed["access_token"] not in (first["access_token"], other["access_token"])
    assert renewed["expires_in"] == 3600
    assert tokens.identity(first["access_token"]).email == "sa@p.iam.gserviceaccount.com"
    assert len(minted) == 3
