"""The worker-side agent: shipped in every job bundle as `tpuctl_agent.py`, run by the bootstrap.

Needs only the standard library and google-cloud-storage (the worker's runtime Python has no tpuctl).

`prepare`: installs the template's requirements into this Python once per requirements hash (a marker file
caches it), skipping distributions that are already installed (the local cloud has no network). Keras is
pinned to the release the template is tested with for this interpreter's TensorFlow (template.json's
`keras_by_tensorflow`, by TF minor version): the runtime image's TensorFlow decides, never pip's newest
Keras; a TensorFlow older than every tested one fails here, with what to use instead.

`run`: wraps the training process. When storage is emulated (`STORAGE_EMULATOR_HOST`: TensorFlow cannot read
gs:// from an emulator) it mirrors the config's gs:// data and model locations to local disk, restores the
latest checkpoint from the bucket before the start (resume after preemption), and worker 0 syncs the model
directory (checkpoints, TensorBoard events, exports) back periodically and at exit. On a real TPU VM the
program writes gs:// itself and the agent only heartbeats and copies logs. Every worker copies its log to
`gs://BUCKET/runs/RUN/logs/worker-N.log` and its state to `.../workers/worker-N.json`; `.../status.json`
aggregates them: {"state": running|succeeded|failed, "heartbeat", "step", "exit_code", "workers"}, merged into
what the laptop wrote there (see `merge_json`).
`exit_code` (local file) is written last: when it exists, logs and checkpoints are in the bucket.

Preemption notices: the agent watches the guest's metadata server (`instance/preempted`, `instance/maintenance-event`,
`?wait_for_change=true`) and on a notice writes the save request file the program finds through
`TPUCTL_SAVE_REQUEST` (templates/README.md, "Save on notice"): the program checkpoints at its next step boundary.
The guest's shutdown then SIGTERMs every process (the program too: it saves, if it has not, and ends); the agent
forwards its own SIGTERM to the program and syncs the checkpoint to the bucket before the power goes off (30 s
after the shutdown starts on a Spot VM: compute.v1 `Scheduling.skipGuestOsShutdown`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

STEP = re.compile(rb"\bstep=(\d+)")
PATH_KEYS = ("data_dir", "model_dir", "export_dir")
CANCEL_MARKER = "cancelled"  # written by a cancel (jobs/remote.py, the bootstrap's relaunch) before its SIGTERM
# The guest's notices (metadata path -> its value while nothing is coming): a Spot preemption sets `preempted`
# TRUE (compute/docs/instances/create-use-spot, "Detect preemption"); `maintenance-event` leaves NONE before host
# maintenance (compute/docs/metadata/getting-live-migration-notice; TPU VMs are Compute Engine VMs,
# tpu/docs/prepare-for-maintenance). Read with `?wait_for_change=true` (compute/docs/metadata/querying-metadata).
NOTICES = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
SAVE_REQUEST_VAR = "TPUCTL_SAVE_REQUEST"  # the template contract's save request file (templates/README.md)
SAVE_REQUEST = "save-request"
WAIT_S = 300  # one wait_for_change request's timeout_sec: the watch asks again after it


def _emulated() -> bool:
    return bool(os.environ.get("STORAGE_EMULATOR_HOST"))


def _client(project: str):
    """A storage client acting as the VM's service account, as on a real TPU VM (the metadata server's token).
    With an emulator and no metadata server to ask, requests go anonymously (the emulator's owner)."""
    from google.cloud import storage

    if not _emulated():
        return storage.Client(project=project)
    if os.environ.get("GCE_METADATA_HOST"):
        import google.auth

        credentials = google.auth.default()[0]
    else:
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    # The client ignores ambient credentials when STORAGE_EMULATOR_HOST is set: they must be passed.
    return storage.Client(project=project, credentials=credentials)


# status.json has two writers: worker 0's agent (the job's account: state, step, exit_code, heartbeat) and the
# laptop's `tpuctl run` (recovering; and, when it decides how the run ended, `final` with its verdict). Keys the
# agent does not write are never touched by it, and it leaves a final status alone.
STATUS = "status.json"
RACE_ATTEMPTS = 10  # a read-modify-write, or a listing, that another writer keeps invalidating: tries


def merge_json(bucket, name: str, fields: dict, *, unless=None) -> dict | None:
    """Merge `fields` into the JSON object `name` of `bucket` (a google.cloud.storage Bucket) without losing
    a concurrent writer's keys: read the object and its generation, write the merge only while that generation
    is still the live one (`ifGenerationMatch`, 0 when there is no object yet), and read again on 412
    (cloud.google.com/storage/docs/request-preconditions), after a jittered backoff. Returns what was written, or
    None when `unless(current document)` says to leave it as it is. Blocks for a few requests (seconds at worst
    under contention); idempotent. RuntimeError when it lost the race RACE_ATTEMPTS times."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    for attempt in range(RACE_ATTEMPTS):
        if attempt:  # jittered backoff: writers that collided do not collide again in lockstep
            time.sleep(random.uniform(0, min(1.0, 0.05 * 2 ** attempt)))
        blob = bucket.blob(name)
        try:
            current = json.loads(blob.download_as_bytes())
            generation = blob.generation  # from the download's x-goog-generation
        except NotFound:
            current, generation = {}, 0
        except ValueError:  # not JSON: replaced like a missing object, but only this generation of it
            current, generation = {}, blob.generation
        if not isinstance(current, dict):
            current = {}
        if unless is not None and unless(current):
            return None
        doc = {**current, **fields}
        try:
            bucket.blob(name).upload_from_string(json.dumps(doc, sort_keys=True), content_type="application/json",
                                                 if_generation_match=generation)
            return doc
        except PreconditionFailed:
            continue  # another writer got in between: merge onto theirs
    raise RuntimeError(f"gs://{bucket.name}/{name} kept changing: {RACE_ATTEMPTS} writes lost the race")


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("gs://"):].partition("/")
    return bucket, prefix.rstrip("/")


# ---------------------------------------------------------------------------------------------- prepare

def _requirements(path: Path) -> list[str]:
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if ";" in line:
            try:
                from packaging.markers import Marker

                if not Marker(line.split(";", 1)[1]).evaluate():
                    continue
            except ImportError:
                pass
            line = line.split(";", 1)[0].strip()
        reqs.append(line)
    return reqs


def _installed(requirement: str) -> bool:
    """Installed, and at a version the requirement accepts (version checks need `packaging`, which pip
    environments have; without it presence is enough)."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement

        req = Requirement(requirement)
        name, specifier = req.name, req.specifier
    except ImportError:
        name, specifier = re.split(r"[\s\[<>=!~]", requirement, maxsplit=1)[0], None
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return specifier is None or specifier.contains(version, prereleases=True)


def tensorflow_version() -> str | None:
    """The TensorFlow this interpreter carries (any of its distributions), or None."""
    from importlib import metadata

    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-tpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def keras_requirement(tested: dict[str, str], tf_version: str | None) -> str | None:
    """`keras==X` for this TensorFlow per the template's tested table; None keeps the requirements' own
    Keras line (no table, no TensorFlow, or a TensorFlow newer than the table). ValueError for a TensorFlow
    older than every tested one: no Keras the template runs on is known to work there."""
    if not tested or tf_version is None:
        return None
    pin = tested.get(".".join(str(n) for n in _minor(tf_version)))
    if pin:
        return f"keras=={pin}"
    oldest = min(tested, key=_minor)
    if _minor(tf_version) < _minor(oldest):
        raise ValueError(f"TensorFlow {tf_version} is older than any this template is tested with "
                         f"({', '.join(sorted(tested, key=_minor))}): use a tpu-vm-tf-{oldest}.x runtime or newer")
    return None


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _keep_installed(workdir: Path, installing: list[str], cache: Path) -> list[str]:
    """pip arguments that hold every package the image has (the bootstrap's `image-constraints.txt`) at its
    installed version, except those being installed now: a requirement never upgrades TensorFlow's own."""
    listed = workdir / "image-constraints.txt"
    if not listed.is_file():
        return []
    names = {_name(r) for r in installing}
    keep = [line for line in listed.read_text().splitlines() if line and _name(line) not in names]
    cache.mkdir(parents=True, exist_ok=True)
    constraints = cache / "constraints.txt"
    constraints.write_text("\n".join(keep) + "\n")
    return ["-c", str(constraints)]


def _install_target() -> list[str]:
    """Where pip installs outside a venv: the user site. An interpreter its distribution marks EXTERNALLY-MANAGED
    (PEP 668; Ubuntu 24.04, which TPU7x's accelerator image is) refuses even `--user` installs unless told
    `--break-system-packages` (pip's documented override; the user site leaves the system packages as they are)."""
    if sys.prefix != sys.base_prefix:
        return []
    import sysconfig

    managed = Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").is_file()
    return ["--user", "--break-system-packages"] if managed else ["--user"]


def prepare(bundle: Path, cache: Path) -> int:
    job = json.loads((bundle / "job.json").read_text())
    req_rel = job.get("requirements")
    if not req_rel:
        return 0
    req_file = bundle / req_rel
    meta_file = req_file.parent / "template.json"
    tested = json.loads(meta_file.read_text()).get("keras_by_tensorflow") or {} if meta_file.is_file() else {}
    tf_version = tensorflow_version()
    try:
        keras = keras_requirement(tested, tf_version)
    except ValueError as exc:
        print(f"tpuctl agent: {exc}", file=sys.stderr, flush=True)
        return 2
    reqs = _requirements(req_file)
    if keras:
        reqs = [r for r in reqs if _name(r) != "keras"] + [keras]
    digest = hashlib.sha256("\n".join(reqs).encode() + sys.executable.encode()).hexdigest()[:16]
    marker = cache / f"{digest}.ok"
    if marker.exists():
        return 0
    missing = [r for r in reqs if not _installed(r)]
    if missing:
        print(f"tpuctl agent: installing {' '.join(missing)}", flush=True)
        base = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        done = subprocess.run(base + _install_target() + _keep_installed(bundle.parent, missing, cache)
                              + missing)
        if done.returncode != 0:
            print(f"tpuctl agent: pip install failed ({done.returncode})", file=sys.stderr, flush=True)
            return done.returncode
    cache.mkdir(parents=True, exist_ok=True)
    marker.write_text(" ".join(missing) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- storage

# A checkpoint directory holds a `checkpoint` pointer naming its checkpoints, newest first: TensorFlow's text
# proto (`model_checkpoint_path: "ckpt-30"` + `all_model_checkpoint_paths: ...`) or a bare name. A
# checkpoint's files are its name or its name plus a suffix (ckpt-30.index, ckpt-30.data-00000-of-00001);
# TensorFlow writes shards into ckpt-30_temp/ first, then the data files, the index, then the pointer.
POINTER = "checkpoint"
TF_CHECKPOINT = re.compile(r"^.+-\d+(\.index|\.data-\d+-of-\d+|_temp.*)$")
ALL_PATHS = re.compile(r'^\s*all_model_checkpoint_paths:\s*"(.*)"\s*$')
TF_SHARD = re.compile(r"\.data-(\d+)-of-(\d+)$")
STEP_SUFFIX = re.compile(r"^(?P<base>.+?)-(?P<step>\d+)(?=$|[._])")
# Half-written files: our own downloads (.part), and TensorFlow's atomic writes (NAME.tmp<uuid hex>,
# NAME.tempstate<digits>).
_TEMPORARY = re.compile(r"\.(part|tmp[0-9a-f]*|tempstate\d+)$")


def _pointer_names(text: str) -> list[str]:
    """The checkpoint names a pointer file holds, the newest first."""
    pairs = re.findall(r'^\s*(model_checkpoint_path|all_model_checkpoint_paths):\s*"(.*)"\s*$', text, re.M)
    if not pairs:
        return [os.path.basename(text.strip())] if text.strip() else []
    latest = [os.path.basename(v) for k, v in pairs if k == "model_checkpoint_path"][:1]
    return latest + [os.path.basename(v) for k, v in pairs if k != "model_checkpoint_path"
                     and os.path.basename(v) not in latest]


def _pointer_naming(text: str, keep: set[str]) -> str:
    """The pointer `text` naming only the checkpoints in `keep`: TensorFlow pairs the i-th
    all_model_checkpoint_paths with the i-th all_model_checkpoint_timestamps, so both go together."""
    lines = text.splitlines(keepends=True)
    paths = [m.group(1) for m in map(ALL_PATHS.match, lines) if m]
    dropped = {i for i, path in enumerate(paths) if os.path.basename(path) not in keep}
    out, seen = [], {"all_model_checkpoint_paths": 0, "all_model_checkpoint_timestamps": 0}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in seen:
            seen[key] += 1
            if seen[key] - 1 in dropped:
                continue
        out.append(line)
    return "".join(out)


def _bases(names) -> set[str]:
    return {m.group("base") for m in map(STEP_SUFFIX.match, names) if m}


def _pointer_bases(d: Path) -> set[str]:
    try:
        return _bases(_pointer_names((d / POINTER).read_text()))
    except FileNotFoundError:
        return set()


def _is_checkpoint_name(top: str, bases: set[str]) -> bool:
    """`top` (a file or directory right under a checkpoint directory) belongs to some checkpoint."""
    m = STEP_SUFFIX.match(top)
    return bool(TF_CHECKPOINT.match(top) or (m and m.group("base") in bases))


def _is_checkpoint_part(path: Path, d: Path, bases: set[str]) -> bool:
    """`path` is the pointer of `d` or part of one of its checkpoints (published by _publish_checkpoints)."""
    try:
        top = path.relative_to(d).parts[0]
    except ValueError:
        return False
    return top == POINTER or _is_checkpoint_name(top, bases)


def _complete(name: str, members: list[str]) -> bool:
    """Every file of checkpoint `name` is there: its index and all its data shards (TensorFlow), or the
    checkpoint file itself (a single-file format)."""
    shards = [m for m in map(TF_SHARD.search, members) if m]
    if not shards:
        return bool(members) and (name in members or f"{name}.index" not in members)
    total = int(shards[0].group(2))
    return f"{name}.index" in members and {int(m.group(1)) for m in shards} == set(range(total))


def _same_content(path: Path, blob) -> bool:
    """The local file holds exactly the object (MD5, as Cloud Storage reports it). Size alone is not enough:
    a restored `checkpoint` pointer naming ckpt-30.json has the size of a stale one naming ckpt-10.json."""
    if blob.md5_hash is None or not path.is_file() or path.stat().st_size != blob.size:
        return False
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode() == blob.md5_hash


class Store:
    """The run's bucket prefix plus the local mirror of gs:// locations used when storage is emulated."""

    def __init__(self, job: dict, worker: int, mirror_root: Path):
        self.job = job
        self.worker = worker
        self.client = _client(job["project"])
        self.bucket = self.client.bucket(job["bucket"])
        self.prefix = job["prefix"].rstrip("/")
        self.mirror_root = mirror_root
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._published: dict[str, str] = {}  # checkpoint directory -> the pointer text last published

    def local(self, url: str) -> Path:
        bucket, prefix = _split(url)
        return self.mirror_root / bucket / prefix

    def as_urls(self, line: bytes) -> bytes:
        """A line of the program's output with every mirror path written as the gs:// URL it stands for: the
        mirror is how this worker reaches emulated storage, not a place the user can look."""
        return line.replace(str(self.mirror_root).encode() + b"/", b"gs://")

    def download_prefix(self, url: str) -> int:
        """Mirror the objects under `url` to local disk (only those that differ); returns how many were
        downloaded. A listed object is read at its listed generation: one replaced or deleted meanwhile is 404
        (worker 0 publishing a newer checkpoint while this worker restores), and the prefix is listed again, so
        the mirror is one state the bucket was in (uploads publish a checkpoint's files before its pointer)."""
        from google.api_core.exceptions import NotFound

        bucket, prefix = _split(url)
        dest = self.local(url)
        n = 0
        for _ in range(RACE_ATTEMPTS):
            try:
                for blob in self.client.list_blobs(bucket, prefix=prefix + "/"):
                    rel = blob.name[len(prefix) + 1:]
                    if not rel or rel.endswith("/"):
                        continue
                    target = dest / rel
                    if _same_content(target, blob):
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    tmp = target.with_name(target.name + ".part")
                    blob.download_to_filename(str(tmp))
                    tmp.replace(target)
                    n += 1
                break
            except NotFound:
                continue
        else:
            raise RuntimeError(f"{url} kept changing while it was read: {RACE_ATTEMPTS} listings went stale")
        dest.mkdir(parents=True, exist_ok=True)
        return n

    def upload_dir(self, url: str) -> int:
        """Upload the files under the local mirror of `url` that changed since the last call. Blocks for the
        uploads; safe to interrupt at any point (a kill mid-call leaves the bucket restorable).

        Checkpoints are published, not copied: a checkpoint's files are uploaded only once its directory's
        `checkpoint` pointer names it (the program writes the pointer after the files are complete), the
        pointer goes up only after every file of the checkpoint it names is in the bucket, and older
        checkpoints are deleted from the bucket only after that. So the bucket's pointer always names a
        complete checkpoint, a half-written one is never uploaded, and a cancel at any moment leaves at
        least the previous complete checkpoint."""
        bucket, prefix = _split(url)
        src = self.local(url)
        if not src.exists():
            return 0
        dest = self.client.bucket(bucket)
        files = [p for p in src.rglob("*") if p.is_file() and not _TEMPORARY.search(p.name)]
        ckpt_dirs = {p.parent for p in files if p.name == POINTER or TF_CHECKPOINT.match(p.name)}
        ckpt_dirs |= {p.parent.parent for p in files if TF_CHECKPOINT.match(p.parent.name)}
        bases = {d: _pointer_bases(d) for d in ckpt_dirs}
        n = 0
        for p in sorted(files):
            d = next((d for d in ckpt_dirs if _is_checkpoint_part(p, d, bases[d])), None)
            if d is None:
                try:
                    n += self._upload_changed(dest, f"{prefix}/{p.relative_to(src)}", p)
                except FileNotFoundError:  # removed by the program between listing and upload
                    continue
        for d in sorted(ckpt_dirs):
            rel = d.relative_to(src).as_posix()
            n += self._publish_checkpoints(dest, prefix if rel == "." else f"{prefix}/{rel}", d)
        return n

    def _upload_changed(self, dest, name: str, path: Path) -> int:
        """1 if `path` was uploaded, 0 if unchanged. Raises FileNotFoundError if it vanished."""
        st = path.stat()
        sig = (st.st_size, st.st_mtime_ns)
        if self._uploaded.get(str(path)) == sig:
            return 0
        dest.blob(name).upload_from_filename(str(path))
        self._uploaded[str(path)] = sig
        return 1

    def _publish_checkpoints(self, dest, prefix: str, d: Path) -> int:
        """Upload the checkpoints that `d`'s pointer names, then the pointer as it was read (only if the
        newest one it names is wholly in the bucket), then delete the bucket's older checkpoints that the
        pointer no longer names."""
        from google.api_core.exceptions import NotFound

        pointer = d / POINTER
        try:
            text = pointer.read_text()  # read before listing: the files it names were complete then
        except FileNotFoundError:
            return 0  # the first checkpoint is still being written: nothing is published yet
        names = _pointer_names(text)
        if not names:
            return 0
        entries = sorted(e.name for e in d.iterdir() if e.is_file() and not _TEMPORARY.search(e.name))
        uploaded = 0
        done = set()
        for name in names:
            members = [e for e in entries if e == name or e.startswith(name + ".")]
            if not _complete(name, members):
                continue
            try:
                for e in members:
                    uploaded += self._upload_changed(dest, f"{prefix}/{e}", d / e)
            except FileNotFoundError:  # rotated away by the program meanwhile; the newer one counts
                continue
            done.add(name)
        if names[0] not in done:
            return uploaded  # the bucket's pointer still names an older, complete checkpoint
        text = _pointer_naming(text, done)  # without older ones rotated away while this sync ran
        if self._published.get(str(d)) == text:
            return uploaded
        dest.blob(f"{prefix}/{POINTER}").upload_from_string(text)
        self._published[str(d)] = text
        # Whatever checkpoint files the pointer does not name now go: older ones rotated away, and the
        # half of one whose upload a killed agent left behind (this sync uploads only named ones).
        bases = _bases(names)
        for blob in self.client.list_blobs(dest, prefix=prefix + "/"):
            top = blob.name[len(prefix) + 1:].split("/", 1)[0]
            named = any(top == n or top.startswith(n + ".") for n in done)
            if not named and _is_checkpoint_name(top, bases):
                try:
                    blob.delete()
                except NotFound:
                    pass
        return uploaded + 1

    def put_json(self, name: str, doc: dict) -> None:
        self.bucket.blob(f"{self.prefix}/{name}").upload_from_string(
            json.dumps(doc, sort_keys=True), content_type="application/json")

    def merge_status(self, fields: dict) -> None:
        """The job's account into status.json, unless the laptop has written its final verdict there."""
        merge_json(self.bucket, f"{self.prefix}/{STATUS}", fields, unless=lambda doc: bool(doc.get("final")))

    def get_json(self, name: str) -> dict | None:
        from google.api_core.exceptions import NotFound

        try:
            return json.loads(self.bucket.blob(f"{self.prefix}/{name}").download_as_bytes())
        except NotFound:
            return None

    def put_file(self, name: str, path: Path) -> None:
        if path.exists():
            self.bucket.blob(f"{self.prefix}/{name}").upload_from_filename(str(path), content_type="text/plain")


# ---------------------------------------------------------------------------------------------- run

class Agent:
    def __init__(self, bundle: Path, worker: int):
        self.bundle = bundle.resolve()
        self.home = self.bundle.parent
        self.child: subprocess.Popen | None = None
        self.terminated = False
        # First, before the storage client's slow import: the bootstrap starts the agent with SIGTERM ignored
        # and a cancel leaves CANCEL_MARKER before it signals, so a cancel at any moment of the start is seen
        # here (the marker) or by the handler, never lost to SIGTERM's default action.
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if (self.home / CANCEL_MARKER).exists():
            self.terminated = True
        self.job = json.loads((self.bundle / "job.json").read_text())
        self.worker = worker
        self.num_workers = int(self.job.get("num_workers") or 1)
        self.store = Store(self.job, worker, self.home / "gcs")
        self.step: int | None = None
        self.state = "running"
        self.exit_code: int | None = None
        self.ended: float | None = None
        self.log_path = self.home / "job.log"
        self._log_size = -1
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.save_request = self.home / SAVE_REQUEST

    def say(self, message: str) -> None:
        """The agent's own notes go into the job's log, where `tpuctl logs` and the bucket copy show them."""
        with open(self.log_path, "ab") as log:  # O_APPEND: whole lines, interleaved safely
            log.write(f"tpuctl agent: {message}\n".encode())

    # --- config paths
    def _config(self) -> dict:
        config = json.loads(json.dumps(self.job.get("config") or {}))
        runtime = config.get("runtime") or {}
        if _emulated():
            for key in PATH_KEYS:
                url = runtime.get(key)
                if isinstance(url, str) and url.startswith("gs://"):
                    runtime[key] = str(self.store.local(url))
        return config

    def _model_urls(self) -> list[str]:
        runtime = (self.job.get("config") or {}).get("runtime") or {}
        model = runtime.get("model_dir")
        urls = [u for u in (model, runtime.get("export_dir")) if isinstance(u, str) and u.startswith("gs://")]
        # An export directory under the model directory is synced with it.
        return [u for u in urls if u == model or not model or not u.startswith(model.rstrip("/") + "/")]

    def stage(self) -> None:
        if not _emulated():
            return
        runtime = (self.job.get("config") or {}).get("runtime") or {}
        data = runtime.get("data_dir")
        if isinstance(data, str) and data.startswith("gs://"):
            n = self.store.download_prefix(data)
            self.say(f"data: {n} file(s) from {data}")
        for url in self._model_urls():
            n = self.store.download_prefix(url)
            if n:
                self.say(f"restored {n} file(s) from {url}")

    # --- status
    def _worker_doc(self) -> dict:
        return {"worker": self.worker, "state": self.state, "step": self.step, "heartbeat": int(time.time()),
                "exit_code": self.exit_code, "ended": self.ended}

    def publish(self, final: bool = False) -> None:
        with self._lock:
            if self.worker == 0 and _emulated():
                for url in self._model_urls():
                    self.store.upload_dir(url)
            size = self.log_path.stat().st_size if self.log_path.exists() else -1
            if size != self._log_size or final:
                self.store.put_file(f"logs/worker-{self.worker}.log", self.log_path)
                self._log_size = size
            self.store.put_json(f"workers/worker-{self.worker}.json", self._worker_doc())
            if self.worker == 0 or final:
                self.store.merge_status(self._aggregate())

    def _aggregate(self) -> dict:
        docs = {self.worker: self._worker_doc()}
        for i in range(self.num_workers):
            if i != self.worker:
                doc = self.store.get_json(f"workers/worker-{i}.json")
                if doc:
                    docs[i] = doc
        states = [d.get("state") for d in docs.values()]
        failed = [d for d in docs.values() if d.get("state") == "failed"]
        if failed:
            # The first worker to fail is the cause; the others were usually stopped because of it.
            first = min(failed, key=lambda d: d.get("ended") or float("inf"))
            state, code = "failed", first.get("exit_code")
        elif len(docs) == self.num_workers and all(s == "succeeded" for s in states):
            state, code = "succeeded", 0
        else:
            state, code = "running", None
        steps = [d.get("step") for d in docs.values() if d.get("step") is not None]
        return {"state": state, "heartbeat": int(time.time()), "step": max(steps) if steps else None,
                "exit_code": code, "workers": self.num_workers}

    def _heartbeat_loop(self) -> None:
        interval = float(self.job.get("heartbeat_s") or 10)
        while not self._stop.wait(interval):
            try:
                self.publish()
            except Exception as exc:  # a flaky bucket must not kill training; the next beat retries
                self.say(f"sync failed: {type(exc).__name__}: {exc}")

    # --- notices
    def _watch(self, path: str, quiet: str) -> None:
        """Follow metadata `path` until the agent stops; a value other than `quiet` is a notice. An unreachable
        metadata server (briefly, or none at all off Google Cloud) is asked again, backing off up to a minute."""
        # Where google-auth (GCE_METADATA_HOST) or JAX (GCE_METADATA_IP) would look; a real VM sets neither.
        host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP") or "metadata.google.internal"
        url = f"http://{host}/computeMetadata/v1/{path}"
        etag, delay = None, 1.0  # None: not read yet (the first read answers at once)
        while not self._stop.is_set():
            query = "" if etag is None else \
                f"?wait_for_change=true&timeout_sec={WAIT_S}" + (f"&last_etag={etag}" if etag else "")
            request = urllib.request.Request(url + query, headers={"Metadata-Flavor": "Google"})
            try:
                with urllib.request.urlopen(request, timeout=WAIT_S + 30) as answer:
                    value, etag = answer.read().decode().strip(), answer.headers.get("ETag") or ""
            except (OSError, ValueError):
                self._stop.wait(delay)
                delay = min(2 * delay, 60.0)
                continue
            delay = 1.0
            if value != quiet:
                self.notice(f"{path}={value}")

    def notice(self, what: str) -> None:
        """Ask the program for a checkpoint at its next step boundary (the contract's request file)."""
        self.say(f"notice: {what}: asking the program to checkpoint at its next step")
        tmp = self.save_request.with_suffix(".tmp")
        tmp.write_text(what + "\n")
        tmp.replace(self.save_request)  # whole, never half-written, when the program looks

    # --- process
    def _on_term(self, signum, frame) -> None:
        self.terminated = True
        if self.child and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        # The log exists from the first moment, so `tpuctl logs -f` follows staging (which can take long)
        # instead of giving up waiting for the file.
        self.log_path.touch()
        from importlib import metadata

        try:
            keras = metadata.version("keras")
        except metadata.PackageNotFoundError:
            keras = None
        # Into agent.log (the job's log starts with the program's own output): what the job runs with.
        print(f"tpuctl agent: python={sys.version.split()[0]} tensorflow={tensorflow_version()} keras={keras}",
              flush=True)
        if not self.terminated:
            self.stage()
        work = self.home / "config.json"
        work.write_text(json.dumps(self._config(), indent=1))
        argv = [sys.executable, "-u", "-m", self.job["module"], "--config", str(work), *self.job.get("args", [])]
        env = {**os.environ, **{str(k): str(v) for k, v in (self.job.get("env") or {}).items()},
               "PYTHONPATH": os.pathsep.join(p for p in (str(self.bundle), os.environ.get("PYTHONPATH")) if p),
               "TPUCTL_RUN": self.job["run"], "TPUCTL_WORKER": str(self.worker),
               SAVE_REQUEST_VAR: str(self.save_request)}
        self.save_request.unlink(missing_ok=True)  # a request of a previous boot's notice was for its program
        self.publish()
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        for path, quiet in NOTICES.items():
            threading.Thread(target=self._watch, args=(path, quiet), daemon=True, name=f"watch {path}").start()
        if self.terminated:
            self.say("cancelled before the program started")
            code = -signal.SIGTERM
        else:
            code = self._supervise(argv, env)
        self.ended = time.time()
        self.exit_code = 128 - code if code < 0 else code
        self.state = "succeeded" if self.exit_code == 0 else "failed"
        self._stop.set()
        beat.join(timeout=30)
        for attempt in range(5):
            try:
                self.publish(final=True)
                break
            except Exception as exc:
                self.say(f"final sync failed: {type(exc).__name__}: {exc}")
                time.sleep(1 + attempt)
        tmp = self.home / "exit_code.tmp"
        tmp.write_text(f"{self.exit_code}\n")
        tmp.replace(self.home / "exit_code")
        if self.worker == 0 and self.num_workers > 1:
            self._settle_status()
        return self.exit_code

    def _supervise(self, argv: list[str], env: dict[str, str]) -> int:
        """Runs the program, copying its output into the job log; returns its wait status."""
        with open(self.log_path, "ab", buffering=0) as log:
            self.child = subprocess.Popen(argv, cwd=self.bundle, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if self.terminated:  # the SIGTERM came between the check in run() and the child's existence
                self.child.send_signal(signal.SIGTERM)
            assert self.child.stdout is not None
            emulated = _emulated()
            for line in iter(self.child.stdout.readline, b""):
                log.write(self.store.as_urls(line) if emulated else line)
                m = STEP.search(line)
                if m:
                    self.step = int(m.group(1))
            return self.child.wait()

    def _settle_status(self) -> None:
        """Workers finishing together can each aggregate before seeing the others' final state; worker 0
        waits (bounded) until every worker reported, so a detached run's status.json ends final for gc.
        An attached `tpuctl run` does not wait for this: it reads the exit_code files and writes its own."""
        end = time.monotonic() + max(60.0, 10 * float(self.job.get("heartbeat_s") or 10))
        while time.monotonic() < end:
            try:
                doc = self._aggregate()
                if doc["state"] != "running":
                    self.store.merge_status(doc)
                    return
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                self.say(f"status aggregation failed: {type(exc).__name__}: {exc}")
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpuctl_agent")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--bundle", type=Path, required=True)
    r.add_argument("--worker", type=int, required=True)
    a = parser.parse_args(argv)
    if a.cmd == "prepare":
        return prepare(a.bundle, a.cache)
    return Agent(a.bundle, a.worker).run()


if __name__ == "__main__":
    sys.exit(main())
