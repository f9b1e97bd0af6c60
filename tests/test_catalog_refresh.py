"""`tpuctl catalog refresh` and `tpuctl cost` end to end: the CLI, the official clients, the local cloud."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from google.auth.credentials import AnonymousCredentials

from tpuctl import catalog, paths
from tpuctl.cli import cli
from tpuctl.localcloud import facts
from tpuctl.provision import labels as L
from tpuctl.provision import tpu
from tpuctl.provision.clients import build

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(cloud, tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TPUCTL_API_ENDPOINT", cloud.endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", cloud.storage_host)
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"


def invoke(*args):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_refresh_pulls_billing_skus_into_the_cache_which_then_wins(env):
    before = catalog.load()
    assert "asia-east1" not in before.tpu_prices("v2")  # not in the embedded sample
    out = json.loads(invoke("catalog", "refresh", "--json"))
    assert out["skus_read"] > out["prices_set"] > 0 and out["path"] == str(paths.catalog_cache())
    after = catalog.load()
    assert "Billing Catalog" in after.prices_from
    # localcloud's own price table is the oracle: every price it sells came through, per chip-hour.
    for region, gens in facts.TPU_PRICES.items():
        for gen, (on_demand, spot) in gens.items():
            p = after.tpu_prices(gen)[region]
            assert p.on_demand == pytest.approx(on_demand)
            if spot is not None:
                assert p.spot == pytest.approx(spot)
    show = json.loads(invoke("catalog", "show", "v2-8", "--json"))
    assert show["price_per_hour_by_region"]["asia-east1"]["on_demand"] == pytest.approx(4 * 1.2375)
    # Refreshing again is idempotent.
    assert json.loads(invoke("catalog", "refresh", "--json"))["tpu_prices_per_chip_hour"] == out["tpu_prices_per_chip_hour"]


def test_device_priced_skus_are_converted_to_chip_prices():
    from google.cloud import billing_v1

    def sku(desc, usd, region="us-central1"):
        units = int(usd)
        return billing_v1.Sku(description=desc, service_regions=[region], pricing_info=[billing_v1.PricingInfo(
            pricing_expression=billing_v1.PricingExpression(tiered_rates=[billing_v1.PricingExpression.TierRate(
                unit_price={"currency_code": "USD", "units": units, "nanos": int(round((usd - units) * 1e9))})]))])

    n, prices = catalog.prices_from_skus([
        sku("Tpu-v3 running in Americas", 8.0), sku("Preemptible Tpu-v3 running in Americas", 2.4),
        sku("Tpu-v3 Pod running in Americas", 99.0), sku("TpuV5e chip running in us-central1", 1.2),
        sku("E2 Instance Core running in Americas", 0.02)])
    assert n == 5
    assert prices == {"v3": {"us-central1": {"on_demand": 2.0, "spot": 0.6}},
                      "v5e": {"us-central1": {"on_demand": 1.2}}}


def test_cost_reports_live_runs_by_run_owner_and_type(cloud, env):
    clients = build(project=f"cost-cli-{uuid.uuid4().hex[:8]}", credentials=AnonymousCredentials(),
                    endpoint=cloud.endpoint, storage_host=cloud.storage_host, local=True)
    tpu.create_node(clients, tpu.NodeRequest(
        name="n1", zone="europe-west4-a", accelerator="v3-8", runtime_version="tpu-vm-tf-2.17.0-pjrt",
        labels=L.run_labels("r1", owner_name="ann", ttl_s=3600), service_account=""), deadline_s=30)
    by_run = json.loads(invoke("cost", "--project", clients.project, "--json"))
    assert [(r["key"], r["live"]) for r in by_run["rows"]] == [("r1", 1)]
    assert by_run["usd_per_hour_now"] == pytest.approx(8.8)
    assert [r["key"] for r in json.loads(invoke("cost", "--project", clients.project, "--by", "owner",
                                                "--json"))["rows"]] == ["ann"]
    assert [r["key"] for r in json.loads(invoke("cost", "--project", clients.project, "--by", "type",
                                                "--json"))["rows"]] == ["v3-8"]
    bad = CliRunner().invoke(cli, ["cost", "--project", clients.project, "--since", "forever"])
    assert bad.exit_code == 2
