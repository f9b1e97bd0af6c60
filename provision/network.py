"""Where a TPU or VM attaches: the network fields every create request carries, in one place.

The Cloud TPU API (`Node.networkConfig`, `Node.tags`) and Compute Engine (`Instance.networkInterfaces[]`,
`Instance.tags`) spell the same four choices differently; each request builder asks this type for its own
spelling instead of repeating the fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.cloud import compute_v1, tpu_v2


@dataclass(frozen=True)
class Network:
    name: str = "default"  # a network name, or a `projects/.../global/networks/N` path
    subnet: str | None = None
    tags: tuple[str, ...] = ()  # firewall rules' target tags
    internal_ips: bool = False  # no external address (an org policy may forbid them)

    @classmethod
    def of_plan(cls, plan) -> Network:
        return cls(name=plan.network, subnet=plan.subnet, tags=tuple(plan.tags), internal_ips=plan.internal_ips)

    def tpu_config(self) -> tpu_v2.NetworkConfig:
        config = tpu_v2.NetworkConfig(network=self.name, enable_external_ips=not self.internal_ips)
        if self.subnet:
            config.subnetwork = self.subnet
        return config

    def compute_interface(self) -> compute_v1.NetworkInterface:
        nic = compute_v1.NetworkInterface(
            network=self.name if "/" in self.name else f"global/networks/{self.name}",
            access_configs=[] if self.internal_ips else [compute_v1.AccessConfig(name="External NAT",
                                                                                 type_="ONE_TO_ONE_NAT")])
        if self.subnet:
            nic.subnetwork = self.subnet
        return nic

    def compute_tags(self) -> compute_v1.Tags:
        return compute_v1.Tags(items=list(self.tags))

    @classmethod
    def of_node(cls, node: tpu_v2.Node) -> Network:
        """The network an existing TPU node was created with (to create it again as it was)."""
        return cls(name=node.network_config.network or "default", subnet=node.network_config.subnetwork or None,
                   tags=tuple(node.tags), internal_ips=not node.network_config.enable_external_ips)
