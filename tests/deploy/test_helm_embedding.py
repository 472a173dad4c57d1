"""helm/pdserve's dedicated embedding workers: off by default; with embedding.enabled a Deployment, a headless
Service, a PodDisruptionBudget and a NetworkPolicy (only the gateway reaches them), and the gateway routes
requests for embedding.model to them."""
from __future__ import annotations

import pytest

from deploy_tools import pdserve_parse
from test_helm import FULL, Rendered, VALUE_SETS, env_of, flag

NAME = f"{FULL}-embedding"



@pytest.fixture(scope="module")
def enabled(render) -> Rendered:
    return render(*VALUE_SETS["embedding"])


def named(r: Rendered) -> list[str]:
    return [f"{d['kind']}/{d['metadata']['name']}" for d in r.docs if "embedding" in d["metadata"]["name"]]


def test_nothing_embedding_by_default(render):
    r = render()
    assert named(r) == []
    gateway = r.container("gateway")
    assert "--embedding-model" not in gateway["args"] and "--embedding-worker" not in gateway["args"]
    assert not any(k.startswith("PDSERVE_EMBEDDING") for k in env_of(gateway))
    init = r.get("Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["prepare-model"]


def test_enabled_renders_a_deployment_a_headless_service_and_a_budget(enabled):
    assert sorted(named(enabled)) == [f"Deployment/{NAME}", f"NetworkPolicy/{NAME}", f"PodDisruptionBudget/{NAME}",
                                      f"Service/{NAME}"]
    deployment = enabled.get("Deployment", NAME)
    assert deployment["spec"]["replicas"] == 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/component"] == "embedding"
    service = enabled.get("Service", NAME)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["selector"].items() <= pod_labels.items()
    budget = enabled.get("PodDisruptionBudget", NAME)
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # the generative roles are untouched
    for role in ("prefill", "decode"):
        assert enabled.get("Deployment", f"{FULL}-{role}")["spec"]["replicas"] == 1


def test_embedding_worker_args_ports_and_probes(enabled):
    c = enabled.container("embedding")
    args = pdserve_parse(c["args"])
    assert args.command == "colocated" and args.is_embedding and args.model_path == "all-MiniLM-L6-v2"
    assert (args.host, args.port, args.http_port, args.threads) == ("0.0.0.0", 50061, 51061, 2)
    assert env_of(c)["OMP_NUM_THREADS"]["value"] == "2"
    assert c["image"] == "pdserve:0.1.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50061, "http": 51061}
    service_ports = {p["name"]: p["port"] for p in enabled.get("Service", NAME)["spec"]["ports"]}
    assert service_ports == ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    spec = enabled.get("Deployment", NAME)["spec"]["template"]["spec"]
    assert spec["initContainers"][0]["args"] == ["prepare-model", "--model-path", "all-MiniLM-L6-v2"]
    assert {"name": "models", "mountPath": "/var/cache/pdserve"} in c["volumeMounts"]


def test_gateway_gets_the_embedding_model_and_the_headless_service(enabled):
    gateway = enabled.container("gateway")
    args = pdserve_parse(gateway["args"])
    assert args.embedding_model == "all-MiniLM-L6-v2"
    assert args.embedding_worker == [f"{NAME}:50061"]  # resolved to every ready embedding pod
    assert args.prefill == [f"{FULL}-prefill:50051"] and args.model_path == "default"
    init = enabled.get("Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["initContainers"]
    assert [(c["name"], c["args"]) for c in init] == [
        ("prepare-model", ["prepare-model", "--model-path", "default"]),
        ("prepare-embedding-model", ["prepare-model", "--model-path", "all-MiniLM-L6-v2"])]


def test_model_and_port_settings_reach_every_place(render):
    path = "/var/cache/pdserve/e5-small"
    r = render("--set", "embedding.enabled=true", "--set", f"embedding.model={path}", "--set", "embedding.port=50071",
               "--set", "embedding.httpPort=51071", "--set", "podDisruptionBudget.enabled=false")
    assert flag(r.container("embedding")["args"], "--model-path") == [path]
    assert flag(r.container("embedding")["args"], "--port") == ["50071"]
    assert flag(r.container("gateway")["args"], "--embedding-model") == [path]
    assert flag(r.container("gateway")["args"], "--embedding-worker") == [f"{NAME}:50071"]
    assert {p["name"]: p["port"] for p in r.get("Service", NAME)["spec"]["ports"]} == {"grpc": 50071, "http": 51071}
    assert r.kinds("PodDisruptionBudget") == []


def test_quantization_reaches_the_embedding_workers_only_when_set(render):
    assert flag(render("--set", "embedding.enabled=true").container("embedding")["args"], "--quantization") == []
    r = render("--set", "embedding.enabled=true", "--set", "embedding.quantization=w8a8_int8")
    assert flag(r.container("embedding")["args"], "--quantization") == ["w8a8_int8"]
    assert flag(r.container("decode")["args"], "--quantization") == []


def test_worker_quantization_reaches_prefill_and_decode_not_the_embedding_workers(render):
    r = render("--set", "embedding.enabled=true", "--set", "worker.quantization=w8a8_int8")
    for role in ("prefill", "decode"):
        assert flag(r.container(role)["args"], "--quantization") == ["w8a8_int8"]
    assert flag(r.container("embedding")["args"], "--quantization") == []
