"""The interpreter a local TPU worker runs: the runtime image's software, built once per runtime.

A TPU VM boots an image (the node's `runtimeVersion`) that already carries Python, TensorFlow and Keras
(`facts.RUNTIME_SOFTWARE`). A local worker gets the same software as a cached virtualenv, built on first use
from the package registry with pip (`tensorflow-cpu==X.Y.Z` stands in for the TPU build) under the cache
dir, one per distinct software set (`tpu-vm-tf-2.17.0-pjrt` and `-pod-pjrt` share one). Every worker then
gets its own small venv layered on that image venv (a `.pth` file puts the image's site-packages after its
own), so what a job pip-installs lands on that worker alone, as on a VM's own disk, and the shared image
stays as built.

Builds are safe under concurrency: one builder per image (an `fcntl` lock file; others wait on it), into a
temporary dir that is renamed into place only once pip succeeded and the imports check out, so a reader
never sees half an image. `WorkerPython("host")` skips all of this: workers run the host interpreter (the
one running localcloud), for tests where the runtime's exact software is not the point.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import facts

HOST = "host"
RUNTIME = "runtime"
MODES = (RUNTIME, HOST)
MODE_ENV = "TPUCTL_WORKER_PYTHON"
CACHE_ENV = "TPUCTL_RUNTIME_CACHE"
_READY = "image.json"  # written last inside a finished image venv
_PIP_TIMEOUT_S = 3600.0


class BuildError(RuntimeError):
    """pip could not build a runtime image venv; the message carries pip's last lines."""


def default_cache(state_dir: Path | None) -> Path:
    """`$TPUCTL_RUNTIME_CACHE`, else `STATE_DIR/runtimes`, else the daemon's default state dir's
    (`$TPUCTL_HOME/localcloud/runtimes`), so in-memory clouds share what a daemon built."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if state_dir is not None:
        return Path(state_dir) / "runtimes"
    home = Path(os.environ.get("TPUCTL_HOME") or Path.home() / ".tpuctl").expanduser()
    return home / "localcloud" / "runtimes"


def mode_from_env(value: str | None) -> str:
    """The worker-python mode: an explicit value, else `$TPUCTL_WORKER_PYTHON`, else `runtime`."""
    mode = value or os.environ.get(MODE_ENV) or RUNTIME
    if mode not in MODES:
        raise ValueError(f"worker_python must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def _base_python() -> str:
    """The interpreter venvs are made from: the one under this process's venv, if it runs in one."""
    return getattr(sys, "_base_executable", None) or sys.executable


def image_key(software: facts.Software) -> str:
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    if software.tensorflow is None:
        return f"base-{py}"
    return f"tf{software.tensorflow}-keras{software.local_keras}-{py}"


def requirements(software: facts.Software) -> list[str]:
    """What pip installs for an image: TensorFlow's CPU build of the image's version, and its Keras."""
    if software.tensorflow is None:
        return []
    return [f"tensorflow-cpu=={software.tensorflow}", f"keras=={software.local_keras}"]


@dataclass(frozen=True)
class Image:
    """A finished image venv: its interpreter and site-packages dir."""

    root: Path
    python: Path
    site_packages: Path


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _load(root: Path) -> Image | None:
    if not (root / _READY).is_file():
        return None
    python = root / "bin" / "python"
    return Image(root, python, Path(json.loads((root / _READY).read_text())["site_packages"]))


class Images:
    """The cache of image venvs under `cache`; `ensure` blocks, `start` builds in the background.

    Thread-safe; several processes may share one cache (the lock file serialises builders).
    """

    def __init__(self, cache: Path) -> None:
        self.cache = Path(cache).absolute()
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, str] = {}

    def path(self, software: facts.Software) -> Path:
        return self.cache / image_key(software)

    def ready(self, software: facts.Software) -> Image | None:
        return _load(self.path(software))

    def ensure(self, software: facts.Software) -> Image:
        """The image venv, built first if missing (blocks for the whole pip install: minutes for TensorFlow)."""
        image = self.ready(software)
        if image is not None:
            return image
        root = self.path(software)
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.cache / f".{root.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another builder (thread or process) finishes first
            image = _load(root)
            if image is None:
                image = self._build(software, root)
        return image

    def start(self, software: facts.Software) -> None:
        """Build in a background thread unless ready or already building; `state` tells how it went."""
        key = image_key(software)
        with self._lock:
            thread = self._threads.get(key)
            if self.ready(software) is not None or (thread is not None and thread.is_alive()):
                return
            self._errors.pop(key, None)

            def build() -> None:
                try:
                    self.ensure(software)
                except Exception as exc:  # reported through state(): the node's create fails with it
                    self._errors[key] = str(exc)

            thread = self._threads[key] = threading.Thread(target=build, name=f"localcloud-image-{key}", daemon=True)
            thread.start()

    def state(self, software: facts.Software) -> tuple[str, str]:
        """("ready" | "building" | "failed" | "absent", detail)."""
        if self.ready(software) is not None:
            return "ready", ""
        key = image_key(software)
        if key in self._errors:
            return "failed", self._errors[key]
        thread = self._threads.get(key)
        return ("building", "") if thread is not None and thread.is_alive() else ("absent", "")

    def _build(self, software: facts.Software, root: Path) -> Image:
        tmp = root.with_name(f".{root.name}.building-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        try:
            subprocess.run([_base_python(), "-m", "venv", str(tmp)], check=True, capture_output=True)
            python = tmp / "bin" / "python"
            reqs = requirements(software)
            if reqs:
                done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                       *reqs], capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
                if done.returncode != 0:
                    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
                    raise BuildError(f"pip install {' '.join(reqs)} failed ({done.returncode}): {tail}")
                check = subprocess.run([str(python), "-c", "import tensorflow, keras; print(tensorflow.__version__, "
                                        "keras.__version__)"], capture_output=True, text=True, timeout=600)
                if check.returncode != 0 or check.stdout.split() != [software.tensorflow, software.local_keras]:
                    raise BuildError(f"the image venv imports {check.stdout.strip() or check.stderr.strip()[-300:]!r}, "
                                     f"not TensorFlow {software.tensorflow} with Keras {software.local_keras}")
            info = {"requirements": reqs, "site_packages": "", "python": sys.version.split()[0],
                    "build_seconds": round(time.monotonic() - started, 1), "built": time.time()}
            # venvs hard-code their own path in scripts and pyvenv.cfg: rename first, then record.
            shutil.rmtree(root, ignore_errors=True)
            os.replace(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fix_paths(tmp, root)
        info["site_packages"] = str(_site_packages(root / "bin" / "python"))
        ready = root / f"{_READY}.tmp"
        ready.write_text(json.dumps(info, indent=1))
        os.replace(ready, root / _READY)
        return _load(root)


def _fix_paths(old: Path, new: Path) -> None:
    """Point a renamed venv's activation scripts and console-script shebangs at its new place.

    `bin/python` itself is a symlink to the base interpreter and needs nothing; pyvenv.cfg names only the base.
    """
    old_b, new_b = str(old).encode(), str(new).encode()
    for path in (new / "bin").iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        with contextlib.suppress(OSError):
            data = path.read_bytes()
            if old_b in data:
                path.write_bytes(data.replace(old_b, new_b))


def worker_venv(image: Image, directory: Path) -> Path:
    """A worker's own venv on top of `image` (idempotent); returns its bin dir.

    Made with the image's base interpreter and without pip of its own: `python -m pip` runs the image's pip
    (found through the `.pth` file) and installs into this venv, whose site-packages come first on sys.path.
    """
    venv = Path(directory)
    marker = venv / "image.pth"
    site = _site_packages_guess(venv)
    if not (venv / "bin" / "python").exists() or not (site / marker.name).is_file():
        subprocess.run([str(image.python), "-m", "venv", "--without-pip", "--clear", str(venv)], check=True,
                       capture_output=True)
        site = _site_packages(venv / "bin" / "python")
    (site / marker.name).write_text(f"{image.site_packages}\n")
    return venv / "bin"


def _site_packages_guess(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


class WorkerPython:
    """Which interpreter a worker's `python` / `python3` is: its runtime image's (`runtime`, the default) or
    the host's (`host`, an explicit choice for tests that do not care which TensorFlow runs)."""

    def __init__(self, mode: str | None, cache: Path) -> None:
        self.mode = mode_from_env(mode)
        self.images = Images(cache)

    def _software(self, runtime: str | None) -> facts.Software | None:
        if self.mode == HOST or runtime is None:
            return None
        return facts.RUNTIME_SOFTWARE.get(runtime)

    def prepare(self, runtime: str | None) -> tuple[str, str]:
        """Start building the runtime's image if needed: ("ready" | "building" | "failed", detail).

        A node stays CREATING while its image builds, as a VM boots only once its image is there."""
        software = self._software(runtime)
        if software is None:
            return "ready", ""
        self.images.start(software)
        state, detail = self.images.state(software)
        return (state if state != "absent" else "building"), detail

    def bin_dir(self, directory: Path, runtime: str | None) -> Path:
        """The bin dir to put first on a worker's PATH (builds the image if it is missing: blocks)."""
        software = self._software(runtime)
        if software is None:
            return Path(sys.executable).parent
        return worker_venv(self.images.ensure(software), Path(directory) / ".localcloud" / "python")
