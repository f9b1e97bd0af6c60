"""The run's bucket as the worker sees it, and the local mirror of gs:// locations used when storage is emulated."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import time
from pathlib import Path


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

