"""tpuctl and Cloud Storage's rules: bucket names checked up front, another project's bucket never adopted, soft
delete off unless asked (and said so in the plan), the narrow grant, and soft-deleted bytes in `tpuctl cost`."""

from __future__ import annotations

import json
import time

import pytest
from conftest import new_project, tpuctl_here
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from test_provision import FAST_DEADLINE, everything, make_plan
from test_up_down import UP

from tpuctl import cost, ledger, spec
from tpuctl import provision as prov
from tpuctl.catalog import load as load_catalog
from tpuctl.errors import BadInput
from tpuctl.provision import bucket as B
from tpuctl.provision import labels as L

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("name,rule", [("192.168.5.4", "IP address"), ("my-google-bucket", "'google'"),
                                       ("my-g00gle-bucket", "'google'"), ("goog-bucket", "'goog'"),
                                       ("a" * 64, "3-63 characters"), ("Caps", "lowercase"),
                                       ("dots." + "a" * 64, "dot-separated part")])
def test_a_bad_bucket_name_is_refused_before_anything_naming_the_rule(name, rule):
    raw = {"name": "run1", "accelerator": "v3-8", "zone": "europe-west4-a", "bucket": name}
    with pytest.raises(BadInput) as refused:
        prov.plan(spec.from_mapping(raw), project="my-project", owner="tester")
    assert refused.value.field == "bucket" and rule in refused.value.message


def test_the_cli_says_it_in_one_line_and_exits_2(env, pc):
    p = tpuctl_here(env, *UP, "--bucket", "my-google-bucket")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: bucket: 'my-google-bucket' is not a valid bucket name: must not contain "
                               "'google'"), p.stderr
    assert everything(pc) == []


def test_long_dotted_names_pass_and_auto_names_are_always_valid():
    L.check_bucket_name(".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 30]))
    for run in ("google-test", "g00gle", "x" * 40, "a"):
        name = L.auto_bucket("my-project", run)
        assert L.bucket_name_problem(name) is None, name


def test_a_bucket_name_taken_by_another_project_is_refused_not_adopted(pc, cloud):
    other = storage.Client(project=new_project(), credentials=AnonymousCredentials())
    plan = make_plan(pc, bucket="taken-elsewhere-1")
    other.create_bucket(other.bucket("taken-elsewhere-1"), location="europe-west4")
    with pytest.raises(BadInput) as refused:
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert refused.value.field == "bucket" and "taken by another project" in refused.value.message
    assert "bucket: auto" in refused.value.hint
    assert everything(pc) == [], "nothing created, and the other project's bucket not touched"
    assert other.get_bucket("taken-elsewhere-1").labels == {}


def test_a_create_conflict_with_another_project_is_one_bad_input(pc, cloud):
    other = storage.Client(project=new_project(), credentials=AnonymousCredentials())
    other.create_bucket(other.bucket("raced-name-1"), location="europe-west4")
    with pytest.raises(BadInput, match="taken by another project"):
        B.ensure(pc, "raced-name-1", "europe-west4", {L.RUN: "r"})


def test_buckets_are_created_with_soft_delete_off_and_the_plan_says_so(env, pc):
    p = tpuctl_here(env, *UP, "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)["plan"]
    assert plan["bucket_soft_delete"] == "0s"
    bucket_step = next(s for s in plan["steps"] if s["key"] == "bucket")
    assert "soft delete off" in bucket_step["detail"]
    result = prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    b = pc.storage.get_bucket(result.get(prov.Kind.BUCKET).name)
    assert b.soft_delete_policy.retention_duration_seconds == 0


def test_a_chosen_soft_delete_retention_is_validated_and_applied(env, pc):
    p = tpuctl_here({**env, "TPUCTL_BUCKET_SOFT_DELETE": "3d"}, *UP, "--dry-run")
    assert p.returncode == 2 and p.stderr.startswith("error: bucket_soft_delete:") and "7 to 90 days" in p.stderr
    p = tpuctl_here({**env, "TPUCTL_BUCKET_SOFT_DELETE": "14d"}, *UP, "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    assert "soft delete 14d" in next(s for s in json.loads(p.stdout)["plan"]["steps"] if s["key"] == "bucket")["detail"]
    plan = make_plan(pc, bucket_soft_delete="14d")
    prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert pc.storage.get_bucket(plan.bucket).soft_delete_policy.retention_duration_seconds == 14 * 86400


def test_the_tpu_service_account_gets_object_user_on_the_bucket_only(pc):
    plan = make_plan(pc)
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    sa = f"serviceAccount:{result.service_account}"
    assert [r for r, m in B.bindings(pc, plan.bucket) if m == sa] == ["roles/storage.objectUser"]
    assert "objectUser" in next(s for s in plan.steps if s.key == "bucket-iam").detail


def test_revoke_also_removes_the_role_earlier_versions_granted(pc):
    plan = make_plan(pc)
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    b = pc.storage.bucket(plan.bucket)
    policy = b.get_iam_policy(requested_policy_version=3)
    policy.bindings.append({"role": "roles/storage.objectAdmin", "members": {f"serviceAccount:{result.service_account}"}})
    b.set_iam_policy(policy)
    B.revoke(pc, plan.bucket, result.service_account)
    assert not [m for _r, m in B.bindings(pc, plan.bucket) if result.service_account in m]


def test_soft_deleted_bytes_of_a_deleted_bucket_are_in_tpuctl_cost(pc, env, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", env["TPUCTL_HOME"])
    plan = make_plan(pc, bucket_soft_delete="30d")
    prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    b = pc.storage.bucket(plan.bucket)
    b.blob("ckpt/1").upload_from_string(b"c" * 2_000_000)
    b.blob("ckpt/1").delete()  # a rotated checkpoint: soft-deleted for 30 days
    b.blob("ckpt/2").upload_from_string(b"c" * 3_000_000)
    before = time.time()
    B.delete(pc, plan.bucket)
    entries = [e for e in ledger.Ledger().entries() if e.kind == ledger.SOFT_DELETED]
    assert len(entries) == 1
    entry = entries[0]
    assert entry.run == "run1" and entry.gb == pytest.approx(0.005)
    assert entry.deleted - entry.created == pytest.approx(30 * 86400, abs=60)
    catalog = load_catalog()
    month = cost.report(entries, catalog, since=before, now=before + 30 * 86400)
    expected = 0.005 * catalog.storage_price_per_gb_month("europe-west4") * 30 * 24 / cost.HOURS_PER_MONTH
    assert month.total_usd == pytest.approx(expected, rel=0.01)
    now = cost.report(entries, catalog, since=before, now=time.time() + 1)
    assert now.rows[0].live == 1 and now.usd_per_hour_now > 0, "still billing after the bucket is gone"


def test_no_soft_delete_entry_when_soft_delete_is_off(pc, env, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", env["TPUCTL_HOME"])
    plan = make_plan(pc)
    prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    pc.storage.bucket(plan.bucket).blob("x").upload_from_string(b"x" * 1000)
    B.delete(pc, plan.bucket)
    assert [e for e in ledger.Ledger().entries() if e.kind == ledger.SOFT_DELETED] == []
    assert spec.from_mapping({}).bucket_soft_delete_s == 0
