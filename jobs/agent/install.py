"""`prepare`: the template's requirements, installed into the worker's Python once per requirements hash."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path


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

