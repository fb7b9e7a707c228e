"""A real Prometheus (Debian's `prometheus` binary) for tests: scraping given targets every second, with given
alert rules evaluated every second, queried over its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx2
import pytest
import yaml

from kvwire.cluster.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "observability" / "kvwire-dashboard.json"
RULES = REPO / "deploy" / "observability" / "rules.yaml"


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str] | list[tuple[str, str]], rules_for: str = "0s"):
        """`targets`: component -> host:port serving /metrics (the `component` label the PodMonitors set), or
        (component, host:port) pairs where a component has several.
        `rules_for`: every alert's `for`, so that one fires within a test (the rules are deploy/'s otherwise)."""
        groups = yaml.safe_load(RULES.read_text())["spec"]["groups"]
        for group in groups:
            for rule in group["rules"]:
                rule["for"] = rules_for
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
                  "rule_files": [str(workdir / "rules.yaml")],
                  "scrape_configs": [{"job_name": "kvwire", "static_configs": [
                      {"targets": [address], "labels": {"component": component}}
                      for component, address in (targets.items() if isinstance(targets, dict) else targets)]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [binary(), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"], stdout=self._log, stderr=self._log)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx2.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            assert self._proc.poll() is None and time.monotonic() < deadline, "prometheus did not start"
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        resp = httpx2.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()["data"]["result"]

    def firing(self) -> dict[str, list[dict]]:
        """Alert name -> the labels of its firing alerts."""
        alerts = httpx2.get(f"{self.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        out: dict[str, list[dict]] = {}
        for alert in alerts:
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return out

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


def draw(prometheus: Prometheus, panels: list[tuple[str, str]], path: Path, seconds: float = 60.0) -> None:
    """The panels as an operator's Grafana shows them, drawn from the same queries over the last `seconds`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time()
    fig, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(12, 2.6 * ((len(panels) + 1) // 2)))
    for ax, (title, expr) in zip(axes.flat, panels):
        resp = httpx2.get(f"{prometheus.url}/api/v1/query_range", timeout=10,
                         params={"query": expr, "start": end - seconds, "end": end, "step": 1})
        for series in resp.json()["data"]["result"]:
            label = ",".join(f"{v}" for k, v in series["metric"].items() if k not in ("__name__", "job")) or expr
            xs = [float(t) - end for t, _ in series["values"]]
            ax.plot(xs, [float(v) for _, v in series["values"]], label=label[:40])
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
