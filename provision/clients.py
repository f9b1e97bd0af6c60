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
    service_usage: Any = None  # service_usage_v1.ServiceUsageClient (REST)
    compute_projects: Any = None  # compute_v1.ProjectsClient: project-wide metadata (enable-oslogin)
    networks: Any = None  # compute_v1.NetworksClient
    subnetworks: Any = None  # compute_v1.SubnetworksClient
    oslogin: Any = None  # oslogin_v1.OsLoginServiceClient (REST)
    # IAM and Org Policy have no REST-capable client installed: plain authorized GETs (see `get_json`).
    session: Any = None  # google.auth.transport.requests.AuthorizedSession
    endpoint: str | None = None  # the local cloud's; None: each API's googleapis.com host
    account: str | None = None  # the caller's email (OS Login user), when known

    def get_json(self, api: str, path: str) -> dict:
        """GET `path` ("v1/projects/...") of `api` ("iam"). Raises the google.api_core exception of an error
        response, as the generated clients do, so `waits.call` retries and maps it the same way."""
        from google.api_core import exceptions as gexc

        root = self.endpoint or f"https://{api}.googleapis.com"
        resp = self.session.get(f"{root.rstrip('/')}/{path}", timeout=60)
        if resp.status_code >= 400:
            raise gexc.from_http_response(resp)
        return resp.json()

    def post_json(self, api: str, path: str, body: dict) -> dict:
        """POST `body` to `path` of `api`, as `get_json` GETs: for fields only a pre-GA API version carries (the
        installed clients speak TPU v2alpha1 over gRPC only)."""
        from google.api_core import exceptions as gexc

        root = self.endpoint or f"https://{api}.googleapis.com"
        resp = self.session.post(f"{root.rstrip('/')}/{path}", json=body, timeout=60)
        if resp.status_code >= 400:
            raise gexc.from_http_response(resp)
        return resp.json()


def connect(settings: Settings) -> Clients:
    """Build every client for `settings`. Makes no API call; for GCP resolves ADC (files, or metadata)."""
    if settings.local:
        from google.auth.credentials import AnonymousCredentials

        return build(project=settings.project, credentials=AnonymousCredentials(), endpoint=settings.endpoint,
                     storage_host=settings.storage_host, local=True, account=settings.account)
    import google.auth

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    return build(project=settings.project, credentials=credentials, endpoint=None, storage_host=None, local=False,
                 account=settings.account or getattr(credentials, "service_account_email", None))


def build(*, project: str, credentials: Any, endpoint: str | None, storage_host: str | None, local: bool,
          account: str | None = None) -> Clients:
    from google.api_core.client_options import ClientOptions
    from google.auth.transport.requests import AuthorizedSession
    from google.cloud import billing_v1, compute_v1, oslogin_v1, resourcemanager_v3, service_usage_v1, storage, tpu_v2

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
        service_usage=service_usage_v1.ServiceUsageClient(transport="rest", credentials=credentials, client_options=opts),
        compute_projects=compute_v1.ProjectsClient(credentials=credentials, client_options=opts),
        networks=compute_v1.NetworksClient(credentials=credentials, client_options=opts),
        subnetworks=compute_v1.SubnetworksClient(credentials=credentials, client_options=opts),
        oslogin=oslogin_v1.OsLoginServiceClient(transport="rest", credentials=credentials, client_options=opts),
        session=AuthorizedSession(credentials),
        endpoint=endpoint,
        account=account,
    )
