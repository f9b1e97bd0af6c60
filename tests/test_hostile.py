"""Hostile and bad input: property tests over spec files and `tpuctl up` arguments, and hostile job values
on a real local-cloud worker.

Every invalid input must exit 2 with one `error: FIELD: ...` line naming the field (plus an optional hint
line), and the local cloud must show that nothing was created.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import load_chaos
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]


chaos = load_chaos()

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
    with chaos.Stack() as s:
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

def _bad_spec():
    """(field the error must name, spec mapping)."""
    return st.one_of(
        st.tuples(st.just("accelerator"), hostile.map(lambda v: {**VALID, "accelerator": v})),
        st.tuples(st.just("zone"), hostile.filter(lambda v: v.strip(", ") and "," not in v)
                  .map(lambda v: {**VALID, "zone": v})),
        st.tuples(st.just("provisioning"), hostile.map(lambda v: {**VALID, "provisioning": v})),
        st.tuples(st.just("ttl"), hostile.map(lambda v: {**VALID, "ttl": v})),
        st.tuples(st.just("name"), hostile.map(lambda v: {**VALID, "name": v})),
        st.tuples(st.just("bucket"), hostile.filter(lambda v: v != "auto").map(lambda v: {**VALID, "bucket": v})),
        st.tuples(st.just("labels"), st.tuples(hostile, hostile).map(lambda kv: {**VALID, "labels": {kv[0]: kv[1]}})),
        st.tuples(st.just("service_account"), hostile.filter(lambda v: v != "default")
                  .map(lambda v: {**VALID, "service_account": v})),
        st.tuples(st.just("runtime_version"), hostile.map(lambda v: {**VALID, "runtime_version": v})),
        st.tuples(st.just("job.max_recoveries"), st.integers(max_value=-1).map(
            lambda v: {**VALID, "job": {"max_recoveries": v}})),
        st.tuples(st.just("vms"), hostile
                  .map(lambda v: {**VALID, "vms": [{"name": v}]})),
        st.tuples(st.just("unknown"), st.from_regex(r"[a-z]{3,12}", fullmatch=True)
                  .filter(lambda k: k not in {"name", "project", "zone", "zones", "accelerator", "bucket", "labels",
                                              "ttl", "vms", "tags", "job", "network", "subnet", "provisioning"})
                  .map(lambda k: {**VALID, k: "x"})),
    )


def _is_valid(spec: dict) -> bool:
    from tpuctl import provision
    from tpuctl import spec as spec_mod
    from tpuctl.errors import BadInput

    try:
        provision.plan(spec_mod.from_mapping(spec), project=chaos.PROJECT, owner="hostile")
        return True
    except BadInput:
        return False


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=_bad_spec())
def test_invalid_spec_file_exits_2_naming_the_field_and_creates_nothing(stack, tmp_path, case):
    field, spec = case
    if _is_valid(spec):  # hypothesis may draw a value that happens to be valid (e.g. ttl "5m")
        return
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    result = _invoke(stack, ["up", str(path), "--yes"])
    # The unknown-key case names the key itself; vms errors name the VM's field path.
    fields = (next(k for k in spec if k not in VALID),) if field == "unknown" else (
        "vms.0.name",) if field == "vms" else (field,)
    if field == "labels":
        fields = ("labels", f"labels.{next(iter(spec['labels']))}")
    _assert_rejected(stack, result, fields, tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(option=st.sampled_from(["--name", "--accelerator", "--zone", "--ttl", "--bucket", "--service-account",
                               "--runtime-version"]),
       value=hostile.filter(lambda v: not v.startswith("-") and "\x00" not in v))
def test_invalid_cli_arguments_exit_2_naming_the_field_and_create_nothing(stack, tmp_path, option, value):
    field = option[2:].replace("-", "_")
    args = {"--name": "ok-run", "--accelerator": "v3-8", "--zone": "us-central1-a", option: value}
    spec = {k[2:].replace("-", "_"): v for k, v in args.items()}
    if _is_valid(spec):
        return
    argv = ["up", "--yes"] + [x for kv in args.items() for x in kv]
    result = _invoke(stack, argv)
    _assert_rejected(stack, result, (field, field.replace("_", "-"), "zone" if field == "zone" else field), tmp_path)


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
                                   bundle_object=f"runs/r1/{values[0]}", bundle_sha="0" * 64, launch_id="l1")
    subprocess.run(["bash", "-n", "-c", boot], check=True, cwd=tmp)


def test_hostile_job_args_and_env_reach_a_local_cloud_worker_verbatim_and_execute_nothing(stack, tmp_path):
    args = [a for a in HOSTILE_TEXT if "\x00" not in a]
    env = {"TPUCTL_TEST_HOSTILE": "$(touch PWNED-env)\n`touch PWNED-env2`; touch PWNED-env3 é"}
    result = chaos.up(stack, "hostile-job", "v3-8", ("us-central1-a",), "on-demand")
    try:
        assert result.exit_code == 0, result.message
        job = chaos.Job(stack, "hostile-job", max_steps=3, checkpoint_every=3, args=tuple(args), env=env)
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
        chaos.cleanup(stack, "hostile-job", "down")
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
    {"args": [a for a in HOSTILE_TEXT if "\x00" not in a]},
    {"env": {"TPUCTL_TEST_X": "$(touch PWNED-v)", "BAD KEY;touch PWNED-k": "x"}},
    {"data": {"corpus": ["$(touch PWNED-c).txt", "`touch PWNED-d`", "/nonexistent/\n;touch PWNED-e"]}},
    {"template": "$(touch PWNED-t)"},
    {"preset": "x; touch PWNED-p"},
], ids=["args", "env-keys", "corpus-paths", "template", "preset"])
def test_tpuctl_run_with_hostile_job_fields_runs_them_as_data_or_refuses(stack, tmp_path, job):
    """A real `tpuctl run`: hostile job values either reach the job verbatim (exit 0) or are refused with exit 2
    naming the job field before anything is created; nothing they spell is ever executed."""
    run = "hostile-run"
    job = {"template": str(chaos.STANDIN), "config": {"trainer": {"max_steps": 2, "checkpoint_every": 2,
                                                                  "step_seconds": 0.01}}, **job}
    spec = chaos.write_spec(stack, run, "v3-8", ("us-central1-a",), "on-demand", extra={"job": job})
    proc = subprocess.run(chaos.run_command(spec), env=chaos.child_env(stack, "hostile"), capture_output=True,
                          text=True, cwd=tmp_path, timeout=240)
    try:
        errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert proc.returncode in (0, 2), proc.stderr[-2000:]
        if proc.returncode == 2:
            assert len(errors) == 1 and errors[0].startswith("error: job"), errors
            assert stack.live(run) == []
        elif "args" in job:
            log = stack.clients.storage.bucket(chaos_bucket(run)).blob(f"runs/{run}/logs/worker-0.log").download_as_text()
            assert next(json.loads(l[5:]) for l in log.splitlines() if l.startswith("args=")) == job["args"]
        assert not [p for r in (stack.home, tmp_path, REPO) for p in r.rglob(f"{CANARY}*")]
    finally:
        chaos.cleanup(stack, run, "down")


def chaos_bucket(run: str) -> str:
    from tpuctl.provision.labels import auto_bucket

    return auto_bucket(chaos.PROJECT, run)
