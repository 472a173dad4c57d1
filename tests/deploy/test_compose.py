"""compose.yaml, validated and normalised by a real docker compose v2 binary (no engine needed)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from deploy_tools import REPO, pdserve_parse

PDSERVE_SERVICES = ["model-init", "prefill", "decode", "jobs", "gateway"]
GPU_SERVICES = ["prefill-gpu", "decode-gpu"]


def compose(binary: Path, *args: str, compose_file: Path = REPO / "compose.yaml",
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    return subprocess.run([str(binary), "-f", str(compose_file), *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, cwd=compose_file.parent, timeout=120)


def config(binary: Path, *profiles: str, env: dict[str, str] | None = None) -> dict:
    args = [a for p in profiles for a in ("--profile", p)]
    result = compose(binary, *args, "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def project(compose_binary) -> dict:
    return config(compose_binary)


@pytest.fixture(scope="module")
def gpu_project(compose_binary) -> dict:
    return config(compose_binary, "gpu")


def flag(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, a in enumerate(command[:-1]) if a == name]


def test_the_binary_rejects_an_invalid_file(compose_binary, tmp_path):
    """The check is real: the binary (unlike its Python wrapper) fails on a broken file."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on:\n      b: {condition: service_healthy}\n")
    result = compose(compose_binary, "config", compose_file=bad)
    assert result.returncode != 0 and "undefined service" in result.stderr


def test_default_services(project):
    assert sorted(project["services"]) == sorted(["redis", "secrets-init", *PDSERVE_SERVICES])


def test_only_the_gateway_publishes_a_port(project, gpu_project, compose_binary):
    for proj in (project, gpu_project):
        published = {name: s.get("ports") for name, s in proj["services"].items() if s.get("ports")}
        assert list(published) == ["gateway"]
        assert [(p["target"], str(p["published"])) for p in published["gateway"]] == [(30000, "30000")]
    moved = config(compose_binary, env={"PDSERVE_PORT": "8080"})
    assert [str(p["published"]) for p in moved["services"]["gateway"]["ports"]] == ["8080"]


def test_every_long_running_service_has_a_healthcheck_on_its_own_port(gpu_project):
    for name, service in gpu_project["services"].items():
        if name in ("model-init", "secrets-init"):
            assert "healthcheck" not in service and service["restart"] == "no"
            continue
        test = service["healthcheck"]["test"]
        if name == "redis":  # authenticated with the generated password, which is on no command line
            assert test[0] == "CMD-SHELL" and "REDISCLI_AUTH=" in test[1] and "redis-cli ping" in test[1]
            continue
        assert test[0] == "CMD", (name, test)
        command = service["command"]
        port = (flag(command, "--http-port") or flag(command, "--port"))[0]
        assert test[1:3] == ["python", "-c"] and f"http://127.0.0.1:{port}/health" in test[3], (name, test)


def test_start_order_waits_on_health_and_on_the_model(gpu_project):
    deps = {name: s.get("depends_on", {}) for name, s in gpu_project["services"].items()}
    for name in ["prefill", "decode", "gateway", *GPU_SERVICES]:
        assert deps[name]["model-init"]["condition"] == "service_completed_successfully", name
    assert deps["decode"]["prefill"]["condition"] == "service_healthy"
    assert deps["decode-gpu"]["prefill-gpu"]["condition"] == "service_healthy"
    assert deps["jobs"]["redis"]["condition"] == "service_healthy"
    for dep in ("prefill", "decode", "jobs"):
        assert deps["gateway"][dep] == {"condition": "service_healthy", "required": True}
    for dep in GPU_SERVICES:  # present only with the gpu profile
        assert deps["gateway"][dep] == {"condition": "service_healthy", "required": False}
    for name, service_deps in deps.items():
        for dep, spec in service_deps.items():
            assert spec["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)


def test_services_reach_each_other_by_name(project):
    s = {name: svc["command"] for name, svc in project["services"].items() if "command" in svc}
    assert flag(s["decode"], "--prefill") == ["prefill:" + flag(s["prefill"], "--port")[0]]
    assert flag(s["gateway"], "--prefill") == ["prefill:" + flag(s["prefill"], "--port")[0]]
    assert flag(s["gateway"], "--decode") == ["decode:" + flag(s["decode"], "--port")[0]]
    assert flag(s["gateway"], "--jobs-url") == ["http://jobs:" + flag(s["jobs"], "--port")[0]]
    assert flag(s["jobs"], "--redis-url") == []  # with its password, from the secrets volume (environment)
    assert flag(s["jobs"], "--gateway-url") == ["http://gateway:" + flag(s["gateway"], "--port")[0]]
    for name in ("prefill", "decode", "jobs", "gateway"):
        assert flag(s[name], "--host") == ["0.0.0.0"], name


def test_volumes_hold_the_models_and_redis_data(project):
    services = project["services"]
    assert {"models", "redis-data"} <= set(project["volumes"])
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert [(v["type"], v["source"], v["target"]) for v in redis["volumes"]] == [
        ("volume", "redis-data", "/data"), ("volume", "redis-secrets", "/run/pdserve-secrets")]
    for name in ("model-init", "prefill", "decode", "gateway"):
        mounts = [(v["type"], v["source"], v["target"]) for v in services[name]["volumes"]]
        assert ("volume", "models", services[name]["environment"]["PDSERVE_CACHE_DIR"]) in mounts, name
    assert services["model-init"]["command"][:1] == ["prepare-model"]


def test_one_image_for_every_role(gpu_project):
    services = gpu_project["services"]
    images = {services[n]["image"] for n in PDSERVE_SERVICES}
    assert images == {"pdserve:latest"}
    for name in PDSERVE_SERVICES:
        assert services[name]["build"]["args"]["VARIANT"] == "cpu"
    for name in GPU_SERVICES:
        assert services[name]["image"] == "pdserve:latest-cuda"
        assert services[name]["build"]["args"]["VARIANT"] == "cuda"


def test_gpu_profile_reserves_devices_and_joins_the_worker_names(gpu_project):
    services = gpu_project["services"]
    for name, alias, device in (("prefill-gpu", "prefill", "0"), ("decode-gpu", "decode", "1")):
        service = services[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        # each its own device (both "count: 1" would both get device 0)
        assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "device_ids": [device]}]
        assert flag(service["command"], "--device") == ["cuda"]
        assert service["networks"]["default"]["aliases"] == [alias]
        assert service["profiles"] == ["gpu"]
    for name in ("prefill", "decode"):
        assert "--device" not in services[name]["command"] and "deploy" not in services[name]


def test_settings_come_from_the_environment(compose_binary):
    project = config(compose_binary, env={"PDSERVE_MODEL": "/var/cache/pdserve/my-model",
                                          "PDSERVE_API_KEY": "sk-compose", "PDSERVE_TRANSFER_BACKEND": "tcp"})
    s = project["services"]
    for name in ("model-init", "prefill", "decode", "gateway"):
        assert flag(s[name]["command"], "--model-path") == ["/var/cache/pdserve/my-model"], name
    # the key goes to the one-shot secrets-init, which writes it into the secrets volume; the services read
    # it from there into their environment: it is on no command line and in no other service's settings
    assert s["secrets-init"]["environment"]["PDSERVE_API_KEY"] == "sk-compose"
    for name, service in s.items():
        if name != "secrets-init":
            assert "sk-compose" not in json.dumps(service), name
    assert flag(s["decode"]["command"], "--transfer-backend") == ["tcp"]


def test_lora_adapters_reach_both_worker_roles(compose_binary):
    project = config(compose_binary, env={"PDSERVE_LORA_PATHS": "sql=/adapters/sql", "PDSERVE_LORA_DIR": "/srv/ad"})
    for name in ("prefill", "decode"):
        service = project["services"][name]
        assert service["environment"]["PDSERVE_LORA_PATHS"] == "sql=/adapters/sql"
        mounts = {v["target"]: v for v in service["volumes"]}
        assert mounts["/adapters"]["source"] == "/srv/ad" and mounts["/adapters"]["read_only"]
        assert "/var/cache/pdserve" in mounts


@pytest.mark.parametrize("name", [*PDSERVE_SERVICES, *GPU_SERVICES])
def test_commands_are_accepted_by_the_pdserve_cli(gpu_project, name):
    command = gpu_project["services"][name]["command"]
    args = pdserve_parse(command)
    if name.startswith("decode"):
        assert args.prefill == ["prefill:50051"]


def test_the_tracing_profile_adds_a_collector_and_the_endpoint_reaches_the_gateway_and_workers(compose_binary,
                                                                                               project):
    assert "jaeger" not in project["services"]  # only under the profile
    traced = config(compose_binary, "tracing", env={"PDSERVE_OTLP_TRACES_ENDPOINT": "jaeger:4317"})
    jaeger = traced["services"]["jaeger"]
    assert [(p["target"], p.get("host_ip")) for p in jaeger["ports"]] == [(16686, "127.0.0.1")]  # the UI, loopback
    for name in ("gateway", "prefill", "decode", "jobs"):
        assert traced["services"][name]["environment"]["PDSERVE_OTLP_TRACES_ENDPOINT"] == "jaeger:4317", name
        assert project["services"][name]["environment"]["PDSERVE_OTLP_TRACES_ENDPOINT"] == ""  # off by default


def test_the_services_read_the_traces_endpoint_from_their_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_OTLP_TRACES_ENDPOINT", "jaeger:4317")
    for command in ("gateway", "decode"):
        assert pdserve_parse([command]).otlp_traces_endpoint == "jaeger:4317"
    monkeypatch.setenv("PDSERVE_OTLP_TRACES_ENDPOINT", "")
    assert pdserve_parse(["gateway"]).otlp_traces_endpoint is None
