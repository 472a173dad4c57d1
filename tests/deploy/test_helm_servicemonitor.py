"""helm/pdserve's optional ServiceMonitor: off by default; when on, it selects exactly the Services whose pods
serve /metrics (gateway, prefill, decode) and scrapes their `http` port."""
from __future__ import annotations

import yaml

from deploy_tools import REPO

CHART = REPO / "helm" / "pdserve"
ENABLED = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.release=prom",
           "--set", "metrics.serviceMonitor.interval=30s"]


def render(helm, *values: str) -> list[dict]:
    result = helm("template", "pd", str(CHART), "--namespace", "llm", *values)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr  # the only operator this chart uses
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_no_servicemonitor_by_default(helm):
    assert [d for d in render(helm) if d["kind"] == "ServiceMonitor"] == []


def test_servicemonitor_scrapes_the_gateway_and_every_worker(helm):
    docs = render(helm, *ENABLED)
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
    [endpoint] = spec["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "30s")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    selected = {name for name, svc in services.items() if selects(spec["selector"], svc["metadata"]["labels"])}
    assert selected == {"pd-pdserve-gateway", "pd-pdserve-prefill", "pd-pdserve-decode"}
    docs = render(helm, *ENABLED, "--set", "embedding.enabled=true")  # and the embedding workers when they run
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    selected = {name for name, svc in services.items() if selects(spec["selector"], svc["metadata"]["labels"])}
    assert selected == {"pd-pdserve-gateway", "pd-pdserve-prefill", "pd-pdserve-decode", "pd-pdserve-embedding"}
    for name in selected:  # the named port exists and is the pods' HTTP port, which serves /metrics
        assert "http" in {p["name"] for p in services[name]["spec"]["ports"]}, name


def test_chart_lints_with_the_servicemonitor(helm):
    lint = helm("lint", "--strict", str(CHART), *ENABLED)
    assert lint.returncode == 0, lint.stdout + lint.stderr
