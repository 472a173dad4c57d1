"""helm/pdserve's hardening, rendered with `helm template`: secrets only through Secrets (never container args
or plain env values), Redis with a password and a restricted security context, NetworkPolicies between the
roles, seccomp RuntimeDefault on every pod, and the graceful-stop wiring (preStop, drain, grace period)."""
from __future__ import annotations

import base64

import pytest

from test_helm import FULL, Rendered, VALUE_SETS, env_of, flag

PLAIN_KEY = "sk-helm-plain-key-never-in-args"



def pods(r: Rendered) -> dict[str, dict]:
    """Pod spec of every workload, by name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in r.docs
            if d["kind"] in ("Deployment", "StatefulSet")}


def secret_data(r: Rendered, name: str) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in r.get("Secret", name)["data"].items()}


def test_no_secret_in_any_container_args_or_plain_env_value(render):
    r = render("--set", f"apiKey.value={PLAIN_KEY}")
    password = secret_data(r, f"{FULL}-redis-auth")["password"]
    assert len(password) >= 32
    for name, spec in pods(r).items():
        for c in spec["containers"] + spec.get("initContainers", []):
            args = " ".join(c.get("args", []) + c.get("command", []))
            assert PLAIN_KEY not in args and password not in args, (name, c["name"])
            assert "--api-key" not in args and "--redis-url" not in args and "PDSERVE_" not in args
            for e in c.get("env", []):
                assert PLAIN_KEY not in e.get("value", "") and password not in e.get("value", ""), e
    jobs = env_of(r.container("jobs"))
    assert jobs["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis-auth", "key": "url"}
    assert jobs["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-api-key"


def test_the_charts_redis_requires_the_generated_password_and_runs_restricted(render):
    r = render()
    data = secret_data(r, f"{FULL}-redis-auth")
    password = data["password"]
    assert data["redis.conf"] == f"requirepass {password}\n"
    assert data["url"] == f"redis://:{password}@{FULL}-redis:6379/0"
    spec = pods(r)[f"{FULL}-redis"]
    redis = spec["containers"][0]
    assert redis["args"][:2] == ["redis-server", "/etc/redis/redis.conf"]
    assert {"name": "config", "mountPath": "/etc/redis", "readOnly": True} in redis["volumeMounts"]
    [config] = [v for v in spec["volumes"] if v["name"] == "config"]
    assert config["secret"]["secretName"] == f"{FULL}-redis-auth"
    assert config["secret"]["items"] == [{"key": "redis.conf", "path": "redis.conf"}]
    assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis-auth",
                                                                           "key": "password"}
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 999
    assert redis["securityContext"]["readOnlyRootFilesystem"] is True
    assert redis["securityContext"]["allowPrivilegeEscalation"] is False
    assert redis["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    leftover = [d["metadata"]["name"] for d in render(*VALUE_SETS["external-redis"]).kinds("Secret")]
    assert sorted(leftover) == [f"{FULL}-admin-api-key", f"{FULL}-cluster-token"]  # no Redis, no password


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_runs_non_root_with_seccomp_runtime_default(render, value_set):
    for name, spec in pods(render(*VALUE_SETS[value_set])).items():
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])


def labels_of(r: Rendered, kind: str, name: str) -> dict:
    return r.get(kind, name)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def allowed_from(r: Rendered, policy: dict, port: str) -> set[str]:
    """The roles whose pods the policy lets in on `port` (a named port)."""
    roles = {role: labels_of(r, "Deployment", f"{FULL}-{role}") for role in ("gateway", "prefill", "decode", "jobs")}
    roles["redis"] = labels_of(r, "StatefulSet", f"{FULL}-redis")
    found = set()
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule.get("from", [{"podSelector": {}}]):
            found |= {role for role, labels in roles.items() if selects(peer["podSelector"], labels)}
    return found


def test_network_policies_let_only_the_gateway_reach_workers_and_jobs_and_only_both_reach_redis(render):
    r = render()
    policies = {d["metadata"]["name"].removeprefix(f"{FULL}-"): d for d in r.kinds("NetworkPolicy")}
    assert sorted(policies) == ["gateway", "jobs", "redis", "workers"]
    for role, policy in (("gateway", "gateway"), ("prefill", "workers"), ("decode", "workers"), ("jobs", "jobs")):
        assert selects(policies[policy]["spec"]["podSelector"], labels_of(r, "Deployment", f"{FULL}-{role}"))
    assert selects(policies["redis"]["spec"]["podSelector"], labels_of(r, "StatefulSet", f"{FULL}-redis"))
    assert allowed_from(r, policies["workers"], "grpc") == {"gateway", "prefill", "decode"}
    assert allowed_from(r, policies["workers"], "transfer") == {"prefill", "decode"}  # KV pages
    assert allowed_from(r, policies["jobs"], "http") == {"gateway"}
    assert allowed_from(r, policies["redis"], "redis") == {"jobs", "gateway"}  # the gateway's stored responses
    assert policies["gateway"]["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]  # open

    metrics = render("--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
                     "--set", "embedding.enabled=true")
    for policy in ("workers", "embedding"):  # the scraper reaches every worker's /metrics
        [rule] = [x for x in metrics.get("NetworkPolicy", f"{FULL}-{policy}")["spec"]["ingress"]
                  if x.get("ports") == [{"port": "http", "protocol": "TCP"}]]
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    assert render("--set", "networkPolicy.enabled=false").kinds("NetworkPolicy") == []
    external = render(*VALUE_SETS["external-redis"]).kinds("NetworkPolicy")
    assert f"{FULL}-redis" not in [d["metadata"]["name"] for d in external]


@pytest.mark.parametrize("drain, sleep", [(30, 5), (60, 8)])
def test_graceful_stop_covers_the_prestop_sleep_and_the_drain(render, drain, sleep):
    r = render("--set", f"gracefulStop.drainTimeoutSeconds={drain}", "--set",
               f"gracefulStop.preStopSleepSeconds={sleep}")
    assert flag(r.container("gateway")["args"], "--drain-timeout") == [str(drain)]
    for role, drains in (("gateway", drain), ("prefill", 30), ("decode", 30)):
        spec = r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(sleep)]
        assert spec["terminationGracePeriodSeconds"] >= sleep + drains + 5, role


def test_workers_and_the_gateway_get_the_generated_cluster_token_from_its_secret(render):
    r = render("--set", "embedding.enabled=true")
    token = secret_data(r, f"{FULL}-cluster-token")["token"]
    assert len(token) >= 32 and token != render().get("Secret", f"{FULL}-cluster-token")["data"]["token"]
    ref = {"name": f"{FULL}-cluster-token", "key": "token"}
    for name in ("gateway", "prefill", "decode", "embedding"):
        env = env_of(r.container(name))
        assert env["PDSERVE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == ref, name
    assert "PDSERVE_CLUSTER_TOKEN" not in env_of(r.container("jobs"))  # jobs talks to the gateway only
    mine = render("--set", "clusterToken.existingSecret=fleet-token", "--set", "clusterToken.existingSecretKey=t")
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"] == f"{FULL}-cluster-token" for d in mine.docs)
    assert env_of(mine.container("decode"))["PDSERVE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == \
        {"name": "fleet-token", "key": "t"}


def secrets_read(spec: dict) -> dict[str, set[str]]:
    """Secret name -> the env variables (or "volume") through which a pod's containers can read it."""
    read: dict[str, set[str]] = {}
    for c in spec["containers"] + spec.get("initContainers", []):
        for e in c.get("env", []):
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                read.setdefault(ref["name"], set()).add(e["name"])
        for source in c.get("envFrom", []):
            if ref := source.get("secretRef"):
                read.setdefault(ref["name"], set()).add("envFrom")
    for volume in spec.get("volumes", []):
        sources = [volume] + volume.get("projected", {}).get("sources", [])
        for source in sources:
            if name := source.get("secret", {}).get("secretName") or source.get("secret", {}).get("name"):
                read.setdefault(name, set()).add("volume")
    return read


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_each_pod_can_read_only_the_secrets_its_service_uses(render, value_set):
    """Workers get the cluster token and nothing else: neither the API key nor the Redis URL or password."""
    external = value_set == "external-redis"
    api_key = "pdserve-api" if external else f"{FULL}-api-key"
    redis = "pdserve-redis" if external else f"{FULL}-redis-auth"
    token = f"{FULL}-cluster-token"
    expected = {"gateway": {api_key: {"PDSERVE_API_KEY"}, token: {"PDSERVE_CLUSTER_TOKEN"},
                            redis: {"PDSERVE_REDIS_URL"},  # stored /v1/responses
                            f"{FULL}-admin-api-key": {"PDSERVE_ADMIN_API_KEY"}},
                "jobs": {api_key: {"PDSERVE_API_KEY"}, redis: {"PDSERVE_REDIS_URL"}},
                "redis": {redis: {"REDISCLI_AUTH", "volume"}}}
    r = render(*VALUE_SETS[value_set])
    seen = set()
    for d in r.docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        seen.add(component)
        want = expected.get(component, {token: {"PDSERVE_CLUSTER_TOKEN"}})  # every worker role
        assert secrets_read(d["spec"]["template"]["spec"]) == want, d["metadata"]["name"]
    assert {"gateway", "jobs", "prefill", "decode"} <= seen
    assert ("redis" in seen) != external and ("embedding" in seen) == (value_set == "embedding")
