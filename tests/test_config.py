"""Settings resolution: flags > TPUCTL_* env > spec > user config > gcloud config > defaults; the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpuctl import config
from tpuctl.errors import BadInput


@pytest.fixture
def home(tmp_path):
    gcloud = tmp_path / "gcloud"
    (gcloud / "configurations").mkdir(parents=True)
    (gcloud / "active_config").write_text("work\n")
    (gcloud / "configurations" / "config_work").write_text(
        "[core]\nproject = from-gcloud\n[compute]\nzone = us-central1-b\n")
    user = tmp_path / "config.yaml"
    return {"env": {"CLOUDSDK_CONFIG": str(gcloud), "HOME": str(tmp_path)}, "user": user, "gcloud": gcloud}


def test_gcloud_config_is_read_from_its_files(home):
    assert config.gcloud_config(home["env"]) == {"project": "from-gcloud", "zone": "us-central1-b"}


def test_precedence(home):
    env = home["env"]
    home["user"].write_text("project: from-user\nzone: europe-west4-a\naccelerator: v2-8\n")
    merged, src = config.layered({}, {}, env=env, config_path=home["user"])
    assert (merged["project"], src["project"]) == ("from-user", "user config")
    merged, src = config.layered({}, {"project": "from-spec", "zone": ["us-east1-d"]}, env=env,
                                 config_path=home["user"])
    assert merged["project"] == "from-spec" and merged["zone"] == ["us-east1-d"] and merged["accelerator"] == "v2-8"
    merged, src = config.layered({}, {"project": "from-spec"}, env={**env, "TPUCTL_PROJECT": "from-env"},
                                 config_path=home["user"])
    assert (merged["project"], src["project"]) == ("from-env", "environment")
    merged, src = config.layered({"project": "from-flag", "zone": None}, {"project": "from-spec"},
                                 env={**env, "TPUCTL_PROJECT": "from-env"}, config_path=home["user"])
    assert (merged["project"], src["project"]) == ("from-flag", "flag")
    assert merged["zone"] == "europe-west4-a"  # a flag left unset does not override


def test_zone_flag_replaces_zones_list_from_spec(home):
    merged, _ = config.layered({"zone": "us-central1-a"}, {"zones": ["europe-west4-a"]}, env=home["env"],
                               config_path=home["user"])
    assert merged["zone"] == "us-central1-a" and "zones" not in merged


def test_env_spot(home):
    merged, _ = config.layered({}, {}, env={**home["env"], "TPUCTL_SPOT": "1"}, config_path=home["user"])
    assert merged["provisioning"] == "spot"


def test_endpoint_env_means_local(home):
    env = {**home["env"], "TPUCTL_API_ENDPOINT": "http://127.0.0.1:9/", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:8"}
    s = config.settings(project="p", env=env, config_path=home["user"])
    assert (s.target, s.endpoint, s.storage_host, s.project) == ("local", "http://127.0.0.1:9", "http://127.0.0.1:8", "p")


def test_project_and_adc_mean_gcp(home):
    (home["gcloud"] / "application_default_credentials.json").write_text("{}")
    s = config.settings(env=home["env"], config_path=home["user"])
    assert (s.target, s.project, s.sources["project"]) == ("gcp", "from-gcloud", "gcloud config")


def test_nothing_configured_means_the_embedded_local_cloud(tmp_path):
    s = config.settings(env={"HOME": str(tmp_path)}, config_path=tmp_path / "none.yaml", start_local=False)
    assert (s.target, s.project, s.endpoint) == ("local", config.LOCAL_PROJECT, None)


def test_cloud_flag_forces(home):
    (home["gcloud"] / "application_default_credentials.json").write_text("{}")
    assert config.settings(cloud="local", env=home["env"], config_path=home["user"], start_local=False).local
    with pytest.raises(BadInput) as e:
        config.settings(cloud="gcp", env={"HOME": str(home["env"]["HOME"])}, config_path=home["user"])
    assert e.value.field == "project"
    with pytest.raises(BadInput) as e:
        config.settings(cloud="aws", env=home["env"], config_path=home["user"])
    assert e.value.field == "cloud"


def test_bad_user_config(home):
    home["user"].write_text("- not a mapping\n")
    with pytest.raises(BadInput) as e:
        config.user_config(home["user"])
    assert e.value.field == "config"


# ---------------------------------------------------------------------------------- credentials

def test_a_metadata_server_is_credentials_as_for_google_auth(home, metadata_server, no_metadata_server):
    """Cloud Run, Compute Engine, GKE: no key file, the credentials come from the metadata server. A project
    there is Google Cloud, never the embedded emulator (a Cloud Run gc would clean up an empty local cloud)."""
    s = config.settings(env={**home["env"], **metadata_server}, config_path=home["user"], start_local=False)
    assert (s.target, s.project) == ("gcp", "from-gcloud")
    assert not config.has_adc({**home["env"], **metadata_server, "NO_GCE_CHECK": "true"})  # google.auth's switch
    assert not config.has_adc({**home["env"], **no_metadata_server})


def test_a_named_project_without_credentials_is_an_error_not_the_emulator(home, no_metadata_server):
    env = {**home["env"], **no_metadata_server}
    for project, source in ((None, "gcloud config"), ("p1", None)):
        with pytest.raises(BadInput) as e:
            config.settings(project=project, env=env, config_path=home["user"], start_local=False)
        assert e.value.field == "credentials" and e.value.exit_code == 2
        assert (f"(from {source})" in e.value.message) == bool(source)
        assert "gcloud auth application-default login" in e.value.hint and "GOOGLE_APPLICATION_CREDENTIALS" in e.value.hint
    with pytest.raises(BadInput) as e:  # a key named but missing is said so
        config.settings(env={**env, "GOOGLE_APPLICATION_CREDENTIALS": str(home["gcloud"] / "gone.json")},
                        config_path=home["user"], start_local=False)
    assert "gone.json, which is not a file" in e.value.message
    # Only a project nobody named leaves the embedded cloud the default; --cloud local still forces it.
    assert config.settings(cloud="local", env=env, config_path=home["user"], start_local=False).local


def test_max_run_duration_comes_from_the_environment_too(home):
    merged, src = config.layered({}, {}, env={**home["env"], "TPUCTL_MAX_RUN_DURATION": "4h"},
                                 config_path=home["user"])
    assert (merged["max_run_duration"], src["max_run_duration"]) == ("4h", "environment")


def test_zero_never_means_off_for_the_local_clouds_idle_stop():
    assert config.local_idle_stop_s("off", env={}) == config.local_idle_stop_s("never", env={}) == 0
    for value, env in (("0", {}), (None, {"TPUCTL_LOCAL_IDLE": "0"})):
        with pytest.raises(BadInput) as e:
            config.local_idle_stop_s(value, env=env)
        assert "zero" in e.value.message


def test_tpuctl_home_moves_the_user_config_file_and_the_readme_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    (tmp_path / "config.yaml").write_text("zone: asia-east1-c\n")
    assert config.user_config() == {"zone": "asia-east1-c"}
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "config.yaml" in next(line for line in readme.splitlines() if line.startswith("| `TPUCTL_HOME`"))
