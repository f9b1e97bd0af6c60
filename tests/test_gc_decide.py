"""gc's decision rules, on resources as the provisioning layer reports them (no cloud needed)."""

from __future__ import annotations

import pytest

from tpuctl.provision import gc
from tpuctl.provision.resources import Kind, Resource, State

NOW = 1_800_000_000.0


def res(name, run="r1", owner="ann", kind=Kind.TPU, state=State.READY, expires=None, labelled=True):
    labels = {}
    if labelled:
        labels = {"tpuctl-run": run, "tpuctl-owner": owner, "tpuctl-created": str(int(NOW - 3600))}
        if expires is not None:
            labels["tpuctl-expires"] = str(int(expires))
    loc = "us-central1" if kind == Kind.BUCKET else "us-central1-b"
    return Resource(kind=kind, name=name, project="p", location=loc, state=state, labels=labels, created=None,
                    run=labels.get("tpuctl-run"), accelerator="v2-8" if kind == Kind.TPU else None)


def policy(**kw):
    base = dict(now=NOW, owner="ann", idle_s=1800.0)
    base.update(kw)
    return gc.Policy(**base)


def deleted(actions):
    return sorted(a.resource.name for a in actions if a.verdict == "delete")


def test_expired_run_goes_whole_but_not_its_bucket():
    rs = [res("tpu", expires=NOW - 1), res("vm", kind=Kind.VM, expires=NOW + 999),
          res("bkt", kind=Kind.BUCKET, expires=NOW + 999), res("q", kind=Kind.QUEUED, expires=NOW + 999)]
    acts = gc.decide(rs, {}, {}, policy())
    assert deleted(acts) == ["q", "tpu", "vm"]
    assert all(a.reasons == ("expired",) for a in acts)


def test_unexpired_and_unlabelled_survive():
    rs = [res("young", expires=NOW + 60), res("stranger", labelled=False, state=State.PREEMPTED),
          res("no-ttl")]
    assert gc.decide(rs, {}, {}, policy()) == []


def test_label_without_owner_is_not_ours():
    r = res("half")
    r = Resource(**{**r.__dict__, "labels": {"tpuctl-run": "r1", "tpuctl-expires": "1"}})
    assert not gc.ours(r)
    assert gc.decide([r], {}, {}, policy()) == []


@pytest.mark.parametrize("status,reason", [
    (gc.JobStatus("succeeded", NOW), "finished"),
    (gc.JobStatus("failed", NOW), "failed"),
    (gc.JobStatus("cancelled", NOW), "cancelled"),
    (gc.JobStatus("running", NOW - 1801), "idle"),
    (gc.JobStatus("running", None), "idle"),
])
def test_job_status_rules(status, reason):
    acts = gc.decide([res("tpu")], {"r1": status}, {}, policy())
    assert [a.reasons for a in acts] == [(reason,)]


def test_a_final_status_older_than_the_runs_compute_is_an_earlier_jobs():
    # res() labels resources created an hour ago; a "succeeded" written two hours ago predates them.
    assert gc.decide([res("tpu")], {"r1": gc.JobStatus("succeeded", NOW - 7200)}, {}, policy()) == []
    assert gc.decide([res("tpu")], {"r1": gc.JobStatus("failed", NOW - 7200)}, {}, policy()) == []


def test_fresh_heartbeat_and_missing_status_keep_the_run():
    assert gc.decide([res("tpu")], {"r1": gc.JobStatus("running", NOW - 60)}, {}, policy()) == []
    assert gc.decide([res("tpu")], {"r1": None}, {}, policy()) == []
    assert gc.decide([res("tpu")], {"r1": gc.JobStatus("running", NOW - 9999)}, {}, policy(idle_s=None)) == []


def test_preempted_goes_unless_recovering():
    rs = [res("tpu", state=State.PREEMPTED)]
    assert deleted(gc.decide(rs, {}, {}, policy())) == ["tpu"]
    recovering = gc.JobStatus("running", NOW - 9999, recovering=True)
    assert gc.decide(rs, {"r1": recovering}, {}, policy()) == []
    # TTL stays a hard limit even while recovering.
    rs = [res("tpu", state=State.PREEMPTED, expires=NOW - 1)]
    assert [a.reasons for a in gc.decide(rs, {"r1": recovering}, {}, policy())] == [("expired",)]


def test_budget_per_run_and_per_owner():
    rs = [res("a", run="r1"), res("b", run="r2")]
    accrued = {"r1": 6.0, "r2": 5.0}
    assert deleted(gc.decide(rs, {}, accrued, policy(budget_usd=5.5))) == ["a"]
    assert deleted(gc.decide(rs, {}, accrued, policy(budget_usd=10.0, budget_per="owner"))) == ["a", "b"]
    assert gc.decide(rs, {}, accrued, policy(budget_usd=12.0, budget_per="owner")) == []


def test_other_owners_are_skipped_unless_all_owners():
    rs = [res("mine", expires=NOW - 1), res("theirs", run="r2", owner="bob", expires=NOW - 1)]
    acts = gc.decide(rs, {}, {}, policy())
    assert deleted(acts) == ["mine"]
    skip = [a for a in acts if a.verdict == "skip"]
    assert [a.resource.name for a in skip] == ["theirs"] and "--all-owners" in skip[0].why
    assert deleted(gc.decide(rs, {}, {}, policy(all_owners=True))) == ["mine", "theirs"]


def test_same_run_name_different_owners_are_separate_runs():
    rs = [res("mine", run="r1", expires=NOW - 1), res("theirs", run="r1", owner="bob", expires=NOW + 999)]
    assert deleted(gc.decide(rs, {}, {}, policy(all_owners=True))) == ["mine"]


def test_buckets_only_with_flag_and_own_ttl():
    rs = [res("bkt", kind=Kind.BUCKET, expires=NOW - 1), res("tpu", expires=NOW - 1),
          res("bkt2", run="r2", kind=Kind.BUCKET, expires=NOW + 60)]
    assert deleted(gc.decide(rs, {}, {}, policy())) == ["tpu"]
    assert deleted(gc.decide(rs, {}, {}, policy(buckets=True))) == ["bkt", "tpu"]


def test_record_is_json_ready():
    import json

    a = gc.decide([res("tpu", expires=NOW - 1)], {}, {}, policy())[0]
    rec = json.loads(json.dumps(a.record()))
    assert rec["verdict"] == "delete" and rec["kind"] == "tpu" and rec["reasons"] == ["expired"]
