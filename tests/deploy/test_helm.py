"""helm/pdserve: lint, render with several value sets, validate the manifests, and check what matters."""
from __future__ import annotations

import base64
import re
import subprocess
import sys

import pytest
import yaml

from deploy_tools import REPO, pdserve_parse

CHART = REPO / "helm" / "pdserve"
RELEASE = "pd"
FULL = "pd-pdserve"
VALUE_SETS = {
    "defaults": [],
    "gpu": ["-f", str(CHART / "ci" / "gpu-values.yaml")],
    "external-redis": ["-f", str(CHART / "ci" / "external-redis-values.yaml")],
    "3-prefill-2-decode": ["-f", str(CHART / "ci" / "scaled-values.yaml")],
    "embedding": ["-f", str(CHART / "ci" / "embedding-values.yaml")],
    "kv-tiers": ["-f", str(CHART / "ci" / "kv-tiers-values.yaml")],
    "tensor-parallel": ["-f", str(CHART / "ci" / "tp-values.yaml")],
}
ROLES = ("gateway", "prefill", "decode", "jobs")


class Rendered:
    def __init__(self, text: str) -> None:
        self.text = text
        self.docs = [d for d in yaml.safe_load_all(text) if d]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    def kinds(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def container(self, role: str) -> dict:
        return self.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_render_and_validate_strictly(helm, render, tmp_path, value_set):
    lint = helm("lint", "--strict", str(CHART), *VALUE_SETS[value_set])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(render(*VALUE_SETS[value_set]).text)
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(manifests)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_role_has_probes_on_its_http_port(render, value_set):
    r = render(*VALUE_SETS[value_set])
    for role in ROLES:
        c = r.container(role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        http_flag = "--http-port" if role in ("prefill", "decode") else "--port"
        assert str(ports["http"]) == flag(c["args"], http_flag)[0], role
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # The gateway's liveness asks only whether it answers: /health also needs a healthy worker pair.
            path = "/live" if (role, probe) == ("gateway", "livenessProbe") else "/health"
            assert c[probe]["httpGet"] == {"path": path, "port": "http"}, (role, probe)
        if role in ("prefill", "decode"):
            assert str(ports["grpc"]) == flag(c["args"], "--port")[0]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workers_are_reached_through_headless_services(render, value_set):
    r = render(*VALUE_SETS[value_set])
    for role in ("prefill", "decode"):
        service = r.get("Service", f"{FULL}-{role}")
        pod_labels = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is False  # only ready workers are resolved
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == role
    prefill_port = flag(r.container("prefill")["args"], "--port")[0]
    decode_port = flag(r.container("decode")["args"], "--port")[0]
    gateway = r.container("gateway")["args"]
    assert flag(gateway, "--prefill") == [f"{FULL}-prefill:{prefill_port}"]
    assert flag(gateway, "--decode") == [f"{FULL}-decode:{decode_port}"]
    assert flag(r.container("decode")["args"], "--prefill") == [f"{FULL}-prefill:{prefill_port}"]
    jobs_service = r.get("Service", f"{FULL}-jobs")
    assert flag(gateway, "--jobs-url") == [f"http://{FULL}-jobs:{jobs_service['spec']['ports'][0]['port']}"]
    gateway_service = r.get("Service", f"{FULL}-gateway")
    assert flag(r.container("jobs")["args"], "--gateway-url") == [
        f"http://{FULL}-gateway:{gateway_service['spec']['ports'][0]['port']}"]
    decode_ports = {p["name"]: p["port"] for p in r.get("Service", f"{FULL}-decode")["spec"]["ports"]}
    assert str(decode_ports["transfer"]) == flag(r.container("decode")["args"], "--transfer-port")[0]
    assert str(decode_ports["grpc"]) == decode_port


def test_replica_counts_per_role(render):
    r = render(*VALUE_SETS["3-prefill-2-decode"])
    replicas = {role: r.get("Deployment", f"{FULL}-{role}")["spec"]["replicas"] for role in ROLES}
    assert replicas == {"gateway": 2, "prefill": 3, "decode": 2, "jobs": 1}
    defaults = render()
    assert {role: defaults.get("Deployment", f"{FULL}-{role}")["spec"]["replicas"] for role in ROLES} == dict.fromkeys(
        ROLES, 1)


def test_gateway_workers_become_the_gateways_flag(render):
    assert flag(render().container("gateway")["args"], "--gateway-workers") == ["1"]
    scaled = render(*VALUE_SETS["3-prefill-2-decode"]).container("gateway")["args"]
    assert flag(scaled, "--gateway-workers") == ["2"] and flag(scaled, "--redis-url") == []  # Redis: in the env


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_variable_an_argument_uses_is_defined(render, value_set):
    """Kubernetes leaves an undefined $(VAR) as literal text: every reference must have its env entry."""
    r = render(*VALUE_SETS[value_set])
    for deployment in r.kinds("Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
                assert var in env_of(c), (deployment["metadata"]["name"], var)


def test_api_key_reaches_pods_only_from_a_secret(render):
    plain = "sk-plain-value-must-not-leak"
    r = render("--set", f"apiKey.value={plain}")
    assert plain not in r.text
    secret = r.get("Secret", f"{FULL}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == plain
    for role in ("gateway", "jobs"):
        c = r.container(role)
        # the environment only: an argument would be expanded into the process's command line (`ps`)
        assert not any("PDSERVE_API_KEY" in a or a == "--api-key" for a in c["args"])
        assert env_of(c)["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-api-key",
                                                                            "key": "api-key"}
    for role in ("prefill", "decode"):
        assert "--api-key" not in r.container(role)["args"]
    for deployment in r.kinds("Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                assert "value" not in e or "key" not in e["name"].lower(), e


def test_generated_api_key_and_existing_secret(render):
    generated = render()
    key = base64.b64decode(generated.get("Secret", f"{FULL}-api-key")["data"]["api-key"]).decode()
    assert len(key) >= 32 and key not in generated.text
    existing = render(*VALUE_SETS["external-redis"])
    # The chart creates no API key or Redis Secret when one is named (the cluster token's and the admin key's are
    # settings of their own).
    assert sorted(d["metadata"]["name"] for d in existing.kinds("Secret")) == [f"{FULL}-admin-api-key",
                                                                                f"{FULL}-cluster-token"]
    for role in ("gateway", "jobs"):
        ref = env_of(existing.container(role))["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pdserve-api", "key": "key"}
    disabled = render("--set", "apiKey.enabled=false")
    assert sorted(d["metadata"]["name"] for d in disabled.kinds("Secret")) == [f"{FULL}-admin-api-key",
                                                                                f"{FULL}-cluster-token",
                                                                                f"{FULL}-redis-auth"]
    assert "--api-key" not in disabled.text and "PDSERVE_API_KEY" not in disabled.text


def test_the_admin_key_reaches_the_gateway_only(render):
    generated = render()
    admin = base64.b64decode(generated.get("Secret", f"{FULL}-admin-api-key")["data"]["admin-api-key"]).decode()
    assert len(admin) >= 32 and admin not in generated.text
    ref = env_of(generated.container("gateway"))["PDSERVE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{FULL}-admin-api-key", "key": "admin-api-key"}
    for role in ("jobs", "prefill", "decode"):
        assert "PDSERVE_ADMIN_API_KEY" not in env_of(generated.container(role))
    named = render("--set", "adminApiKey.existingSecret=ops-admin", "--set", "adminApiKey.existingSecretKey=k")
    assert f"{FULL}-admin-api-key" not in [d["metadata"]["name"] for d in named.kinds("Secret")]
    assert env_of(named.container("gateway"))["PDSERVE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == \
        {"name": "ops-admin", "key": "k"}


def test_redis_statefulset_with_a_claim_by_default(render):
    r = render()
    redis = r.get("StatefulSet", f"{FULL}-redis")
    assert redis["spec"]["serviceName"] == f"{FULL}-redis"
    r.get("Service", f"{FULL}-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert flag(container["args"], "--appendonly") == ["yes"]
    assert container["volumeMounts"][0] == {"name": "data", "mountPath": "/data"}
    claim = redis["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    # the URL, with the generated password, from the chart's Secret into the environment, never into args
    assert env_of(r.container("jobs"))["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULL}-redis-auth", "key": "url"}
    assert flag(r.container("jobs")["args"], "--redis-url") == []


def test_external_redis_replaces_the_statefulset(render):
    from_secret = render(*VALUE_SETS["external-redis"])
    assert from_secret.kinds("StatefulSet") == []
    assert env_of(from_secret.container("jobs"))["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "pdserve-redis", "key": "url"}
    by_url = render("--set", "redis.url=redis://redis.example:6379/3")
    assert by_url.kinds("StatefulSet") == []
    assert env_of(by_url.container("jobs"))["PDSERVE_REDIS_URL"]["value"] == "redis://redis.example:6379/3"


def test_both_redis_settings_are_refused(helm):
    result = helm("template", RELEASE, str(CHART), "--set", "redis.url=redis://a:6379/0",
                  "--set", "redis.existingSecret=b")
    assert result.returncode != 0 and "set either redis.url or redis.existingSecret" in result.stderr


def test_gpu_requests_only_on_workers(render):
    r = render(*VALUE_SETS["gpu"])
    for role in ("prefill", "decode"):
        c = r.container(role)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["cpu"] == "2"  # the CPU request is kept
        assert flag(c["args"], "--device") == ["cuda"]
        assert c["image"] == "pdserve:0.1.0-cuda"
        pod = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    for role in ("gateway", "jobs"):
        assert "nvidia.com/gpu" not in str(r.container(role)["resources"])
        assert r.container(role)["image"] == "pdserve:0.1.0"
    cpu = render()
    assert "nvidia.com/gpu" not in cpu.text and "--device" not in cpu.text


def test_prefill_and_decode_share_the_settings_they_must_agree_on(render):
    r = render("--set", "worker.dtype=float16", "--set", "worker.pageSize=32", "--set", "model.path=/m/x.gguf")
    for role in ("prefill", "decode"):
        args = r.container(role)["args"]
        assert flag(args, "--dtype") == ["float16"] and flag(args, "--page-size") == ["32"]
        assert flag(args, "--model-path") == ["/m/x.gguf"]
    assert flag(r.container("gateway")["args"], "--model-path") == ["/m/x.gguf"]


def test_pods_that_need_the_model_prepare_it_into_the_shared_volume(render):
    r = render()
    for role in ("gateway", "prefill", "decode"):
        spec = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        init = spec["initContainers"][0]
        assert init["args"] == ["prepare-model", "--model-path", "default"]
        mount = {"name": "models", "mountPath": "/var/cache/pdserve"}
        assert mount in init["volumeMounts"] and mount in spec["containers"][0]["volumeMounts"]
        assert env_of(spec["containers"][0])["PDSERVE_CACHE_DIR"]["value"] == "/var/cache/pdserve"
        assert spec["volumes"] == [{"name": "models", "emptyDir": {}}]
    claim = render("--set", "model.existingClaim=models-pvc")
    spec = claim.get("Deployment", f"{FULL}-prefill")["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "models-pvc"}}]


def test_lora_flags_and_adapter_volume_reach_both_worker_roles(render):
    r = render("--set", "lora.enabled=true", "--set", "lora.adapters.sql=/adapters/sql",
               "--set", "lora.maxRank=32", "--set", "lora.existingClaim=adapters-pvc",
               "--set", "lora.targetModules={q_proj,v_proj}")
    for role in ("prefill", "decode"):
        spec = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        args = spec["containers"][0]["args"]
        parsed = pdserve_parse(args)
        assert parsed.enable_lora and parsed.lora_paths == ["sql=/adapters/sql"] and parsed.max_lora_rank == 32
        assert parsed.lora_target_modules == ["q_proj", "v_proj"] and parsed.max_loras_per_batch == 8
        assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in spec["containers"][0]["volumeMounts"]
        assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "adapters-pvc", "readOnly": True}} \
            in spec["volumes"]
    assert "--enable-lora" not in render().container("prefill")["args"]


def test_tracing_values_reach_the_gateway_and_both_worker_roles(render):
    r = render("--set", "tracing.enabled=true", "--set", "tracing.endpoint=http://otel:4318/v1/traces",
               "--set", "tracing.sampleRatio=0.25")
    for role in ("gateway", "prefill", "decode", "jobs"):
        parsed = pdserve_parse(r.container(role)["args"])
        assert parsed.otlp_traces_endpoint == "http://otel:4318/v1/traces" and parsed.otlp_traces_sample_ratio == 0.25
        assert not parsed.otlp_traces_include_content
    assert "--otlp-traces-endpoint" not in render().container("gateway")["args"]  # off unless asked
    r = render("--set", "tracing.enabled=true", "--set", "tracing.endpoint=https://otel:4317",
               "--set", "tracing.trustClientContext=true", "--set", "tracing.includeContent=true",
               "--set", "tracing.contentMaxSize=16MiB", "--set", "tracing.protocol=grpc",
               "--set", "tracing.caSecret=otel-ca")
    for role in ("gateway", "prefill", "decode", "jobs"):
        container = r.container(role)
        parsed = pdserve_parse(container["args"])
        assert parsed.otlp_traces_trust_client_context and parsed.otlp_traces_include_content
        assert parsed.otlp_traces_content_max_size == 16 << 20
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
        ca = env["OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"]
        mount = next(m for m in container["volumeMounts"] if ca.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] and ca.endswith("/ca.crt")
        pod = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "otel-ca"


def test_disruption_budgets_for_workers(render):
    r = render()
    budgets = {d["metadata"]["name"]: d for d in r.kinds("PodDisruptionBudget")}
    assert sorted(budgets) == [f"{FULL}-decode", f"{FULL}-prefill"]
    for role in ("prefill", "decode"):
        pdb = budgets[f"{FULL}-{role}"]
        labels = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert render("--set", "podDisruptionBudget.enabled=false").kinds("PodDisruptionBudget") == []


@pytest.mark.parametrize("role", ROLES)
def test_container_args_are_accepted_by_the_pdserve_cli(render, role):
    for values in VALUE_SETS.values():
        args = render(*values).container(role)["args"]
        pdserve_parse(args)


def test_values_are_documented_in_the_chart_readme():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()

    blocks = {"resources", "podSecurityContext", "securityContext", "commonLabels"}  # documented as one block

    def keys(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in tree.items():
            path = f"{prefix}{k}"
            if isinstance(v, dict) and v and k not in blocks and not prefix:
                out += keys(v, path + ".")
            else:
                out.append(path)
        return out

    missing = [k for k in keys(values) if not re.search(rf"`{re.escape(k)}[`.]", readme)]
    assert not missing, f"values missing from helm/pdserve/README.md: {missing}"
