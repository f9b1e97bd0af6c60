"""Cloud TPU v2 emulation, driven through the official tpu_v2.TpuClient over REST in strict mode."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import asyncssh
import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from conftest import FAST_POLLING, process_alive

ZONE = "europe-west4-a"
TF = "tpu-vm-tf-2.14.1"


def _key_line(key: asyncssh.SSHKey, user: str = "alice") -> str:
    return f"{user}:{key.export_public_key().decode().strip()} {user}"


def _create(clients, node_id: str, zone: str = ZONE, **fields) -> tpu_v2.Node:
    fields.setdefault("accelerator_type", "v3-8")
    fields.setdefault("runtime_version", TF)
    op = clients.tpu.create_node(parent=clients.parent(zone), node_id=node_id, node=tpu_v2.Node(**fields))
    return op.result(polling=FAST_POLLING)


async def _run_on_workers(node: tpu_v2.Node, host_keys: list[str], key: asyncssh.SSHKey, command: str) -> list[str]:
    async def one(ep, host_key):
        trusted = asyncssh.import_public_key(host_key)
        async with asyncssh.connect(ep.ip_address, ep.port, username="alice", client_keys=[key],
                                    known_hosts=([trusted], [], [])) as conn:
            result = await conn.run(command, check=True, timeout=20)
            return result.stdout.strip()

    return await asyncio.gather(*(one(ep, hk) for ep, hk in zip(node.network_endpoints, host_keys)))


def _host_keys(clients, name: str) -> list[str]:
    resp = clients.tpu.get_guest_attributes(request={"name": name, "query_path": "hostkeys/"})
    keys = []
    for attr in resp.guest_attributes:
        item = next(i for i in attr.query_value.items if i.key == "ssh-ed25519")
        keys.append(f"{item.key} {item.value}")
    return keys


# Run on a worker: google-auth's own metadata client (the one every Google library on a TPU VM uses) reads who
# this worker is; GCE_METADATA_HOST/GCE_METADATA_IP are all it is given.
GOOGLE_AUTH_PROBE = r"""python - <<'EOF'
import json, os
import google.auth
import google.auth.transport.requests
from google.auth.compute_engine import _metadata
request = google.auth.transport.requests.Request()
attribute = lambda key: _metadata.get(request, f"instance/attributes/{key}")
credentials, project = google.auth.default()
credentials.refresh(request)
print(json.dumps({
    "ping": _metadata.ping(request), "project": _metadata.get_project_id(request), "default_project": project,
    "number": _metadata.get(request, "project/numeric-project-id"), "zone": _metadata.get(request, "instance/zone"),
    "hostname": _metadata.get(request, "instance/hostname"), "worker": attribute("agent-worker-number"),
    "accelerator": attribute("accelerator-type"), "endpoints": attribute("worker-network-endpoints"),
    "tpu_env": attribute("tpu-env"), "ssh_keys": attribute("ssh-keys"), "oslogin": attribute("enable-oslogin"),
    "custom": _metadata.get(request, "instance/attributes/tier", return_none_for_not_found_error=True),
    "account": _metadata.get_service_account_info(request), "credentials": type(credentials).__name__,
    "token": credentials.token, "host": os.environ["GCE_METADATA_HOST"],
    "tpu_variables": sorted(name for name in os.environ if name.startswith("TPU_")),
    "notices": [_metadata.get(request, "instance/maintenance-event"), _metadata.get(request, "instance/preempted")],
}))
EOF"""


def test_v3_32_has_four_ssh_reachable_workers_that_know_themselves_only_from_metadata(clients):
    key = asyncssh.generate_private_key("ssh-ed25519")
    node = _create(clients, "pod", accelerator_type="v3-32", runtime_version="tpu-vm-tf-2.14.1-pod",
                   metadata={"ssh-keys": _key_line(key), "enable-oslogin": "FALSE"})
    assert node.state == tpu_v2.Node.State.READY
    assert node.accelerator_config.type_ == tpu_v2.AcceleratorConfig.Type.V3
    assert node.accelerator_config.topology == "4x4"
    assert len(node.network_endpoints) == 4
    assert {ep.ip_address for ep in node.network_endpoints} == {"127.0.0.1"}
    assert len({ep.port for ep in node.network_endpoints}) == 4
    host_keys = _host_keys(clients, node.name)
    assert len(host_keys) == 4
    clients.tpu.update_node(node=tpu_v2.Node(name=node.name, metadata={**node.metadata, "tier": "gold"}),
                            update_mask={"paths": ["metadata"]}).result(polling=FAST_POLLING)

    seen = [json.loads(out) for out in asyncio.run(_run_on_workers(node, host_keys, key, GOOGLE_AUTH_PROBE))]
    number = clients.projects.get_project(name=f"projects/{clients.project}").name.split("/")[1]
    hostnames = [s["hostname"].split(".")[0] for s in seen]
    assert len(set(hostnames)) == 4 and all(re.fullmatch(r"t1v-n-[0-9a-f]{8}-w-\d", h) for h in hostnames)
    for i, s in enumerate(seen):
        assert s["tpu_variables"] == []  # no TPU_WORKER_ID / TPU_WORKER_HOSTNAMES / TPU_NAME: those are GKE's
        assert s["ping"] is True and s["credentials"] == "Credentials" and s["token"].startswith("ya29.")
        assert s["project"] == s["default_project"] == clients.project and s["number"] == number
        assert s["zone"] == f"projects/{number}/zones/{ZONE}"
        assert s["hostname"] == f"{hostnames[i]}.{ZONE}.c.{clients.project}.internal"
        assert (s["worker"], s["accelerator"]) == (str(i), "v3-32")
        assert [e.split(":") for e in s["endpoints"].split(",")] == [[h, str(node.id), "127.0.0.1"] for h in hostnames]
        tpu_env = dict(line.split(": ", 1) for line in s["tpu_env"].splitlines())
        assert (tpu_env["NODE_ID"], tpu_env["WORKER_ID"], tpu_env["ACCELERATOR_TYPE"]) == ("'pod'", f"'{i}'", "'v3-32'")
        assert key.export_public_key().decode().split()[1] in s["ssh_keys"] and s["oslogin"] == "FALSE"
        assert s["custom"] == "gold"  # metadata patched through the API is what the guest reads next
        assert s["notices"] == ["NONE", "FALSE"]  # what a guest polls for maintenance and Spot preemption
        assert s["account"] == {"aliases": ["default"], "email": f"{number}-compute@developer.gserviceaccount.com",
                                "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
    assert len({s["host"] for s in seen}) == 4  # one metadata endpoint per worker

    # As on Google: no Metadata-Flavor request header, no metadata (403); the answer carries the header back.
    url = f"http://{seen[1]['host']}/computeMetadata/v1/instance/attributes/agent-worker-number"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 403 and b"Missing Metadata-Flavor:Google header" in refused.value.read()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"}), timeout=10) as r:
        assert (r.read(), r.headers["Metadata-Flavor"]) == (b"1", "Google")


def test_a_job_on_a_tpu_vm_without_chips_fails_loudly_unless_the_local_cloud_asks_for_a_cpu_rehearsal(clients):
    """The template knows an emulated TPU VM from its metadata alone, and that it has no TPU: without localcloud's
    explicit CPU-rehearsal flag it refuses, naming what it tried, instead of training on the CPU."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    node = _create(clients, "nochips", metadata={"ssh-keys": _key_line(key)})
    templates = Path(__file__).resolve().parents[1] / "templates"
    command = f"""cd {templates}
probe() {{ python - <<'EOF'
import os
from bert import config
from lmkit import guest, strategy
vm = guest.tpu_vm()
print(vm.node, vm.worker, len(vm.hosts))
if os.environ.get("LOCALCLOUD_TPU_REHEARSAL"):
    print(strategy._check_tpu_host(vm, "local"))
else:
    strategy.resolve(config.RuntimeConfig())
EOF
}}
probe; echo exit=$?; (unset LOCALCLOUD_TPU_REHEARSAL; probe 2>&1); echo exit=$?"""
    (out,) = asyncio.run(_run_on_workers(node, _host_keys(clients, node.name), key, command))
    rehearsal, refusal = out.split("exit=", 1)
    assert rehearsal.splitlines()[:2] == ["nochips 0 1", "True"]  # the flag: a CPU rehearsal is what is asked
    assert "AcceleratorError: runtime.tpu: TPU VM nochips (v3-8) worker 0 per its metadata server, but no TPU " \
           "chips are attached: tried /dev/accel*, /dev/vfio/[0-9]*; libtpu: " in refusal
    # The worker runs this interpreter: with the pip libtpu installed (the test extra brings the TPU compiler)
    # that is the libtpu it names, else every place it looked.
    pip_libtpu = importlib.util.find_spec("libtpu")
    if pip_libtpu is not None:
        assert f"libtpu: {Path(pip_libtpu.origin).parent / 'libtpu.so'}" in refusal
    else:
        assert "libtpu: TPU_LIBRARY_PATH (unset)" in refusal and "/lib/libtpu.so (missing)" in refusal
    assert refusal.rstrip().endswith("exit=1")


@pytest.mark.parametrize("accelerator,workers", [("v2-8", 1), ("v5litepod-16", 2), ("v5litepod-4", 1), ("v4-32", 4)])
def test_worker_count_follows_the_accelerator_type(clients, accelerator, workers):
    zone = {"v2-8": "us-central1-b", "v4-32": "us-central2-b"}.get(accelerator, "us-east5-a")
    runtime = "tpu-vm-tf-2.16.1-pod-pjrt" if accelerator.startswith("v5") else "tpu-ubuntu2204-base"
    node = _create(clients, "n", zone=zone, accelerator_type=accelerator, runtime_version=runtime)
    assert len(node.network_endpoints) == workers
    assert len(_host_keys(clients, node.name)) == workers


def test_accelerator_config_is_accepted_instead_of_a_type_name(clients):
    node = _create(clients, "cfg", accelerator_type="", runtime_version="v2-alpha-tpuv5-lite", zone="us-east5-a",
                   accelerator_config=tpu_v2.AcceleratorConfig(type_=tpu_v2.AcceleratorConfig.Type.V5LITE_POD, topology="2x4"))
    assert node.accelerator_type == "v5litepod-8"


def test_node_lifecycle_get_list_stop_start_delete(clients):
    # On demand: Spot TPUs cannot be stopped (tests/test_google_failures.py).
    created = _create(clients, "life", labels={"tpuctl-run": "r1"})
    got = clients.tpu.get_node(name=created.name)
    assert got.state == tpu_v2.Node.State.READY and got.labels["tpuctl-run"] == "r1"
    assert not got.scheduling_config.spot and got.create_time and got.id
    assert [n.name for n in clients.tpu.list_nodes(parent=clients.parent(ZONE))] == [created.name]
    assert [n.name for n in clients.tpu.list_nodes(parent=clients.parent("-"))] == [created.name]

    stopped = clients.tpu.stop_node(request={"name": created.name}).result(polling=FAST_POLLING)
    assert stopped.state == tpu_v2.Node.State.STOPPED
    assert all(not ep.port for ep in stopped.network_endpoints)
    with pytest.raises(gexc.BadRequest):  # FAILED_PRECONDITION: only READY nodes stop
        clients.tpu.stop_node(request={"name": created.name})
    started = clients.tpu.start_node(request={"name": created.name}).result(polling=FAST_POLLING)
    assert started.state == tpu_v2.Node.State.READY and all(ep.port for ep in started.network_endpoints)

    clients.tpu.delete_node(name=created.name).result(polling=FAST_POLLING)
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_node(name=created.name)
    ops = clients.tpu.list_operations(request={"name": clients.parent(ZONE)}).operations
    assert {op.done for op in ops} == {True} and len(ops) == 4


def test_node_is_creating_before_its_operation_finishes_and_labels_wait(clients, cloud):
    cloud.faults.add("stuck", service="tpu", method="nodes.create", count=1)
    op = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="slow",
                                 node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF))
    name = f"{clients.parent(ZONE)}/nodes/slow"
    node = clients.tpu.get_node(name=name)
    assert node.state == tpu_v2.Node.State.CREATING and not op.done()
    node.labels["late"] = "x"
    with pytest.raises(gexc.BadRequest, match="CREATING"):
        clients.tpu.update_node(node=node, update_mask={"paths": ["labels"]})
    clients.tpu.delete_node(name=name).result(polling=FAST_POLLING)
    assert op.done() and op.exception() is not None


def test_external_ips_are_switched_by_a_patch_of_network_config_enable_external_ips(clients):
    """nodes.patch "Supported fields: [description, tags, labels, metadata, network_config.enable_external_ips]"
    (tpu v2 discovery document): the endpoints gain and lose their access configs with it."""
    node = _create(clients, "ips")
    assert not any(ep.access_config.external_ip for ep in node.network_endpoints)
    node.network_config.enable_external_ips = True
    mask = {"paths": ["network_config.enable_external_ips"]}
    patched = clients.tpu.update_node(node=node, update_mask=mask).result(polling=FAST_POLLING)
    assert patched.network_config.enable_external_ips and all(ep.access_config.external_ip
                                                              for ep in patched.network_endpoints)
    assert patched.network_config.network.endswith("/networks/default")  # the rest of networkConfig is kept
    with pytest.raises(gexc.BadRequest, match="cannot be updated"):
        clients.tpu.update_node(node=node, update_mask={"paths": ["network_config.network"]})


def test_update_labels_and_ssh_keys_metadata(clients):
    node = _create(clients, "upd", labels={"a": "1"})
    key = asyncssh.generate_private_key("ssh-ed25519")
    node.labels["b"] = "2"
    node.metadata["ssh-keys"] = _key_line(key)
    updated = clients.tpu.update_node(node=node, update_mask={"paths": ["labels", "metadata"]}).result(polling=FAST_POLLING)
    assert dict(updated.labels) == {"a": "1", "b": "2"}
    assert asyncio.run(_run_on_workers(updated, _host_keys(clients, node.name), key, "echo ok")) == ["ok"]
    with pytest.raises(gexc.BadRequest, match="accelerator_type|acceleratorType"):
        clients.tpu.update_node(node=node, update_mask={"paths": ["accelerator_type"]})


@pytest.mark.parametrize("fields,error,match", [
    ({"accelerator_type": "v3-9"}, gexc.BadRequest, "not a valid accelerator type"),
    ({"accelerator_type": "v4-8"}, gexc.BadRequest, "could not be found in the zonal accelerator configurations"),
    ({"runtime_version": "v2-alpha-tpuv5-lite"}, gexc.BadRequest, "not supported for accelerator"),
    ({"runtime_version": ""}, gexc.BadRequest, "runtimeVersion is required"),
    ({"scheduling_config": tpu_v2.SchedulingConfig(spot=True, preemptible=True)}, gexc.BadRequest, "mutually exclusive"),
    ({"labels": {"Run": "x"}}, gexc.BadRequest, "label key 'Run'"),
    ({"labels": {"tpuctl-owner": "Alice@Example.com"}}, gexc.BadRequest, "label value"),
])
def test_invalid_creates_fail_like_the_real_api(clients, fields, error, match):
    fields = {"accelerator_type": "v3-8", "runtime_version": TF, **fields}
    with pytest.raises(error, match=match):
        clients.tpu.create_node(parent=clients.parent(ZONE), node_id="bad", node=tpu_v2.Node(**fields))
    assert list(clients.tpu.list_nodes(parent=clients.parent(ZONE))) == []


def test_duplicate_node_id_is_already_exists(clients):
    """gcloud shows Google's 409 and 404 with the resource's name in a google.rpc.ResourceInfo detail."""
    node = _create(clients, "dup")
    with pytest.raises(gexc.Conflict) as taken:
        _create(clients, "dup")
    with pytest.raises(gexc.NotFound) as missing:
        clients.tpu.get_node(name=node.name + "x")
    for exc, name in ((taken.value, node.name), (missing.value, node.name + "x")):
        assert [(d["@type"], d["resourceName"]) for d in exc.details] == [
            ("type.googleapis.com/google.rpc.ResourceInfo", name)]  # REST details come as dicts


def test_legacy_v1_api_is_refused(cloud):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{cloud.endpoint}/v1/projects/p/locations/{ZONE}/nodes?nodeId=x", method="POST",
                                 data=json.dumps({"acceleratorType": "v3-8", "tensorflowVersion": "2.12"}).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 400
    assert "retired" in json.loads(info.value.read())["error"]["message"]


def test_accelerator_types_and_runtime_versions(clients):
    parent = clients.parent("us-central2-b")
    types = {t.type_ for t in clients.tpu.list_accelerator_types(parent=parent)}
    assert "v4-8" in types and "v3-8" not in types
    t = clients.tpu.get_accelerator_type(name=f"{parent}/acceleratorTypes/v4-32")
    assert t.accelerator_configs[0].type_ == tpu_v2.AcceleratorConfig.Type.V4
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_accelerator_type(name=f"{parent}/acceleratorTypes/v3-8")
    versions = {r.version for r in clients.tpu.list_runtime_versions(parent=parent)}
    assert "tpu-vm-tf-2.14.1" in versions and "v2-alpha-tpuv5-lite" not in versions
    assert clients.tpu.get_runtime_version(name=f"{parent}/runtimeVersions/tpu-vm-v4-base").version == "tpu-vm-v4-base"
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_runtime_version(name=f"{parent}/runtimeVersions/v2-alpha-tpuv6e")
    page = clients.tpu.list_accelerator_types(request={"parent": parent, "page_size": 3})
    assert len(list(page)) == len(types)  # the pager follows nextPageToken


def test_service_identity_and_project_number_agree(clients):
    number = clients.projects.get_project(name=f"projects/{clients.project}").name.split("/")[1]
    ident = clients.tpu.generate_service_identity(request={"parent": clients.parent(ZONE)})
    assert ident.identity.email == f"service-{number}@cloud-tpu.iam.gserviceaccount.com"


def test_startup_script_runs_at_worker_boot(clients, tmp_path):
    marker = tmp_path / "booted"
    script = (f"#!/bin/bash\ncurl -sf -H 'Metadata-Flavor: Google' "
              f"http://$GCE_METADATA_HOST/computeMetadata/v1/instance/attributes/agent-worker-number >> {marker}\n")
    _create(clients, "boot", metadata={"startup-script": script})
    deadline = time.monotonic() + 10
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:  # >> creates it first
        time.sleep(0.05)
    assert marker.read_text().split() == ["0"]


def test_deleting_a_node_kills_its_processes(clients, tmp_path):
    key = asyncssh.generate_private_key("ssh-ed25519")
    node = _create(clients, "kill", metadata={"ssh-keys": _key_line(key)})
    pid_file = tmp_path / "pid"
    asyncio.run(_run_on_workers(node, _host_keys(clients, node.name), key,
                                f"nohup sleep 300 >/dev/null 2>&1 & echo $! > {pid_file}"))
    pid = int(pid_file.read_text())
    clients.tpu.delete_node(name=node.name).result(polling=FAST_POLLING)
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid)


# ------------------------------------------------------------------------------------ queued resources

def _qr(clients, qr_id: str, node_id: str, **extra) -> tpu_v2.QueuedResource:
    parent = clients.parent(ZONE)
    return tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(
            parent=parent, node_id=node_id, node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF))]),
        **extra)


def _wait_qr(clients, name: str, state, timeout: float = 20.0) -> tpu_v2.QueuedResource:
    deadline = time.monotonic() + timeout
    while True:
        qr = clients.tpu.get_queued_resource(name=name)
        if qr.state.state == state or time.monotonic() > deadline:
            return qr
        time.sleep(0.02)


def test_queued_resource_ids_follow_the_discovery_documents_pattern(clients):
    """queuedResourceId and nodeSpec.nodeId "Should follow the `^[A-Za-z0-9_.~+%-]+$` regex format"."""
    parent = clients.parent(ZONE)
    op = clients.tpu.create_queued_resource(parent=parent, queued_resource_id="Qr_1.a",
                                            queued_resource=_qr(clients, "Qr_1.a", "Node_1"))
    name = f"{parent}/queuedResources/Qr_1.a"
    assert op.result(polling=FAST_POLLING).name == name
    with pytest.raises(gexc.BadRequest, match="queuedResourceId"):
        clients.tpu.create_queued_resource(parent=parent, queued_resource_id="qr/2",
                                           queued_resource=_qr(clients, "qr/2", "n2"))
    clients.tpu.delete_queued_resource(request={"name": name, "force": True}).result(polling=FAST_POLLING)
    # queuedResourceId is "Optional" (tpu v2 discovery): without one the server names the request.
    named = clients.tpu.create_queued_resource(parent=parent, queued_resource=_qr(clients, "", "n3")).result(
        polling=FAST_POLLING).name
    assert named.startswith(f"{parent}/queuedResources/") and len(named) > len(f"{parent}/queuedResources/")
    assert clients.tpu.get_queued_resource(name=named).tpu.node_spec[0].node_id == "n3"
    clients.tpu.delete_queued_resource(request={"name": named, "force": True}).result(polling=FAST_POLLING)


def test_queued_resource_becomes_active_and_force_delete_removes_its_node(clients):
    S = tpu_v2.QueuedResourceState.State
    parent = clients.parent(ZONE)
    op = clients.tpu.create_queued_resource(parent=parent, queued_resource_id="qr1",
                                            queued_resource=_qr(clients, "qr1", "qn", spot=tpu_v2.QueuedResource.Spot()))
    accepted = op.result(polling=FAST_POLLING)
    assert accepted.state.state == S.WAITING_FOR_RESOURCES  # tpu/docs/queued-resources: no ACCEPTED any more
    qr = _wait_qr(clients, f"{parent}/queuedResources/qr1", S.ACTIVE)
    assert qr.state.state == S.ACTIVE
    node = clients.tpu.get_node(name=f"{parent}/nodes/qn")
    assert node.state == tpu_v2.Node.State.READY and node.queued_resource == qr.name and node.scheduling_config.spot
    assert [q.name for q in clients.tpu.list_queued_resources(parent=parent)] == [qr.name]
    with pytest.raises(gexc.BadRequest, match="force"):
        clients.tpu.delete_queued_resource(name=qr.name)
    clients.tpu.delete_queued_resource(request={"name": qr.name, "force": True}).result(polling=FAST_POLLING)
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_queued_resource(name=qr.name)
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_node(name=node.name)


def test_queued_resource_waits_for_capacity_then_fails_at_valid_until(clients, cloud):
    S = tpu_v2.QueuedResourceState.State
    cloud.faults.add("capacity", service="tpu", zone=ZONE)
    parent = clients.parent(ZONE)
    qr = _qr(clients, "qr2", "qn2", queueing_policy=tpu_v2.QueuedResource.QueueingPolicy(
        valid_until_duration={"seconds": 300}))  # 0.3 s at speed 1000
    clients.tpu.create_queued_resource(parent=parent, queued_resource_id="qr2", queued_resource=qr).result(polling=FAST_POLLING)
    name = f"{parent}/queuedResources/qr2"
    assert _wait_qr(clients, name, S.WAITING_FOR_RESOURCES).state.state == S.WAITING_FOR_RESOURCES
    failed = _wait_qr(clients, name, S.FAILED)
    assert failed.state.state == S.FAILED and "valid-until" in failed.state.failed_data.error.message
    clients.tpu.delete_queued_resource(name=name).result(polling=FAST_POLLING)


def test_preempted_spot_node_suspends_its_queued_resource(clients, cloud):
    S = tpu_v2.QueuedResourceState.State
    parent = clients.parent(ZONE)
    clients.tpu.create_queued_resource(parent=parent, queued_resource_id="qr3", queued_resource=_qr(
        clients, "qr3", "qn3", spot=tpu_v2.QueuedResource.Spot())).result(polling=FAST_POLLING)
    name = f"{parent}/queuedResources/qr3"
    assert _wait_qr(clients, name, S.ACTIVE).state.state == S.ACTIVE
    cloud.preempt(f"{parent}/nodes/qn3")
    assert clients.tpu.get_node(name=f"{parent}/nodes/qn3").state == tpu_v2.Node.State.PREEMPTED
    assert clients.tpu.get_queued_resource(name=name).state.state == S.SUSPENDED


def test_locations_list_and_get(clients):
    from google.cloud.location import locations_pb2

    listed = clients.tpu.list_locations(locations_pb2.ListLocationsRequest(name=f"projects/{clients.project}"))
    assert "us-central2-b" in {loc.location_id for loc in listed.locations}
    got = clients.tpu.get_location(locations_pb2.GetLocationRequest(name=clients.parent(ZONE)))
    assert got.location_id == ZONE
