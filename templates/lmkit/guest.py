"""Who this machine is, from the Compute Engine metadata server: the one place the template learns its worker.

A Cloud TPU VM sets no TPU_WORKER_ID / TPU_WORKER_HOSTNAMES / TPU_NAME (those are GKE's); like JAX's
`cloud_tpu_cluster.py` (`GceTpuCluster`), workers read `instance/attributes/` from the metadata server. What
every TPU VM serves, the TPU API's and Compute Engine's (TPU7x) alike, is what JAX reads: `agent-worker-number`
(its presence is JAX's test for a TPU VM) and `worker-network-endpoints` (per worker, in worker order:
"hostname:uid:ip", or in Google's newer format just the hostname, as JAX reads either). The rest is optional:
a TPU API VM also serves `accelerator-type` and `tpu-env` (`KEY: 'value'` lines; `NODE_ID` is the node's name),
which no source shows on a Compute Engine TPU VM; every Compute Engine VM serves `instance/machine-type`
(compute/docs/metadata/predefined-metadata-keys). The server is
`GCE_METADATA_HOST` (google-auth's variable; `GCE_METADATA_ROOT` is its old name), else
`metadata.google.internal`; every request carries `Metadata-Flavor: Google`.

Pure stdlib (urllib), so it runs before anything else is imported. Off Google Cloud it answers None without
touching the network: the metadata server is only asked when `GCE_METADATA_HOST` is set or the machine says it
is a Google VM (`/sys/class/dmi/id/product_name`, google-auth's residency check).
"""

from __future__ import annotations

import functools
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import AcceleratorError

DEFAULT_HOST = "metadata.google.internal"
PRODUCT_NAME = Path("/sys/class/dmi/id/product_name")
_TIMEOUT_S = 5.0
_TRIES = 6  # as JAX: six tries, half a second apart (the server can answer 503 during maintenance)
_RETRY_S = 0.5
# Never through a proxy: the metadata server is link-local, an http_proxy would answer for it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class TpuVm:
    """This worker of a Cloud TPU VM slice, as its metadata server describes it."""

    node: str | None  # the TPU node's name (tpu-env NODE_ID; TPU API VMs): what TPUClusterResolver(tpu=...) takes
    worker: int  # agent-worker-number
    hosts: tuple[str, ...]  # every worker's IP, in worker order
    accelerator_type: str | None  # accelerator-type, e.g. "v3-32" (TPU API VMs)
    machine_type: str | None = None  # instance/machine-type's name, e.g. "tpu7x-standard-4t" (Compute Engine VMs)
    endpoints: str = ""  # worker-network-endpoints as served: names this slice where no NODE_ID does
    # Multislice (a queued resource's slices over DCN): MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and
    # MEGASCALE_COORDINATOR_ADDRESS, from the environment else tpu-env, as JAX's cloud_tpu_cluster.py reads them.
    slices: int = 1
    slice_id: int = 0
    coordinator: str | None = None

    @property
    def name(self) -> str:
        """The slice in messages: its node, else its machine type."""
        return self.node or self.machine_type or "TPU VM"


def metadata_host() -> str | None:
    """The metadata server's host[:port], or None when this is not a Google Cloud VM."""
    host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_ROOT")
    if host:
        return host
    try:
        return DEFAULT_HOST if PRODUCT_NAME.read_text().startswith("Google") else None
    except OSError:
        return None


def get(host: str, path: str) -> str | None:
    """The text at `computeMetadata/v1/PATH`; None if the server has no such entry (404).

    Raises AcceleratorError when the server cannot be reached or keeps failing.
    """
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}",
                                     headers={"Metadata-Flavor": "Google"})
    last: Exception | None = None
    for attempt in range(_TRIES):
        try:
            with _OPENER.open(request, timeout=_TIMEOUT_S) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            last = exc
        except OSError as exc:
            last = exc
        if attempt + 1 < _TRIES:
            time.sleep(_RETRY_S)
    raise AcceleratorError(f"metadata server {host}: cannot read {path}: {last}")


def parse_tpu_env(text: str) -> dict[str, str]:
    """`tpu-env`'s `KEY: 'value'` lines -> {KEY: value}, read the way JAX reads them."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            env[key.strip()] = value.strip().strip("'")
    return env


@functools.cache
def tpu_vm() -> TpuVm | None:
    """This machine as a Cloud TPU VM worker, or None (not a Google VM, or a VM without `agent-worker-number`,
    which is how JAX's GceTpuCluster tells a TPU VM)."""
    host = metadata_host()
    if host is None:
        return None
    worker = get(host, "instance/attributes/agent-worker-number")
    if worker is None:
        return None
    endpoints = get(host, "instance/attributes/worker-network-endpoints")
    if endpoints is None:
        raise AcceleratorError(f"metadata server {host}: a TPU VM (worker {worker.strip()}) without "
                               "worker-network-endpoints")
    accelerator = get(host, "instance/attributes/accelerator-type")
    tpu_env = get(host, "instance/attributes/tpu-env")
    machine_type = get(host, "instance/machine-type")
    env = parse_tpu_env(tpu_env or "")
    megascale = {key: os.environ.get(key) or env.get(key) for key in MEGASCALE}
    return TpuVm(node=env.get("NODE_ID") or None, worker=int(worker), hosts=worker_addresses(endpoints),
                 accelerator_type=accelerator.strip() if accelerator else None,
                 machine_type=machine_type.strip().rsplit("/", 1)[-1] if machine_type else None,
                 endpoints=endpoints.strip(), slices=int(megascale["MEGASCALE_NUM_SLICES"] or 1),
                 slice_id=int(megascale["MEGASCALE_SLICE_ID"] or 0),
                 coordinator=megascale["MEGASCALE_COORDINATOR_ADDRESS"] or None)


# What JAX's `cloud_tpu_cluster.py` (`get_tpu_env_value`: the environment first, then tpu-env) reads for a
# multislice: without MEGASCALE_COORDINATOR_ADDRESS it is one slice.
MEGASCALE = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")


def worker_addresses(endpoints: str) -> tuple[str, ...]:
    """Each worker's address from `worker-network-endpoints`, in worker order. Google serves it in two formats
    (JAX's `cloud_tpu_cluster.py`: "In the new format, it is just a list of hostnames. In the old format, it is a
    list of name:id:ip triples."): the hostname of the one, the IP of the other."""
    addresses = []
    for endpoint in (e.strip() for e in endpoints.strip().split(",") if e.strip()):
        parts = endpoint.split(":")
        if len(parts) not in (1, 3):
            raise AcceleratorError(f"worker-network-endpoints: {endpoint!r} is neither a hostname nor name:id:ip")
        addresses.append(parts[-1])
    return tuple(addresses)
