"""A job bundle: the template program + the resolved config + the user's files + the worker agent, packed
into one reproducible tar.gz named by its sha256 and uploaded to `gs://BUCKET/runs/RUN/`.

Reproducible (sorted entries, zeroed times and owners): the same inputs give the same hash, so shipping
an unchanged job again uploads nothing.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tpuctl import frameworks
from tpuctl.errors import BadInput, from_google
from tpuctl.spec import ENV_NAME_RULE, bad_env_names
from tpuctl.templates import contract

from .remote import check_run_name

# The worker agent ships as this package (every module of `tpuctl.jobs.agent`, under this name: the worker has no
# tpuctl), run as `python -m tpuctl_agent` with the bundle on its path (templates/bootstrap.sh.tmpl).
AGENT_PACKAGE = "tpuctl_agent"
_SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache"}


@dataclass(frozen=True)
class JobDescription:
    """Everything the worker agent needs, written into the bundle as `job.json`."""

    run: str
    project: str
    bucket: str
    module: str  # run as `python -m MODULE --config CONFIG.json ARGS...`
    config: Mapping
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    num_workers: int = 1
    heartbeat_s: float = 10.0
    storage: str = "gcs"  # how the workers' programs reach the bucket: one of STORAGE_KINDS (`worker_storage`)

    @property
    def prefix(self) -> str:
        return f"runs/{self.run}"


# The agent's storage (jobs/agent/storage.py): "gcs", Cloud Storage, which the program reads and writes itself;
# "mirror", a storage emulator, which TensorFlow's gs:// filesystem cannot reach, so the agent mirrors the
# program's gs:// locations to the worker's disk and back.
STORAGE_KINDS = ("gcs", "mirror")


def check_storage(kind: str) -> str:
    """`kind` when it is one of STORAGE_KINDS; BadInput naming job.storage otherwise."""
    if kind not in STORAGE_KINDS:
        raise BadInput(f"storage {kind!r} is not one of {', '.join(STORAGE_KINDS)}", field="job.storage",
                       hint="see tpuctl.jobs.bundle.worker_storage")
    return kind


def worker_storage(clients) -> str:
    """The storage the workers of `clients`' cloud have: the local cloud's serve its storage emulator."""
    return "mirror" if clients.local else "gcs"


@dataclass(frozen=True)
class Bundle:
    path: Path
    sha256: str
    run: str
    storage: str = "gcs"  # its job.json `storage`: the bootstrap fetches it with that storage's client

    @property
    def object_name(self) -> str:
        return f"runs/{self.run}/bundle-{self.sha256[:16]}.tar.gz"


def resolve_template(template: str) -> Path:
    """A template name under `templates/`, or a local directory (its name is the Python package name)."""
    return contract.find(template).root


def job_config(overrides: Mapping | None, *, preset: str | None, bucket: str, run: str,
               data_url: str | None, framework: str = "", profile: str | None = None, sharding: str = "data") -> dict:
    """The template's config: the user's overrides plus where to read and write. Model, TensorBoard events
    and exports live under `gs://BUCKET/runs/RUN/model/`, so the run's results outlive its TPU. `framework`
    (the plan's choice, which fixed the TPU's runtime) becomes `runtime.framework`; `profile` (job.profile, steps
    FIRST-LAST to trace) becomes `runtime.profile`, given only when set: a template without it is not sent it; so
    does `sharding` (job.sharding as resolved: data, zero1 or fsdp) become `runtime.sharding`, only when zero1 or fsdp."""
    config = json.loads(json.dumps(dict(overrides or {})))
    if preset:
        config.setdefault("preset", preset)
    runtime = dict(config.get("runtime") or {})
    model = f"gs://{bucket}/runs/{run}/model"
    runtime.setdefault("model_dir", model)
    runtime.setdefault("export_dir", f"{model}/export")
    if data_url:
        runtime.setdefault("data_dir", data_url)
    if framework:
        runtime["framework"] = framework
    if profile:
        runtime["profile"] = profile
    if sharding in frameworks.SPLIT:  # not data, nor auto (the config check before the fit answers it)
        runtime["sharding"] = sharding
    config["runtime"] = runtime
    return config


def check_job_config(template, job, config: Mapping) -> None:
    """`template`'s own config check (contract.Template.check_config) on the `config` job_config made of `job` (a
    spec's JobSpec), naming the spec's field where the value came from one (job.preset, job.profile, job.sharding:
    what the user wrote), else job.config.FIELD. Raises BadInput."""
    try:
        template.check_config(config)
    except BadInput as exc:
        from_spec = {"job.config.preset": "preset" not in job.config and "job.preset",
                     "job.config.runtime.profile": bool(job.profile) and "job.profile",
                     "job.config.runtime.sharding": job.sharding in frameworks.SPLIT and "job.sharding"}
        if from_spec.get(exc.field):
            raise BadInput(exc.message, field=from_spec[exc.field], hint=exc.hint) from exc
        raise


def check_config(template_dir: Path, config: Mapping) -> None:
    """The template's own config check (its contract's `config.validate`) on the config the workers would get,
    so a typo or an impossible value is bad input here, before anything is created. Raises BadInput naming
    `job.config.FIELD`; a template that declares no check ships its config unchecked."""
    contract.find(str(template_dir)).check_config(config)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts) and p.suffix != ".pyc")


def agent_modules() -> list:
    """The agent package's modules (importlib.resources traversables), sorted: the bundle carries all of them."""
    return sorted((m for m in resources.files("tpuctl.jobs.agent").iterdir() if m.name.endswith(".py")),
                  key=lambda m: m.name)


def build(template_dir: Path, job: JobDescription, out_dir: Path, files: Sequence[Path] = (),
          packages: Sequence[Path] = ()) -> Bundle:
    """Pack the bundle into `out_dir`. Pure and deterministic; user files land under `files/`; `packages` (the
    template's `uses`) ship beside the template's own package, importable by their directory names."""
    check_run_name(job.run)
    # Checked again here, not only in the spec: this is where the names meet a shell on the workers.
    bad_env = bad_env_names(job.env)
    if bad_env:
        raise BadInput(f"environment variable name(s) {bad_env!r} are not valid", field="job.env",
                       hint=ENV_NAME_RULE)
    check_storage(job.storage)
    package = template_dir.name
    # A framework's own list where the template has one (bert: requirements-jax.txt for the JAX base images).
    framework = str(((job.config or {}).get("runtime") or {}).get("framework") or "")
    requirements = template_dir / f"requirements-{framework}.txt"
    if not framework or not requirements.is_file():
        requirements = template_dir / "requirements.txt"
    doc = {
        "run": job.run, "project": job.project, "bucket": job.bucket, "prefix": job.prefix, "module": job.module,
        "config": job.config, "args": list(job.args), "env": dict(job.env), "num_workers": job.num_workers,
        "heartbeat_s": job.heartbeat_s, "storage": job.storage,
        "requirements": f"{package}/{requirements.name}" if requirements.is_file() else None,
    }
    raw = io.BytesIO()
    # gzip with mtime 0 and no file name: byte-identical output for identical input.
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        _add_bytes(tar, "job.json", json.dumps(doc, sort_keys=True, indent=1).encode())
        for module in agent_modules():
            _add_bytes(tar, f"{AGENT_PACKAGE}/{module.name}", module.read_bytes())
        for root in (template_dir, *packages):
            for p in _files_under(root):
                _add_bytes(tar, f"{root.name}/{p.relative_to(root).as_posix()}", p.read_bytes())
        for f in files:
            f = Path(f)
            if not f.exists():
                raise BadInput(f"no such file {f}", field="job.files", hint="paths are relative to the spec file")
            entries = [(f.name, f)] if f.is_file() else [(f"{f.name}/{p.relative_to(f).as_posix()}", p) for p in _files_under(f)]
            for rel, p in entries:
                _add_bytes(tar, f"files/{rel}", p.read_bytes())
    data = raw.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bundle-{sha[:16]}.tar.gz"
    if not path.exists():
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(path)
    return Bundle(path=path, sha256=sha, run=job.run, storage=job.storage)


def upload(storage_client, bucket: str, bundle: Bundle) -> bool:
    """Upload unless an object of that (content-addressed) name exists. Returns whether bytes were sent.
    Idempotent."""
    from google.api_core import exceptions as gexc

    blob = storage_client.bucket(bucket).blob(bundle.object_name)
    try:
        if blob.exists():
            return False
        blob.upload_from_filename(str(bundle.path), content_type="application/gzip")
    except gexc.GoogleAPICallError as exc:
        raise from_google(exc, what=f"upload job bundle to gs://{bucket}/{bundle.object_name}") from exc
    return True
