"""The identity of a detached run's supervisor VM (jobs/supervisor_vm.py): a dedicated service account,
`tpuctl-supervisor@PROJECT.iam.gserviceaccount.com`, shared by every detached run of the project, with only the
roles the supervisor needs (README "Runs that last days" says which and why).

`check` is the preflight (`doctor`, `up --dry-run`, `run --detach` before anything is created): the account exists,
or the caller may create it (Resource Manager `testIamPermissions`); else BadInput naming
`supervisor.service_account` and the fix. `ensure` adopts it or creates it (IAM `serviceAccounts.create`) and makes
its grants, each only when missing (read-modify-write with the policy's etag, retried when another writer raced):
the project roles, Service Account User on the TPU's service account only (the supervisor creates TPUs that run
as it when it recovers one), and the run bucket's role on that bucket only. Nothing here deletes the account:
other runs share it.

A spec's `supervisor.service_account` names an existing account instead: it is only checked to exist, and
given the run bucket's role; its project roles are its owner's to grant.
"""

from __future__ import annotations

from collections.abc import Callable

from google.api_core import exceptions as gexc

from tpuctl.errors import BadInput, TpuctlError
from tpuctl.provision import bucket as buckets
from tpuctl.provision import waits
from tpuctl.provision.clients import Clients

ACCOUNT_ID = "tpuctl-supervisor"
FIELD = "supervisor.service_account"
# Project-level roles, and why the supervisor needs each (README "Runs that last days").
PROJECT_ROLES = {
    "roles/tpu.admin": "create and delete the run's TPU (a recovery makes it again; the run's end deletes it)",
    "roles/compute.instanceAdmin.v1": "delete its own VM when the run ends, and the VMs of a TPU7x slice",
}
# On the TPU's service account only: a TPU created by the supervisor runs as that account (iam.serviceAccounts.actAs).
ACT_AS_ROLE = "roles/iam.serviceAccountUser"
# What the caller needs to create the account and grant its project roles.
CREATE_PERMISSIONS = ("iam.serviceAccounts.create", "resourcemanager.projects.setIamPolicy")


def email_of(project: str) -> str:
    return f"{ACCOUNT_ID}@{project}.iam.gserviceaccount.com"


def _exists(clients: Clients, email: str) -> bool:
    try:
        waits.call(lambda: clients.get_json("iam", f"v1/projects/-/serviceAccounts/{email}"),
                   what=f"read service account {email}")
    except TpuctlError as exc:
        if isinstance(exc.__cause__, gexc.NotFound):
            return False
        raise
    return True


def check(clients: Clients, account: str | None = None) -> str:
    """Where the supervisor's identity stands: "exists" or "creatable" (by this caller). BadInput naming
    supervisor.service_account, with the fix, otherwise. Read-only."""
    email = account or email_of(clients.project)
    if _exists(clients, email):
        return "exists"
    if account:
        raise BadInput(f"service account {email} does not exist", field=FIELD,
                       hint="create it, or leave supervisor.service_account out to have tpuctl create "
                            f"{email_of(clients.project)}")
    resp = waits.call(lambda: clients.projects.test_iam_permissions(
        request={"resource": f"projects/{clients.project}", "permissions": list(CREATE_PERMISSIONS)}),
        what=f"test your permissions on project {clients.project}")
    missing = [p for p in CREATE_PERMISSIONS if p not in set(resp.permissions)]
    if missing:
        raise BadInput(f"{email} does not exist and you may not create it (missing {', '.join(missing)})",
                       field=FIELD, hint=f"ask a project owner to run `tpuctl run SPEC --detach` once (it creates it), "
                                         f"or to create it with {_grant_commands(clients.project)}; or name an "
                                         "existing account in supervisor.service_account")
    return "creatable"


def _grant_commands(project: str) -> str:
    email = email_of(project)
    return (f"`gcloud iam service-accounts create {ACCOUNT_ID} --project {project}` and, for each of "
            f"{', '.join(PROJECT_ROLES)}, `gcloud projects add-iam-policy-binding {project} "
            f"--member serviceAccount:{email} --role ROLE`")


def _add_binding(policy: dict, role: str, member: str) -> bool:
    """Add `member` to `role` in a REST policy; False when it is there already (unconditionally)."""
    for binding in policy.setdefault("bindings", []):
        if binding.get("role") == role and not binding.get("condition"):
            if member in binding.get("members", []):
                return False
            binding["members"] = [*binding.get("members", []), member]
            return True
    policy["bindings"].append({"role": role, "members": [member]})
    return True


def _grant_on_account(clients: Clients, account: str, role: str, member: str) -> None:
    path = f"v1/projects/-/serviceAccounts/{account}"

    def read_modify_write() -> None:
        policy = clients.post_json("iam", f"{path}:getIamPolicy", {})
        if _add_binding(policy, role, member):
            clients.post_json("iam", f"{path}:setIamPolicy", {"policy": policy})

    _raced(read_modify_write, what=f"grant {role} on service account {account}")


def _grant_on_project(clients: Clients, member: str) -> None:
    from google.iam.v1 import policy_pb2

    resource = f"projects/{clients.project}"

    def read_modify_write() -> None:
        policy = clients.projects.get_iam_policy(request={"resource": resource})
        changed = False
        for role in PROJECT_ROLES:
            binding = next((b for b in policy.bindings if b.role == role and not b.condition.expression), None)
            if binding is None:
                policy.bindings.append(policy_pb2.Binding(role=role, members=[member]))
                changed = True
            elif member not in binding.members:
                binding.members.append(member)
                changed = True
        if changed:
            clients.projects.set_iam_policy(request={"resource": resource, "policy": policy})

    _raced(read_modify_write, what=f"grant {', '.join(PROJECT_ROLES)} on project {clients.project}")


def _raced(read_modify_write, *, what: str, attempts: int = 5) -> None:
    """An IAM policy's read-modify-write, again from the read when another writer changed the policy in
    between: setIamPolicy's stale etag is 409 ABORTED, which reaches a REST client as Conflict (by its HTTP
    code), the only 409 a setIamPolicy answers."""
    for attempt in range(attempts):
        try:
            waits.call(read_modify_write, what=what)
            return
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.Conflict) or attempt == attempts - 1:
                raise


def ensure(clients: Clients, *, tpu_account: str, account: str | None = None) -> str:
    """The supervisor's account, adopted or created, with its project grants and Service Account User on
    `tpu_account` (each made only when missing); its email. Idempotent. `account`: one the spec names (only
    checked). The run bucket's role is `bucket.grant`'s, once the bucket exists."""
    email = account or email_of(clients.project)
    member = buckets.member(email)
    created = False
    if account:
        check(clients, account)
    elif not _exists(clients, email):
        created = True
        try:
            waits.call(lambda: clients.post_json("iam", f"v1/projects/{clients.project}/serviceAccounts", {
                "accountId": ACCOUNT_ID, "serviceAccount": {
                    "displayName": "tpuctl supervisor", "description": "Runs the supervisor VMs of detached "
                    "tpuctl runs (tpuctl README: Runs that last days). Shared by runs: never deleted by tpuctl."}}),
                what=f"create service account {email}")
        except TpuctlError as exc:
            if isinstance(exc.__cause__, gexc.Forbidden):  # 403 PERMISSION_DENIED, by its HTTP code
                raise BadInput(f"{email} does not exist and you may not create it", field=FIELD,
                               hint=f"ask a project owner to create it: {_grant_commands(clients.project)}") from exc
            if not isinstance(exc.__cause__, gexc.Conflict):  # made meanwhile (another run): adopted
                raise
    if not account:
        fresh = created
        _once_visible(lambda: _grant_on_project(clients, member), fresh=fresh, what=f"grant project roles to {email}")
        _once_visible(lambda: _grant_on_account(clients, tpu_account, ACT_AS_ROLE, member), fresh=fresh,
                      what=f"grant {ACT_AS_ROLE} on {tpu_account} to {email}")
    return email


# IAM is eventually consistent: "if you write data with the IAM API, then immediately read that data, the read
# operation might return an older version ... retry the request with truncated exponential backoff" (IAM API
# reference, cloud.google.com/iam/docs/reference/rest). A policy naming an account made seconds ago may be
# refused (400 INVALID_ARGUMENT: the member does not exist) until the account is visible; Terraform's
# google_service_account waits for the same reason. Only for an account this call created.
NEW_ACCOUNT_S = 120.0


def _once_visible(grant: Callable[[], None], *, fresh: bool, what: str) -> None:
    """`grant()`; for a `fresh` account, again with backoff while IAM answers 400 (by its HTTP code), up to
    NEW_ACCOUNT_S (then WaitTimeout). Any other error, or any error for an older account, is raised at once."""
    if not fresh:
        grant()
        return

    def attempt() -> tuple[bool, None]:
        try:
            grant()
        except TpuctlError as exc:
            if isinstance(exc.__cause__, gexc.BadRequest):
                return False, None
            raise
        return True, None

    waits.until(attempt, what=f"{what} (a new account becoming visible to IAM)", deadline_s=NEW_ACCOUNT_S)


def preflight_check(clients: Clients, account: str | None = None):
    """`check` as a row of `tpuctl doctor` (provision.preflight.Check)."""
    from tpuctl.provision.preflight import Check

    email = account or email_of(clients.project)
    try:
        state = check(clients, account)
    except BadInput as exc:
        return Check(FIELD, "problem", exc.message, exc.hint)
    except TpuctlError as exc:  # could not be read: as every preflight check, it stops nothing
        return Check(FIELD, "unknown", f"not checked: {exc.message}", exc.hint)
    return Check(FIELD, "ok", f"{email} exists" if state == "exists"
                 else f"{email} does not exist yet; `tpuctl run --detach` creates it (you may)")
