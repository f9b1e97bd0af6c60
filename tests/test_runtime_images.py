"""Runtime images as Google ships them: the names Google's own samples use, what tpuctl plans for a TensorFlow
job, and a local worker that runs the image's own TensorFlow and Keras (localcloud/runtimes.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import asyncssh
import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from conftest import FAST_POLLING, new_project, official_clients, tpuctl_here
from tpuctl import catalog, spec as spec_mod
from tpuctl import provision
from tpuctl.errors import BadInput
from tpuctl.jobs.agent import install
from tpuctl.localcloud import facts, runtimes
from tpuctl.localcloud.cloud import LocalCloud

REPO = Path(__file__).resolve().parents[1]

# (type, zone, runtime) exactly as Google's python-docs-samples (tpu/*.py) and public gcloud scripts use them.
GOOGLE_SAMPLES = [
    ("v5litepod-4", "us-west4-a", "v2-tpuv5-litepod"),
    ("v3-8", "us-central1-b", "tpu-vm-tf-2.17.0-pjrt"),
    ("v2-8", "us-central1-b", "tpu-vm-tf-2.16.1-pjrt"),
    ("v2-8", "europe-west4-a", "tpu-vm-tf-2.18.0-pjrt-v5p-and-below"),
    ("v5litepod-8", "us-central1-a", "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6"),
    ("v5litepod-16", "us-central1-a", "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6"),
    ("v5litepod-16", "us-central1-a", "tpu-vm-tf-2.16.1-pod-pjrt"),
    ("v3-8", "us-central1-a", "tpu-vm-tf-2.16.1-se"),  # a public gcloud script; tpu/docs/supported-tpu-versions
    ("v4-8", "us-central2-b", "v2-alpha-tpuv4"),  # the gcloud reference's queued-resources example
]


@pytest.fixture(scope="module")
def cat():
    return catalog.Catalog(catalog.embedded_data())


def _plan(accelerator: str, zone: str, runtime: str | None = None, framework: str | None = "tensorflow"):
    spec = spec_mod.from_mapping({"name": "rt", "zone": zone, "accelerator": accelerator, "runtime_version": runtime})
    return provision.plan(spec, project="p-rt-test", framework=framework)


# ------------------------------------------------------------------------------------------ names

@pytest.mark.parametrize("accelerator,zone,runtime", GOOGLE_SAMPLES)
def test_google_sample_runtime_names_create_nodes_in_strict_mode_and_tpuctl_plans_them(clients, cat, accelerator,
                                                                                       zone, runtime):
    op = clients.tpu.create_node(parent=clients.parent(zone), node_id="sample",
                                 node=tpu_v2.Node(accelerator_type=accelerator, runtime_version=runtime))
    assert op.result(polling=FAST_POLLING).runtime_version == runtime
    framework = "tensorflow" if runtime.startswith("tpu-vm-tf-") else None
    assert cat.check(accelerator, zone, runtime, framework).name == accelerator


def test_catalog_and_localcloud_list_the_same_runtimes_per_generation(cat):
    # Two tables written apart (localcloud imports nothing from tpuctl): a name only one of them has is a
    # mistake in one of them, caught here instead of on Google's API.
    for gen in cat.generations():
        t = next(t for t in cat.accelerators() if t.generation == gen)
        assert t.tensorflow == (gen in facts.TENSORFLOW_GENERATIONS), gen
        if t.api == "compute":  # TPU7x: the runtime is a boot image family localcloud serves as a public image
            from tpuctl.localcloud.projects import PUBLIC_IMAGE_FAMILIES

            for image in t.runtimes:
                project, family = image.split("/")[1], image.rsplit("/", 1)[-1]
                assert family in PUBLIC_IMAGE_FAMILIES.get(project, ()), image
            continue
        assert set(t.runtimes) == set(facts.RUNTIMES_BY_GENERATION[gen]), gen


def test_runtime_versions_are_listed_per_zone_as_the_types_offered_there(clients):
    v5e_only = {r.version for r in clients.tpu.list_runtime_versions(parent=clients.parent("us-west4-a"))}
    assert {"v2-tpuv5-litepod", "v2-alpha-tpuv5-lite", "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6"} <= v5e_only
    assert not {"tpu-vm-tf-2.18.0-pjrt-v5p-and-below", "v2-alpha-tpuv6e", "tpu-vm-tf-2.14.1"} & v5e_only
    v4 = clients.parent("us-central2-b")
    assert clients.tpu.get_runtime_version(name=f"{v4}/runtimeVersions/tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below")
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_runtime_version(name=f"{v4}/runtimeVersions/v2-tpuv5-litepod")


def test_every_runtime_records_its_software_and_tensorflow_stops_at_2_18():
    for runtime, sw in facts.RUNTIME_SOFTWARE.items():
        assert sw.python and sw.libtpu and sw.source, runtime
        assert (sw.tensorflow is not None) == runtime.startswith("tpu-vm-tf-"), runtime
        if sw.tensorflow:
            assert runtime.startswith(f"tpu-vm-tf-{sw.tensorflow}") and sw.tensorflow <= "2.18.0"
            assert sw.keras.startswith("2.") == (sw.tensorflow < "2.16"), runtime  # Keras 3 from TF 2.16


# tpu/docs/runtimes' TensorFlow -> libtpu table, patch releases included.
LIBTPU_BY_TENSORFLOW = {"2.14.1": "1.8.1", "2.15.0": "1.9.0", "2.15.1": "1.9.0", "2.16.1": "1.10.1", "2.16.2": "1.10.1",
                        "2.17.0": "1.11.0", "2.17.1": "1.11.1", "2.18.0": "1.12.0"}


def test_every_tensorflow_release_in_googles_libtpu_table_has_its_runtimes_with_its_libtpu(cat, clients):
    images = {sw.tensorflow: sw.libtpu_version for sw in facts.RUNTIME_SOFTWARE.values() if sw.tensorflow}
    assert images == LIBTPU_BY_TENSORFLOW
    for accelerator, zone, runtime in (("v4-32", "us-central2-b", "tpu-vm-tf-2.17.1-pod-pjrt"),
                                       ("v3-8", "us-central1-b", "tpu-vm-tf-2.16.2-pjrt"),
                                       ("v5litepod-8", "us-central1-a", "tpu-vm-tf-2.15.1-pjrt")):
        assert cat.check(accelerator, zone, runtime).name == accelerator  # tpuctl accepts it ...
        assert clients.tpu.get_runtime_version(name=f"{clients.parent(zone)}/runtimeVersions/{runtime}")  # Google


# ------------------------------------------------------------------------------------------ planning

def test_tensorflow_job_on_v6e_is_refused_in_one_line_naming_what_runs_it(cat):
    for runtime in (None, "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6", "v2-alpha-tpuv6e"):
        with pytest.raises(BadInput) as err:
            _plan("v6e-8", "us-east5-a", runtime)
        assert err.value.field == "accelerator" and err.value.exit_code == 2
        assert "TensorFlow does not run on v6e" in str(err.value) and "v5e" in str(err.value)
        assert "\n" not in str(err.value)
    assert _plan("v6e-8", "us-east5-a", framework=None).runtime_version == "v2-alpha-tpuv6e"  # a bare `up`


def test_tpuctl_run_of_the_bert_template_on_v6e_with_tensorflow_exits_2_with_one_line(cloud, tmp_path):
    import yaml

    spec = tmp_path / "v6e.yaml"
    spec.write_text(yaml.safe_dump({"name": "bert-v6e", "zone": "us-east5-a", "accelerator": "v6e-8",
                                    "job": {"template": "bert", "preset": "bert-tiny"}}))
    project = new_project()
    env = {**os.environ, "TPUCTL_API_ENDPOINT": cloud.endpoint, "TPUCTL_STORAGE_HOST": cloud.storage_host,
           "TPUCTL_PROJECT": project, "TPUCTL_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    r = tpuctl_here(env, "run", str(spec), "--yes", "--framework", "tensorflow", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: job.framework: TensorFlow does not run on v6e"), r.stderr
    assert [n for n in cloud.inventory()["nodes"] if n["project"] == project] == []


@pytest.mark.parametrize("accelerator,zone", [("v3-32", "europe-west4-a"), ("v5litepod-16", "us-east5-a"),
                                              ("v4-32", "us-central2-b"), ("v5p-16", "us-east5-a")])
def test_a_multi_host_slice_always_gets_a_pod_runtime(accelerator, zone):
    assert "-pod" in _plan(accelerator, zone).runtime_version
    single = "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6" if accelerator.startswith("v5lite") else "tpu-vm-tf-2.16.1-pjrt"
    with pytest.raises(BadInput) as err:
        _plan(accelerator, zone, single)
    assert err.value.field == "runtime_version" and "-pod" in str(err.value)


def test_stream_executor_images_run_on_v2_to_v4_only_and_a_slice_takes_their_pod_twin(clients, cat):
    # tpu/docs/supported-tpu-versions: `-se` (stream executor) beside `-pjrt` from TF 2.15 on v2-v4; "TPU v5e and
    # future TPU generations only support PJRT".
    for accelerator, zone in (("v2-8", "us-central1-b"), ("v3-8", "us-central1-a"), ("v4-8", "us-central2-b")):
        for release in ("2.15.0", "2.15.1", "2.16.1"):
            assert cat.check(accelerator, zone, f"tpu-vm-tf-{release}-se", "tensorflow").name == accelerator
    assert _plan("v4-32", "us-central2-b", "tpu-vm-tf-2.16.1-pod-se").runtime_version == "tpu-vm-tf-2.16.1-pod-se"
    with pytest.raises(BadInput) as err:
        _plan("v4-32", "us-central2-b", "tpu-vm-tf-2.16.1-se")
    assert err.value.field == "runtime_version" and "tpu-vm-tf-2.16.1-pod-se" in str(err.value)
    for accelerator, zone in (("v5litepod-8", "us-west4-a"), ("v5p-8", "us-east5-a")):
        with pytest.raises(BadInput) as err:
            cat.check(accelerator, zone, "tpu-vm-tf-2.16.1-se", "tensorflow")
        assert err.value.field == "runtime_version"
        with pytest.raises(gexc.BadRequest):  # 400, as the API answers a runtime the type lacks
            clients.tpu.create_node(parent=clients.parent(zone), node_id="se",
                                    node=tpu_v2.Node(accelerator_type=accelerator,
                                                     runtime_version="tpu-vm-tf-2.16.1-se")).result(polling=FAST_POLLING)
    # Only the releases Google names: no `-se` image of 2.16.2 or 2.17 is documented.
    assert "tpu-vm-tf-2.17.0-se" not in facts.RUNTIMES_BY_GENERATION["v3"]


@pytest.mark.parametrize("accelerator,zone,base", [("v3-8", "europe-west4-a", "tpu-ubuntu2204-base"),
                                                   ("v5litepod-8", "us-east5-a", "v2-alpha-tpuv5-lite"),
                                                   ("v5litepod-8", "us-east5-a", "v2-tpuv5-litepod"),
                                                   ("v5p-8", "us-east5-a", "v2-alpha-tpuv5")])
def test_a_base_image_is_refused_for_a_tensorflow_template_only(accelerator, zone, base):
    with pytest.raises(BadInput) as err:
        _plan(accelerator, zone, base)
    assert err.value.field == "runtime_version" and "without TensorFlow" in str(err.value)
    assert _plan(accelerator, zone, base, framework=None).runtime_version == base


# ------------------------------------------------------------------------------------------ Keras per TensorFlow

def test_a_runtime_older_than_the_templates_tested_tensorflow_is_refused_before_anything_is_created():
    from tpuctl.jobs.pipeline import check_runtime_tensorflow
    from tpuctl.templates import contract

    bert = contract.find("bert")
    with pytest.raises(BadInput) as err:
        check_runtime_tensorflow(bert, "tpu-vm-tf-2.14.1", "tpu-vm-tf-2.17.0-pjrt")
    assert err.value.field == "runtime_version" and "TensorFlow 2.14" in str(err.value)
    assert "tpu-vm-tf-2.17.0-pjrt" in err.value.hint
    for ok in ("tpu-vm-tf-2.15.0-pjrt", "tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below", "v2-alpha-tpuv5"):
        check_runtime_tensorflow(bert, ok, "tpu-vm-tf-2.17.0-pjrt")


def test_the_bootstrap_pins_the_keras_the_template_is_tested_with_for_the_images_tensorflow():
    import json

    tested = json.loads((REPO / "templates" / "bert" / "template.json").read_text())["keras_by_tensorflow"]
    assert set(tested) == {"2.15", "2.16", "2.17", "2.18"}  # every TF family Google ships a runtime for
    assert install.keras_requirement(tested, "2.15.0") == f"keras=={tested['2.15']}"  # over the bundled Keras 2
    assert install.keras_requirement(tested, "2.18.1") == f"keras=={tested['2.18']}"
    assert install.keras_requirement(tested, "2.21.0") is None  # newer than the table: requirements.txt's keras>=3
    with pytest.raises(ValueError, match="TensorFlow 2.14.1 is older than any this template is tested with"):
        install.keras_requirement(tested, "2.14.1")


def test_installs_on_a_worker_keep_the_images_packages_at_their_versions(tmp_path):
    # google-cloud-storage's newest deps would pull a protobuf that shadows TF 2.15's own (seen in the
    # runtime matrix): every install is constrained to what the image had, except what it installs.
    (tmp_path / "image-constraints.txt").write_text("protobuf==4.25.9\nkeras==3.4.1\ntensorflow-cpu==2.17.0\n")
    args = install._keep_installed(tmp_path, ["keras==3.15.1", "Tensor_Board>=2.16"], tmp_path / "env")
    assert args[0] == "-c"
    assert Path(args[1]).read_text().split() == ["protobuf==4.25.9", "tensorflow-cpu==2.17.0"]
    assert install._keep_installed(tmp_path / "nowhere", ["keras"], tmp_path / "env") == []


def test_installs_outside_a_venv_go_to_the_user_site_even_on_a_pep_668_image(tmp_path, monkeypatch):
    # TPU7x boots Ubuntu 24.04, whose python3 is EXTERNALLY-MANAGED: a plain `pip install --user` is refused there.
    import sysconfig

    monkeypatch.setattr(install.sys, "prefix", install.sys.base_prefix)
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path))
    assert install._install_target() == ["--user"]
    (tmp_path / "EXTERNALLY-MANAGED").write_text("[externally-managed]\n")
    assert install._install_target() == ["--user", "--break-system-packages"]
    monkeypatch.setattr(install.sys, "prefix", str(tmp_path / "venv"))
    assert install._install_target() == []


# ------------------------------------------------------------------------------------------ image venvs

def test_image_venvs_build_once_under_concurrency_and_workers_layer_their_own(tmp_path):
    base = facts.RUNTIME_SOFTWARE["v2-tpuv5-litepod"]  # no framework: a bare venv builds in seconds
    images = runtimes.Images(tmp_path / "cache")
    built = []
    threads = [threading.Thread(target=lambda: built.append(images.ensure(base))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({b.root for b in built}) == 1 and len(built) == 3
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert [e for e in entries if not e.startswith(".")] == [runtimes.image_key(base)]
    assert not [e for e in entries if ".building-" in e]  # built aside, renamed into place
    worker_bin = runtimes.worker_venv(built[0], tmp_path / "w0")
    out = subprocess.run([str(worker_bin / "python"), "-c", "import sys; print(sys.prefix); print(sys.path)"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(tmp_path / "w0")
    assert str(built[0].site_packages) in out[1]  # the image's packages, behind the worker's own


def _key_line(key: asyncssh.SSHKey) -> str:
    return "alice:" + key.export_public_key("openssh").decode().strip()


def test_a_worker_runs_its_runtime_image_python_not_the_hosts(tmp_path):
    key = asyncssh.generate_private_key("ssh-ed25519")
    with LocalCloud(speed=1000, strict=True, worker_python="runtime", runtime_cache=tmp_path / "cache") as lc:
        clients = official_clients(lc, new_project())
        node = clients.tpu.create_node(parent=clients.parent("us-west4-a"), node_id="img", node=tpu_v2.Node(
            accelerator_type="v5litepod-4", runtime_version="v2-tpuv5-litepod",
            metadata={"ssh-keys": _key_line(key)})).result(polling=FAST_POLLING, timeout=120)
        ep = node.network_endpoints[0]

        async def run() -> str:
            async with asyncssh.connect(ep.ip_address, ep.port, username="alice", client_keys=[key],
                                        known_hosts=None) as conn:
                r = await conn.run('python -c "import sys, importlib.util as u; '
                                   'print(sys.prefix, u.find_spec(\'tensorflow\') is None)"', check=True, timeout=60)
                return r.stdout.strip()

        prefix, no_tf = asyncio.run(run()).split()
    assert prefix != sys.prefix and "/.localcloud/python" in prefix
    assert no_tf == "True"  # a base image carries no TensorFlow, whatever the host has


@pytest.mark.slow
@pytest.mark.tf
def test_the_default_runtimes_own_tensorflow_runs_the_bert_template(runtime_cache, tmp_path, monkeypatch):
    """CI builds this one image venv (tensorflow-cpu of the default runtime's version, ~25 s from a warm pip
    cache, ~1.3 GB); every other test runs workers on the host interpreter."""
    from google.auth.credentials import AnonymousCredentials

    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.provision.clients import build

    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    default = catalog.load().accelerator("v3-8").default_runtime
    want = facts.RUNTIME_SOFTWARE[default]
    with LocalCloud(speed=1000, strict=True, state_dir=tmp_path / "cloud", worker_python="runtime",
                    runtime_cache=runtime_cache) as lc:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", lc.storage_host)
        clients = build(project=new_project(), credentials=AnonymousCredentials(), endpoint=lc.endpoint,
                        storage_host=lc.storage_host, local=True)
        spec = spec_mod.from_mapping({
            "name": "bert-image", "zone": "europe-west4-a", "accelerator": "v3-8", "provisioning": "spot",
            "job": {"template": "bert", "preset": "bert-tiny",
                    "config": {"trainer": {"max_steps": 10, "checkpoint_every": 10, "log_every": 10,
                                           "steps_per_execution": 10, "warmup_steps": 5}},
                    "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
        o = Pipeline(clients, spec, options=RunOptions(yes=True, poll_s=1.0)).run()
        agent_log = next((tmp_path / "cloud").rglob("runs/bert-image/w0/agent.log")).read_text()
    assert o.state == "succeeded" and o.step == 10
    tested = __import__("json").loads((REPO / "templates/bert/template.json").read_text())["keras_by_tensorflow"]
    assert f"tensorflow={want.tensorflow} keras={tested[want.tensorflow[:4]]}" in agent_log, agent_log
    assert f"python={sys.version.split()[0]}" in agent_log
