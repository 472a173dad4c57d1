"""compose.yaml's secrets, from the config the real compose binary prints, and its scripts run for real: the
one-shot secrets-init generates the API key, the Redis password and the cluster token into a volume of its own
(or takes the given ones) and gives each service a volume holding only the secrets it uses; Redis requires
that password, and the gateway and jobs read theirs into their environment before they become `pdserve`, so no
secret is ever on a command line, and no worker can read the API key or the Redis URL."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_compose import config, flag

FOLDER = "/run/pdserve-secrets"
# What each service's secrets volume holds: the secrets it uses, and no other.
USES = {"gateway": {"api-key", "admin-api-key", "cluster-token", "redis-url"}, "jobs": {"api-key", "redis-url"},
        "workers": {"cluster-token"}, "redis": {"redis.conf", "redis-password"}}
VOLUMES = {"gateway": "gateway-secrets", "jobs": "jobs-secrets", "workers": "worker-secrets",
           "redis": "redis-secrets"}
WORKERS = ("prefill", "decode", "prefill-gpu", "decode-gpu", "embedding")


@pytest.fixture(scope="module")
def services(compose_binary) -> dict:
    return config(compose_binary)["services"]


def unescape(text: str) -> str:
    return text.replace("$$", "$")  # `compose config` escapes $ for re-reading; containers get one $


def run_init(services: dict, folder: Path, **env: str) -> None:
    """The secrets-init script itself, on a temporary folder (its chown, which needs root, left out)."""
    script = unescape(services["secrets-init"]["entrypoint"][2]).replace(FOLDER, str(folder))
    result = subprocess.run([sys.executable, "-c", "import os; os.chown = lambda *a: None\n" + script],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"docker compose exec gateway cat {folder}/api-key" in result.stdout  # where to find the key


def test_secrets_are_generated_once_and_given_ones_win(services, tmp_path):
    run_init(services, tmp_path)
    store = tmp_path / "all"
    key, password = (store / "api-key").read_text(), (store / "redis-password").read_text()
    assert len(key) >= 32 and len(password) >= 32 and key != password
    assert (store / "redis.conf").read_text() == f'requirepass "{password}"\n'
    assert (store / "redis-url").read_text() == f"redis://:{password}@redis:6379/0"
    assert all(oct(p.stat().st_mode)[-3:] == "400" for p in tmp_path.rglob("*") if p.is_file())
    run_init(services, tmp_path)  # a restart keeps them
    assert (store / "api-key").read_text() == (tmp_path / "gateway" / "api-key").read_text() == key
    run_init(services, tmp_path, PDSERVE_API_KEY="sk-mine", PDSERVE_REDIS_PASSWORD="p/w d")
    assert (tmp_path / "gateway" / "api-key").read_text() == (tmp_path / "jobs" / "api-key").read_text() == "sk-mine"
    assert (tmp_path / "jobs" / "redis-url").read_text() == "redis://:p%2Fw%20d@redis:6379/0"
    admin = (store / "admin-api-key").read_text()
    assert len(admin) >= 32 and admin != key and (tmp_path / "gateway" / "admin-api-key").read_text() == admin


def test_each_service_volume_holds_only_the_secrets_that_service_uses(services, compose_binary, tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "api-key").write_text("left by an older layout")
    run_init(services, tmp_path)
    for service, names in USES.items():
        assert {p.name for p in (tmp_path / service).iterdir()} == names, service
    every_profile = config(compose_binary, "gpu", "embedding")
    mounts = {name: {v["source"] for v in s.get("volumes", []) if v["type"] == "volume"}
              for name, s in every_profile["services"].items()}
    assert mounts["secrets-init"] >= {"secrets", *VOLUMES.values()}
    assert [name for name, sources in mounts.items() if "secrets" in sources] == ["secrets-init"]
    for name in ("gateway", "jobs", "redis"):
        assert mounts[name] & ({"secrets", *VOLUMES.values()}) == {VOLUMES[name]}, name
    for name in WORKERS:  # neither the API key nor the Redis URL: only the cluster token
        assert mounts[name] & ({"secrets", *VOLUMES.values()}) == {"worker-secrets"}, name
        environment = every_profile["services"][name]["environment"]
        assert not {"PDSERVE_API_KEY", "PDSERVE_REDIS_URL"} & set(environment), name
    for name in ("model-init", "embedding-init"):  # nothing secret at all
        assert mounts[name] & ({"secrets", *VOLUMES.values()}) == set(), name


def test_gateway_and_jobs_get_their_secrets_in_the_environment_only(services, tmp_path):
    run_init(services, tmp_path)
    fake = tmp_path / "bin" / "pdserve"  # stands in for the image's pdserve: shows what it was given
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"argv: $*\"\necho \"key: $PDSERVE_API_KEY\"\necho \"redis: $PDSERVE_REDIS_URL\"\n")
    fake.chmod(0o755)
    key, url = (tmp_path / "all" / "api-key").read_text(), (tmp_path / "all" / "redis-url").read_text()
    for name in ("gateway", "jobs"):
        service = services[name]  # each reads its own volume, as mounted at FOLDER
        entrypoint = [unescape(part).replace(FOLDER, str(tmp_path / name)) for part in service["entrypoint"]]
        out = subprocess.run([*entrypoint, *service["command"]], capture_output=True, text=True, timeout=30,
                             env={"PATH": f"{fake.parent}:/usr/bin:/bin"}).stdout
        assert f"argv: {' '.join(service['command'])}\n" in out and f"key: {key}\n" in out
        assert f"redis: {url}\n" in out  # jobs, and the gateway for its stored responses
        assert not any(key in part or "PDSERVE_API_KEY" in part for part in service["command"])
        assert {v["target"]: (v["source"], v.get("read_only")) for v in service["volumes"]}[FOLDER] == \
            (VOLUMES[name], True)
        assert service["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    assert flag(services["gateway"]["command"], "--drain-timeout") == ["30"]


def test_redis_requires_the_password(services):
    redis = services["redis"]
    assert redis["command"][:2] == ["redis-server", f"{FOLDER}/redis.conf"]
    assert redis["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    assert "REDISCLI_AUTH" in redis["healthcheck"]["test"][1]
    for name, service in services.items():  # nothing holds a password or key in its settings
        assert "requirepass" not in " ".join(service.get("command") or []), name


def test_workers_and_the_gateway_share_the_generated_cluster_token(services, compose_binary, tmp_path):
    run_init(services, tmp_path)
    token = (tmp_path / "workers" / "cluster-token").read_text()
    assert len(token) >= 32 and token != (tmp_path / "all" / "api-key").read_text()
    assert (tmp_path / "gateway" / "cluster-token").read_text() == token
    run_init(services, tmp_path, PDSERVE_CLUSTER_TOKEN="fleet-token")
    assert (tmp_path / "workers" / "cluster-token").read_text() == "fleet-token"
    every_profile = config(compose_binary, "gpu", "embedding")["services"]
    for name in ("prefill", "decode", "gateway", "prefill-gpu", "decode-gpu", "embedding"):
        service = every_profile[name]
        volume = VOLUMES["gateway" if name == "gateway" else "workers"]
        assert service["environment"]["PDSERVE_CLUSTER_TOKEN_FILE"] == f"{FOLDER}/cluster-token", name
        assert any(v["source"] == volume and v["target"] == FOLDER and v.get("read_only")
                   for v in service["volumes"]), name
        assert service["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully", name
        assert "fleet-token" not in " ".join(service["command"])
