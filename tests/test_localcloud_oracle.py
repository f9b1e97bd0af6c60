"""localcloud as an independent oracle: its own facts, consistent with Google's protos, sharing no tpuctl code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from google.cloud import tpu_v2

from tpuctl.localcloud import facts
from tpuctl.localcloud.schema import Validator

LOCALCLOUD = Path(__file__).resolve().parent.parent / "localcloud"


@pytest.mark.parametrize("path", sorted(LOCALCLOUD.glob("*.py")), ids=lambda p: p.name)
def test_localcloud_imports_nothing_from_tpuctl(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] in ("tpuctl", "provision", "jobs") for a in node.names), ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert (node.module or "").split(".")[0] not in ("tpuctl", "provision", "jobs"), ast.unparse(node)


@pytest.mark.parametrize("name,zones", [
    ("v2-8", ("us-central1-b", "us-central1-c", "europe-west4-a", "asia-east1-c")),
    ("v2-32", ("us-central1-a", "europe-west4-a")), ("v2-512", ("us-central1-a", "europe-west4-a")),
    ("v3-8", ("us-central1-a", "us-central1-b", "europe-west4-a")),
    ("v3-32", ("europe-west4-a",)), ("v3-2048", ("europe-west4-a",)),
])
def test_v2_and_v3_zones_depend_on_the_size(name, zones):
    """tpu/docs/regions-zones lists v2 and v3 zones per size: slices are in fewer zones than a single host."""
    assert facts.TPU_TYPES[name].zones == zones


@pytest.mark.parametrize("name,chips,hosts,topology", [
    ("v2-8", 4, 1, "2x2"), ("v2-32", 16, 4, "4x4"), ("v3-8", 4, 1, "2x2"), ("v3-32", 16, 4, "4x4"),
    ("v4-8", 4, 1, "2x2x1"), ("v4-32", 16, 4, "2x2x4"), ("v5litepod-1", 1, 1, "1x1"), ("v5litepod-8", 8, 1, "2x4"),
    ("v5litepod-16", 16, 2, "4x4"), ("v5p-8", 4, 1, "2x2x1"), ("v5p-16", 8, 2, "2x2x2"), ("v6e-8", 8, 1, "2x4"),
    ("v6e-256", 256, 32, "16x16"),
])
def test_slice_shapes_follow_the_published_rules(name, chips, hosts, topology):
    t = facts.TPU_TYPES[name]
    assert (t.chips, t.hosts, t.topology) == (chips, hosts, topology)


def test_api_type_names_are_the_protos_with_their_non_contiguous_numbers():
    numbers = {name: tpu_v2.AcceleratorConfig.Type[name].value for name in facts.API_TYPE.values()}
    assert numbers == {"V2": 2, "V3": 4, "V4": 7, "V5LITE_POD": 9, "V5P": 10, "V6E": 11}


def test_every_zone_offering_a_type_has_an_on_demand_price_for_it():
    missing = sorted({(t.generation, facts.region_of(z)) for t in facts.TPU_TYPES.values() for z in t.zones
                      if facts.tpu_price(t.generation, facts.region_of(z), spot=False) is None})
    assert missing == []


def test_project_numbers_are_stable_twelve_digit_strings():
    assert facts.project_number("my-project") == facts.project_number("my-project")
    assert facts.project_number("my-project") != facts.project_number("my-projects")
    assert len(facts.project_number("x")) == 12


@pytest.mark.parametrize("doc", ["tpu.v2", "cloudresourcemanager.v3", "cloudbilling.v1", "storage.v1"])
def test_every_schema_converts_compiles_and_accepts_an_empty_object(doc):
    v = Validator(doc)
    for name, schema in v.doc["schemas"].items():
        if schema.get("type", "object") == "object":
            assert v.check_request(name, {}) == [] and v.check_response(name, {}) == [], name
