"""compose.yaml's `embedding` profile: a dedicated embedding worker that the gateway routes to only when
PDSERVE_EMBEDDING_MODEL is set; the default `docker compose up` is unchanged."""
from __future__ import annotations

import pytest

from deploy_tools import pdserve_parse
from test_compose import config, flag

MODEL = "all-MiniLM-L6-v2"
EMBEDDING_SERVICES = {"embedding", "embedding-init"}


@pytest.fixture(scope="module")
def embedding_project(compose_binary) -> dict:
    return config(compose_binary, "embedding", env={"PDSERVE_EMBEDDING_MODEL": MODEL})


def parse_gateway(gateway: dict, monkeypatch):
    """The gateway's args as its container sees them: its command, with its environment set."""
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, value or "")
    return pdserve_parse(gateway["command"])


def test_embedding_services_exist_only_under_the_profile(compose_binary, embedding_project):
    for env in ({}, {"PDSERVE_EMBEDDING_MODEL": MODEL}):
        services = config(compose_binary, env=env)["services"]
        assert not EMBEDDING_SERVICES & set(services), env
        assert "embedding" in services["gateway"]["depends_on"]  # optional: the default start ignores it
    services = embedding_project["services"]
    assert EMBEDDING_SERVICES <= set(services)
    for name in EMBEDDING_SERVICES:
        assert services[name]["profiles"] == ["embedding"]
        assert services[name]["image"] == "pdserve:latest"
    assert [n for n, s in services.items() if s.get("ports")] == ["gateway"]  # the worker stays on the network


def test_embedding_worker_command_health_and_start_order(embedding_project):
    services = embedding_project["services"]
    worker = services["embedding"]
    args = pdserve_parse(worker["command"])
    assert args.command == "colocated" and args.is_embedding and args.model_path == MODEL
    assert (args.host, args.port, args.http_port) == ("0.0.0.0", 50061, 51061)
    assert "http://127.0.0.1:51061/health" in worker["healthcheck"]["test"][3]
    init = services["embedding-init"]
    assert init["command"] == ["prepare-model", "--model-path", MODEL] and init["restart"] == "no"
    assert "healthcheck" not in init
    assert worker["depends_on"]["embedding-init"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["depends_on"]["embedding"] == {"condition": "service_healthy", "required": False}
    mounts = [(v["type"], v["source"], v["target"]) for v in worker["volumes"]]
    assert ("volume", "models", worker["environment"]["PDSERVE_CACHE_DIR"]) in mounts


def test_gateway_routes_to_the_worker_only_when_the_model_is_set(compose_binary, embedding_project, monkeypatch):
    gateway = embedding_project["services"]["gateway"]
    port = flag(embedding_project["services"]["embedding"]["command"], "--port")[0]
    assert gateway["environment"]["PDSERVE_EMBEDDING_MODEL"] == MODEL
    assert gateway["environment"]["PDSERVE_EMBEDDING_WORKER"] == f"embedding:{port}"
    assert gateway["environment"]["PDSERVE_CACHE_DIR"] == "/var/cache/pdserve"
    args = parse_gateway(gateway, monkeypatch)
    assert args.embedding_model == MODEL and args.embedding_worker == [f"embedding:{port}"]
    assert args.prefill == ["prefill:50051"]  # the generative workers are unchanged

    for profiles in ((), ("embedding",)):  # unset: no embedding model on the gateway, profile or not
        plain = config(compose_binary, *profiles)["services"]
        assert plain["gateway"]["environment"]["PDSERVE_EMBEDDING_WORKER"] in ("", None)
        args = parse_gateway(plain["gateway"], monkeypatch)
        assert args.embedding_model is None and args.embedding_worker == []
    # The profile alone runs the default embedding model.
    assert flag(plain["embedding"]["command"], "--model-path") == [MODEL]


def test_embedding_model_from_the_environment(compose_binary):
    path = "/var/cache/pdserve/e5-small"
    services = config(compose_binary, "embedding", env={"PDSERVE_EMBEDDING_MODEL": path})["services"]
    assert flag(services["embedding"]["command"], "--model-path") == [path]
    assert flag(services["embedding-init"]["command"], "--model-path") == [path]
    assert services["gateway"]["environment"]["PDSERVE_EMBEDDING_MODEL"] == path
    assert flag(services["gateway"]["command"], "--model-path") == ["default"]  # the generative model stays


@pytest.mark.parametrize("workers, expected", [
    ("embedding:50061", ["embedding:50061"]),
    ("e1:50061,e2:50061", ["e1:50061", "e2:50061"]),
    (" e1:50061  e2:50061 ", ["e1:50061", "e2:50061"]),
    ("", []),
])
def test_gateway_cli_reads_its_embedding_settings_from_the_environment(monkeypatch, workers, expected):
    monkeypatch.setenv("PDSERVE_EMBEDDING_MODEL", MODEL)
    monkeypatch.setenv("PDSERVE_EMBEDDING_WORKER", workers)
    args = pdserve_parse(["gateway"])
    assert args.embedding_model == MODEL and args.embedding_worker == expected
    flags = pdserve_parse(["gateway", "--embedding-model", "other", "--embedding-worker", "x:1"])
    assert flags.embedding_model == "other" and flags.embedding_worker == [*expected, "x:1"]


def test_gateway_cli_without_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_EMBEDDING_MODEL", raising=False)
    monkeypatch.delenv("PDSERVE_EMBEDDING_WORKER", raising=False)
    args = pdserve_parse(["gateway"])
    assert args.embedding_model is None and args.embedding_worker == []
    monkeypatch.setenv("PDSERVE_EMBEDDING_MODEL", "")  # compose passes an unset setting as empty
    assert pdserve_parse(["gateway"]).embedding_model is None
