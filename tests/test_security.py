"""Least privilege and secrets, asserted from the local cloud's own state after a real run.

One spot v3-8 run with a VM is provisioned through `tpuctl.provision` and runs the stand-in job on its
worker; then the cloud's inventory, the node/VM definitions, the bucket and TPUCTL_HOME are inspected.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest
import cloud_stack

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]


RUN = "secure"
# A credential the user has on their laptop; it must never travel anywhere.
CANARY_KEY = {"type": "service_account", "project_id": "p", "private_key_id": "0123canary",
              "private_key": "-----BEGIN PRIVATE KEY-----\nQ0FOQVJZLXNlY3JldC1rZXktbWF0ZXJpYWw=\n-----END PRIVATE KEY-----\n",
              "client_email": "laptop@p.iam.gserviceaccount.com"}
NARROW_ROLES = ("roles/storage.objectUser",)  # read/write/overwrite/delete objects; nothing on the bucket itself


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("adc") / "key.json"
    key_file.write_text(json.dumps(CANARY_KEY))
    saved = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = str(key_file)
    try:
        with cloud_stack.Stack() as s:
            yield s
    finally:
        if saved is None:
            os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        else:
            os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = saved


@pytest.fixture(scope="module")
def deployed(stack):
    # Tripwire: any setIamPolicy on the TPU/Compute/Resource Manager endpoint (project or instance level)
    # matches this fault and increments its hit count.
    trip = stack.fault("unavailable", method="*setIamPolicy")
    result = cloud_stack.up(stack, RUN, "v3-8", ("us-central1-a",), "spot",
                      extra={"vms": [{"name": "data", "machine_type": "e2-small"}]})
    assert result.exit_code == 0, result.message
    job = cloud_stack.Job(stack, RUN, max_steps=10, checkpoint_every=5)
    states = job.run_to_end()
    assert [s.exit_code for s in states] == [0]
    # tpuctl's own commands against the run, so their log files (if any) exist to be scanned.
    for args in (["status", RUN, "--json"], ["list", "--json"]):
        subprocess.run([sys.executable, "-m", "tpuctl", *args], env={**os.environ, **stack.env}, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    yield result, job, trip
    stack.clear_faults()


def _node(stack):
    return stack.clients.tpu.get_node(name=f"projects/{cloud_stack.PROJECT}/locations/us-central1-a/nodes/{RUN}")


def _private_key_body(job) -> str:
    lines = job.key.private_path.read_text().splitlines()
    return "".join(l for l in lines if not l.startswith("-----"))


def _bucket_row(stack, name):
    return next(b for b in stack.status()["resources"]["buckets"] if b["name"] == name)


def test_iam_only_on_the_run_bucket_only_for_the_tpu_service_account(stack, deployed):
    result, job, _ = deployed
    sa = _node(stack).service_account.email
    assert sa == job.service_account
    buckets = stack.status()["resources"]["buckets"]
    mine = [b for b in buckets if b["name"] == job.bucket]
    assert len(mine) == 1
    bindings = mine[0]["iam_policy"].get("bindings", [])
    granted = [(b["role"], m) for b in bindings for m in b["members"] if m == f"serviceAccount:{sa}"]
    assert len(granted) == 1 and granted[0][0] in NARROW_ROLES, bindings
    assert not any(b.get("condition") for b in bindings)
    from tpuctl.provision.labels import auto_bucket

    # The whole-run test's own run grants the same account on its bucket, when it ran first.
    for other in buckets:
        if other["name"] not in (job.bucket, auto_bucket(cloud_stack.PROJECT, "secure-run")):
            members = {m for b in other["iam_policy"].get("bindings", []) for m in b["members"]}
            assert f"serviceAccount:{sa}" not in members, other["name"]


def test_no_project_or_instance_level_policy_change(stack, deployed):
    _, _, trip = deployed
    live = {f["id"]: f for f in stack.admin("GET", "faults")["faults"]}
    assert live[trip["id"]].get("hits", 0) == 0, "tpuctl called setIamPolicy outside Cloud Storage"
    # And no other code path could: setIamPolicy is called on a bucket object, and on the project only by the
    # detached run's supervisor identity (provision/supervisor_account.py: its own account's project roles,
    # README "Runs that last days"), which a run without --detach never reaches (the trip wire above).
    allowed = ("provision/bucket.py", "b.set_iam_policy"), ("provision/supervisor_account.py",
                                                            "clients.projects.set_iam_policy")
    calls = []
    for path in [*(REPO / "provision").rglob("*.py"), *(REPO / "tpuctl").rglob("*.py"), *(REPO / "jobs").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("set_iam_policy", "setIamPolicy"):
                calls.append(f"{path.relative_to(REPO)}:{node.lineno}:{ast.unparse(node)}")
    assert calls and all(any(c.startswith(f) and c.endswith(a) for f, a in allowed) for c in calls), calls


def test_bucket_uniform_access_public_access_prevention_no_public_member(stack, deployed):
    _, job, _ = deployed
    row = _bucket_row(stack, job.bucket)
    iam = row["iamConfiguration"]
    assert iam["uniformBucketLevelAccess"]["enabled"] is True
    assert iam["publicAccessPrevention"] == "enforced"
    assert row["objects"] > 0, "the job wrote checkpoints and logs"
    members = {m for b in row["iam_policy"].get("bindings", []) for m in b["members"]}
    assert not members & {"allUsers", "allAuthenticatedUsers"}
    for blob in stack.clients.storage.list_blobs(job.bucket):
        assert blob.acl is not None  # uniform access: ACLs are off, so no object can be public on its own
        assert not (blob.metadata or {}).get("public")


def test_no_credential_in_node_or_vm_metadata_labels_or_startup_scripts(stack, deployed):
    _, job, _ = deployed
    node = _node(stack)
    texts = {f"node metadata {k}": v for k, v in node.metadata.items()}
    texts.update({f"node label {k}": f"{k}={v}" for k, v in node.labels.items()})
    vm = stack.clients.instances.get(project=cloud_stack.PROJECT, zone="us-central1-a", instance=f"{RUN}-data")
    texts.update({f"vm metadata {i.key}": i.value for i in vm.metadata.items})
    texts.update({f"vm label {k}": f"{k}={v}" for k, v in vm.labels.items()})
    private = _private_key_body(job)
    found = {where: cloud_stack.secrets_in(text, (private, CANARY_KEY["private_key_id"])) for where, text in texts.items()}
    assert not {k: v for k, v in found.items() if v}
    for line in node.metadata.get("ssh-keys", "").splitlines():
        user, _, key = line.partition(":")
        assert key.split()[0] == "ssh-ed25519" and asyncssh.import_public_key(" ".join(key.split()[:2]))


def test_no_credential_in_anything_written_to_the_bucket(stack, deployed):
    _, job, _ = deployed
    private = _private_key_body(job)
    scanned = 0
    bad = {}
    for blob in stack.clients.storage.list_blobs(job.bucket):
        data = blob.download_as_bytes()
        if blob.name.endswith(".tar.gz"):
            import io
            import tarfile

            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                text = "".join(tar.extractfile(m).read().decode(errors="replace") for m in tar.getmembers() if m.isfile())
        else:
            text = data.decode(errors="replace")
        scanned += "/logs/" in blob.name
        hits = cloud_stack.secrets_in(text, (private, CANARY_KEY["private_key_id"]))
        if hits:
            bad[blob.name] = hits
    assert scanned >= 1, "the worker's log reached the bucket"
    assert not bad


def test_no_credential_in_tpuctl_own_files(stack, deployed):
    _, job, _ = deployed
    private = _private_key_body(job)
    bad = {}
    files = [p for p in stack.home.rglob("*") if p.is_file() and p != job.key.private_path]
    assert files
    for p in files:
        hits = cloud_stack.secrets_in(p.read_bytes().decode(errors="replace"), (private, CANARY_KEY["private_key_id"]))
        if hits:
            bad[str(p.relative_to(stack.home))] = hits
    assert not bad


def test_ssh_private_key_is_0600_in_a_0700_directory(stack, deployed):
    _, job, _ = deployed
    assert stat.S_IMODE(job.key.private_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(job.key.private_path.parent.stat().st_mode) & 0o077 == 0


def test_published_host_keys_are_enforced(stack, deployed):
    from tpuctl import provision
    from tpuctl.jobs.ssh import HostKeyMismatch, Target, connect

    _, job, _ = deployed
    workers = provision.workers(stack.clients, "us-central1-a", RUN)
    assert workers and all(w.host_key for w in workers), "the local cloud publishes host keys"
    impostor = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()
    w = workers[0]
    wrong = Target(index=w.index, host=w.ip, port=w.port, host_key=" ".join(impostor[:2]))

    async def attempt():
        conn = await connect(wrong, job.key, deadline_s=10)
        conn.close()

    with pytest.raises(HostKeyMismatch):
        asyncio.run(attempt())


@pytest.mark.slow  # fast tier: the deployed run's files: test_no_credential_in_anything_written_to_the_bucket
def test_a_whole_tpuctl_run_leaves_no_credential_in_its_bucket_or_tpuctl_home(stack, deployed):
    """The full pipeline (up, ship, train, tear down) as a user runs it, then everything it left is scanned."""
    spec = cloud_stack.write_spec(stack, "secure-run", "v3-8", ("us-central1-a",), "spot", extra={"job": {
        "template": str(cloud_stack.STANDIN), "env": {"TPUCTL_TEST_PLAIN": "not-a-secret"},
        "config": {"trainer": {"max_steps": 10, "checkpoint_every": 5, "step_seconds": 0.02}}}})
    proc = subprocess.run(cloud_stack.run_command(spec), env=cloud_stack.child_env(stack, "secure"), capture_output=True,
                          text=True, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, job, _ = deployed
    extra = (_private_key_body(job), CANARY_KEY["private_key_id"])
    assert not cloud_stack.secrets_in(proc.stdout + proc.stderr, extra)
    from tpuctl.provision.labels import auto_bucket

    bucket = auto_bucket(cloud_stack.PROJECT, "secure-run")
    blobs = list(stack.clients.storage.list_blobs(bucket))
    assert any("/logs/" in b.name for b in blobs)
    bad = {b.name: cloud_stack.secrets_in(b.download_as_bytes().decode(errors="replace"), extra) for b in blobs
           if not b.name.endswith(".tar.gz")}
    assert not {k: v for k, v in bad.items() if v}
    home = {str(p): cloud_stack.secrets_in(p.read_bytes().decode(errors="replace"), extra)
            for p in stack.home.rglob("*") if p.is_file() and p != job.key.private_path}
    assert not {k: v for k, v in home.items() if v}
    row = _bucket_row(stack, bucket)
    assert row["iamConfiguration"]["publicAccessPrevention"] == "enforced"
    # Beyond the project convenience bindings every new bucket gets, only the narrow grant to the TPU's account.
    bindings = [b for b in row["iam_policy"]["bindings"] if not all(m.startswith("project") for m in b["members"])]
    assert bindings and all(b["role"] in NARROW_ROLES and b["members"] == [f"serviceAccount:{job.service_account}"]
                            for b in bindings), bindings
    assert [k for k in stack.live("secure-run") if not k.startswith("buckets/")] == [], "run tears its TPU down"
