"""The supervisor's identity (provision/supervisor_account.py): created or adopted with exactly its grants, refused
in one line when the caller may not create it, checked by the preflight."""

from __future__ import annotations

import pytest
from google.api_core import exceptions as gexc

from conftest import tpuctl_here
from test_run import _spec, _spec_file
from tpuctl.errors import BadInput
from tpuctl.provision import supervisor_account as sa

COMPUTE_SA_ROLE = "roles/iam.serviceAccountUser"


def _project_roles_of(pc, email: str) -> set[str]:
    policy = pc.projects.get_iam_policy(request={"resource": f"projects/{pc.project}"})
    return {b.role for b in policy.bindings if f"serviceAccount:{email}" in b.members}


def _act_as(pc, account: str) -> list[dict]:
    return pc.post_json("iam", f"v1/projects/-/serviceAccounts/{account}:getIamPolicy", {}).get("bindings", [])


def test_run_detach_creates_the_account_once_with_its_grants_then_adopts_it(cloud, pc):
    from tpuctl.provision import bucket

    cloud.shape_project(pc.project, service_accounts=[])  # only the default compute account exists
    email, tpu_account = sa.email_of(pc.project), bucket.default_service_account(pc)
    assert sa.check(pc) == "creatable"
    assert sa.ensure(pc, tpu_account=tpu_account) == email
    assert sa.check(pc) == "exists"
    assert _project_roles_of(pc, email) == set(sa.PROJECT_ROLES)
    # Act as the TPU's account only (not every account of the project): a role on that account's own policy.
    assert _act_as(pc, tpu_account) == [{"role": COMPUTE_SA_ROLE, "members": [f"serviceAccount:{email}"]}]
    etag = pc.projects.get_iam_policy(request={"resource": f"projects/{pc.project}"}).etag
    sa.ensure(pc, tpu_account=tpu_account)  # adopted: no second create (it would be 409), no policy write
    assert pc.projects.get_iam_policy(request={"resource": f"projects/{pc.project}"}).etag == etag
    assert len(_act_as(pc, tpu_account)) == 1


def test_a_caller_who_may_not_create_it_is_refused_in_one_line_before_anything_exists(cloud, env, tmp_path):
    project = env["TPUCTL_PROJECT"]
    cloud.shape_project(project, service_accounts=[], denied_permissions=["iam.serviceAccounts.create"])
    p = tpuctl_here(env, "doctor", "--accelerator", "v3-8", "--zone", "us-central1-a")
    assert p.returncode == 2, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if "supervisor.service_account" in x)
    assert line.startswith(f"problem  supervisor.service_account: {sa.email_of(project)} does not exist and you "
                           "may not create it (missing iam.serviceAccounts.create) -> fix: ask a project owner"), line
    spec = _spec_file(tmp_path, _spec("sa-refused", accelerator="v3-8"))
    for dry in ((), ("--dry-run",)):
        p = tpuctl_here(env, "run", str(spec), "--yes", "--detach", "--no-fit-check", *dry)
        errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert p.returncode == 2 and errors == [
            f"error: supervisor.service_account: {sa.email_of(project)} does not exist and you may not create it "
            "(missing iam.serviceAccounts.create)"], (dry, p.stderr)
    assert cloud.inventory()["nodes"] == [] or all(project not in n["name"] for n in cloud.inventory()["nodes"])
    # The API refuses as the preflight said it would.
    from tpuctl.provision.clients import build
    from google.auth.credentials import AnonymousCredentials

    pc = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
               storage_host=cloud.storage_host, local=True)
    with pytest.raises(BadInput) as exc:
        sa.ensure(pc, tpu_account=f"{project}-compute@developer.gserviceaccount.com")
    assert exc.value.field == sa.FIELD and "gcloud iam service-accounts create tpuctl-supervisor" in exc.value.hint


def test_a_named_account_must_exist(cloud, pc):
    mine, gone = (f"{n}@{pc.project}.iam.gserviceaccount.com" for n in ("mine", "gone"))
    cloud.shape_project(pc.project, service_accounts=[mine])
    assert sa.check(pc, mine) == "exists"
    with pytest.raises(BadInput) as exc:
        sa.check(pc, gone)
    assert str(exc.value) == f"supervisor.service_account: service account {gone} does not exist"


def test_a_project_policy_write_from_a_stale_read_is_refused_and_the_grant_reads_again(cloud, pc):
    """setIamPolicy's etag: a write based on a read another writer overtook is 409, and `ensure` starts over."""
    resource = {"resource": f"projects/{pc.project}"}
    stale = pc.projects.get_iam_policy(request=resource)
    pc.projects.set_iam_policy(request={**resource, "policy": stale})
    with pytest.raises(gexc.Conflict):
        pc.projects.set_iam_policy(request={**resource, "policy": stale})
    reads = []
    real = pc.projects.get_iam_policy

    def racing(request):
        got = real(request=request)
        if not reads:  # another writer, between this first read and its write
            pc.projects.set_iam_policy(request={**resource, "policy": real(request=request)})
        reads.append(got)
        return got

    pc.projects.get_iam_policy = racing
    sa._grant_on_project(pc, "serviceAccount:x@y.iam.gserviceaccount.com")
    assert len(reads) == 2
    assert _project_roles_of(pc, "x@y.iam.gserviceaccount.com") == set(sa.PROJECT_ROLES)


def test_a_grant_naming_an_account_made_seconds_ago_is_retried_while_iam_has_not_seen_it():
    """IAM reads are eventually consistent: a policy naming a brand-new member may be refused with 400 for a
    while. A fresh account's grant is tried again (with backoff) until it goes through; an older account's 400,
    or a fresh one's other errors, are raised at once."""
    from tpuctl.errors import TpuctlError

    calls: list[int] = []

    def grant(fail: int, cause: Exception):
        def once():
            calls.append(1)
            if len(calls) <= fail:
                raise TpuctlError("refused") from cause
        return once

    sa._once_visible(grant(3, gexc.BadRequest("member does not exist")), fresh=True, what="grant")
    assert len(calls) == 4
    calls.clear()
    with pytest.raises(TpuctlError):
        sa._once_visible(grant(3, gexc.BadRequest("member does not exist")), fresh=False, what="grant")
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(TpuctlError):
        sa._once_visible(grant(3, gexc.Forbidden("no")), fresh=True, what="grant")
    assert len(calls) == 1
