"""OS Login: whether a project or TPU node uses it, and the POSIX user our key logs in as when it does.

With `enable-oslogin` TRUE in the node's metadata, or else in the project's common metadata, the guest ignores
`ssh-keys` metadata and admits only keys in the caller's OS Login profile, as the caller's POSIX user. This
follows gcloud (`compute tpus tpu-vm ssh` -> `ssh_utils.GetOsloginState`): the caller is the active account's
email, the profile is read with `users.getLoginProfile`, the key is imported with `users.importSshPublicKey`
when missing, and the primary POSIX account's username is the login name.
"""

from __future__ import annotations

from collections.abc import Mapping

from tpuctl.errors import BadInput
from tpuctl.provision import waits
from tpuctl.provision.clients import Clients

ENABLE_KEY = "enable-oslogin"
TWO_FACTOR_KEY = "enable-oslogin-2fa"


# What the guest agent, which decides who may log in, takes for true and false: Go's strconv.ParseBool
# (guest-agent metadata.go parses enable-oslogin and enable-oslogin-2fa with it).
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def _flag(metadata: Mapping[str, str], key: str) -> bool | None:
    """The flag's value as the guest agent reads it; None when unset or unparseable (then the next level
    decides, as the agent leaves such a value unset)."""
    value = metadata.get(key)
    return True if value in _TRUE else False if value in _FALSE else None


def project_metadata(clients: Clients) -> dict[str, str]:
    """The project's common instance metadata. Read-only; one Compute `projects.get`."""
    project = waits.call(lambda: clients.compute_projects.get(project=clients.project),
                         what=f"read project {clients.project}'s metadata")
    return {i.key: i.value for i in project.common_instance_metadata.items}


def enabled(project_meta: Mapping[str, str], node_meta: Mapping[str, str] | None = None, key: str = ENABLE_KEY) -> bool:
    """The node's value when it sets one the guest agent can parse, else the project's."""
    for meta in (node_meta or {}, project_meta):
        flag = _flag(meta, key)
        if flag is not None:
            return flag
    return False


def unusable(clients: Clients, project_meta: Mapping[str, str], node_meta: Mapping[str, str] | None = None) -> str | None:
    """Why tpuctl could not log in to an OS Login guest (None when it can, or OS Login is off). Pure."""
    if not enabled(project_meta, node_meta):
        return None
    if enabled(project_meta, node_meta, TWO_FACTOR_KEY):
        return (f"{TWO_FACTOR_KEY} is TRUE on project {clients.project}: every login asks a second factor, which a "
                "job launcher cannot answer")
    if not clients.account:
        return (f"{ENABLE_KEY} is TRUE on project {clients.project} and tpuctl does not know your account email "
                "(the OS Login user)")
    return None


def fix_for(problem: str) -> str:
    if problem.startswith(TWO_FACTOR_KEY):
        return ("set enable-oslogin-2fa=FALSE in the project metadata (`gcloud compute project-info add-metadata "
                "--metadata enable-oslogin-2fa=FALSE`) or use another project")
    return "set TPUCTL_ACCOUNT=you@example.com (or `gcloud config set account`), or use a service account key"


def login_user(clients: Clients, public_key: str) -> str:
    """Make sure `public_key` is in the caller's OS Login profile; returns the POSIX username to log in as.

    Idempotent: imports the key only when the profile lacks it or has no POSIX account yet. Raises BadInput
    (nothing is retried for minutes) when the caller's account is unknown."""
    problem = unusable(clients, {ENABLE_KEY: "TRUE"})
    if problem:
        raise BadInput(problem, field="account", hint=fix_for(problem))
    user = f"users/{clients.account}"
    what = f"read the OS Login profile of {clients.account}"
    profile = waits.call(lambda: clients.oslogin.get_login_profile(
        request={"name": user, "project_id": clients.project}), what=what)
    wanted = " ".join(public_key.split()[:2])
    has_key = any(" ".join(k.key.split()[:2]) == wanted for k in profile.ssh_public_keys.values())
    if not has_key or not profile.posix_accounts:
        profile = waits.call(lambda: clients.oslogin.import_ssh_public_key(
            request={"parent": user, "ssh_public_key": {"key": public_key}, "project_id": clients.project}),
            what=f"import an SSH key into the OS Login profile of {clients.account}").login_profile
    accounts = list(profile.posix_accounts)
    if not accounts:
        raise BadInput(f"the OS Login profile of {clients.account} has no POSIX account", field="account",
                       hint="grant roles/compute.osAdminLogin (or osLogin) on the project and retry")
    return next((a.username for a in accounts if a.primary), accounts[0].username)
