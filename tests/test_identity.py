"""Projects as real ones are set up: OS Login, disabled APIs, missing networks and service accounts, permissions.

The first half talks to the strict local cloud with Google's own clients (what Google would answer); the
second half runs tpuctl's preflight, `up` and SSH login against such projects: it must stop before creating
anything, naming the fix, or log in the way an OS Login guest admits.
"""

from __future__ import annotations

import asyncio
import json
import time

import asyncssh
import pytest
from conftest import FAST_POLLING, new_project, tpuctl, tpuctl_here
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, oslogin_v1, resourcemanager_v3, service_usage_v1, tpu_v2

from tpuctl import provision as prov
from tpuctl import spec
from tpuctl.errors import BadInput
from tpuctl.jobs import cluster
from tpuctl.provision import preflight
from tpuctl.provision.clients import build

ZONE, REGION = "europe-west4-a", "europe-west4"
TF = "tpu-vm-tf-2.16.1-pjrt"
ACCOUNT = "ann.lee@example.com"


@pytest.fixture
def kw(cloud):
    return {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=cloud.endpoint)}


def tpu_client(kw):
    return tpu_v2.TpuClient(transport="rest", **kw)


def create_node(kw, project: str, node_id: str, metadata: dict | None = None) -> tpu_v2.Node:
    return tpu_client(kw).create_node(parent=f"projects/{project}/locations/{ZONE}", node_id=node_id, node=tpu_v2.Node(
        accelerator_type="v3-8", runtime_version=TF, metadata=metadata or {})).result(polling=FAST_POLLING)


def can_login(port: int, user: str, key: asyncssh.SSHKey) -> bool:
    async def attempt() -> bool:
        try:
            conn = await asyncio.wait_for(asyncssh.connect("127.0.0.1", port, username=user, client_keys=[key],
                                                           known_hosts=None, agent_path=None, config=None), 10)
        except asyncssh.PermissionDenied:
            return False
        conn.close()
        return True

    return asyncio.run(attempt())


def public(key: asyncssh.SSHKey) -> str:
    return key.export_public_key().decode().strip()


# ---------------------------------------------------------------------------------------------- local cloud

def test_oslogin_project_ignores_ssh_keys_metadata_and_admits_imported_keys(cloud, kw):
    project = new_project()
    cloud.shape_project(project, metadata={"enable-oslogin": "TRUE"})
    key = asyncssh.generate_private_key("ssh-ed25519")
    node = create_node(kw, project, "osl", {"ssh-keys": f"alice:{public(key)} alice"})
    port = node.network_endpoints[0].port
    assert not can_login(port, "alice", key)  # metadata keys are ignored on an OS Login guest

    oslogin = oslogin_v1.OsLoginServiceClient(transport="rest", **kw)
    # The account's profile is the session cloud's, across projects: keys other tests imported stay in it.
    before = [k.key for k in oslogin.get_login_profile(request={"name": f"users/{ACCOUNT}", "project_id": project})
              .ssh_public_keys.values()]
    profile = oslogin.import_ssh_public_key(request={"parent": f"users/{ACCOUNT}", "ssh_public_key": {"key": public(key)},
                                                     "project_id": project}).login_profile
    user = profile.posix_accounts[0].username
    assert user == "ann_lee_example_com" and profile.posix_accounts[0].primary
    assert sorted(k.key for k in profile.ssh_public_keys.values()) == sorted([*before, public(key)])
    assert can_login(port, user, key) and not can_login(port, "alice", key)
    again = oslogin.get_login_profile(request={"name": f"users/{ACCOUNT}", "project_id": project})
    assert again.posix_accounts[0].username == user and len(again.ssh_public_keys) == len(before) + 1


def test_an_ssh_keys_line_admits_its_user_only(cloud, kw):
    """Google's guest agent writes each `USER:KEY` line into that user's authorized_keys alone, and refuses a
    line without a user ("Expecting user:ssh-key")."""
    key, other = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-ed25519")
    node = create_node(kw, new_project(), "own", {"ssh-keys": f"alice:{public(key)} alice\n{public(other)}"})
    port = node.network_endpoints[0].port
    assert can_login(port, "alice", key)
    assert not can_login(port, "bob", key) and not can_login(port, "root", key)
    assert not can_login(port, "alice", other) and not can_login(port, "bob", other)


def test_instance_metadata_overrides_the_project_and_project_metadata_changes_apply_to_running_workers(cloud, kw):
    project = new_project()
    key = asyncssh.generate_private_key("ssh-ed25519")
    keys = f"alice:{public(key)} alice"
    off_here = create_node(kw, project, "off", {"ssh-keys": keys, "enable-oslogin": "FALSE"})
    plain = create_node(kw, project, "plain", {"ssh-keys": keys})
    assert can_login(plain.network_endpoints[0].port, "alice", key)

    projects = compute_v1.ProjectsClient(**kw)
    fingerprint = projects.get(project=project).common_instance_metadata.fingerprint
    with pytest.raises(gexc.PreconditionFailed):  # 412, like setMetadata: a stale fingerprint loses
        projects.set_common_instance_metadata(project=project, metadata_resource=compute_v1.Metadata(
            fingerprint="stale", items=[compute_v1.Items(key="enable-oslogin", value="TRUE")]))
    projects.set_common_instance_metadata(project=project, metadata_resource=compute_v1.Metadata(
        fingerprint=fingerprint, items=[compute_v1.Items(key="enable-oslogin", value="TRUE")])).result(timeout=30)
    assert [(i.key, i.value) for i in projects.get(project=project).common_instance_metadata.items] == [
        ("enable-oslogin", "TRUE")]
    assert not can_login(plain.network_endpoints[0].port, "alice", key)
    assert can_login(off_here.network_endpoints[0].port, "alice", key)


def test_a_disabled_api_answers_403_service_disabled_with_error_info(cloud, kw):
    project = new_project()
    cloud.shape_project(project, disabled_services=["tpu.googleapis.com"])
    with pytest.raises(gexc.Forbidden) as exc:
        tpu_client(kw).list_nodes(parent=f"projects/{project}/locations/{ZONE}")
    assert exc.value.reason == "SERVICE_DISABLED" and exc.value.metadata["service"] == "tpu.googleapis.com"
    assert "has not been used in project" in exc.value.message
    assert exc.value.metadata["serviceTitle"] == "Cloud TPU API"
    [help_detail] = [d for d in exc.value.details if "links" in str(d)]  # what Google's own clients look for
    assert "Google developers console API activation" in str(help_detail)
    usage = service_usage_v1.ServiceUsageClient(transport="rest", **kw)
    got = usage.batch_get_services(request={"parent": f"projects/{project}", "names": [
        f"projects/{project}/services/{s}" for s in ("tpu.googleapis.com", "compute.googleapis.com")]})
    assert [(s.config.name, s.state.name) for s in got.services] == [
        ("tpu.googleapis.com", "DISABLED"), ("compute.googleapis.com", "ENABLED")]



def test_a_disabled_os_login_api_refuses_calls_naming_the_project_in_their_query(cloud, kw):
    """OS Login paths name a user, not a project: the project a call is for is its `projectId` parameter."""
    project = new_project()
    cloud.shape_project(project, disabled_services=["oslogin.googleapis.com"])
    oslogin = oslogin_v1.OsLoginServiceClient(transport="rest", **kw)
    with pytest.raises(gexc.Forbidden) as exc:
        oslogin.get_login_profile(request={"name": f"users/{ACCOUNT}", "project_id": project})
    assert exc.value.reason == "SERVICE_DISABLED" and exc.value.metadata["service"] == "oslogin.googleapis.com"
    assert oslogin.get_login_profile(request={"name": f"users/{ACCOUNT}", "project_id": new_project()}).name


def test_creates_naming_a_missing_network_subnetwork_or_service_account_are_refused(cloud, kw):
    project = new_project()
    cloud.shape_project(project, default_network=False, networks=["vpc"], subnetworks=[f"{REGION}/sub/vpc"],
                        compute_sa=False)
    tpu = tpu_client(kw)
    parent = f"projects/{project}/locations/{ZONE}"

    def create(network: str, subnet: str | None = None, sa: str = ""):
        return tpu.create_node(parent=parent, node_id="n", node=tpu_v2.Node(
            accelerator_type="v3-8", runtime_version=TF, network_config=tpu_v2.NetworkConfig(
                network=network, subnetwork=subnet or ""), service_account=tpu_v2.ServiceAccount(email=sa)))

    with pytest.raises(gexc.BadRequest, match="network resource cannot be found"):
        create("default", sa="x@other.iam.gserviceaccount.com")
    with pytest.raises(gexc.BadRequest, match="subnetwork resource cannot be found"):
        create("vpc", "nope", sa="x@other.iam.gserviceaccount.com")
    with pytest.raises(gexc.BadRequest, match="does not exist"):  # the default compute SA: Compute never enabled
        create("vpc", "sub")
    create("vpc", "sub", sa="x@other.iam.gserviceaccount.com").result(polling=FAST_POLLING)

    instances = compute_v1.InstancesClient(**kw)
    with pytest.raises(gexc.BadRequest, match="network resource cannot be found"):
        instances.insert(project=project, zone=ZONE, instance_resource=compute_v1.Instance(
            name="vm", machine_type=f"zones/{ZONE}/machineTypes/e2-small",
            disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True)],
            network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")]))
    with pytest.raises(gexc.NotFound):
        compute_v1.NetworksClient(**kw).get(project=project, network="default")
    assert compute_v1.SubnetworksClient(**kw).get(project=project, region=REGION, subnetwork="sub").network.endswith("/vpc")


def test_external_ips_denied_by_org_policy_and_unknown_images_are_refused(cloud, kw):
    project = new_project()
    cloud.shape_project(project, external_ips_denied=True)
    import urllib.request

    url = f"{cloud.endpoint}/v2/projects/{project}/policies/compute.vmExternalIpAccess:getEffectivePolicy"
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert json.load(resp)["spec"]["rules"] == [{"denyAll": True}]
    tpu = tpu_client(kw)
    with pytest.raises(gexc.BadRequest, match="constraints/compute.vmExternalIpAccess violated"):
        tpu.create_node(parent=f"projects/{project}/locations/{ZONE}", node_id="ext", node=tpu_v2.Node(
            accelerator_type="v3-8", runtime_version=TF, network_config=tpu_v2.NetworkConfig(enable_external_ips=True)))
    tpu.create_node(parent=f"projects/{project}/locations/{ZONE}", node_id="int", node=tpu_v2.Node(
        accelerator_type="v3-8", runtime_version=TF)).result(polling=FAST_POLLING)

    instances = compute_v1.InstancesClient(**kw)

    def insert(name: str, image: str, external: bool):
        return instances.insert(project=project, zone=ZONE, instance_resource=compute_v1.Instance(
            name=name, machine_type=f"zones/{ZONE}/machineTypes/e2-small",
            disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
                source_image=image))],
            network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default", access_configs=[
                compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")] if external else [])]))

    with pytest.raises(gexc.PreconditionFailed, match="vmExternalIpAccess"):  # Compute: 412 conditionNotMet
        insert("vm1", "projects/debian-cloud/global/images/family/debian-12", True)
    with pytest.raises(gexc.NotFound, match="images/family/debian-8' was not found"):
        insert("vm2", "projects/debian-cloud/global/images/family/debian-8", False)
    insert("vm3", "projects/debian-cloud/global/images/debian-12-bookworm-v20240701", False)


def test_test_iam_permissions_returns_only_the_held_ones(cloud, kw):
    project = new_project()
    cloud.shape_project(project, denied_permissions=["tpu.nodes.create"])
    crm = resourcemanager_v3.ProjectsClient(transport="rest", **kw)
    got = crm.test_iam_permissions(resource=f"projects/{project}", permissions=["tpu.nodes.create", "tpu.nodes.get"])
    assert list(got.permissions) == ["tpu.nodes.get"]
    with pytest.raises(gexc.BadRequest, match="wildcards"):  # iam_policy.proto: wildcards "are not allowed"
        crm.test_iam_permissions(resource=f"projects/{project}", permissions=["tpu.*"])


def test_shaping_rejects_unknown_options_over_the_admin_api(cloud):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{cloud.endpoint}/_localcloud/projects/{new_project()}", method="POST",
                                 data=json.dumps({"oslogin": True}).encode())
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400
    req = urllib.request.Request(f"{cloud.endpoint}/_localcloud/projects/{new_project()}", method="POST",
                                 data=json.dumps({"metadata": {"enable-oslogin": "TRUE"}}).encode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.load(resp)["metadata"] == {"enable-oslogin": "TRUE"}


# ---------------------------------------------------------------------------------------------- tpuctl

def pclients(cloud, project: str, account: str | None = ACCOUNT):
    return build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                 storage_host=cloud.storage_host, local=True, account=account)


def created_in(cloud, pc) -> list[str]:
    """What exists in the project, read from the local cloud's own state (its APIs may be disabled)."""
    inv = cloud.inventory()
    return ([r["name"] for r in inv["nodes"] + inv["queued_resources"] if f"projects/{pc.project}/" in r["name"]]
            + [i["name"] for i in inv["instances"] if i["project"] == pc.project]
            + [b.name for b in pc.storage.list_buckets(project=pc.project)])


def make_plan(project: str):
    raw = {"name": "run1", "accelerator": "v3-8", "zone": ZONE, "ttl": "2h"}
    return prov.plan(spec.from_mapping(raw), project=project, owner="tester")


def test_preflight_passes_on_a_set_up_project(cloud):
    pc = pclients(cloud, new_project())
    checks = preflight.require(pc, preflight.Target.of_plan(make_plan(pc.project)))
    assert [c.name for c in checks] == ["apis", "network", "subnetwork", "service-account", "permissions",
                                        "external-ips", "os-login", "tpu-quota"]


@pytest.mark.parametrize("shape,account,failed", [
    ({"disabled_services": ["tpu.googleapis.com"]}, ACCOUNT, {"apis"}),
    ({"disabled_services": ["compute.googleapis.com"]}, ACCOUNT, {"apis", "service-account"}),
    ({"default_network": False}, ACCOUNT, {"network", "subnetwork"}),
    ({"compute_sa": False}, ACCOUNT, {"service-account"}),
    ({"denied_permissions": ["iam.serviceAccounts.actAs"]}, ACCOUNT, {"permissions"}),
    ({"metadata": {"enable-oslogin": "TRUE"}}, None, {"os-login"}),
    ({"external_ips_denied": True}, ACCOUNT, {"external-ips"}),
    ({"metadata": {"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"}}, ACCOUNT, {"os-login"}),
])
def test_up_stops_before_creating_anything_on_a_project_that_cannot_work(cloud, shape, account, failed):
    pc = pclients(cloud, new_project(), account)
    cloud.shape_project(pc.project, **shape)
    checks = preflight.checks(pc, preflight.Target.of_plan(make_plan(pc.project)))
    assert {c.name for c in checks if not c.ok} == failed
    assert all(c.fix for c in checks if c.status != "ok")
    started = time.monotonic()
    with pytest.raises(preflight.PreflightFailed) as exc:
        prov.apply(pc, make_plan(pc.project), deadline_s=60)
    assert exc.value.exit_code == 2 and time.monotonic() - started < 10
    assert created_in(cloud, pc) == []


def test_a_check_that_cannot_be_read_is_unknown_and_stops_nothing(cloud):
    pc = pclients(cloud, new_project())
    cloud.shape_project(pc.project, disabled_services=["orgpolicy.googleapis.com"])  # often so on real projects
    checks = {c.name: c for c in preflight.require(pc, preflight.Target.of_plan(make_plan(pc.project)))}
    assert checks["external-ips"].status == "unknown" and "has not been used" in checks["external-ips"].detail
    assert all(c.status == "ok" for n, c in checks.items() if n != "external-ips")


def test_ssh_on_an_oslogin_project_logs_in_as_the_profiles_posix_user(cloud, tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    pc = pclients(cloud, new_project())
    cloud.shape_project(pc.project, metadata={"enable-oslogin": "TRUE"})
    result = prov.apply(pc, make_plan(pc.project), deadline_s=60)
    try:
        key, targets = cluster.authorize(pc, result.zone, "run1")
        assert key.user == "ann_lee_example_com"
        node = pc.tpu.get_node(name=f"projects/{pc.project}/locations/{ZONE}/nodes/run1")
        assert "ssh-keys" not in node.metadata  # nothing written where the guest would not look
        assert can_login(targets[0].port, key.user, key.load_private())
        imported = dict(cloud.projects.users[ACCOUNT]["keys"])
        assert cluster.authorize(pc, result.zone, "run1")[0].user == key.user
        assert cloud.projects.users[ACCOUNT]["keys"] == imported  # idempotent: the key is not imported twice
    finally:
        prov.down(pc, "run1", delete_bucket=True)


def test_internal_ips_satisfy_the_org_policy(cloud):
    pc = pclients(cloud, new_project())
    cloud.shape_project(pc.project, external_ips_denied=True)
    plan = prov.plan(spec.from_mapping({"name": "run1", "accelerator": "v3-8", "zone": ZONE, "ttl": "2h",
                                        "internal_ips": True}), project=pc.project, owner="tester")
    result = prov.apply(pc, plan, deadline_s=60)
    try:
        node = pc.tpu.get_node(name=f"projects/{pc.project}/locations/{ZONE}/nodes/run1")
        assert not node.network_config.enable_external_ips and result.get(prov.Kind.TPU).workers
    finally:
        prov.down(pc, "run1", delete_bucket=True)


def test_ssh_on_an_oslogin_node_without_a_known_account_fails_at_once(cloud, tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    pc = pclients(cloud, new_project(), account=None)
    result = prov.apply(pc, make_plan(pc.project), deadline_s=60)
    try:
        cloud.shape_project(pc.project, metadata={"enable-oslogin": "TRUE"})  # turned on after `up`
        started = time.monotonic()
        with pytest.raises(BadInput, match="enable-oslogin") as exc:
            cluster.authorize(pc, result.zone, "run1")
        assert "TPUCTL_ACCOUNT" in exc.value.hint and time.monotonic() - started < 5
    finally:
        prov.down(pc, "run1", delete_bucket=True)


def test_doctor_prints_one_line_per_check_and_exits_by_the_result(cloud, env):
    p = tpuctl(env, "doctor", "--zone", ZONE)
    assert p.returncode == 0, p.stderr
    assert [ln.split()[0] for ln in p.stdout.splitlines()] == ["ok"] * 8  # 7 checks + the supervisor's account
    cloud.shape_project(env["TPUCTL_PROJECT"], default_network=False, metadata={"enable-oslogin": "TRUE"})
    p = tpuctl_here(env, "doctor", "--zone", ZONE, "--json")
    assert p.returncode == 2, p.stderr
    doc = json.loads(p.stdout)
    assert not doc["ok"] and {c["name"] for c in doc["checks"] if not c["ok"]} == {"network", "subnetwork"}
    oslogin = next(c for c in doc["checks"] if c["name"] == "os-login")
    assert oslogin["ok"] and env["TPUCTL_PROJECT"] and "@localcloud.test" in oslogin["detail"]
    p = tpuctl_here(env, "doctor", "--zone", ZONE)
    assert p.returncode == 2 and "problem  network: network default does not exist" in p.stdout
    assert "fix: gcloud compute networks create default" in p.stdout


def test_up_exits_2_with_the_fix_and_creates_nothing(cloud, env):
    cloud.shape_project(env["TPUCTL_PROJECT"], disabled_services=["tpu.googleapis.com"])
    p = tpuctl_here(env, "up", "--accelerator", "v3-8", "--zone", ZONE, "--name", "r1", "--yes")
    assert p.returncode == 2, p.stderr
    assert "error: project: project" in p.stderr and "gcloud services enable tpu.googleapis.com" in p.stderr
    assert created_in(cloud, pclients(cloud, env["TPUCTL_PROJECT"])) == []


def test_project_shapes_and_oslogin_profiles_survive_a_restart(tmp_path):
    from tpuctl.localcloud.cloud import LocalCloud

    with LocalCloud(speed=1000, strict=True, state_dir=tmp_path) as first:
        first.shape_project("keep-me-1", default_network=False, metadata={"enable-oslogin": "TRUE"})
        first.projects.import_ssh_public_key({"usersId": ACCOUNT}, {}, {"key": public(asyncssh.generate_private_key("ssh-ed25519"))})
        before = first.projects.describe("keep-me-1")
    with LocalCloud(speed=1000, strict=True, state_dir=tmp_path) as again:
        assert again.projects.describe("keep-me-1") == before
        assert [k.split(":")[0] for k in again.projects.oslogin_keys()] == ["ann_lee_example_com"]


@pytest.mark.parametrize("instance, project, on", [
    ({"enable-oslogin": "1"}, {}, True), ({"enable-oslogin": "t"}, {}, True), ({"enable-oslogin": "True"}, {}, True),
    ({"enable-oslogin": "False"}, {"enable-oslogin": "TRUE"}, False),
    ({"enable-oslogin": "yes"}, {"enable-oslogin": "TRUE"}, True),  # unparseable: the project's value decides
    ({"enable-oslogin": "tRuE"}, {}, False), ({}, {"enable-oslogin": "0"}, False), ({}, {}, False),
])
def test_enable_oslogin_is_read_as_the_guest_agent_reads_it(instance, project, on):
    """Google's guest agent parses enable-oslogin with Go's strconv.ParseBool and leaves an unparseable value
    unset (metadata.go); tpuctl must predict the guest's choice, and localcloud's guest makes it."""
    from tpuctl.localcloud.projects import oslogin_enabled
    from tpuctl.provision import oslogin

    assert oslogin.enabled(project, instance) is on
    assert oslogin_enabled(project, instance) is on
