"""job.framework: auto picks TensorFlow where Google ships it (v2-v5p) and JAX elsewhere, each with its runtime;
a combination Google does not support is one error line (exit 2) naming what would work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import tpuctl_here

from tpuctl import catalog, frameworks
from tpuctl.errors import BadInput
from tpuctl.jobs.bundle import job_config
from tpuctl.provision.plan import make
from tpuctl.spec import from_mapping, with_framework

CAT = catalog.load()


@pytest.mark.parametrize(("accelerator", "requested", "framework", "runtime"), [
    ("v3-8", "auto", "tensorflow", "tpu-vm-tf-2.17.0-pjrt"),
    ("v4-32", "auto", "tensorflow", "tpu-vm-tf-2.17.0-pod-pjrt"),
    ("v6e-8", "auto", "jax", "v2-alpha-tpuv6e"),
    ("v2-8", "jax", "jax", "tpu-ubuntu2204-base"),
    ("v4-8", "jax", "jax", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "jax", "jax", "v2-alpha-tpuv5-lite"),
    ("v5p-8", "jax", "jax", "v2-alpha-tpuv5"),
])
def test_the_choice_and_its_runtime(accelerator, requested, framework, runtime):
    assert frameworks.choose(requested, CAT.accelerator(accelerator), None) == frameworks.Choice(framework, runtime)


def test_an_explicit_runtime_decides_auto_and_must_agree_with_an_explicit_framework():
    v5e = CAT.accelerator("v5litepod-8")
    assert frameworks.choose("auto", v5e, "v2-alpha-tpuv5-lite").framework == "jax"
    assert frameworks.choose("auto", v5e, "tpu-vm-tf-2.16.1-pjrt").framework == "tensorflow"
    with pytest.raises(BadInput, match="tpu-vm-tf-2.16.1-pjrt is a TensorFlow image, and framework is jax") as e:
        frameworks.choose("jax", v5e, "tpu-vm-tf-2.16.1-pjrt")
    assert e.value.field == "runtime_version" and str(e.value).endswith(
        "use runtime v2-alpha-tpuv5-lite for JAX, or framework: tensorflow to keep tpu-vm-tf-2.16.1-pjrt")


def test_unsupported_combinations_name_what_would_work():
    v6e = CAT.accelerator("v6e-8")
    with pytest.raises(BadInput, match=r"TensorFlow does not run on v6e .*use framework: jax \(runtime v2-alpha-tpuv6e\)$"):
        frameworks.choose("tensorflow", v6e, None)
    with pytest.raises(BadInput, match=r"the template does not offer TensorFlow; use runtime tpu-ubuntu2204-base "
                                       r"\(JAX\)$") as e:
        frameworks.choose("auto", CAT.accelerator("v3-8"), "tpu-vm-tf-2.17.0-pjrt", offered=("jax",))
    assert e.value.field == "runtime_version"
    # A TensorFlow-only template on v6e: the catalog's own refusal names the types that run TensorFlow.
    spec = from_mapping({"accelerator": "v6e-8", "zone": "us-east5-b", "name": "fw", "job": {"template": "x"}})
    with pytest.raises(BadInput, match="TensorFlow does not run on v6e .*v5e") as e:
        make(spec, project="my-proj-123", owner="me", frameworks=("tensorflow",))
    assert e.value.exit_code == 2 and e.value.field == "accelerator"


def test_errors_name_the_field_the_user_gave_and_what_works_instead():
    # Only a runtime was given (`up --accelerator v6e-8 --runtime-version tpu-vm-tf-2.17.0-pjrt`): the runtime is
    # at fault, not a job.framework the user never wrote.
    spec = from_mapping({"accelerator": "v6e-8", "zone": "us-east5-b", "name": "fw",
                         "runtime_version": "tpu-vm-tf-2.17.0-pjrt"})
    with pytest.raises(BadInput) as e:
        make(spec, project="my-proj-123", owner="me")
    assert str(e.value) == ("runtime_version: runtime tpu-vm-tf-2.17.0-pjrt is a TensorFlow image, and TensorFlow "
                            "does not run on v6e (Google ships TensorFlow runtimes for v2-v5p only); use runtime "
                            "v2-alpha-tpuv6e (JAX)")
    # TensorFlow on a base image: the TensorFlow runtime, or JAX on that image; not "use framework: tensorflow".
    base = spec.model_copy(update={"accelerator": "v3-8", "zones": ("europe-west4-a",),
                                   "runtime_version": "tpu-ubuntu2204-base"})
    with pytest.raises(BadInput) as e:
        make(with_framework(base, "tensorflow"), project="my-proj-123", owner="me")
    assert str(e.value) == ("runtime_version: runtime tpu-ubuntu2204-base is an image without TensorFlow, and "
                            "framework is tensorflow; use runtime tpu-vm-tf-2.17.0-pjrt for TensorFlow, or "
                            "framework: jax to keep tpu-ubuntu2204-base")
    # A TensorFlow-only template on a base image of a multi-host slice: the runtime that runs it, by name.
    with pytest.raises(BadInput) as e:
        make(base.model_copy(update={"accelerator": "v3-32"}), project="my-proj-123", owner="me",
             frameworks=("tensorflow",))
    assert e.value.field == "runtime_version" and "use runtime tpu-vm-tf-2.17.0-pod-pjrt" in str(e.value)


def test_catalog_show_lists_the_runtimes_that_run_on_the_type(tmp_path):
    env = {**os.environ, "TPUCTL_HOME": str(tmp_path), "NO_COLOR": "1", "COLUMNS": "400"}

    def show(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "tpuctl", "catalog", "show", *args], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout

    v6e = {line[:23].strip(): line[23:].strip() for line in show("v6e-8").splitlines()}
    assert v6e["runtimes"] == "v2-alpha-tpuv6e" and v6e["default runtime"] == "v2-alpha-tpuv6e"
    assert v6e["TensorFlow"].startswith("no (Google supports none from v6e on; its API still accepts 10 tpu-vm-tf-*")
    v3 = json.loads(show("v3-8", "--json"))  # where TensorFlow runs, every runtime the API takes runs a job
    assert v3["usable_runtimes"] == v3["runtimes"] and "tpu-vm-tf-2.17.0-pjrt" in v3["runtimes"]


def test_the_plan_carries_the_choice_and_the_job_config_gets_it():
    spec = from_mapping({"accelerator": "v6e-8", "zone": "us-east5-b", "name": "fw", "job": {"template": "bert"}})
    plan = make(spec, project="my-proj-123", owner="me")
    assert (plan.framework, plan.runtime_version) == ("jax", "v2-alpha-tpuv6e")
    assert "v2-alpha-tpuv6e (jax)" in [s for s in plan.steps if s.key == "tpu"][0].detail
    forced = make(with_framework(spec.model_copy(update={"accelerator": "v3-8", "zones": ("europe-west4-a",)}),
                                 "jax"), project="my-proj-123", owner="me")
    assert (forced.framework, forced.runtime_version) == ("jax", "tpu-ubuntu2204-base")
    # A template that declares no frameworks keeps the catalog's default runtime and gets no framework.
    legacy = make(spec, project="my-proj-123", owner="me", frameworks=None)
    assert (legacy.framework, legacy.runtime_version) == ("", CAT.accelerator("v6e-8").default_runtime)
    config = job_config({"runtime": {"seed": 3}}, preset="bert-tiny", bucket="b", run="r", data_url=None,
                        framework=plan.framework)
    assert config["runtime"] == {"seed": 3, "framework": "jax", "model_dir": "gs://b/runs/r/model",
                                 "export_dir": "gs://b/runs/r/model/export"}


def test_the_cli_flag_shows_the_choice_and_refuses_tensorflow_on_v6e_with_one_line(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "CLOUDSDK_", "GOOGLE_"))},
           "TPUCTL_HOME": str(tmp_path), "TPUCTL_PROJECT": "my-proj-123", "TPUCTL_CLOUD": "local",
           "NO_COLOR": "1"}
    up = ["up", "--accelerator", "v6e-8", "--zone", "us-east5-b", "--name", "fw", "--dry-run"]
    p = tpuctl_here(env, *up, "--json")
    assert p.returncode == 0, p.stderr
    assert {k: json.loads(p.stdout)["plan"][k] for k in ("framework", "runtime_version")} == {
        "framework": "jax", "runtime_version": "v2-alpha-tpuv6e"}
    p = tpuctl_here(env, *up, "--framework", "tensorflow")
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: job.framework: TensorFlow does not run on v6e (Google ships TensorFlow runtimes "
                      "for v2-v5p only); use framework: jax (runtime v2-alpha-tpuv6e)"], p.stderr


def test_a_jax_job_installs_jax_tpu_and_a_tensorflow_job_keeps_the_runtimes_tensorflow(tmp_path):
    import tarfile

    from tpuctl.jobs import bundle

    template = bundle.resolve_template("bert")
    docs = {}
    for framework in ("jax", "tensorflow"):
        job = bundle.JobDescription(run="fw", project="p", bucket="b", module="bert.train",
                                    config={"runtime": {"framework": framework}})
        with tarfile.open(bundle.build(template, job, tmp_path / framework).path) as tar:
            docs[framework] = json.load(tar.extractfile("job.json"))
            requirements = tar.extractfile(docs[framework]["requirements"]).read().decode()
        assert ("jax[tpu]==" in requirements) == (framework == "jax"), requirements
    assert docs["jax"]["requirements"] == "bert/requirements-jax.txt"
    assert docs["tensorflow"]["requirements"] == "bert/requirements.txt"
