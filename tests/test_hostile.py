"""Hostile and bad input: property tests over spec files and `tpuctl up` arguments, and hostile job values
on a real local-cloud worker.

Every invalid input must exit 2 with one `error: FIELD: ...` line naming the field (plus an optional hint
line), and the local cloud must show that nothing was created.
"""

from __future__ import annotations

import io
import json
import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import cloud_stack
import yaml
from conftest import tpuctl_here
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tpuctl import catalog as catalog_mod
from tpuctl import spec as spec_mod
from tpuctl.catalog import region_of
from tpuctl.errors import BadInput

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]


VALID = {"name": "ok-run", "zone": "us-central1-a", "accelerator": "v3-8"}
HOSTILE_TEXT = ["$(touch PWNED)", "`touch PWNED2`", "a; touch PWNED3", "x\ny", "it's", 'say "hi"', "--x=$HOME",
                "*", "é漢字🙂", "a" * 300, "../../etc/passwd", "-rf", "a|b&c>d<e", "\x00nul", "${IFS}"]
CANARY = "PWNED"

# Text that may carry shell metacharacters, newlines, unicode and great length.
hostile = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(min_size=1, max_size=80),
                    st.text(alphabet="$`;|&<>()'\"\\\n *?~{}", min_size=1, max_size=20),
                    st.text(min_size=64, max_size=400))


@pytest.fixture(scope="module")
def stack():
    with cloud_stack.Stack() as s:
        yield s


def _invoke(stack, args: list[str]) -> tuple[int, str]:
    """Run the CLI in-process (a subprocess per hypothesis example would cost seconds); returns (exit code,
    what it wrote to stderr). tpuctl's console holds the real stderr, so it is pointed at a buffer here."""
    from tpuctl import console
    from tpuctl.cli import cli

    buf = io.StringIO()
    saved = console.err
    console.err = console._console(buf)
    try:
        result = CliRunner().invoke(cli, args, env={**stack.env, "USER": "hostile", "LOGNAME": "hostile"},
                                    catch_exceptions=False)
    finally:
        console.err = saved
    return result.exit_code, buf.getvalue()


def _assert_rejected(stack, result, fields: tuple[str, ...], tmp: Path) -> None:
    code, err = result
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, (code, err)
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1, err
    assert any(re.match(rf"error: {re.escape(f)}\b", errors[0]) for f in fields), (fields, errors[0])
    assert all(l.startswith(("error:", "  hint:")) for l in lines), err
    assert stack.live() == [], "nothing may be created on bad input"
    assert not list(tmp.rglob(f"{CANARY}*")) and not list(Path.cwd().glob(f"{CANARY}*"))


# ------------------------------------------------------------------------------------------ spec files

# The rules come from their sources, not from the code under test: the catalog's data (Google's types, their
# zones, runtimes and provisioning models), Google's naming rules (RFC 1035 resource names; Cloud Storage
# bucket names, cloud.google.com/storage/docs/buckets#naming; labels, cloud.google.com/compute/docs/labeling-
# resources), the README's duration grammar and Google's bounds (a flex-start TPU runs 30s to 7d and waits at most
# 2h: tpu/docs/request-using-flex-start, compute/docs/instances/limit-vm-runtime; soft delete 0 or 7d to 90d:
# storage/docs/soft-delete), and two limits of tpuctl's own, marked. Valid specs are built from them and must
# plan; each invalid spec is a valid one with exactly one rule broken, so it must be refused with one error
# naming that field.
CATALOG = catalog_mod.Catalog(catalog_mod.embedded_data())
TYPES = CATALOG.accelerators()
ALL_ZONES = sorted({z for t in TYPES for z in t.zones})
ALL_RUNTIMES = sorted({r for t in TYPES for r in t.runtimes})
PROVISIONING = ("on-demand", "spot", "preemptible", "queued", "flex-start")
RUN_NAME_MAX = 40  # tpuctl's own limit on a run name: room for the VM and bucket names made from it
LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DAY = 86400
# A spec's fields, as the README and examples/ document them (`zone` is how specs spell `zones`); any other
# key is unknown.
SPEC_FIELDS = {"name", "zone", "zones", "accelerator", "provisioning", "runtime_version", "ttl", "bucket",
               "bucket_soft_delete", "labels", "service_account", "network", "subnet", "internal_ips", "tags",
               "allow_cross_region", "project", "max_run_duration", "valid_until", "vms", "job"}
# The fields `up` takes as flags too.
FLAGS = {"name": "--name", "accelerator": "--accelerator", "zone": "--zone", "ttl": "--ttl", "bucket": "--bucket",
         "service_account": "--service-account", "runtime_version": "--runtime-version"}


def _chars_except(allowed: str):
    """Any character but `allowed` (surrogates cannot be written to a file; "/" is the bucket's own separator,
    stripped from `gs://name/`)."""
    return st.characters(blacklist_categories=("Cs",), blacklist_characters=allowed + "/")


def _rfc1035(max_len: int):
    """Names Google takes for TPU nodes and Compute instances: a lowercase letter, then letters, digits or -,
    not ending in -."""
    return st.from_regex(rf"[a-z]([-a-z0-9]{{0,{max_len - 2}}}[a-z0-9])?", fullmatch=True)


def _bad_rfc1035(max_len: int, *, prefixed: bool = False) -> list:
    """Names breaking exactly one RFC 1035 rule, one strategy per rule. `prefixed`: the name follows `RUN-` (a
    VM's), so a leading digit or - is allowed there."""
    good = _rfc1035(max_len)
    cases = [
        good.map(lambda s: s + "-"),  # ends with -
        st.tuples(good, st.integers(0, 60), _chars_except(LOWER + DIGITS + "-")).map(
            lambda a: a[0][:a[1]] + a[2] + a[0][a[1]:]),  # a character outside [a-z0-9-], uppercase included
        st.from_regex(rf"[a-z][a-z0-9]{{{max_len},{max_len + 30}}}", fullmatch=True),  # too long
    ]
    if not prefixed:
        cases.append(st.tuples(st.sampled_from(DIGITS + "-"), good).map("".join))  # not starting with a letter
    return cases


def _google_like(name: str) -> bool:
    return name.startswith("goog") or re.search(r"g[o0]{2}g[l1]e", name) is not None


def _bucket():
    """Cloud Storage names: 3-63 of [a-z0-9_-] (dotted: parts of 1-63, 222 in all), a letter or digit at both
    ends, not an IP address, not starting with goog, not containing google or a close misspelling."""
    plain = st.from_regex(r"[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]", fullmatch=True)
    dotted = st.lists(st.from_regex(r"[a-z0-9]([a-z0-9_-]{0,20}[a-z0-9])?", fullmatch=True), min_size=2,
                      max_size=4).map(".".join)
    return st.one_of(plain, dotted).filter(lambda n: not _google_like(n) and not re.fullmatch(r"[\d.]+", n))


def _bad_bucket() -> list:
    good = _bucket()
    return [
        st.from_regex(r"[a-z0-9]{1,2}", fullmatch=True),  # too short
        st.from_regex(r"[a-z0-9]{64,90}", fullmatch=True),  # too long without dots
        st.tuples(st.from_regex(r"[a-z0-9]{64,70}", fullmatch=True), good).map(".".join),  # a part too long
        st.tuples(good, st.sampled_from("-_.")).map("".join),  # not ending in a letter or digit
        st.tuples(st.sampled_from("-_."), good).map("".join),  # not starting with one
        st.tuples(good, st.integers(1, 60), _chars_except(LOWER + DIGITS + "-_.")).map(
            lambda a: a[0][:a[1]] + a[2] + a[0][a[1]:]).filter(lambda n: not n.startswith("gs:")),
        st.tuples(good, good).map("..".join),  # an empty dot-separated part
        st.tuples(*[st.integers(0, 255)] * 4).map(lambda ip: ".".join(map(str, ip))),  # an IP address
        good.map(lambda n: "goog" + n),
        st.tuples(good, st.sampled_from(["google", "g00gle", "go0gle"])).map(  # Google's example misspelling
            lambda a: a[0][:3] + a[1] + a[0][3:]),
    ]


def _duration(low_s: float, high_s: float):
    """A duration in the README's grammar ("90m", "1h30m", "3600" or a number of seconds) within bounds."""
    def text(s: int):
        parts, rest = [], s
        for u, size in sorted(UNITS.items(), key=lambda kv: -kv[1]):
            if rest >= size:
                parts.append(f"{rest // size}{u}")
                rest %= size
        return "".join(parts)

    seconds = st.integers(int(math.ceil(low_s)), int(high_s))
    return st.one_of(seconds, seconds.map(str), seconds.map(text))


def _not_a_duration() -> list:
    """Zero, negative, not finite, or text that is not digits with units of s, m, h, d, w."""
    return [
        st.integers(max_value=0), st.floats(max_value=0, allow_nan=False), st.sampled_from([math.nan, math.inf]),
        st.tuples(st.integers(1, 99), st.sampled_from(sorted(set(LOWER) - set(UNITS)))).map(
            lambda a: f"{a[0]}{a[1]}"),  # a unit that is not one
        st.tuples(st.sampled_from(sorted(UNITS)), st.integers(1, 99)).map(lambda a: f"{a[0]}{a[1]}"),
        st.sampled_from(sorted(UNITS)).map(lambda u: f"0{u}"),
        st.text(max_size=20).filter(lambda v: not any(c.isdigit() for c in v)),  # no number at all
    ]


def _labels():
    key = st.from_regex(r"[a-z][a-z0-9_-]{0,62}", fullmatch=True).filter(lambda k: not k.startswith("tpuctl-"))
    return st.dictionaries(key, st.from_regex(r"[a-z0-9_-]{0,63}", fullmatch=True), max_size=3)


def _bad_labels() -> list:
    good_key = st.from_regex(r"[a-z][a-z0-9_-]{0,30}", fullmatch=True)
    ascii_bad = st.sampled_from(sorted(set(map(chr, range(32, 127))) - set(LOWER + DIGITS + "_-")))
    return [
        # a key not starting with a letter
        st.tuples(st.sampled_from(DIGITS + "_-"), good_key).map(lambda a: {"".join(a): "x"}),
        st.tuples(good_key, ascii_bad).map(lambda a: {a[0] + a[1]: "x"}),  # a key character outside the set
        st.tuples(good_key, ascii_bad).map(lambda a: {a[0]: "v" + a[1]}),  # a value character outside it
        good_key.map(lambda k: {(k * 64)[:64]: "x"}),  # a key over 63
        good_key.map(lambda k: {k: "v" * 64}),  # a value over 63
        st.just({f"k{i}": "v" for i in range(65)}),  # more than 64 labels
        st.sampled_from(["tpuctl-run", "tpuctl-owner", "tpuctl-created", "tpuctl-expires"]).map(
            lambda k: {k: "x"}),  # tpuctl's own labels
    ]


def _service_account():
    return st.from_regex(r"[a-z][a-z0-9-]{4,28}[a-z0-9]@[a-z][a-z0-9-]{4,28}[a-z0-9]\.iam\.gserviceaccount\.com",
                         fullmatch=True)


def _bad_service_account() -> list:
    good = _service_account()
    return [good.map(lambda e: e.replace("@", "")), good.map(lambda e: e.replace("@", "@@")),
            good.map(lambda e: e.split(".")[0]),  # a domain without a dot
            st.tuples(good, st.sampled_from(" \t\n")).map(lambda a: a[0].replace("@", a[1] + "@"))]


@st.composite
def valid_specs(draw, flags_only: bool = False, provisioning: str | None = None,
                api: str | None = None) -> tuple[dict, catalog_mod.AcceleratorType]:
    """A spec every rule allows, with the type it asks for. `flags_only`: on-demand, and only what `up`'s
    flags can say; `provisioning`: of this model; `api`: a type this API makes."""
    provisioning = "on-demand" if flags_only else provisioning
    # tpuctl's own limit: it makes flex-start Compute Engine TPUs single-host only so far.
    t = draw(st.sampled_from([t for t in TYPES if provisioning in (None, *t.provisioning) and api in (None, t.api)
                              and not (provisioning == "flex-start" and t.api == "compute" and t.multi_host)]))
    provisioning = provisioning or draw(st.sampled_from(t.provisioning))
    if provisioning == "flex-start" and t.api == "compute" and t.multi_host:
        provisioning = "on-demand"
    zones = (t.flex_start_zones or t.zones) if provisioning == "flex-start" else t.zones
    zone = draw(st.sampled_from(sorted(zones)))
    spec = {"name": draw(_rfc1035(RUN_NAME_MAX)), "accelerator": t.name, "provisioning": provisioning}
    failover = [z for z in zones if z != zone and region_of(z) == region_of(zone)]
    spec["zone"] = [zone, draw(st.sampled_from(failover))] if failover and draw(st.booleans()) else zone
    if provisioning == "flex-start":
        spec["max_run_duration"] = draw(_duration(30, 7 * DAY))
    if provisioning in ("flex-start", "queued") and draw(st.booleans()):
        spec["valid_until"] = draw(_duration(1, 2 * 3600 if provisioning == "flex-start" else 30 * DAY))
    optional = {"ttl": _duration(1, 30 * DAY), "bucket": st.one_of(st.just("auto"), _bucket(),
                                                                   _bucket().map(lambda b: f"gs://{b}/")),
                "labels": _labels(), "service_account": st.one_of(st.just("default"), _service_account()),
                "runtime_version": st.just(t.default_runtime),
                "bucket_soft_delete": st.one_of(st.sampled_from(["0s", "off"]), _duration(7 * DAY, 90 * DAY)),
                "vms": _rfc1035(62 - len(spec["name"])).map(lambda n: [{"name": n}]) if len(spec["name"]) < 61
                else st.just([])}
    if flags_only:
        optional = {k: v for k, v in optional.items() if k in FLAGS}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=len(optional))):
        spec[key] = draw(optional[key])
    return spec, t


def _invalid_for(spec: dict, t: catalog_mod.AcceleratorType) -> dict[str, list]:
    """field -> that field's rules, each a strategy of copies of `spec` (a valid spec of type `t`) with exactly
    that rule broken. Flex-start's fields hold only together: a change of provisioning drops or adds them to
    match. A rule that cannot be broken for this spec (a type sold with every model) is left out."""
    def put(key: str):
        return lambda v: {**spec, key: v}

    def each(rules: list, key: str) -> list:
        return [r.map(put(key)) for r in rules]

    names = {x.name for x in TYPES}
    no_wait = {k: v for k, v in spec.items() if k not in ("max_run_duration", "valid_until")}
    flex = spec["provisioning"] == "flex-start"
    # Not a provisioning model, or one Google does not sell (or tpuctl does not make) for this type.
    unsold = [p for p in PROVISIONING if p not in t.provisioning
              or (p == "flex-start" and t.api == "compute" and t.multi_host)]
    cases = {
        "name": each(_bad_rfc1035(RUN_NAME_MAX), "name"),
        "accelerator": each([
            hostile.filter(lambda v: v.strip().lower() not in names),
            st.tuples(st.sampled_from(sorted({x.generation for x in TYPES})), st.integers(0, 9000))
            .map(lambda a: f"{a[0]}-{a[1]}").filter(lambda v: v not in names)], "accelerator"),
        # A zone not offering the type, zone-shaped or any text; for flex-start where Google sells it in some of
        # the type's zones, one of the others.
        "zone": each([st.sampled_from(sorted(set(t.zones) - set(t.flex_start_zones)))]
                     if flex and t.flex_start_zones else
                     [rule.filter(lambda z: z.strip() not in t.zones) for rule in (
                         st.sampled_from(sorted(set(ALL_ZONES) - set(t.zones))),
                         st.from_regex(r"[a-z]{2,8}-[a-z]{3,9}[0-9]-[a-z]", fullmatch=True),
                         hostile.filter(lambda v: "," not in v))], "zone"),
        "provisioning": [
            hostile.filter(lambda v: v not in PROVISIONING).map(lambda v: {**no_wait, "provisioning": v}),
            *([st.sampled_from(unsold).map(lambda p: {**no_wait, "provisioning": p, **(
                {"max_run_duration": "4h"} if p == "flex-start" else {})})] if unsold else [])],
        "runtime_version": each([st.sampled_from(sorted(set(ALL_RUNTIMES) - set(t.runtimes))),
                                 hostile.filter(lambda v: v not in t.runtimes)], "runtime_version"),
        "ttl": each(_not_a_duration(), "ttl"),
        "bucket": each(_bad_bucket(), "bucket"),
        "labels": each(_bad_labels(), "labels"),
        "service_account": each(_bad_service_account(), "service_account"),
        "bucket_soft_delete": each([_duration(1, 7 * DAY - 1), _duration(90 * DAY + 1, 400 * DAY)],
                                   "bucket_soft_delete"),
        "job.max_recoveries": [st.integers(max_value=-1).map(lambda v: {**spec, "job": {"max_recoveries": v}})],
        # The VM's name follows the run's and a -: together at most 63.
        "vms.0.name": [r.map(lambda v: {**spec, "vms": [{"name": v}]})
                       for r in _bad_rfc1035(63 - len(spec["name"]) - 1, prefixed=True)],
        "unknown": [st.from_regex(r"[a-z][a-z_]{2,12}", fullmatch=True)
                    .filter(lambda k: k not in SPEC_FIELDS).map(lambda k: {**spec, k: "x"})],
        # Flex-start needs a run length of 30s to 7d, which nothing else takes; a wait for capacity (valid_until)
        # is for flex-start (at most 2h) and queued only.
        "max_run_duration": [*each([_duration(1, 29), _duration(7 * DAY + 1, 60 * DAY), *_not_a_duration()],
                                   "max_run_duration"),
                             st.just({k: v for k, v in spec.items() if k != "max_run_duration"})]
        if flex else each([_duration(30, 7 * DAY)], "max_run_duration"),
        "valid_until": each([_duration(2 * 3600 + 1, 30 * DAY)] if flex else _not_a_duration()
                            if spec["provisioning"] == "queued" else [_duration(1, DAY)], "valid_until"),
    }
    return cases


FIELDS = ("name", "accelerator", "zone", "provisioning", "runtime_version", "ttl", "bucket", "labels",
          "service_account", "bucket_soft_delete", "job.max_recoveries", "vms.0.name", "unknown", "max_run_duration",
          "valid_until")
# (field, what the valid spec broken is): the rules of flex-start, queued and Compute Engine TPUs need one.
CASES = [(f, {}) for f in FIELDS] + [
    ("zone", {"provisioning": "flex-start"}), ("provisioning", {"provisioning": "flex-start"}),
    ("max_run_duration", {"provisioning": "flex-start"}), ("valid_until", {"provisioning": "flex-start"}),
    ("valid_until", {"provisioning": "queued"}), ("provisioning", {"api": "compute"})]


@st.composite
def invalid_specs(draw, field: str, flags_only: bool = False, **base) -> list[tuple[str, dict]]:
    """For each of `field`'s rules: (the field the error must name, a valid spec (`base`: valid_specs' choices)
    with that rule broken). Every example breaks every rule, so none is left to chance."""
    spec, t = draw(valid_specs(flags_only, **base))
    bad = [draw(rule) for rule in _invalid_for(spec, t)[field]]
    return [((next(k for k in b if k not in spec) if field == "unknown" else field), b) for b in bad]


def _plan(spec: dict):
    from tpuctl import provision

    return provision.plan(spec_mod.from_mapping(spec), project=cloud_stack.PROJECT, owner="hostile")


def _assert_plan_refuses(spec: dict, field: str) -> None:
    with pytest.raises(BadInput) as refused:
        _plan(spec)
    assert refused.value.field == field or refused.value.field.startswith(f"{field}."), (field, refused.value)


@settings(max_examples=100, deadline=None)
@given(case=valid_specs())
def test_specs_every_rule_allows_are_planned_as_given(case):
    spec, t = case
    plan = _plan(spec)
    zones = [spec["zone"]] if isinstance(spec["zone"], str) else spec["zone"]
    assert (plan.run, plan.accelerator.name, plan.zones, plan.provisioning) == (
        spec["name"], t.name, tuple(zones), spec["provisioning"])
    if spec.get("bucket", "auto") != "auto":
        assert plan.bucket == spec["bucket"].removeprefix("gs://").rstrip("/")
    assert spec.get("labels", {}).items() <= plan.labels.items()


@pytest.mark.parametrize("broken,base", CASES, ids=["-".join([f, *b.values()]) for f, b in CASES])
def test_invalid_spec_file_exits_2_naming_the_field_and_creates_nothing(stack, tmp_path, broken, base):
    @settings(max_examples=4, deadline=None)
    @given(cases=invalid_specs(broken, **base))
    def check(cases):
        for field, spec in cases:
            _assert_plan_refuses(spec, field)
            path = tmp_path / "spec.yaml"
            path.write_text(yaml.safe_dump(spec, allow_unicode=True))
            _assert_rejected(stack, _invoke(stack, ["up", str(path), "--yes"]), (field,), tmp_path)

    check()


@pytest.mark.parametrize("broken", sorted(FLAGS))
def test_invalid_cli_arguments_exit_2_naming_the_field_and_create_nothing(stack, tmp_path, broken):
    @settings(max_examples=3, deadline=None)
    @given(cases=invalid_specs(broken, flags_only=True))
    def check(cases):
        for field, spec in cases:
            _assert_plan_refuses(spec, field)  # first: `up` on a spec that plans would create it, slowly
            # Click reads a value starting with - as a flag, and no argv word holds a NUL: such a value is
            # refused in a spec file above.
            if any(str(v).startswith("-") or "\x00" in str(v) for v in spec.values()):
                continue
            argv = ["up", "--yes"]
            for key, value in spec.items():
                if key != "provisioning":  # on-demand, the default
                    argv += [FLAGS[key], ",".join(value) if isinstance(value, list) else str(value)]
            _assert_rejected(stack, _invoke(stack, argv), (field, FLAGS[field][2:]), tmp_path)

    check()


def test_vm_name_with_newline_still_gives_a_one_line_error(stack, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**VALID, "vms": [{"name": "data\n$(touch PWNED)"}]}))
    _assert_rejected(stack, _invoke(stack, ["up", str(path), "--yes"]), ("vms",), tmp_path)


def test_malformed_spec_files_exit_2(stack, tmp_path):
    cases = {"not yaml": "name: [unclosed", "a list": "- a\n- b\n", "binary": "\x00\x01\x02"}
    for text in cases.values():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        _assert_rejected(stack, _invoke(stack, ["up", str(path), "--yes"]), ("spec",), tmp_path)
    _assert_rejected(stack, _invoke(stack, ["up", str(tmp_path / "missing.yaml"), "--yes"]), ("spec",), tmp_path)


# ------------------------------------------------------------------------------------------ workers

@settings(max_examples=80, deadline=None)
@given(values=st.lists(hostile.filter(lambda v: "\x00" not in v), min_size=1, max_size=4))
def test_bootstrap_script_keeps_hostile_values_inside_their_quotes(tmp_path_factory, values):
    from tpuctl.jobs import remote

    tmp = tmp_path_factory.mktemp("render")
    template = "printf '%s\\0' " + " ".join(f"{{{{v{i}}}}}" for i in range(len(values)))
    script = remote.render(template, {f"v{i}": v for i, v in enumerate(values)})
    out = subprocess.run(["bash", "-c", script], capture_output=True, cwd=tmp, check=True).stdout
    assert out.decode().split("\0")[:-1] == values
    assert not list(tmp.iterdir())
    # The real bootstrap with hostile values in every slot that can carry user text is valid bash.
    boot = remote.bootstrap_script(run="r1", worker=0, python="python3", project=values[0], bucket=values[-1],
                                   bundle_object=f"runs/r1/{values[0]}", bundle_sha="0" * 64, launch_id="l1",
                                   storage="gcs")
    subprocess.run(["bash", "-n", "-c", boot], check=True, cwd=tmp)


def test_hostile_job_args_and_env_reach_a_local_cloud_worker_verbatim_and_execute_nothing(stack, tmp_path):
    args = [a for a in HOSTILE_TEXT if "\x00" not in a]
    env = {"TPUCTL_TEST_HOSTILE": "$(touch PWNED-env)\n`touch PWNED-env2`; touch PWNED-env3 é"}
    result = cloud_stack.up(stack, "hostile-job", "v3-8", ("us-central1-a",), "on-demand")
    try:
        assert result.exit_code == 0, result.message
        job = cloud_stack.Job(stack, "hostile-job", max_steps=3, checkpoint_every=3, args=tuple(args), env=env)
        states = job.run_to_end()
        assert [s.exit_code for s in states] == [0]
        log = stack.clients.storage.bucket(job.bucket).blob("runs/hostile-job/logs/worker-0.log").download_as_text()
        lines = log.splitlines()
        got_args = next(json.loads(l[len("args="):]) for l in lines if l.startswith("args="))
        got_env = next(json.loads(l[len("env="):]) for l in lines if l.startswith("env="))
        assert got_args == args and got_env == env
        roots = [stack.home, Path(stack.cloud.world.workers.root) if hasattr(stack.cloud.world.workers, "root") else stack.home,
                 REPO, Path.cwd()]
        assert not [p for r in roots for p in r.rglob(f"{CANARY}*")]
    finally:
        cloud_stack.cleanup(stack, "hostile-job", "down")
    assert stack.live() == []


def test_shell_command_for_ssh_quotes_each_word(tmp_path):
    from tpuctl.jobs import remote

    words = ["printf", "%s|", *[a for a in HOSTILE_TEXT if "\x00" not in a]]
    out = subprocess.run(["bash", "-c", remote.shell_command(words)], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout
    assert out == "".join(f"{w}|" for w in words[2:])
    assert shlex.split(remote.shell_command(words)) == words
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("job", [
    # A whole run (~16 s): hostile args reaching a worker verbatim stay in the fast tier through
    # test_hostile_job_args_and_env_reach_a_local_cloud_worker_verbatim_and_execute_nothing.
    pytest.param({"args": [a for a in HOSTILE_TEXT if "\x00" not in a]}, marks=pytest.mark.slow),
    {"env": {"TPUCTL_TEST_X": "$(touch PWNED-v)", "BAD KEY;touch PWNED-k": "x"}},
    {"data": {"corpus": ["$(touch PWNED-c).txt", "`touch PWNED-d`", "/nonexistent/\n;touch PWNED-e"]}},
    {"template": "$(touch PWNED-t)"},
    {"preset": "x; touch PWNED-p"},
], ids=["args", "env-keys", "corpus-paths", "template", "preset"])
def test_tpuctl_run_with_hostile_job_fields_runs_them_as_data_or_refuses(stack, tmp_path, job):
    """A real `tpuctl run`: hostile job values either reach the job verbatim (exit 0) or are refused with exit 2
    naming the job field before anything is created; nothing they spell is ever executed."""
    run = "hostile-run"
    job = {"template": str(cloud_stack.STANDIN), "config": {"trainer": {"max_steps": 2, "checkpoint_every": 2,
                                                                  "step_seconds": 0.01}}, **job}
    spec = cloud_stack.write_spec(stack, run, "v3-8", ("us-central1-a",), "on-demand", extra={"job": job})
    env = cloud_stack.child_env(stack, "hostile")
    whole = "args" in job or "preset" in job  # the stand-in takes any preset name: these two run to the end
    if whole:  # a process, as the user starts it
        proc = subprocess.run(cloud_stack.run_command(spec), env=env, capture_output=True, text=True, cwd=tmp_path,
                              timeout=240)
    else:  # refused before anything is created: in process (conftest `tpuctl_here`), ~3-7 s of imports less
        proc = tpuctl_here(env, *cloud_stack.run_command(spec)[3:], cwd=tmp_path)  # after `python -m tpuctl`
    try:
        errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert proc.returncode in ((0, 2) if whole else (2,)), proc.stderr[-2000:]
        if proc.returncode == 2:
            assert len(errors) == 1 and errors[0].startswith("error: job"), errors
            assert stack.live(run) == []
        elif "args" in job:
            log = stack.clients.storage.bucket(chaos_bucket(run)).blob(f"runs/{run}/logs/worker-0.log").download_as_text()
            assert next(json.loads(l[5:]) for l in log.splitlines() if l.startswith("args=")) == job["args"]
        assert not [p for r in (stack.home, tmp_path, REPO) for p in r.rglob(f"{CANARY}*")]
    finally:
        cloud_stack.cleanup(stack, run, "down")


def chaos_bucket(run: str) -> str:
    from tpuctl.provision.labels import auto_bucket

    return auto_bucket(cloud_stack.PROJECT, run)
