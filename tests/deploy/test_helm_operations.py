"""helm/pdserve's operator-facing parts: the values schema (bad values refused before anything renders, every
value covered), the optional PodMonitor and queue-depth HPAs, and the gateway's liveness apart from its
readiness."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from test_helm import CHART, FULL, RELEASE, Rendered



@pytest.mark.parametrize("value, named", [
    ("worker.dtype=float8", "worker.dtype"),
    ("worker.transferBackend=rdma", "worker.transferBackend"),
    ("prefill.replicaCount=-1", "prefill.replicaCount"),
    ("decode.port=70000", "decode.port"),
    ("gateway.replicas=2", "gateway"),  # a misspelt key: replicaCount
    ("autoscaling.decode.minReplicas=0", "autoscaling.decode.minReplicas"),
    ("embedding.quantization=fp8", "embedding.quantization"),
])
def test_the_schema_refuses_bad_values_naming_them(helm, value, named):
    result = helm("template", RELEASE, str(CHART), "--set", value)
    assert result.returncode != 0
    assert "schema" in result.stderr and named in result.stderr, result.stderr


def test_the_schema_describes_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def missing(tree: dict, node: dict, path: str) -> list[str]:
        out = []
        for key, value in tree.items():
            sub = node.get("properties", {}).get(key)
            if sub is None:
                if node.get("additionalProperties", True) is False:
                    out.append(path + key)
                continue
            if isinstance(value, dict):
                out += missing(value, sub, f"{path}{key}.")
        return out

    assert missing(values, schema, "") == []
    assert schema["additionalProperties"] is False


def test_a_pod_monitor_scrapes_every_pdserve_pod(render):
    assert not render().kinds("PodMonitor")
    r = render("--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.labels.release=prom",
               "--set", "embedding.enabled=true")
    [monitor] = r.kinds("PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    [components] = [e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]]
    assert set(components) == {"gateway", "prefill", "decode", "jobs", "embedding"}
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s",
                                                        "scrapeTimeout": "10s"}]
    for role in components:  # the port it names exists on every pod it selects
        assert "http" in {p["name"] for p in r.container(role)["ports"]}


def test_queue_depth_autoscaling_owns_the_replica_count(render):
    assert not render().kinds("HorizontalPodAutoscaler")
    r = render("--set", "autoscaling.decode.enabled=true", "--set", "autoscaling.decode.maxReplicas=6")
    [hpa] = r.kinds("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-decode"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    [metric] = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "sglang_num_queue_reqs"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert "replicas" not in r.get("Deployment", f"{FULL}-decode")["spec"]  # the HPA's to set
    assert r.get("Deployment", f"{FULL}-prefill")["spec"]["replicas"] == 1


def test_bounds_the_wrong_way_round_are_refused(helm):
    result = helm("template", RELEASE, str(CHART), "--set", "autoscaling.prefill.enabled=true",
                  "--set", "autoscaling.prefill.minReplicas=5", "--set", "autoscaling.prefill.maxReplicas=2")
    assert result.returncode != 0 and "maxReplicas must be >= minReplicas" in result.stderr


def test_the_gateways_liveness_does_not_depend_on_its_workers(render):
    gateway = render().container("gateway")
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_notes_say_where_to_look(helm, tmp_path):
    """NOTES.txt rendered for real: `helm install --dry-run` needs a cluster, so a copy of the chart renders
    the same text into a ConfigMap."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "test.notes" -}}\n' + notes + "{{- end }}\n")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
        '{{ include "test.notes" . | indent 4 }}\n')
    result = helm("template", RELEASE, str(chart), "--namespace", "ml", "--set", "autoscaling.decode.enabled=true")
    assert result.returncode == 0, result.stderr
    text = Rendered(result.stdout).get("ConfigMap", "notes")["data"]["notes"]
    assert "http://127.0.0.1:30000/status" in text and "/metrics" in text
    assert f"Secret {FULL}-cluster-token" in text
    assert "namespaces/ml/pods/*/sglang_num_queue_reqs" in text
