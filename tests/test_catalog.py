"""The catalog: shapes from the generation rules, validation messages, prices and the refresh overlay."""

from __future__ import annotations

import json

import pytest

from tpuctl import catalog
from tpuctl.errors import BadInput


@pytest.fixture
def cat(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    return catalog.load()


# Published shapes (cloud.google.com/tpu/docs/system-architecture-tpu-vm, v5e, v5p, v6e pages).
@pytest.mark.parametrize("name,chips,cores,hosts,topology", [
    ("v2-8", 4, 8, 1, "2x2"), ("v2-32", 16, 32, 4, "4x4"), ("v2-512", 256, 512, 64, "16x16"),
    ("v3-8", 4, 8, 1, "2x2"), ("v3-64", 32, 64, 8, "4x8"), ("v3-2048", 1024, 2048, 256, "32x32"),
    ("v4-8", 4, 8, 1, "2x2x1"), ("v4-16", 8, 16, 2, "2x2x2"), ("v4-64", 32, 64, 8, "2x4x4"),
    ("v4-4096", 2048, 4096, 512, "8x16x16"),
    ("v5litepod-1", 1, 1, 1, "1x1"), ("v5litepod-8", 8, 8, 1, "2x4"), ("v5litepod-256", 256, 256, 32, "16x16"),
    ("v5p-8", 4, 8, 1, "2x2x1"), ("v5p-16", 8, 16, 2, "2x2x2"), ("v5p-12288", 6144, 12288, 1536, "16x16x24"),
    ("v6e-4", 4, 4, 1, "2x2"), ("v6e-16", 16, 16, 2, "4x4"),
])
def test_shapes(cat, name, chips, cores, hosts, topology):
    t = cat.accelerator(name)
    assert (t.chips, t.cores, t.hosts, t.topology) == (chips, cores, hosts, topology)


def test_every_type_is_consistent_and_its_default_runtime_validates(cat):
    gens = {"v2": "V2", "v3": "V3", "v4": "V4", "v5e": "V5LITE_POD", "v5p": "V5P", "v6e": "V6E"}
    # Types of the Cloud TPU API; TPU7x (Compute Engine machine types) is checked in test_tpu7x.py.
    types = [t for t in cat.accelerators() if t.api == "tpu-v2"]
    assert {t.generation for t in types} == set(gens)
    for t in types:
        assert t.api_type == gens[t.generation]
        dims = [int(d) for d in t.topology.split("x")]
        assert dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1) == t.chips
        assert cat.check(t.name, t.zones[0], t.default_runtime) is t
        if t.tensorflow:  # the first template is TensorFlow; a multi-host slice gets the -pod image
            assert cat.check(t.name, t.zones[0], t.default_runtime, "tensorflow") is t
            assert ("-pod" in t.default_runtime) == (t.hosts > 1)
            assert t.default_runtime.startswith("tpu-vm-tf-")
        else:  # Google runs no TensorFlow from v6e on: the default is the JAX/PyTorch base image
            assert t.generation == "v6e" and t.default_runtime == "v2-alpha-tpuv6e"


def test_api_type_names_exist_in_the_tpu_client(cat):
    from google.cloud import tpu_v2

    for gen in cat.generations():
        t = next(t for t in cat.accelerators() if t.generation == gen)
        if t.api == "tpu-v2":
            assert tpu_v2.AcceleratorConfig.Type[t.api_type]


@pytest.mark.parametrize("args,field,suggestion", [
    (("v3-9", "europe-west4-a", None), "accelerator", "v3-8"),
    (("V3-8 ", "europe-west4-b", None), "zone", "europe-west4-a"),
    (("v4-8", "us-central1-a", None), "zone", "us-central2-b"),
    (("v5litepod-8", "us-central1-a", "tpu-vm-tf-2.14.1"), "runtime_version", "tpu-vm-tf-2.16.1-pjrt"),
    (("v3-8", "europe-west4-a", "tpu-vm-tf-2.18.0-pjrt"), "runtime_version", "tpu-vm-tf-2.18.0-pjrt-v5p-and-below"),
    (("v3-32", "europe-west4-a", "tpu-vm-tf-2.17.0-pjrt"), "runtime_version", "tpu-vm-tf-2.17.0-pod-pjrt"),
    (("v4-32", "us-central2-b", "tpu-vm-tf-2.18.0-pjrt-v5p-and-below"), "runtime_version",
     "tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below"),
    (("v5litepod-16", "us-east5-a", "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6"), "runtime_version",
     "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6"),
    (("v6e-8", "us-east5-a", "v2-alpha-tpuv5"), "runtime_version", "v2-alpha-tpuv6e"),
])
def test_validation_names_field_and_nearest_choices(cat, args, field, suggestion):
    with pytest.raises(BadInput) as err:
        cat.check(*args)
    assert err.value.field == field
    assert suggestion in str(err.value) + err.value.hint
    assert err.value.exit_code == 2
    assert "\n" not in str(err.value)


def test_prices(cat):
    assert cat.tpu_price_per_hour("v2-8", "us-central1-f", spot=False) == pytest.approx(4.50)
    assert cat.tpu_price_per_hour("v3-8", "europe-west4-a", spot=True) == pytest.approx(4 * 0.561)
    # No sampled spot price in europe-west4 for v2: the on-demand price stands in (errs high).
    assert cat.tpu_price_per_hour("v2-8", "europe-west4-a", spot=True) == pytest.approx(4 * 1.2375)
    # asia-east1 (a v2 zone) has its own billing price since 2026-11-28; before, the dearest known region's
    # 1.2375 stood in and the estimate erred low.
    assert cat.tpu_price_per_hour("v2-8", "asia-east1-c", spot=False) == pytest.approx(4 * 1.305)
    # No price at all for v2 in us-west4: the dearest known region stands in, for spot too (errs high).
    assert cat.tpu_price_per_hour("v2-8", "us-west4-a", spot=False) == pytest.approx(4 * 1.305)
    assert cat.tpu_price_per_hour("v2-8", "us-west4-a", spot=True) == pytest.approx(4 * 1.2375)
    assert cat.vm_price_per_hour("e2-standard-2", "us-central1-a") == pytest.approx(0.067)
    assert cat.vm_price_per_hour("n1-standard-1", "europe-west4-a") > 0.0475
    assert cat.storage_price_per_gb_month("us-central1") == pytest.approx(0.020)
    with pytest.raises(BadInput) as err:
        cat.vm_price_per_hour("e2-standard-3", "us-central1")
    assert err.value.field == "machine_type" and "e2-standard-2" in str(err.value)


def test_multi_host_v2_v3_slices_bill_googles_pod_prices(cat):
    """Billing Catalog 'Tpu-v2 Pod' / 'Tpu-v3 Pod' SKUs: a v2-32 bills 24.00/h in us-central1 where four v2-8s
    bill 18.00 (catalog_data.json `price_sources`); single-host slices and generations without pod SKUs keep the
    chip price."""
    assert cat.tpu_price_per_hour("v2-32", "us-central1-a", spot=False) == pytest.approx(16 * 1.50)
    assert cat.tpu_price_per_hour("v2-32", "us-central1-a", spot=True) == pytest.approx(16 * 0.3825)
    assert cat.tpu_price_per_hour("v3-32", "europe-west4-a", spot=True) == pytest.approx(16 * 0.66)
    assert cat.tpu_price_per_hour("v3-8", "europe-west4-a", spot=False) == pytest.approx(4 * 2.20)
    assert cat.tpu_price_per_hour("v5p-16", "us-east5-a", spot=False) == pytest.approx(8 * 4.20)
    # A region without a pod price: the dearest pod price known errs high.
    assert cat.tpu_price_per_hour("v2-32", "us-west4-a", spot=False) == pytest.approx(16 * 1.50)
    shown = catalog.accelerator_json(cat.accelerator("v2-32"), cat)["price_per_hour_by_region"]
    assert shown["us-central1"] == {"on_demand": 24.0, "spot": 6.12}


def test_every_generation_names_its_price_source_and_tpu7x_is_googles_list_price(cat):
    for gen in cat.generations():
        source = cat.price_source(gen)
        assert "2026-" in source and ("http" in source or "billing copy" in source), (gen, source)
    # Google's pricing page (quoted, retrieved 2026-09-24/25): 12.00 on demand; 8.40 was the 1-year commitment.
    assert cat.tpu_price_per_hour("tpu7x-8", "us-central1-c", spot=False) == pytest.approx(4 * 12.00)
    assert "ESTIMATE" in cat.price_source("tpu7x")
    # A v5e zone (us-west4-a) now bills its own region's price, not the dearest region's (europe-west4).
    assert cat.tpu_price_per_hour("v5litepod-8", "us-west4-a", spot=False) == pytest.approx(8 * 1.20)
    assert cat.tpu_price_per_hour("v5litepod-8", "us-west4-a", spot=True) == pytest.approx(8 * 0.48)


def test_region_of():
    assert catalog.region_of("us-central1-b") == "us-central1"
    assert catalog.region_of("europe-west4") == "europe-west4"


def test_refresh_cache_wins_over_embedded_prices_and_bad_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    from tpuctl import paths

    catalog.write_json_atomic(paths.catalog_cache(), {
        "fetched_at": "2026-11-23T00:00:00+00:00", "source": "test",
        "tpu_prices_per_chip_hour": {"v3": {"europe-west4": {"on_demand": 3.0}, "asia-east1": {"spot": 0.5}},
                                     "v9": {"mars-1": {"on_demand": 1.0}}}})
    cat = catalog.load()
    assert cat.tpu_price_per_hour("v3-8", "europe-west4-a", spot=False) == pytest.approx(12.0)
    assert cat.tpu_price_per_hour("v3-8", "europe-west4-a", spot=True) == pytest.approx(4 * 0.561)
    assert cat.tpu_prices("v3")["asia-east1"].spot == 0.5
    assert "test" in cat.prices_from
    # The overlay keeps the embedded pod price the cache did not name, and says where each price came from.
    assert cat.tpu_price_per_hour("v3-32", "europe-west4-a", spot=False) == pytest.approx(16 * 2.00)
    assert cat.price_source("v3").startswith("test fetched 2026-11-23") and "billing copy" in cat.price_source("v3")
    assert cat.price_source("v5e") == catalog.embedded_data()["price_sources"]["v5e"]
    paths.catalog_cache().write_text("{not json")
    assert catalog.load().tpu_price_per_hour("v3-8", "europe-west4-a", spot=False) == pytest.approx(8.8)


def test_data_carries_provenance():
    data = catalog.embedded_data()
    assert data["as_of"] and data["sources"]
    json.dumps(data)


def test_pod_runtime_on_a_single_host_is_accepted_as_google_samples_do(cat):
    assert cat.check("v3-8", "us-central1-a", "tpu-vm-tf-2.17.0-pod-pjrt").hosts == 1
    assert cat.check("v4-32", "us-central2-b", "tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below").hosts == 4


@pytest.mark.parametrize("accelerator,zone", [
    ("v5litepod-8", "us-east1-b"), ("v5litepod-8", "us-east1-c"), ("v5litepod-8", "us-west4-b"),
    ("v5litepod-8", "asia-east1-a"), ("v6e-8", "us-central1-a"), ("v6e-8", "us-central1-c"), ("v5p-8", "us-east1-d"),
    ("v3-8", "us-central1-f"), ("v2-8", "us-central1-f"),
])
def test_zones_only_older_copies_of_googles_page_list_are_refused_by_both_tables(cat, clients, accelerator, zone):
    """tpu/docs/regions-zones re-read on 2026-11-28 no longer lists these: tpuctl's catalog refuses them (exit 2)
    and strict localcloud, from its own table, answers a create there as Google answers a zone without the type."""
    from google.api_core import exceptions as gexc
    from google.cloud import tpu_v2

    with pytest.raises(BadInput) as err:
        cat.check(accelerator, zone, None)
    assert err.value.field == "zone"
    with pytest.raises(gexc.BadRequest, match="could not be found in the zonal accelerator configurations"):
        clients.tpu.create_node(parent=clients.parent(zone), node_id="gone",
                                node=tpu_v2.Node(accelerator_type=accelerator, runtime_version="tpu-vm-tf-2.17.0-pjrt"))
    assert "2026-11-28" in cat.source and "2 hosts of 8" in cat.source


def test_single_tenant_zones_are_offered_and_marked(cat):
    shown = catalog.accelerator_json(cat.accelerator("v5litepod-16"), cat)
    assert shown["single_tenant_zones"] == ["us-east5-a", "us-east5-b", "us-east5-c"]
    assert set(shown["single_tenant_zones"]) <= set(shown["zones"]) and "us-west4-a" in shown["zones"]
    assert cat.accelerator("v5litepod-16").hosts == 2  # the TPU API's 2 hosts of 8 chips, not GKE's 4-chip VMs
