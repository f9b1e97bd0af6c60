"""The requests Google's own TPU samples make (GoogleCloudPlatform/python-docs-samples, folder tpu/), with the
same request shapes and defaults, against the strict local cloud: what works for Google's sample code must
work here, and answer what the samples print.

Written in this project's words, one test per sample (or per pair that needs each other):
create_tpu.py, create_tpu_spot.py, create_tpu_topology.py, create_tpu_with_script.py, get_tpu.py,
list_tpu.py, stop_tpu.py, start_tpu.py, delete_tpu.py; queued_resources_create.py, _create_spot.py,
_create_startup_script.py, _create_time_bound.py, _get.py, _list.py, _delete.py, _delete_force.py.

Two deliberate departures, each because the sample's value is not Google's documented one:
- The queued-resource samples use `tpu_v2alpha1`; the same messages exist in `tpu_v2`, the API localcloud
  serves (and tpuctl uses), so these tests send them through `tpu_v2`.
- create_tpu.py's default runtime `v2-tpuv5-litepod` is not in Google's table of TPU software versions
  (cloud.google.com/tpu/docs/runtimes lists `v2-alpha-tpuv5-lite` for v5e); the documented one is used.
"""

from __future__ import annotations

import time

import pytest
from conftest import FAST_POLLING
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

V5E_RUNTIME = "v2-alpha-tpuv5-lite"
TF_RUNTIME = "tpu-vm-tf-2.17.0-pjrt"  # the samples' default for v2/v3
SCRIPT = """#!/bin/bash
    echo "Hello World" > /var/log/hello.log
    sudo pip3 install --upgrade numpy >> /var/log/hello.log 2>&1
    """


def _create(clients, zone: str, name: str, node: tpu_v2.Node) -> tpu_v2.Node:
    request = tpu_v2.CreateNodeRequest(parent=f"projects/{clients.project}/locations/{zone}", node_id=name, node=node)
    return clients.tpu.create_node(request=request).result(polling=FAST_POLLING)


def _queued(clients, zone: str, name: str, node: tpu_v2.Node, **fields) -> tpu_v2.QueuedResource:
    parent = f"projects/{clients.project}/locations/{zone}"
    node_spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=f"{name}-node", node=node)
    resource = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[node_spec]), **fields)
    request = tpu_v2.CreateQueuedResourceRequest(parent=parent, queued_resource_id=name, queued_resource=resource)
    return clients.tpu.create_queued_resource(request=request).result(polling=FAST_POLLING)


def test_create_get_list_stop_start_delete_as_the_samples_do(clients):
    zone = "us-central1-a"
    created = _create(clients, zone, "tpu-name", tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version=V5E_RUNTIME))
    assert created.state == tpu_v2.Node.State.READY and created.accelerator_type == "v5litepod-4"
    assert created.name == f"projects/{clients.project}/locations/{zone}/nodes/tpu-name"

    got = clients.tpu.get_node(request=tpu_v2.GetNodeRequest(name=created.name))  # get_tpu.py
    assert got.name == created.name and got.state == tpu_v2.Node.State.READY

    nodes = clients.tpu.list_nodes(parent=f"projects/{clients.project}/locations/{zone}")  # list_tpu.py
    assert [(n.name, n.state, n.accelerator_type) for n in nodes] == [(created.name, tpu_v2.Node.State.READY, "v5litepod-4")]

    stopped = clients.tpu.stop_node(request=tpu_v2.StopNodeRequest(name=created.name)).result(polling=FAST_POLLING)
    assert stopped.state == tpu_v2.Node.State.STOPPED
    started = clients.tpu.start_node(request=tpu_v2.StartNodeRequest(name=created.name)).result(polling=FAST_POLLING)
    assert started.state == tpu_v2.Node.State.READY

    clients.tpu.delete_node(request=tpu_v2.DeleteNodeRequest(name=created.name)).result(polling=FAST_POLLING)
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_node(name=created.name)


def test_create_spot_as_the_sample_does_and_stop_print_the_error(clients):
    # create_tpu_spot.py sets `preemptible=True` ("TODO: ... change preemptible to spot=True").
    node = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version=V5E_RUNTIME,
                       scheduling_config=tpu_v2.SchedulingConfig(preemptible=True))
    created = _create(clients, "us-central1-a", "tpu-with-spot", node)
    assert created.scheduling_config.preemptible and not created.scheduling_config.spot
    # stop_tpu.py catches and prints any exception: stopping a Spot/preemptible TPU is one.
    with pytest.raises(gexc.BadRequest):
        clients.tpu.stop_node(request=tpu_v2.StopNodeRequest(name=created.name))
    clients.tpu.delete_node(request=tpu_v2.DeleteNodeRequest(name=created.name)).result(polling=FAST_POLLING)


def test_create_with_topology_as_the_sample_does(clients):
    node = tpu_v2.Node(runtime_version=TF_RUNTIME)
    node.accelerator_config = tpu_v2.AcceleratorConfig(type_=tpu_v2.AcceleratorConfig.Type.V2, topology="2x2")
    created = _create(clients, "us-central1-b", "tpu-name", node)
    assert created.accelerator_config.type_ == tpu_v2.AcceleratorConfig.Type.V2
    assert created.accelerator_config.topology == "2x2" and created.accelerator_type == "v2-8"
    clients.tpu.delete_node(name=created.name).result(polling=FAST_POLLING)


def test_create_with_a_startup_script_and_external_ips_as_the_sample_does(clients):
    node = tpu_v2.Node(metadata={"startup-script": SCRIPT},
                       network_config=tpu_v2.NetworkConfig(enable_external_ips=True))
    node.accelerator_type = "v3-8"
    node.runtime_version = TF_RUNTIME
    created = _create(clients, "us-central1-b", "tpu-name2", node)
    assert created.metadata == {"startup-script": SCRIPT}
    assert created.network_config.enable_external_ips
    assert all(ep.access_config.external_ip for ep in created.network_endpoints)
    clients.tpu.delete_node(name=created.name).result(polling=FAST_POLLING)


def test_queued_resources_create_get_list_delete_as_the_samples_do(clients):
    zone = "us-central1-b"
    qr = _queued(clients, zone, "resource-name", tpu_v2.Node(accelerator_type="v2-8", runtime_version=TF_RUNTIME))
    assert qr.name == f"projects/{clients.project}/locations/{zone}/queuedResources/resource-name"
    assert qr.state.state == tpu_v2.QueuedResourceState.State.WAITING_FOR_RESOURCES

    got = clients.tpu.get_queued_resource(name=qr.name)  # queued_resources_get.py
    assert got.name == qr.name and got.tpu.node_spec[0].node.accelerator_type == "v2-8"
    listed = clients.tpu.list_queued_resources(parent=f"projects/{clients.project}/locations/{zone}")
    assert [r.name for r in listed] == [qr.name]  # queued_resources_list.py

    deadline = time.monotonic() + 10
    while clients.tpu.get_queued_resource(name=qr.name).state.state != tpu_v2.QueuedResourceState.State.ACTIVE:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # queued_resources_delete.py deletes without force: refused while its node runs (Google's rule);
    # queued_resources_delete_force.py then deletes both.
    with pytest.raises(gexc.BadRequest):
        clients.tpu.delete_queued_resource(name=qr.name)
    request = tpu_v2.DeleteQueuedResourceRequest(name=qr.name, force=True)
    clients.tpu.delete_queued_resource(request=request).result(polling=FAST_POLLING)
    assert not list(clients.tpu.list_queued_resources(parent=f"projects/{clients.project}/locations/{zone}"))
    assert not list(clients.tpu.list_nodes(parent=f"projects/{clients.project}/locations/{zone}"))


def test_queued_spot_and_startup_script_as_the_samples_do(clients):
    spot = _queued(clients, "us-central1-b", "spot-resource", tpu_v2.Node(accelerator_type="v2-8", runtime_version=TF_RUNTIME),
                   spot=tpu_v2.QueuedResource.Spot())
    assert "spot" in tpu_v2.QueuedResource.pb(spot).DESCRIPTOR.fields_by_name and tpu_v2.QueuedResource.pb(spot).HasField("spot")

    node = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version=V5E_RUNTIME, metadata={"startup-script": SCRIPT},
                       network_config=tpu_v2.NetworkConfig(enable_external_ips=True))
    scripted = _queued(clients, "us-central1-a", "script-resource", node)
    assert scripted.tpu.node_spec[0].node.metadata == {"startup-script": SCRIPT}
    for qr in (spot, scripted):
        clients.tpu.delete_queued_resource(request={"name": qr.name, "force": True}).result(polling=FAST_POLLING)


def test_queued_time_bound_as_the_sample_does_answers_valid_until_time(clients):
    node = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version=V5E_RUNTIME)
    policy = tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration="90s")
    qr = _queued(clients, "us-central1-a", "bounded", node, queueing_policy=policy)
    # The sample prints response.queueing_policy.valid_until_time: Google turns the duration into a time.
    assert qr.queueing_policy.valid_until_time.timestamp() > 0
    clients.tpu.delete_queued_resource(request={"name": qr.name, "force": True}).result(polling=FAST_POLLING)
