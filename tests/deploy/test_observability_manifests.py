"""deploy/observability as every overlay renders it: each component's pods are scraped, the alert rules load into
promtool, and the Grafana dashboard's panels each carry a query (a real Prometheus runs those queries in
tests/observability/test_prometheus.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from deploy_manifests import DEPLOY, OVERLAYS, by_kind, kubectl, render, selects

DASHBOARD = DEPLOY / "observability" / "kvwire-dashboard.json"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_component_with_metrics_is_scraped_by_a_pod_monitor(overlay):
    kubectl()
    objects = render(DEPLOY / "overlays" / overlay)
    monitors = by_kind(objects, "PodMonitor").values()
    assert monitors, "the overlay has no PodMonitor"
    for name, deployment in by_kind(objects, "Deployment").items():
        pod = deployment["spec"]["template"]
        ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        if "http" not in ports or pod["metadata"]["labels"].get("app.kubernetes.io/component") == "redis":
            continue
        scraping = [m for m in monitors if selects(m["spec"]["selector"], pod["metadata"]["labels"])]
        assert len(scraping) == 1, f"{overlay}: {name} is scraped by {len(scraping)} PodMonitors"
        assert [e["port"] for e in scraping[0]["spec"]["podMetricsEndpoints"]] == ["http"]


def test_the_alert_rules_load_into_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    kubectl()
    (rule,) = by_kind(render(DEPLOY / "overlays" / "cpu-demo"), "PrometheusRule").values()
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rule['spec']['groups'][0]['rules'])} rules found" in done.stdout


def test_the_dashboard_ships_in_a_config_map_grafana_picks_up():
    kubectl()
    maps = by_kind(render(DEPLOY / "overlays" / "cpu-demo"), "ConfigMap")
    shipped = maps["kvwire-dashboard"]
    assert shipped["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(shipped["data"]["kvwire-dashboard.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])
