"""Where tpuctl points and with what: resolved flags > TPUCTL_* env > spec > user config > gcloud config > defaults.

The target is the local cloud or GCP:
- `TPUCTL_API_ENDPOINT` set -> the local cloud at that endpoint (tests, a daemon started by hand);
- else a project named anywhere (flag, env, spec, user config, gcloud config) -> GCP, with Application Default
  Credentials found where google.auth.default() finds them (its environment variable, gcloud's file, the
  metadata server); a project without credentials is BadInput saying how to get them, never the emulator;
- else the embedded local cloud, auto-started, and one stderr line says so.
`--cloud gcp|local` (or `TPUCTL_CLOUD`) forces either. gcloud itself is never run: its active configuration's
`core/project` and `compute/zone` are read from its files.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpuctl import paths
from tpuctl.errors import BadInput, LocalCloudError
from tpuctl.events import EventSink, Note, ignore

LOCAL_PROJECT = "tpuctl-local"
TARGETS = ("local", "gcp")

# Spec fields that may also come from the environment, e.g. TPUCTL_PROJECT, TPUCTL_ZONE=a,b.
ENV_FIELDS = ("project", "zone", "accelerator", "runtime_version", "provisioning", "bucket", "bucket_soft_delete",
              "service_account", "ttl", "network", "subnet", "max_run_duration")


@dataclass(frozen=True)
class Settings:
    """The resolved cloud target; what `tpuctl.provision.clients.connect` needs."""

    target: str  # "local" | "gcp"
    project: str
    endpoint: str | None = None  # local cloud: http://127.0.0.1:PORT for TPU, Compute, CRM and Billing
    storage_host: str | None = None  # local cloud: http://127.0.0.1:PORT of the storage emulator
    sources: Mapping[str, str] = field(default_factory=dict)  # setting -> where it came from
    account: str | None = None  # the caller's email, for OS Login (see `caller_account`)

    @property
    def local(self) -> bool:
        return self.target == "local"


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ENV_FIELDS:
        value = env.get(f"TPUCTL_{name.upper()}")
        if value:
            out[name] = value
    if env.get("TPUCTL_SPOT", "").lower() in ("1", "true", "yes"):
        if out.get("provisioning", "spot") != "spot":
            raise BadInput(f"TPUCTL_SPOT=1 and TPUCTL_PROVISIONING={out['provisioning']} ask for different capacity",
                           field="provisioning", hint="unset one of them: TPUCTL_SPOT=1 is TPUCTL_PROVISIONING=spot")
        out["provisioning"] = "spot"
    return out


def user_config(path: Path | None = None) -> dict[str, Any]:
    """`~/.tpuctl/config.yaml`: defaults for spec fields (project, zone, ...). Missing file = empty."""
    path = path or paths.user_config()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as exc:
        raise BadInput(f"cannot read {path}: {exc}", field="config", hint="fix or delete the file") from exc
    if not isinstance(data, dict):
        raise BadInput(f"{path} must be a mapping of spec fields", field="config")
    return data


def _gcloud_properties(env: Mapping[str, str]) -> configparser.ConfigParser:
    """gcloud's active configuration file, parsed (empty when absent or unreadable)."""
    root = _gcloud_dir(env)
    try:
        active = env.get("CLOUDSDK_ACTIVE_CONFIG_NAME") or (root / "active_config").read_text().strip() or "default"
    except OSError:
        active = "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(root / "configurations" / f"config_{active}")
    except configparser.Error:
        return configparser.ConfigParser()
    return parser


def gcloud_config(env: Mapping[str, str]) -> dict[str, Any]:
    """core/project and compute/zone of gcloud's active configuration, read from its files."""
    out: dict[str, Any] = {}
    parser = _gcloud_properties(env)
    if parser.has_option("core", "project"):
        out["project"] = parser.get("core", "project")
    if parser.has_option("compute", "zone"):
        out["zone"] = parser.get("compute", "zone")
    if env.get("CLOUDSDK_CORE_PROJECT"):
        out["project"] = env["CLOUDSDK_CORE_PROJECT"]
    return out


def caller_account(env: Mapping[str, str], *, local: bool) -> str | None:
    """Who calls the APIs, as OS Login names users: $TPUCTL_ACCOUNT, else gcloud's `core/account` (the email
    `gcloud compute ssh` uses for OS Login), else on the local cloud OWNER@localcloud.test. None when unknown
    (user ADC without gcloud); `connect` then takes a service account key's own email."""
    explicit = env.get("TPUCTL_ACCOUNT") or env.get("CLOUDSDK_CORE_ACCOUNT")
    if explicit:
        return explicit.strip()
    parser = _gcloud_properties(env)
    if parser.has_option("core", "account"):
        return parser.get("core", "account").strip() or None
    if local:
        from tpuctl.provision.labels import owner

        return f"{owner()}@localcloud.test"
    return None


def _gcloud_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("CLOUDSDK_CONFIG") or Path(env.get("HOME", str(Path.home()))) / ".config" / "gcloud")


def has_adc(env: Mapping[str, str]) -> bool:
    """Application Default Credentials present, looked for where and in the order google.auth.default() looks
    (google/auth/_default.py): GOOGLE_APPLICATION_CREDENTIALS, gcloud's application_default_credentials.json,
    then the metadata server, which is where Cloud Run, Compute Engine, GKE, Workbench and Cloud Shell give
    them. Reads no file's content: a malformed one is google.auth's to report."""
    if env.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return Path(env["GOOGLE_APPLICATION_CREDENTIALS"]).is_file()
    if (_gcloud_dir(env) / "application_default_credentials.json").is_file():
        return True
    return metadata_server(env)


METADATA_IP = "169.254.169.254"  # google/auth/compute_engine/_metadata.py: _GCE_DEFAULT_MDS_IP


def metadata_server(env: Mapping[str, str]) -> bool:
    """Whether a metadata server answers, probed as google.auth's `_metadata.ping` probes it: GET the root of
    $GCE_METADATA_IP (default 169.254.169.254) with `Metadata-Flavor: Google`; it must answer 200 with that
    header. `NO_GCE_CHECK=true` skips it, as there. One try of $GCE_METADATA_TIMEOUT seconds (default 1, not
    google.auth's 3 x 3): off Google Cloud nothing listens there, and the caller only asks once a project is
    named. google.auth's other fallback, a DMI product name starting with "Google", is left out: without an
    answering metadata server those credentials cannot mint a token anyway."""
    import urllib.request

    if env.get("NO_GCE_CHECK") == "true":
        return False
    try:
        timeout = float(env.get("GCE_METADATA_TIMEOUT") or 1)
    except ValueError:
        timeout = 1.0
    # The link-local server is never behind a proxy, whatever http_proxy says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://{env.get('GCE_METADATA_IP') or METADATA_IP}/",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with opener.open(request, timeout=timeout) as resp:
            return resp.status == 200 and resp.headers.get("Metadata-Flavor") == "Google"
    except (OSError, ValueError):
        return False


CREDENTIALS_HINT = ("run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service "
                    "account key file; --cloud local uses the embedded local cloud instead")


def no_credentials(project: str, source: str | None, env: Mapping[str, str]) -> BadInput:
    """The one-line error for a Google project without credentials: how to get them, or to choose the emulator."""
    key = env.get("GOOGLE_APPLICATION_CREDENTIALS")
    found = (f"GOOGLE_APPLICATION_CREDENTIALS names {key}, which is not a file" if key else
             "no Application Default Credentials (no key file, no gcloud login, no metadata server)")
    return BadInput(f"project {project}{f' (from {source})' if source else ''} is on Google Cloud, but {found}",
                    field="credentials", hint=CREDENTIALS_HINT)


def credentials_error(exc: BaseException) -> BadInput | None:
    """google.auth's DefaultCredentialsError (a key file it cannot use, found after `has_adc` said yes) as the
    same one-line BadInput; None for any other exception. By type: the module is loaded whenever it was raised."""
    import sys

    auth = sys.modules.get("google.auth.exceptions")
    if auth is None or not isinstance(exc, auth.DefaultCredentialsError):
        return None
    return BadInput(f"Application Default Credentials unusable: {exc}", field="credentials", hint=CREDENTIALS_HINT)


def layered(flags: Mapping[str, Any], spec: Mapping[str, Any] | None = None, *,
            env: Mapping[str, str] | None = None, config_path: Path | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge spec fields by precedence; returns (merged fields, field -> source name).

    `flags` holds only the flags the user gave (None values are dropped).
    """
    env = os.environ if env is None else env
    layers = (("default", {}), ("gcloud config", gcloud_config(env)), ("user config", user_config(config_path)),
              ("spec", dict(spec or {})), ("environment", env_overrides(env)),
              ("flag", {k: v for k, v in flags.items() if v is not None}))
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, values in layers:
        for k, v in values.items():
            if k == "zone" and "zones" in merged:
                merged.pop("zones")
            merged[k] = v
            sources[k] = source
    return merged, sources


def settings(*, project: str | None = None, cloud: str | None = None, env: Mapping[str, str] | None = None,
             config_path: Path | None = None, sources: Mapping[str, str] | None = None,
             start_local: bool = True, on_event: EventSink = ignore) -> Settings:
    """Pick the target and project. `project` is the already-merged value (flags/env/spec/config), if any.

    Blocks only to auto-start the embedded local cloud (`start_local`), which `on_event` hears as a Note; with
    `start_local=False` a local target without a running cloud comes back with no endpoint.
    """
    env = os.environ if env is None else env
    sources = dict(sources or {})
    if project is None:
        merged, merged_sources = layered({}, env=env, config_path=config_path)
        project = merged.get("project")
        if project is not None:
            sources["project"] = merged_sources["project"]
    cloud = cloud or env.get("TPUCTL_CLOUD") or None
    if cloud is not None and cloud not in TARGETS:
        raise BadInput(f"unknown cloud {cloud!r}", field="cloud", hint="use --cloud gcp or --cloud local")
    endpoint = env.get("TPUCTL_API_ENDPOINT") or None
    # A named project means Google Cloud: with no credentials that is an error, never a quiet fall back to the
    # emulator (a Cloud Run gc would "clean up" an empty local cloud and exit 0).
    if cloud == "gcp" or (cloud is None and endpoint is None and project):
        if not project:
            raise BadInput("no Google Cloud project given", field="project",
                           hint="pass --project, set TPUCTL_PROJECT, or `gcloud config set project P`")
        if not has_adc(env):
            raise no_credentials(project, sources.get("project"), env)
        return Settings(target="gcp", project=project, sources=sources, account=caller_account(env, local=False))
    project = project or LOCAL_PROJECT
    sources.setdefault("project", "default")
    storage_host = env.get("STORAGE_EMULATOR_HOST") or None
    if not start_local and endpoint is None:
        # A dry run names the target without starting anything.
        return Settings(target="local", project=project, sources=sources, account=caller_account(env, local=True))
    if endpoint is None or storage_host is None:
        endpoint, storage_host = _local_endpoints(endpoint, storage_host, on_event)
    return Settings(target="local", project=project, endpoint=endpoint.rstrip("/"),
                    storage_host=storage_host.rstrip("/"), sources=sources, account=caller_account(env, local=True))


def ensure_endpoint(settings: Settings, *, on_event: EventSink = ignore) -> Settings:
    """A local target resolved without starting anything gets its endpoints now (auto-starting the embedded
    cloud, which `on_event` hears as a Note). GCP targets and local ones with endpoints pass through."""
    if not settings.local or settings.endpoint is not None:
        return settings
    endpoint, storage_host = _local_endpoints(None, None, on_event)
    return Settings(target="local", project=settings.project, endpoint=endpoint.rstrip("/"),
                    storage_host=storage_host.rstrip("/"), sources=settings.sources, account=settings.account)


def reachable(settings: Settings) -> Settings | None:
    """The settings with endpoints when the target answers without starting anything (GCP, a local cloud named
    by the environment, the embedded one already running); None when only starting the embedded cloud would
    reach it. For dry runs, which read but never start or create."""
    if not settings.local or settings.endpoint is not None:
        return settings
    try:
        from tpuctl.localcloud import daemon
    except ImportError:  # a base install without the [local] extra has no embedded cloud to ask
        return None
    info = daemon.status(paths.localcloud_dir())
    if info is None:
        return None
    return Settings(target="local", project=settings.project, endpoint=info["endpoint"].rstrip("/"),
                    storage_host=info["storage_host"].rstrip("/"), sources=settings.sources)


def _local_endpoints(endpoint: str | None, storage_host: str | None,
                     on_event: EventSink) -> tuple[str, str]:
    """The running local cloud's endpoints: the one named by the environment, else the embedded daemon."""
    if endpoint is not None:
        return endpoint, storage_host or _storage_host_of(endpoint)
    from tpuctl.localcloud import daemon

    try:
        info = daemon.ensure_running(paths.localcloud_dir(), idle_stop_s=local_idle_stop_s())
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc)) from None
    on_event(Note(f"no Google Cloud project named: using the embedded local cloud at {info['endpoint']} "
                  "(--cloud gcp to change)"))
    return info["endpoint"], storage_host or info["storage_host"]


LOCAL_IDLE_DEFAULT = "30m"
# The words that turn an idle limit off (`local start --idle-stop`, TPUCTL_LOCAL_IDLE, `gc --idle`). Not 0: a
# zero duration is refused everywhere else, so it must not quietly mean "forever" here.
NEVER = ("never", "off")


def local_idle_stop_s(value: str | None = None, env: Mapping[str, str] | None = None) -> float:
    """Seconds of idleness after which the embedded local cloud stops itself: `value` (`tpuctl local start
    --idle-stop`), else TPUCTL_LOCAL_IDLE, else 30m; `never` or `off` keep it running (0 is refused). BadInput if invalid."""
    from tpuctl.spec import parse_duration

    env = os.environ if env is None else env
    source = "idle_stop" if value is not None else "TPUCTL_LOCAL_IDLE"
    text = value if value is not None else env.get("TPUCTL_LOCAL_IDLE") or LOCAL_IDLE_DEFAULT
    if text.strip().lower() in NEVER:
        return 0.0
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise BadInput(str(exc), field=source, hint="a duration such as 30m or 2h, or never") from None


def _storage_host_of(endpoint: str) -> str:
    """Ask a local cloud where its storage emulator listens (its admin status page)."""
    import json
    import urllib.request

    from tpuctl.errors import LocalCloudError

    try:
        with urllib.request.urlopen(f"{endpoint.rstrip('/')}/_localcloud/status", timeout=10) as resp:
            return json.load(resp)["storage_host"]
    except (OSError, ValueError, KeyError) as exc:
        raise LocalCloudError(f"cannot read the local cloud's status at {endpoint}: {exc}") from exc
