"""RunSpec: strict fields, durations, zone lists, legacy TPU Node refusal and --migrate."""

from __future__ import annotations

import pytest

from tpuctl import spec
from tpuctl.errors import BadInput


def test_minimal_spec_gets_defaults():
    s = spec.from_mapping({"accelerator": "v3-8", "zone": "europe-west4-a"})
    assert s.zones == ("europe-west4-a",)
    assert (s.provisioning, s.bucket, s.service_account, s.ttl) == ("on-demand", "auto", "default", "1d")
    assert s.job is None and not s.spot


@pytest.mark.parametrize("zone", [["us-central1-a", "us-central1-b"], "us-central1-a,us-central1-b",
                                  " us-central1-a , us-central1-b,us-central1-a"])
def test_zone_forms_become_an_ordered_failover_list(zone):
    assert spec.from_mapping({"zone": zone}).zones == ("us-central1-a", "us-central1-b")


@pytest.mark.parametrize("text,seconds,normal", [("2h", 7200, "2h"), ("90m", 5400, "90m"), ("1d12h", 129600, "36h"),
                                                 (3600, 3600, "1h"), ("45s", 45, "45s"), ("1.1h", 3960, "66m"),
                                                 ("0.5m", 30, "30s")])
def test_durations(text, seconds, normal):
    s = spec.from_mapping({"ttl": text})
    assert (s.ttl_s, s.ttl) == (seconds, normal)


@pytest.mark.parametrize("raw", [{"ttl": 0.5}, {"ttl": "0.4s"}, {"ttl": "1.5"},
                                 {"provisioning": "queued", "valid_until": "90.5s"},
                                 {"provisioning": "flex-start", "max_run_duration": "3600.5"},
                                 {"bucket_soft_delete": "604800.5"}])
def test_a_fraction_of_a_second_is_refused_not_rounded(raw):
    """A duration is whole seconds: 1.5 became 2s unsaid, and 0.4s became 0s, which `ttl_s` then refused with a
    traceback (parsed again outside validation)."""
    field = next(k for k in raw if k != "provisioning")
    with pytest.raises(BadInput) as e:
        spec.from_mapping(raw)
    assert e.value.field == field and "whole number of seconds" in e.value.message


@pytest.mark.parametrize("raw,field", [
    ({"zonez": "a"}, "zonez"),
    ({"ttl": "2 fortnights"}, "ttl"),
    ({"ttl": 0}, "ttl"),
    ({"provisioning": "cheap"}, "provisioning"),
    ({"valid_until": "2h"}, "valid_until"),
    ({"vms": [{"name": "a"}, {"name": "a"}]}, "vms"),
    ({"vms": [{"name": "a", "cpus": 2}]}, "vms.0.cpus"),
    ({"job": {"data": {"corpus": ["x"], "vocab": 3}}}, "job.data.vocab"),
    ({"job": {"env": {"OK": "1", "BAD KEY;x": "2"}}}, "job.env"),
    ({"job": {"env": {"9LIVES": "1"}}}, "job.env"),
    ({"zone": "a", "zones": ["b"]}, "spec"),
])
def test_bad_fields_are_named(raw, field):
    with pytest.raises(BadInput) as e:
        spec.from_mapping(raw)
    assert e.value.field == field and e.value.exit_code == 2


def test_queued_with_valid_until():
    s = spec.from_mapping({"provisioning": "queued", "valid_until": "6h"})
    assert s.queued and s.valid_until_s == 6 * 3600


def test_job_section():
    s = spec.from_mapping({"job": {"preset": "bert-tiny", "data": {"corpus": "examples/data/*.txt"},
                                   "config": {"steps": 100}, "env": {"A": "1"}}})
    assert s.job.template == "bert" and s.job.data.corpus == ["examples/data/*.txt"]
    assert s.job.max_recoveries == 3 and s.job.config == {"steps": 100}


@pytest.mark.parametrize("raw", [{"tensorflow_version": "2.12.0"}, {"tensorflowVersion": "2.12"},
                                 {"runtime_version": "2.12.0"}, {"api_version": "v1"}])
def test_legacy_tpu_node_is_refused_with_the_retirement_date(raw):
    with pytest.raises(BadInput) as e:
        spec.from_mapping({"accelerator": "v3-8", **raw})
    assert spec.TPU_NODE_RETIRED in e.value.message and "--migrate" in e.value.hint


def test_migrate_turns_a_tpu_node_into_the_closest_tpu_vm_runtime():
    s = spec.from_mapping({"accelerator": "v3-8", "tensorflow_version": "2.16.1"}, migrate=True)
    assert s.runtime_version == "tpu-vm-tf-2.16.1-pjrt"
    pod = spec.from_mapping({"accelerator": "v3-32", "tensorflow_version": "2.12.0"}, migrate=True)
    assert pod.runtime_version.endswith("-pod") or "-pod-" in pod.runtime_version


def test_read_file_errors(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        spec.read_file(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(BadInput, match="mapping"):
        spec.read_file(bad)


def test_example_spec_is_valid():
    from pathlib import Path

    s = spec.load(Path(__file__).parent.parent / "examples" / "bert-tiny.yaml")
    assert s.accelerator == "v3-8" and s.zones[0] == "europe-west4-a" and s.ttl == "2h"
    assert s.job.preset == "bert-tiny"
