"""What a project is set up with, and the APIs that read it: Service Usage, Compute `projects`, `networks`,
`subnetworks` and `globalOperations`, IAM `serviceAccounts.get`, Resource Manager `testIamPermissions`, the
OS Login API (login profiles and imported SSH keys), and Cloud Quotas `quotaInfos.get` of TPU quota (quotas.py).

A project localcloud was never told about is fully set up: every API enabled, an auto-mode `default` network
with a `default` subnetwork in every region, the default compute service account, every permission held, OS
Login off. Tests shape a project otherwise with `LocalCloud.shape_project` / `POST /_localcloud/projects/ID`,
before its first use, as real projects differ: a new project has Compute Engine disabled and so no default
compute service account and no default network; an organization may skip the default network; OS Login may
be on in project metadata. The create calls of TPU and Compute are refused by `check_tpu_node` /
`check_instance` when they name a network, subnetwork or service account the project lacks.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import re
import time
import uuid
from typing import Callable
from urllib.parse import unquote

from . import facts, quotas
from .core import ApiError, World, now_rfc3339

ROOT = "https://compute.googleapis.com/compute/v1/"
# The services a TPU run uses; a project may have any of them disabled (serviceusage itself cannot be).
SERVICES = {
    "tpu.googleapis.com": "Cloud TPU API",
    "compute.googleapis.com": "Compute Engine API",
    "storage.googleapis.com": "Cloud Storage API",
    "iam.googleapis.com": "Identity and Access Management (IAM) API",
    "oslogin.googleapis.com": "Cloud OS Login API",
    "cloudresourcemanager.googleapis.com": "Cloud Resource Manager API",
    "serviceusage.googleapis.com": "Service Usage API",
    "orgpolicy.googleapis.com": "Organization Policy API",
    "cloudquotas.googleapis.com": "Cloud Quotas API",
}
# localcloud's route services -> the API that must be enabled for them.
_SERVICE_OF_ROUTE = {"tpu": "tpu.googleapis.com", "compute": "compute.googleapis.com",
                     "iam": "iam.googleapis.com", "oslogin": "oslogin.googleapis.com",
                     "orgpolicy": "orgpolicy.googleapis.com", "cloudquotas": "cloudquotas.googleapis.com"}
SHAPE_OPTIONS = ("disabled_services", "default_network", "networks", "subnetworks", "compute_sa",
                 "service_accounts", "metadata", "denied_permissions", "external_ips_denied",
                 "tpu_quotas")
EXTERNAL_IP_CONSTRAINT = "compute.vmExternalIpAccess"
# Public image families a VM may boot from (debian-cloud's as listed in googleapis/google-cloud-go#10484).
PUBLIC_IMAGE_FAMILIES = {"debian-cloud": ("debian-11", "debian-12", "debian-11-arm64", "debian-12-arm64"),
                         # TPU VMs on Compute Engine (practitioners' notes, 2026-08: see README "TPUs as Compute
                         # Engine machine types"): TPU7x's 24.04 family and the v5e/v5p/v6e 22.04 one.
                         "ubuntu-os-accelerator-images": ("ubuntu-accel-2404-amd64-tpu-tpu7x",
                                                          "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e")}


def compute_sa(project: str) -> str:
    return f"{facts.project_number(project)}-compute@developer.gserviceaccount.com"


def _regions() -> list[str]:
    return sorted({facts.region_of(z) for z in facts.all_zones()})


def _fingerprint(items: list) -> str:
    return base64.b64encode(hashlib.sha256(repr(sorted((i["key"], i.get("value", "")) for i in items)).encode())
                            .digest()[:8]).decode()


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


# Go's strconv.ParseBool, which Google's guest agent parses `enable-oslogin` (and its other flags) with.
_GO_BOOL = {**dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
            **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False)}


def guest_flag(key: str, project_meta: dict, instance_meta: dict | None) -> bool:
    """A guest agent flag (`enable-oslogin`, `enable-guest-attributes`, ...) as Google's guest agent reads it
    (metadata.go, getOSLoginEnabled): the instance's value, else the project's, parsed by Go's
    strconv.ParseBool ("1", "t", "TRUE", "true", ...); a value it cannot parse counts as unset, so the
    project's value decides."""
    for meta in (instance_meta or {}, project_meta):
        value = _GO_BOOL.get(str(meta.get(key)))
        if value is not None:
            return value
    return False


def oslogin_enabled(project_meta: dict, instance_meta: dict | None) -> bool:
    """Whether the guest uses OS Login (only then, its OS Login keys; else its ssh-keys metadata)."""
    return guest_flag("enable-oslogin", project_meta, instance_meta)


def posix_username(email: str) -> str:
    """The POSIX name OS Login gives an account that has none: for a user the whole email with every
    character other than a letter, digit, `_` or `-` made `_`, cut to 32 characters; for a service account
    `sa_` and its numeric unique id."""
    if email.endswith(".gserviceaccount.com"):
        return "sa_" + str(int(hashlib.sha256(email.encode()).hexdigest(), 16) % 10**21)
    return re.sub(r"[^a-z0-9_-]", "_", email.lower())[:32]


def _public_image(url: str) -> bool:
    m = re.search(r"projects/([^/]+)/global/images/(family/)?([^/]+)$", url)
    if not m:
        return False
    families = PUBLIC_IMAGE_FAMILIES.get(m.group(1), ())
    # A named image is one of a family's (debian-12-bookworm-v20240701 belongs to debian-12).
    return m.group(3) in families if m.group(2) else any(m.group(3).startswith(f + "-") for f in families)


class ProjectsService:
    name = "projects"

    def __init__(self, world: World, on_keys_changed: Callable[[str | None], None]):
        self.w = world
        self.shapes: dict[str, dict] = {}     # project id -> shape (see SHAPE_OPTIONS); absent = fully set up
        self.metadata: dict[str, dict] = {}   # project id -> commonInstanceMetadata {"items", "fingerprint"}
        self.users: dict[str, dict] = {}      # email -> {"keys": {fingerprint: SshPublicKey}, "username"}
        self.ops: dict[str, dict] = {}        # "projects/P/global/operations/NAME" -> compute#operation
        self.policies: dict[str, dict] = {}   # "projects/P" or "projects/P/serviceAccounts/EMAIL" -> IAM Policy
        self._on_keys_changed = on_keys_changed  # (project or None for all) -> refresh the workers' keys

    # ---------------------------------------------------------------------------------- persistence
    def dump(self) -> dict:
        return {"shapes": self.shapes, "metadata": self.metadata, "users": self.users, "ops": self.ops,
                "policies": self.policies}

    def load(self, data: dict) -> None:
        self.shapes = data.get("shapes", {})
        self.metadata = data.get("metadata", {})
        self.users = data.get("users", {})
        self.ops = data.get("ops", {})
        self.policies = data.get("policies", {})

    # ---------------------------------------------------------------------------------- shaping
    def shape(self, project: str, **options) -> dict:
        """Set how `project` is set up (see SHAPE_OPTIONS); ValueError on an unknown option or service."""
        unknown = set(options) - set(SHAPE_OPTIONS)
        if unknown:
            raise ValueError(f"unknown project option(s) {', '.join(sorted(unknown))}; known: {', '.join(SHAPE_OPTIONS)}")
        bad = set(options.get("disabled_services") or ()) - (set(SERVICES) - {"serviceusage.googleapis.com"})
        if bad:
            raise ValueError(f"cannot disable {', '.join(sorted(bad))}; known: {', '.join(sorted(SERVICES))}")
        shape = {"disabled_services": sorted(options.get("disabled_services") or ()),
                 "default_network": bool(options.get("default_network", True)),
                 "networks": sorted(options.get("networks") or ()),
                 "subnetworks": sorted(options.get("subnetworks") or ()),   # "REGION/NAME/NETWORK"
                 "compute_sa": bool(options.get("compute_sa", True)),
                 "service_accounts": None if options.get("service_accounts") is None else sorted(options["service_accounts"]),
                 "denied_permissions": sorted(options.get("denied_permissions") or ()),
                 "external_ips_denied": bool(options.get("external_ips_denied", False)),
                 # quota id -> limit in every zone, or {zone: limit}; absent = generous (quotas.py)
                 "tpu_quotas": dict(options.get("tpu_quotas") or {})}
        with self.w.lock:
            self.shapes[project] = shape
            if options.get("metadata") is not None:
                items = [{"key": k, "value": str(v)} for k, v in sorted(options["metadata"].items())]
                self.metadata[project] = {"items": items, "fingerprint": _fingerprint(items)}
            self.w.changed()
        self._on_keys_changed(project)
        return self.describe(project)

    def describe(self, project: str) -> dict:
        with self.w.lock:
            return {"project": project, **self._shape(project), "metadata": self.project_metadata(project)}

    def _shape(self, project: str) -> dict:
        return self.shapes.get(project) or {"disabled_services": [], "default_network": True, "networks": [],
                                            "subnetworks": [], "compute_sa": True, "service_accounts": None,
                                            "denied_permissions": [], "external_ips_denied": False, "tpu_quotas": {}}

    def enabled(self, project: str, service: str) -> bool:
        return service not in self._shape(project)["disabled_services"]

    def project_metadata(self, project: str) -> dict:
        """Project-wide metadata as a plain dict."""
        items = (self.metadata.get(project) or {}).get("items") or []
        return {i["key"]: i.get("value", "") for i in items}

    def _networks(self, project: str) -> dict[str, dict]:
        """name -> {"auto": bool, "subnets": {region: [names]}}."""
        shape = self._shape(project)
        out: dict[str, dict] = {}
        if shape["default_network"]:
            out["default"] = {"auto": True, "subnets": {r: ["default"] for r in _regions()}}
        for name in shape["networks"]:
            out.setdefault(name, {"auto": False, "subnets": {}})
        for spec in shape["subnetworks"]:
            region, name, network = spec.split("/")
            out.setdefault(network, {"auto": False, "subnets": {}})["subnets"].setdefault(region, []).append(name)
        return out

    def sa_exists(self, project: str, email: str) -> bool:
        shape = self._shape(project)
        if email == compute_sa(project):
            return shape["compute_sa"] and self.enabled(project, "compute.googleapis.com")
        return shape["service_accounts"] is None or email in shape["service_accounts"]

    # ---------------------------------------------------------------------------------- guards
    def guard(self, service: str, params: dict, query: dict) -> None:
        """403 SERVICE_DISABLED for a call to an API the project has not enabled, in Google's shape. The project
        is in the path, or for OS Login's `users/...` calls in their `projectId` parameter."""
        api = _SERVICE_OF_ROUTE.get(service)
        project = params.get("projectsId") or params.get("project") or query.get("projectId")
        if api is None or project is None:
            return
        with self.w.lock:
            if self.enabled(project, api):
                return
        number = facts.project_number(project)
        url = f"https://console.developers.google.com/apis/api/{api}/overview?project={number}"
        message = (f"{SERVICES[api]} has not been used in project {number} before or it is disabled. Enable it by "
                   f"visiting {url} then retry. If you enabled this API recently, wait a few minutes for the action "
                   "to propagate to our systems and retry.")
        # The details of Google's answer as public bodies quote it (gemini-cli#1343, devrel-demos#1382): ErrorInfo
        # with serviceTitle and containerInfo beside service/consumer/activationUrl, and a Help link, which
        # Google's firebase-js-sdk requires, with the reason, to tell a disabled API.
        raise ApiError("PERMISSION_DENIED", message, reason="accessNotConfigured", details=[
            {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "SERVICE_DISABLED",
             "domain": "googleapis.com", "metadata": {"service": api, "consumer": f"projects/{number}",
                                                      "activationUrl": url, "serviceTitle": SERVICES[api],
                                                      "containerInfo": number}},
            {"@type": "type.googleapis.com/google.rpc.Help",
             "links": [{"description": "Google developers console API activation", "url": url}]}])

    def _check_network(self, project: str, region: str, network: str | None, subnetwork: str | None,
                       field: str) -> None:
        nets = self._networks(project)
        net_name = _last(network) if network else "default"
        if net_name not in nets:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}.network': "
                           f"'projects/{project}/global/networks/{net_name}'. The referenced network resource cannot be found.")
        subnets = nets[net_name]["subnets"].get(region, [])
        if subnetwork:
            if _last(subnetwork) not in subnets:
                raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}.subnetwork': "
                               f"'projects/{project}/regions/{region}/subnetworks/{_last(subnetwork)}'. The referenced "
                               "subnetwork resource cannot be found.")
        elif not subnets:
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}.network': network '{net_name}' has no "
                           f"subnetwork in region {region}; name one.")

    def _check_sa(self, project: str, email: str | None, field: str) -> None:
        email = email or compute_sa(project)
        if not self.sa_exists(project, email):
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}': Service account \"{email}\" does not exist.")

    def _external_ip_error(self, project: str, zone: str, name: str, **kw) -> ApiError:
        return ApiError("FAILED_PRECONDITION", f"Constraint constraints/{EXTERNAL_IP_CONSTRAINT} violated for project "
                        f"{facts.project_number(project)}. Add instance projects/{project}/zones/{zone}/instances/{name} "
                        "to the constraint to use external IP with it.", **kw)

    def check_tpu_node(self, project: str, zone: str, node: dict, node_id: str) -> None:
        """A TPU create naming a network, subnetwork or service account the project lacks, or asking for
        external IPs where the organization policy denies them: 400."""
        net = node.get("networkConfig") or {}
        with self.w.lock:
            self._check_network(project, facts.region_of(zone), net.get("network"), net.get("subnetwork"),
                                "node.networkConfig")
            self._check_sa(project, (node.get("serviceAccount") or {}).get("email"), "node.serviceAccount.email")
            if net.get("enableExternalIps") and self._shape(project)["external_ips_denied"]:
                raise self._external_ip_error(project, zone, node_id)

    def check_tpu_quota(self, project: str, zone: str, node: dict, in_use: list[tuple[str, bool]]) -> None:
        """A TPU create past the project's TPU quota in `zone` (`in_use`: the accelerator type and spot-ness of
        every node the project has there): 429 naming the quota."""
        sched = node.get("schedulingConfig") or {}
        spot = bool(sched.get("spot") or sched.get("preemptible"))
        quota = quotas.quota_id(node.get("acceleratorType") or "", spot)
        if quota is None:
            return
        with self.w.lock:
            cap = quotas.limit(self._shape(project), quota, zone)
        used = sum(quotas.units(t) for t, s in in_use if quotas.quota_id(t, s) == quota)
        if used + quotas.units(node["acceleratorType"]) > cap:
            raise quotas.exceeded(quota, zone, cap, project=project)

    def check_compute_tpu_quota(self, project: str, zone: str, tpu: facts.TpuMachineType, model: str,
                                in_use: dict[str, int]) -> str | None:
        """A TPU VM insert past Compute Engine's TPU quota in the zone's region (`in_use`: chips the project's
        TPU VMs there hold, by the quota each drew on): 403 quotaExceeded naming the last quota tried. Returns
        the quota the VM draws on (flex-start: the preemptible one, else the standard one)."""
        region = facts.region_of(zone)
        tried = quotas.compute_quotas(tpu.generation, model)
        with self.w.lock:
            caps = [quotas.limit(self._shape(project), quota, region) for quota in tried]
        for quota, cap in zip(tried, caps):
            if in_use.get(quota, 0) + tpu.chips <= cap:
                return quota
        if tried:
            raise quotas.compute_exceeded(tried[-1], region, caps[-1])
        return None

    def quota_info_get(self, p: dict, q: dict, body: None) -> dict:
        """Cloud Quotas `quotaInfos.get` of a Cloud TPU API or a Compute Engine TPU quota, from the project's shape."""
        served = (quotas.SERVICE, quotas.COMPUTE_SERVICE)
        if p["servicesId"] not in served or p["locationsId"] != "global":
            raise ApiError("NOT_FOUND", f"QuotaInfo {p['quotaInfosId']} of service {p['servicesId']} in "
                           f"{p['locationsId']} was not found (localcloud serves {' and '.join(served)} in global).")
        with self.w.lock:
            return quotas.quota_info(p["projectsId"], p["quotaInfosId"], self._shape(p["projectsId"]),
                                     p["servicesId"])

    def check_instance(self, project: str, zone: str, body: dict) -> None:
        """A VM insert naming a network, subnetwork, image or service account the project lacks (400, an
        image 404), or an external IP the organization policy denies (412 conditionNotMet)."""
        with self.w.lock:
            for i, nic in enumerate(body.get("networkInterfaces") or [{}]):
                self._check_network(project, facts.region_of(zone), nic.get("network"), nic.get("subnetwork"),
                                    f"resource.networkInterfaces[{i}]")
                if nic.get("accessConfigs") and self._shape(project)["external_ips_denied"]:
                    raise self._external_ip_error(project, zone, body.get("name", ""), http=412, reason="conditionNotMet")
            for i, sa in enumerate(body.get("serviceAccounts") or []):
                self._check_sa(project, sa.get("email"), f"resource.serviceAccounts[{i}].email")
        for disk in body.get("disks") or []:
            image = (disk.get("initializeParams") or {}).get("sourceImage")
            if image and not _public_image(image):
                raise ApiError("NOT_FOUND", f"The resource '{image.split('compute/v1/')[-1]}' was not found")

    # ---------------------------------------------------------------------------------- org policy
    def effective_policy(self, p: dict, q: dict, body: None) -> dict:
        """`compute.vmExternalIpAccess` as the project's shape sets it: deny all, or allow all (the
        constraint's default); every other constraint is served unset."""
        project, constraint = p["projectsId"], p["policiesId"]
        name = f"projects/{facts.project_number(project)}/policies/{constraint}"
        if constraint != EXTERNAL_IP_CONSTRAINT:
            return {"name": name}
        with self.w.lock:
            denied = self._shape(project)["external_ips_denied"]
        return {"name": name, "spec": {"rules": [{"denyAll": True} if denied else {"allowAll": True}]}}

    # ---------------------------------------------------------------------------------- service usage
    def _service_view(self, project: str, service: str) -> dict:
        number = facts.project_number(project)
        return {"name": f"projects/{number}/services/{service}", "parent": f"projects/{number}",
                "state": "ENABLED" if self.enabled(project, service) else "DISABLED",
                "config": {"name": service, "title": SERVICES.get(service, service)}}

    def services_get(self, p: dict, q: dict, body: None) -> dict:
        if p["v1Id"] != "projects":
            raise ApiError("INVALID_ARGUMENT", "localcloud serves services of projects only.")
        with self.w.lock:
            return self._service_view(p["v1Id1"], p["servicesId"])

    def services_batch_get(self, p: dict, q: dict, body: None) -> dict:
        names = q.get("names") or []
        names = names if isinstance(names, list) else [names]
        if not names or len(names) > 30:
            raise ApiError("INVALID_ARGUMENT", "names: give between 1 and 30 services.")
        with self.w.lock:
            return {"services": [self._service_view(p["v1Id1"], _last(n)) for n in names]}

    # ---------------------------------------------------------------------------------- compute
    def projects_get(self, p: dict, q: dict, body: None) -> dict:
        project = p["project"]
        with self.w.lock:
            meta = copy.deepcopy(self.metadata.get(project) or {"fingerprint": _fingerprint([])})
        return {"kind": "compute#project", "id": facts.project_number(project), "name": project,
                "creationTimestamp": "2024-01-01T00:00:00.000-08:00",
                "commonInstanceMetadata": {"kind": "compute#metadata", **meta},
                "defaultServiceAccount": compute_sa(project), "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
                "defaultNetworkTier": "PREMIUM", "selfLink": f"{ROOT}projects/{project}"}

    def set_common_instance_metadata(self, p: dict, q: dict, body: dict) -> dict:
        """Replaces the project's metadata; the fingerprint must match (412 otherwise). Done at once."""
        project = p["project"]
        with self.w.lock:
            current = (self.metadata.get(project) or {}).get("fingerprint") or _fingerprint([])
            if body.get("fingerprint") != current:
                raise ApiError("FAILED_PRECONDITION", "Supplied fingerprint does not match current metadata fingerprint.",
                               http=412, reason="conditionNotMet")
            items = [{"key": i["key"], "value": i.get("value", "")} for i in body.get("items") or []]
            self.metadata[project] = {"items": items, "fingerprint": _fingerprint(items)}
            op = self._global_op(project, "setMetadata", f"projects/{project}")
            self.w.changed()
        self._on_keys_changed(project)
        return copy.deepcopy(op)

    def _global_op(self, project: str, op_type: str, target: str) -> dict:
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:13]}"
        url = f"{ROOT}projects/{project}/global/operations/{name}"
        op = {"kind": "compute#operation", "id": str(self.w.next_id()), "name": name, "operationType": op_type,
              "targetLink": f"{ROOT}{target}", "targetId": facts.project_number(project), "status": "DONE",
              "user": "localcloud@example.com", "progress": 100, "insertTime": now_rfc3339(),
              "startTime": now_rfc3339(), "endTime": now_rfc3339(), "selfLink": url}
        self.ops[f"projects/{project}/global/operations/{name}"] = op
        return op

    def global_operations_get(self, p: dict, q: dict, body: None) -> dict:
        key = f"projects/{p['project']}/global/operations/{p['operation']}"
        with self.w.lock:
            if key not in self.ops:
                raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
            return copy.deepcopy(self.ops[key])

    global_operations_wait = global_operations_get  # every global operation here is DONE when returned

    def networks_get(self, p: dict, q: dict, body: None) -> dict:
        project, name = p["project"], p["network"]
        with self.w.lock:
            net = self._networks(project).get(name)
        if net is None:
            raise ApiError("NOT_FOUND", f"The resource 'projects/{project}/global/networks/{name}' was not found")
        return {"kind": "compute#network", "id": str(abs(hash((project, name))) % 10**15), "name": name,
                "autoCreateSubnetworks": net["auto"], "creationTimestamp": "2024-01-01T00:00:00.000-08:00",
                "subnetworks": [f"{ROOT}projects/{project}/regions/{r}/subnetworks/{s}"
                                for r, names in sorted(net["subnets"].items()) for s in names],
                "routingConfig": {"routingMode": "REGIONAL"}, "networkFirewallPolicyEnforcementOrder": "AFTER_CLASSIC_FIREWALL",
                "selfLink": f"{ROOT}projects/{project}/global/networks/{name}"}

    def subnetworks_get(self, p: dict, q: dict, body: None) -> dict:
        project, region, name = p["project"], p["region"], p["subnetwork"]
        with self.w.lock:
            hit = next((n for n, net in self._networks(project).items() if name in net["subnets"].get(region, [])), None)
        key = f"projects/{project}/regions/{region}/subnetworks/{name}"
        if hit is None:
            raise ApiError("NOT_FOUND", f"The resource '{key}' was not found")
        return {"kind": "compute#subnetwork", "id": str(abs(hash(key)) % 10**15), "name": name,
                "network": f"{ROOT}projects/{project}/global/networks/{hit}", "ipCidrRange": "10.128.0.0/20",
                "gatewayAddress": "10.128.0.1", "region": f"{ROOT}projects/{project}/regions/{region}",
                "privateIpGoogleAccess": False, "stackType": "IPV4_ONLY", "purpose": "PRIVATE",
                "creationTimestamp": "2024-01-01T00:00:00.000-08:00", "selfLink": f"{ROOT}{key}"}

    # ---------------------------------------------------------------------------------- iam, resource manager
    def service_accounts_get(self, p: dict, q: dict, body: None) -> dict:
        """`projects/-` (any project) finds the account's project from its email, as IAM does."""
        email = unquote(p["serviceAccountsId"])
        with self.w.lock:
            project = p["projectsId"] if p["projectsId"] != "-" else self._owner(email)
            exists = project is None or self.sa_exists(project, email)
        if not exists:
            raise ApiError("NOT_FOUND", f"Unknown service account {email}.")
        uid = str(int(hashlib.sha256(email.encode()).hexdigest(), 16) % 10**21)
        owner = project or email.split("@", 1)[1].split(".", 1)[0]
        return {"name": f"projects/{owner}/serviceAccounts/{email}", "projectId": owner, "uniqueId": uid,
                "email": email, "displayName": email.split("@")[0], "oauth2ClientId": uid,
                "etag": base64.b64encode(uid.encode()[:8]).decode()}

    def _account(self, p: dict) -> dict:
        """The ServiceAccount resource (iam.v1 `ServiceAccount`) of `projects/P/serviceAccounts/EMAIL`."""
        return self.service_accounts_get({"projectsId": p["projectsId"], "serviceAccountsId": p["serviceAccountsId"]},
                                         {}, None)

    def _require(self, project: str, permission: str, resource: str) -> None:
        """403 as Google words a missing permission, for one the project's shape denies the caller."""
        with self.w.lock:
            denied = permission in self._shape(project)["denied_permissions"]
        if denied:
            raise ApiError("PERMISSION_DENIED", f"Permission '{permission}' denied on resource '{resource}' (or it "
                           "may not exist).")

    def service_accounts_create(self, p: dict, q: dict, body: dict) -> dict:
        """iam.v1 `projects.serviceAccounts.create`: `accountId` 6-30 characters of `[a-z]([-a-z0-9]*[a-z0-9])`
        (CreateServiceAccountRequest), the email ACCOUNT_ID@PROJECT.iam.gserviceaccount.com; 409 when it exists
        (a project localcloud was not told about has every account already)."""
        project = p["projectsId"]
        account = (body or {}).get("accountId") or ""
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])", account) or not 6 <= len(account) <= 30:
            raise ApiError("INVALID_ARGUMENT", f"Invalid accountId {account!r}: it must be 6-30 characters long and "
                           "match [a-z]([-a-z0-9]*[a-z0-9]).")
        self._require(project, "iam.serviceAccounts.create", f"projects/{project}")
        email = f"{account}@{project}.iam.gserviceaccount.com"
        with self.w.lock:
            if self.sa_exists(project, email):
                raise ApiError("ALREADY_EXISTS", f"Service account {account} already exists within project "
                               f"projects/{project}.")
            shape = self.shapes.setdefault(project, self._shape(project))
            shape["service_accounts"] = sorted({*shape["service_accounts"], email})
            self.w.changed()
        made = self._account({"projectsId": project, "serviceAccountsId": email})
        given = (body or {}).get("serviceAccount") or {}
        return {**made, **{k: given[k] for k in ("displayName", "description") if k in given}}

    def _policy(self, resource: str) -> dict:
        return copy.deepcopy(self.policies.get(resource) or {"version": 1, "etag": "ACAB", "bindings": []})

    def _set_policy(self, resource: str, project: str, permission: str, body: dict) -> dict:
        """setIamPolicy (SetIamPolicyRequest): the whole policy replaces the old; an `etag` that is not the
        current one is 409 ABORTED (the read-modify-write raced another), none overwrites; a new etag each write."""
        self._require(project, permission, resource)
        policy = dict((body or {}).get("policy") or {})
        with self.w.lock:
            current = self._policy(resource)
            if policy.get("etag") and policy["etag"] != current["etag"]:
                raise ApiError("ABORTED", "There were concurrent policy changes. Please retry the whole "
                               "read-modify-write with exponential backoff.")
            etag = base64.b64encode(hashlib.sha256(f"{resource}{time.time_ns()}".encode()).digest()[:8]).decode()
            self.policies[resource] = {"version": int(policy.get("version") or 1), "etag": etag,
                                       "bindings": [b for b in policy.get("bindings") or [] if b.get("members")]}
            self.w.changed()
            return self._policy(resource)

    def project_get_iam_policy(self, p: dict, q: dict, body: dict) -> dict:
        """cloudresourcemanager.v3 `projects.getIamPolicy`."""
        resource = f"projects/{p['projectsId']}"
        self._require(p["projectsId"], "resourcemanager.projects.getIamPolicy", resource)
        with self.w.lock:
            return self._policy(resource)

    def project_set_iam_policy(self, p: dict, q: dict, body: dict) -> dict:
        """cloudresourcemanager.v3 `projects.setIamPolicy`."""
        return self._set_policy(f"projects/{p['projectsId']}", p["projectsId"],
                                "resourcemanager.projects.setIamPolicy", body)

    def service_account_get_iam_policy(self, p: dict, q: dict, body: None) -> dict:
        """iam.v1 `projects.serviceAccounts.getIamPolicy` (who may act as the account); 404 for an unknown one."""
        account = self._account(p)
        with self.w.lock:
            return self._policy(account["name"])

    def service_account_set_iam_policy(self, p: dict, q: dict, body: dict) -> dict:
        """iam.v1 `projects.serviceAccounts.setIamPolicy`."""
        account = self._account(p)
        return self._set_policy(account["name"], account["projectId"], "iam.serviceAccounts.setIamPolicy", body)

    def _owner(self, email: str) -> str | None:
        """The shaped project an account email belongs to; None when it is no project localcloud was told about."""
        m = re.match(r"^(\d+)-compute@developer\.gserviceaccount\.com$", email)
        if m:
            return next((p for p in self.shapes if facts.project_number(p) == m.group(1)), None)
        m = re.match(r"^[^@]+@([a-z][-a-z0-9]+)\.iam\.gserviceaccount\.com$", email)
        return m.group(1) if m and m.group(1) in self.shapes else None

    def test_iam_permissions(self, p: dict, q: dict, body: dict) -> dict:
        """The caller holds every permission asked except the project's `denied_permissions`. A wildcard is
        400: "Permissions with wildcards (such as '*' or 'storage.*') are not allowed" (iam_policy.proto)."""
        wild = [perm for perm in (body or {}).get("permissions") or [] if "*" in perm]
        if wild:
            raise ApiError("INVALID_ARGUMENT", f"Permissions with wildcards are not allowed: {', '.join(wild)}.")
        with self.w.lock:
            denied = set(self._shape(p["projectsId"])["denied_permissions"])
        held = [perm for perm in (body or {}).get("permissions") or [] if perm not in denied]
        return {"permissions": held} if held else {}

    # ---------------------------------------------------------------------------------- os login
    def _profile(self, email: str, project: str | None) -> dict:
        user = self.users.get(email) or {"keys": {}, "username": posix_username(email)}
        profile: dict = {"name": email}
        if self.users.get(email):
            profile["posixAccounts"] = [{
                "primary": True, "username": user["username"], "uid": str(1000 + int(hashlib.sha256(email.encode()).hexdigest(), 16) % 10**9),
                "gid": str(1000 + int(hashlib.sha256(email.encode()).hexdigest(), 16) % 10**9),
                "homeDirectory": f"/home/{user['username']}", "shell": "/bin/bash", "gecos": "", "systemId": "",
                "accountId": project or "", "operatingSystemType": "LINUX",
                "name": f"users/{email}/projects/{project}" if project else f"users/{email}"}]
        if user["keys"]:
            profile["sshPublicKeys"] = copy.deepcopy(user["keys"])
        return profile

    def get_login_profile(self, p: dict, q: dict, body: None) -> dict:
        email = unquote(p["usersId"])
        with self.w.lock:
            return self._profile(email, q.get("projectId"))

    def import_ssh_public_key(self, p: dict, q: dict, body: dict) -> dict:
        """Adds the key to the user's profile (idempotent) and gives the account its POSIX user on first use."""
        email = unquote(p["usersId"])
        key = (body or {}).get("key", "").strip()
        parts = key.split()
        try:
            blob = base64.b64decode(parts[1], validate=True) if len(parts) >= 2 else b""
        except ValueError:
            blob = b""
        if not blob:
            raise ApiError("INVALID_ARGUMENT", "Invalid SSH key: expected 'TYPE BASE64 [COMMENT]'.")
        fingerprint = hashlib.sha256(blob).hexdigest()
        with self.w.lock:
            user = self.users.setdefault(email, {"keys": {}, "username": posix_username(email)})
            entry = {"key": key, "fingerprint": fingerprint, "name": f"users/{email}/sshPublicKeys/{fingerprint}"}
            if body.get("expirationTimeUsec"):
                entry["expirationTimeUsec"] = str(body["expirationTimeUsec"])
            user["keys"][fingerprint] = entry
            profile = self._profile(email, q.get("projectId"))
            self.w.changed()
        self._on_keys_changed(None)
        return {"loginProfile": profile}

    def oslogin_keys(self) -> list[str]:
        """`USER:KEY` lines for every key imported through OS Login, as an OS Login guest admits them."""
        now_us = time.time() * 1e6
        return [f"{u['username']}:{k['key']}" for u in self.users.values() for k in u["keys"].values()
                if not k.get("expirationTimeUsec") or float(k["expirationTimeUsec"]) > now_us]

    def authorized_keys(self, project: str, instance_meta: dict | None, metadata_keys: list[str]) -> list[str]:
        """What a worker of `project` admits: with OS Login on (instance metadata, else project metadata)
        the OS Login keys only, and `ssh-keys` metadata is ignored, as the guest environment does."""
        with self.w.lock:
            if oslogin_enabled(self.project_metadata(project), instance_meta):
                return self.oslogin_keys()
        return metadata_keys
