"""`tpuctl export RUN --format FORMAT` and `tpuctl run --export FORMAT`: a run's checkpoint, read from its bucket,
turned into another framework's files by the run's template (its `exporters`, see templates/contract.py).

Works after the TPU is gone: everything comes from the bucket. The run's bucket is the one carrying its
`tpuctl-run` label, else the one the local ledger remembers for it, else the one given (`--bucket`, or a
`gs://BUCKET/runs/RUN` URL). `runs/RUN/launch.json` names the job bundle; its `job.json` says which template ran
(its module) and where the model and the data are (`runtime.model_dir`, `runtime.data_dir`). A built-in template
exports with the installed code. A user's template runs its own exporter on this machine, so its code must come
from this machine too, never from the bucket (the TPU's service account can write there): the template directory
given (`--template DIR`), else the bundle this machine built for the run (`TPUCTL_HOME/bundles`, checked against the
sha256 in launch.json).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpuctl import ledger, provision
from tpuctl.errors import BadInput, NotFound, from_google
from tpuctl.provision import Kind
from tpuctl.templates import contract

from . import cluster
from .remote import check_run_name

if TYPE_CHECKING:
    from tpuctl.provision import Clients


@dataclass(frozen=True)
class Exported:
    run: str
    format: str
    template: str
    model_dir: str
    out_dir: str
    files: tuple[str, ...]


def split_run(run: str, bucket: str | None) -> tuple[str, str | None]:
    """(run name, bucket or None) from `RUN` or `gs://BUCKET/runs/RUN[/...]`. Raises BadInput."""
    if run.startswith("gs://"):
        found_bucket, _, rest = run[len("gs://"):].partition("/")
        parts = rest.strip("/").split("/")
        if not found_bucket or len(parts) < 2 or parts[0] != "runs":
            raise BadInput(f"{run!r} is not a run's URL", field="run", hint="use gs://BUCKET/runs/RUN, or the run name")
        if bucket and bucket != found_bucket:
            raise BadInput(f"--bucket {bucket} disagrees with {run}", field="bucket", hint="give one of them")
        run, bucket = parts[1], found_bucket
    return check_run_name(run), bucket


def find_bucket(clients: Clients, run: str) -> str:
    """The run's bucket: by its label (the truth), else the ledger's memory of it. Raises NotFound."""
    labelled = next((r.name for r in provision.list_resources(clients, run) if r.kind is Kind.BUCKET), None)
    if labelled:
        return labelled
    try:
        remembered = [e for e in ledger.Ledger().entries()
                      if e.kind == Kind.BUCKET.value and e.run == run and e.project == clients.project]
    except OSError:
        remembered = []
    alive = [e for e in remembered if e.deleted is None]
    if alive:
        return alive[-1].name
    if remembered:
        raise NotFound(f"run {run}'s bucket {remembered[-1].name} was deleted, and its checkpoints with it",
                       field="run", hint="keep buckets you want to export from (`tpuctl run` keeps them by default)")
    raise NotFound(f"run {run} has no bucket in project {clients.project}", field="run",
                   hint="see `tpuctl list`; or name it: --bucket BUCKET (or gs://BUCKET/runs/RUN)")


def reader(clients: Clients):
    """`read(url) -> bytes` for gs:// URLs (through the storage client) and local paths; FileNotFoundError for a
    missing file, TpuctlError for any other failure."""
    from google.api_core import exceptions as gexc

    def read(url: str) -> bytes:
        if not url.startswith("gs://"):
            return Path(url).read_bytes()
        bucket, _, name = url[len("gs://"):].partition("/")
        try:
            return clients.storage.bucket(bucket).blob(name).download_as_bytes()
        except gexc.NotFound:
            raise FileNotFoundError(url) from None
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=f"read {url}") from exc

    return read


def _job(clients: Clients, bucket: str, run: str) -> tuple[dict, cluster.LaunchRecord]:
    """The launched job's job.json (data only: read, never run) and its launch record. Raises NotFound."""
    record = cluster.load_launch(clients, bucket, run)
    try:
        bundle = reader(clients)(f"gs://{bucket}/{record.bundle_object}")
    except FileNotFoundError:
        raise NotFound(f"run {run}'s job bundle gs://{bucket}/{record.bundle_object} is gone", field="run") from None
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        return json.load(tar.extractfile("job.json")), record


def _template(package: str, record: cluster.LaunchRecord, template_dir: Path | None, scratch: Path) -> contract.Template:
    """The template directory given, else the built-in of that name, else the user's template from the bundle
    this machine built for the run. Raises BadInput when none is at hand."""
    if template_dir is not None:
        return contract.load(template_dir)
    if (contract.builtin_root() / package / contract.MANIFEST).is_file():
        return contract.find(package)
    from tpuctl import paths

    local = paths.home() / "bundles" / f"bundle-{record.bundle_sha[:16]}.tar.gz"
    if not local.is_file() or hashlib.sha256(local.read_bytes()).hexdigest() != record.bundle_sha:
        raise BadInput(f"run {record.run} ran the template {package!r}, which is not built in, and this machine does "
                       "not hold the bundle it was shipped in", field="template",
                       hint=f"pass the template's directory: --template DIR (the {package}/ the spec named)")
    with tarfile.open(local, mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(f"{package}/")]
        tar.extractall(scratch, members=members, filter="data")
    return contract.load(scratch / package)


def export(clients: Clients, run: str, fmt: str, out_dir: Path, *, bucket: str | None = None,
           template_dir: Path | None = None) -> Exported:
    """Write the `fmt` export of run `run`'s latest checkpoint into local `out_dir` (created; files overwritten).

    Blocks for the bucket reads. Raises BadInput (bad run name, a format the template lacks, files it cannot
    export) or NotFound (no bucket, no launch record, no checkpoint yet)."""
    run, bucket = split_run(run, bucket)
    bucket = bucket or find_bucket(clients, run)
    job, record = _job(clients, bucket, run)
    runtime = (job.get("config") or {}).get("runtime") or {}
    model_dir = runtime.get("model_dir") or f"gs://{bucket}/runs/{run}/model"
    with tempfile.TemporaryDirectory(prefix="tpuctl-export-") as scratch:
        template = _template(str(job["module"]).split(".")[0], record, template_dir, Path(scratch))
        hook = template.exporter(fmt)
        files = contract.RunFiles(model_dir=model_dir, data_dir=runtime.get("data_dir") or "", read=reader(clients))
        try:
            written = hook(files, Path(out_dir))
        except FileNotFoundError as exc:
            raise NotFound(f"run {run} has nothing to export yet: {exc.args[0] if exc.args else exc} is missing",
                           field="run", hint=f"a checkpoint appears in {model_dir}/checkpoints every "
                                             "trainer.checkpoint_every steps") from exc
        except ValueError as exc:
            raise BadInput(f"run {run} cannot be exported as {fmt}: {exc}", field="run") from exc
        except ImportError as exc:  # the base install provisions only; exporters need the training extra's libraries
            raise BadInput(f"the {template.name} template's {fmt} exporter needs the Python package "
                           f"{exc.name or exc}", field="format", hint="pip install 'tpuctl[train]'") from exc
    return Exported(run=run, format=fmt, template=template.name, model_dir=model_dir, out_dir=str(out_dir),
                    files=tuple(written))


def upload(clients: Clients, local_dir: Path, url: str) -> list[str]:
    """Copy every file of `local_dir` to `url` (gs://BUCKET/PREFIX); returns the object names. Idempotent
    (objects are overwritten). Blocks."""
    from google.api_core import exceptions as gexc

    bucket, _, prefix = url[len("gs://"):].partition("/")
    names = []
    for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        name = f"{prefix.rstrip('/')}/{path.relative_to(local_dir).as_posix()}"
        try:
            clients.storage.bucket(bucket).blob(name).upload_from_filename(str(path))
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=f"upload gs://{bucket}/{name}") from exc
        names.append(name)
    return names
