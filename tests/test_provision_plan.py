"""plan(): validation before any API call, names, labels, the step DAG and its $/hour."""

from __future__ import annotations

import pytest

from tpuctl import catalog, spec
from tpuctl import provision as prov
from tpuctl.errors import BadInput
from tpuctl.provision import labels as L

NOW = 1_800_000_000.0


def make(**fields):
    return prov.plan(spec.from_mapping({"accelerator": "v3-8", "zone": "europe-west4-a", **fields}),
                     project="proj-1", owner="alice", now=NOW)


def test_single_host_plan():
    p = make(name="r1", ttl="2h", vms=[{"name": "driver"}], labels={"team": "nlp"})
    assert [s.key for s in p.steps] == ["bucket", "bucket-iam", "tpu", "vm:driver"]
    assert dict((s.key, s.after) for s in p.steps)["bucket-iam"] == ("bucket",)
    assert p.region == "europe-west4" and p.runtime_version == catalog.load().accelerator("v3-8").default_runtime
    assert p.labels == {"team": "nlp", L.RUN: "r1", L.OWNER: "alice", L.CREATED: str(int(NOW)),
                        L.EXPIRES: str(int(NOW + 7200))}
    assert p.bucket == L.auto_bucket("proj-1", "r1") and p.vm_name(p.vms[0]) == "r1-driver"
    cat = catalog.load()
    expected = cat.tpu_price_per_hour("v3-8", "europe-west4", False) + cat.vm_price_per_hour("e2-standard-2", "europe-west4")
    assert p.price_per_hour == pytest.approx(expected)
    assert p.to_json()["steps"][2]["kind"] == "tpu"


def test_spot_is_cheaper_and_queued_is_a_queued_resource():
    assert make(provisioning="spot").price_per_hour < make().price_per_hour
    q = make(provisioning="queued", valid_until="6h")
    assert q.steps[2].kind is prov.Kind.QUEUED and q.valid_until_s == 6 * 3600


def test_multi_host_gets_a_pod_runtime():
    p = prov.plan(spec.from_mapping({"accelerator": "v4-32", "zone": "us-central2-b"}), project="p", owner="a")
    assert p.accelerator.hosts == 4 and "-pod" in p.runtime_version


def test_default_name_is_deterministic_for_idempotent_re_up():
    assert make().run == make().run == "alice-v3-8"


def test_bucket_by_name_and_url():
    assert make(bucket="gs://my-bucket/").bucket == "my-bucket"


def test_failover_zones_same_region_first():
    p = make(zone=["us-central1-a", "europe-west4-a", "us-central1-b"], allow_cross_region=True)
    assert p.zones == ("us-central1-a", "us-central1-b", "europe-west4-a")
    assert p.notes and "cross-region" in p.notes[0]


@pytest.mark.parametrize("fields,field", [
    ({"accelerator": "v3-9"}, "accelerator"),
    ({"accelerator": None}, "accelerator"),
    ({"zone": []}, "zone"),
    ({"zone": "us-central2-b"}, "zone"),  # v3-8 is not offered there
    # v3 slices are offered in europe-west4-a only, v2 slices in us-central1-a and europe-west4-a (regions-zones)
    ({"accelerator": "v3-32", "zone": "us-central1-a", "runtime_version": "tpu-vm-tf-2.17.0-pod-pjrt"}, "zone"),
    ({"accelerator": "v2-32", "zone": "us-central1-b", "runtime_version": "tpu-vm-tf-2.17.0-pod-pjrt"}, "zone"),
    ({"zone": ["europe-west4-a", "us-central1-a"]}, "zone"),  # outside the bucket's region
    ({"runtime_version": "v2-alpha-tpuv6e"}, "runtime_version"),  # another generation's image
    ({"accelerator": "v3-32", "runtime_version": "tpu-vm-tf-2.17.0-pjrt"}, "runtime_version"),  # pod needs -pod
    ({"name": "Bad_Name"}, "name"),
    ({"name": "1abc"}, "name"),
    ({"name": ""}, "name"),  # an empty name is a bad name, not "pick one for me"
    ({"bucket": "my-google-bucket"}, "bucket"),
    ({"bucket": "ab"}, "bucket"),
    # Python's `$` matches before a final newline: the rules are whole-string matches (hypothesis found "00a\n").
    ({"bucket": "00a\n"}, "bucket"),
    ({"name": "abc\n"}, "name"),
    ({"service_account": "not-an-email"}, "service_account"),
    ({"labels": {"Team": "x"}}, "labels"),
    ({"labels": {"team": "NLP"}}, "labels"),
    ({"labels": {L.RUN: "other"}}, "labels"),
    ({"vms": [{"name": "x", "machine_type": "e2-gigantic"}]}, "machine_type"),
    ({"vms": [{"name": "X_1"}]}, "vms.0.name"),
    ({"tags": ["Bad Tag"]}, "tags"),
])
def test_bad_input_names_the_field(fields, field):
    with pytest.raises(BadInput) as e:
        make(**fields)
    assert e.value.field == field and e.value.exit_code == 2


def test_owner_is_tpuctl_owner_else_the_login_name(monkeypatch):
    monkeypatch.setenv("USER", "Alice")
    monkeypatch.setenv("LOGNAME", "Alice")
    monkeypatch.delenv("TPUCTL_OWNER", raising=False)
    assert L.owner() == "alice"
    monkeypatch.setenv("TPUCTL_OWNER", "ML Infra Bot")
    assert L.owner() == "ml-infra-bot"
    plan = prov.plan(spec.from_mapping({"name": "r1", "accelerator": "v3-8", "zone": "europe-west4-a"}), project="p-1")
    assert plan.labels[L.OWNER] == "ml-infra-bot"


def test_label_helpers():
    assert L.label_value("Alice.Smith@X") == "alice-smith-x"
    assert L.suggest_name("My Run!") == "my-run"
    assert L.matches({L.RUN: "a"}, "a") and not L.matches({L.RUN: "a"}, "b") and not L.matches({}, None)
    assert len(L.auto_bucket("p", "r" * 40)) <= 63
    L.check_bucket_name(L.auto_bucket("p", "r" * 40))
