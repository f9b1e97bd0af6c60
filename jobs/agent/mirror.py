"""The `mirror` storage: a storage emulator, which TensorFlow's gs:// filesystem cannot read (`storage` says when
a bundle chooses it). The config's gs:// data and model locations become local directories; the latest
checkpoint is restored from the bucket before the start (resume after preemption), and worker 0 publishes the
model directory (checkpoints, TensorBoard events, exports) back periodically and at exit."""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from .storage import RACE_ATTEMPTS, Gcs

PATH_KEYS = ("data_dir", "model_dir", "export_dir")  # the config's `runtime` locations the program opens


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


class Mirror(Gcs):
    """The run's bucket prefix plus the local mirror of the config's gs:// locations."""

    def __init__(self, job: dict, worker: int, mirror_root: Path):
        super().__init__(job, worker)
        self.mirror_root = mirror_root
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._published: dict[str, str] = {}  # checkpoint directory -> the pointer text last published

    def _client(self, project: str):
        """A storage client acting as the VM's service account, as on a real TPU VM (the metadata server's
        token). With no metadata server to ask, requests go anonymously (the emulator's owner)."""
        from google.cloud import storage

        if os.environ.get("GCE_METADATA_HOST"):
            import google.auth

            credentials = google.auth.default()[0]
        else:
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()
        # The client ignores ambient credentials when STORAGE_EMULATOR_HOST is set: they must be passed.
        return storage.Client(project=project, credentials=credentials)

    def _runtime(self) -> dict:
        return (self.job.get("config") or {}).get("runtime") or {}

    def _model_urls(self) -> list[str]:
        runtime = self._runtime()
        model = runtime.get("model_dir")
        urls = [u for u in (model, runtime.get("export_dir")) if isinstance(u, str) and u.startswith("gs://")]
        # An export directory under the model directory is synced with it.
        return [u for u in urls if u == model or not model or not u.startswith(model.rstrip("/") + "/")]

    def program_config(self, config: dict) -> dict:
        runtime = config.get("runtime") or {}
        for key in PATH_KEYS:
            url = runtime.get(key)
            if isinstance(url, str) and url.startswith("gs://"):
                runtime[key] = str(self.local(url))
        return config

    def stage(self, say: Callable[[str], None]) -> None:
        data = self._runtime().get("data_dir")
        if isinstance(data, str) and data.startswith("gs://"):
            n = self.download_prefix(data)
            say(f"data: {n} file(s) from {data}")
        for url in self._model_urls():
            n = self.download_prefix(url)
            if n:
                say(f"restored {n} file(s) from {url}")

    def sync(self) -> None:
        for url in self._model_urls():
            self.upload_dir(url)

    def log_line(self, line: bytes) -> bytes:
        """Every mirror path written as the gs:// URL it stands for: the mirror is how this worker reaches
        emulated storage, not a place the user can look."""
        return line.replace(str(self.mirror_root).encode() + b"/", b"gs://")

    def local(self, url: str) -> Path:
        bucket, prefix = _split(url)
        return self.mirror_root / bucket / prefix

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
