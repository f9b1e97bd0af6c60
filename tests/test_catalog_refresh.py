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
    for region, gens in facts.TPU_POD_PRICES.items():  # and every pod price, under `pod`
        for gen, (on_demand, spot) in gens.items():
            pod = after.tpu_prices(gen)[region].pod
            assert (pod.on_demand, pod.spot) == (pytest.approx(on_demand), pytest.approx(spot))
    # A multi-host v2 slice is shown at the pod SKU's price, a v2-8 at the device's.
    show = json.loads(invoke("catalog", "show", "v2-32", "--json"))
    on_demand, spot = facts.TPU_POD_PRICES["us-central1"]["v2"]
    chips = show["chips"]
    assert show["price_per_hour_by_region"]["us-central1"] == {"on_demand": pytest.approx(chips * on_demand),
                                                               "spot": pytest.approx(chips * spot)}
    assert "Billing Catalog" in show["price_source"]
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
        sku("Tpu-v3 Pod running in Americas", 8.0), sku("TpuV5e chip running in us-central1", 1.2),
        sku("Tpu-v4 Pod running in Americas", 12.88, region="us-central2"),
        sku("E2 Instance Core running in Americas", 0.02)])
    assert n == 6
    # A v3 pod SKU prices multi-host slices apart; v4 is sold by pod SKUs only (per 8-core device = 4 chips).
    assert prices == {"v3": {"us-central1": {"on_demand": 2.0, "spot": 0.6, "pod": {"on_demand": 2.0}}},
                      "v4": {"us-central2": {"on_demand": 3.22}},
                      "v5e": {"us-central1": {"on_demand": 1.2}}}
    assert catalog.RefreshResult(path=None, skus_read=n, prices=prices).prices_set == 5


def test_refreshed_pod_prices_overlay_the_embedded_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    catalog.write_json_atomic(paths.catalog_cache(), {"source": "test", "tpu_prices_per_chip_hour": {
        "v2": {"us-central1": {"pod": {"on_demand": 1.75}}, "us-east1": {"pod": {"on_demand": 1.6, "spot": 0.4}}}}})
    cat = catalog.load()
    assert cat.tpu_price_per_hour("v2-32", "us-central1-a", spot=False) == pytest.approx(16 * 1.75)
    assert cat.tpu_price_per_hour("v2-32", "us-central1-a", spot=True) == pytest.approx(16 * 0.3825)  # embedded
    assert cat.tpu_price_per_hour("v2-8", "us-central1-b", spot=False) == pytest.approx(4 * 1.125)  # embedded
    # A region priced only by pod SKUs: its pod price is the best estimate for a single device too.
    assert cat.tpu_price_per_hour("v2-8", "us-east1-b", spot=True) == pytest.approx(4 * 0.4)


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
