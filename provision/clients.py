"""The official Google clients, built once per command with explicit credentials and endpoints.

Everything that talks to the cloud takes a `Clients`; tests build one against the `localcloud` fixture, the
CLI with `connect(settings)`. TPU uses the REST transport (the local cloud speaks HTTP/JSON only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuctl.config import Settings


@dataclass(frozen=True)
class Clients:
    project: str
    tpu: Any  # tpu_v2.TpuClient (REST)
    instances: Any  # compute_v1.InstancesClient
    zone_operations: Any  # compute_v1.ZoneOperationsClient
    zones: Any  # compute_v1.ZonesClient
    storage: Any  # google.cloud.storage.Client
    projects: Any  # resourcemanager_v3.ProjectsClient (REST)
    billing_catalog: Any  # billing_v1.CloudCatalogClient (REST)
    local: bool
    # Multi-host Compute Engine TPU slices (TPU7x): workload policy, instance template, managed instance group.
    resource_policies: Any = None  # compute_v1.ResourcePoliciesClient
    instance_templates: Any = None  # compute_v1.RegionInstanceTemplatesClient
    instance_groups: Any = None  # compute_v1.InstanceGroupManagersClient
    region_operations: Any = None  # compute_v1.RegionOperationsClient


def connect(settings: Settings) -> Clients:
    """Build every client for `settings`. Makes no API call; for GCP resolves ADC (files, or metadata)."""
    if settings.local:
        from google.auth.credentials import AnonymousCredentials

        return build(project=settings.project, credentials=AnonymousCredentials(), endpoint=settings.endpoint,
                     storage_host=settings.storage_host, local=True)
    import google.auth

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    return build(project=settings.project, credentials=credentials, endpoint=None, storage_host=None, local=False)


def build(*, project: str, credentials: Any, endpoint: str | None, storage_host: str | None, local: bool) -> Clients:
    from google.api_core.client_options import ClientOptions
    from google.cloud import billing_v1, compute_v1, resourcemanager_v3, storage, tpu_v2

    opts = ClientOptions(api_endpoint=endpoint) if endpoint else None
    storage_opts = {"api_endpoint": storage_host} if storage_host else None
    return Clients(
        project=project,
        tpu=tpu_v2.TpuClient(transport="rest", credentials=credentials, client_options=opts),
        instances=compute_v1.InstancesClient(credentials=credentials, client_options=opts),
        zone_operations=compute_v1.ZoneOperationsClient(credentials=credentials, client_options=opts),
        zones=compute_v1.ZonesClient(credentials=credentials, client_options=opts),
        storage=storage.Client(project=project, credentials=credentials, client_options=storage_opts),
        projects=resourcemanager_v3.ProjectsClient(transport="rest", credentials=credentials, client_options=opts),
        billing_catalog=billing_v1.CloudCatalogClient(transport="rest", credentials=credentials, client_options=opts),
        local=local,
        resource_policies=compute_v1.ResourcePoliciesClient(credentials=credentials, client_options=opts),
        instance_templates=compute_v1.RegionInstanceTemplatesClient(credentials=credentials, client_options=opts),
        instance_groups=compute_v1.InstanceGroupManagersClient(credentials=credentials, client_options=opts),
        region_operations=compute_v1.RegionOperationsClient(credentials=credentials, client_options=opts),
    )
