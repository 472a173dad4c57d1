"""kvTiers: the storage tier of KV pages on the workers, prefill and decode (flags, and a directory mounted where
the flag points), an emptyDir per pod by default or a shared ReadWriteMany claim; nothing of it when disabled."""
from __future__ import annotations

from deploy_tools import pdserve_parse
from test_helm import FULL, VALUE_SETS, flag

TIER_FLAGS = ("--enable-hierarchical-cache", "--hicache-storage-backend", "--hicache-storage-dir",
              "--hicache-write-policy", "--hicache-storage-prefetch-policy", "--hicache-storage-prefetch-timeout")


def pod(r, role: str) -> dict:
    return r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]


def test_disabled_by_default_renders_no_tier(render):
    r = render()
    for role in ("prefill", "decode"):
        args = r.container(role)["args"]
        assert not [a for a in args if a in TIER_FLAGS], role
        assert "kv-storage" not in str(pod(r, role)["volumes"]) + str(r.container(role)["volumeMounts"])


def test_enabled_gives_the_workers_the_flags_and_an_emptydir_at_the_storage_dir(render):
    from pdserve.services.worker.cli import runtime_config

    r = render("--set", "kvTiers.enabled=true", "--set", "kvTiers.prefetchPolicy=timeout",
               "--set", "kvTiers.prefetchTimeoutSeconds=0.5")
    prefill = r.container("prefill")
    args = prefill["args"]
    assert flag(args, "--hicache-storage-backend") == ["file"]
    assert flag(args, "--hicache-storage-dir") == ["/var/cache/pdserve-kv"]
    assert {"name": "kv-storage", "mountPath": "/var/cache/pdserve-kv"} in prefill["volumeMounts"]
    assert {"name": "kv-storage", "emptyDir": {}} in pod(r, "prefill")["volumes"]
    # What the worker makes of the rendered command line: the tier the values describe.
    tiers = runtime_config(pdserve_parse(args), "m").tiers
    assert (tiers.storage_dir, tiers.write_policy, tiers.prefetch_policy, tiers.prefetch_timeout_s) == (
        "/var/cache/pdserve-kv", "write_through", "timeout", 0.5)
    # decode computes a conversation's next turn itself, after the prefix its cache (or the tier) holds
    decode = r.container("decode")
    assert flag(decode["args"], "--hicache-storage-dir") == ["/var/cache/pdserve-kv"]
    assert {"name": "kv-storage", "emptyDir": {}} in pod(r, "decode")["volumes"]


def test_a_size_limit_bounds_the_emptydir(render):
    r = render("--set", "kvTiers.enabled=true", "--set", "kvTiers.sizeLimit=20Gi")
    assert {"name": "kv-storage", "emptyDir": {"sizeLimit": "20Gi"}} in pod(r, "prefill")["volumes"]


def test_an_existing_claim_is_shared_by_every_worker_pod(render):
    r = render(*VALUE_SETS["kv-tiers"])
    for role in ("prefill", "decode"):
        assert {"name": "kv-storage", "persistentVolumeClaim": {"claimName": "kv-pages-rwx"}} in pod(r, role)["volumes"]
    assert r.get("Deployment", f"{FULL}-prefill")["spec"]["replicas"] == 3
    assert flag(r.container("prefill")["args"], "--hicache-write-policy") == ["write_back"]


def test_an_unknown_policy_is_refused_by_the_schema(helm):
    from test_helm import CHART, RELEASE

    result = helm("template", RELEASE, str(CHART), "--set", "kvTiers.enabled=true",
                  "--set", "kvTiers.writePolicy=write_around")
    assert result.returncode != 0 and "writePolicy" in result.stderr


def test_gpu_workers_take_a_host_memory_tier_sized_by_the_values(render):
    from pdserve.services.worker.cli import runtime_config

    r = render("--set", "kvTiers.enabled=true", "--set", "gpu.enabled=true", "--set", "kvTiers.hostRatio=3")
    args = r.container("prefill")["args"]
    assert flag(args, "--hicache-ratio") == ["3"] and "--hicache-size" not in args
    tiers = runtime_config(pdserve_parse(args), "m").tiers
    assert (tiers.host_ratio, tiers.storage_dir) == (3.0, "/var/cache/pdserve-kv")
    sized = render("--set", "kvTiers.enabled=true", "--set", "gpu.enabled=true", "--set", "kvTiers.hostSizeGB=64")
    assert flag(sized.container("decode")["args"], "--hicache-size") == ["64"]
    # unset: no flag, and the GPU worker's own default (twice the pool)
    plain = render("--set", "kvTiers.enabled=true", "--set", "gpu.enabled=true").container("prefill")["args"]
    assert "--hicache-ratio" not in plain
    assert runtime_config(pdserve_parse(plain), "m").tiers.host_ratio == 2.0


def test_a_host_tier_on_cpu_workers_or_smaller_than_the_pool_is_refused(helm):
    from test_helm import CHART, RELEASE

    cpu = helm("template", RELEASE, str(CHART), "--set", "kvTiers.enabled=true", "--set", "kvTiers.hostRatio=2")
    assert cpu.returncode != 0 and "size the host-memory tier of GPU workers (gpu.enabled)" in cpu.stderr
    small = helm("template", RELEASE, str(CHART), "--set", "kvTiers.enabled=true", "--set", "gpu.enabled=true",
                 "--set", "kvTiers.hostRatio=0.5")
    assert small.returncode != 0 and "hostRatio" in small.stderr


def test_the_storage_bounds_and_group_access_reach_the_workers(render):
    from pdserve.services.worker.cli import runtime_config

    plain = runtime_config(pdserve_parse(render("--set", "kvTiers.enabled=true").container("prefill")["args"]),
                           "m").tiers
    assert (plain.storage_max_bytes, plain.storage_min_free_bytes, plain.storage_group_access) == (0, 0, False)
    r = render("--set", "kvTiers.enabled=true", "--set", "kvTiers.maxSize=18GB", "--set",
               "kvTiers.minFreeSpace=2GiB", "--set-string", "kvTiers.evictionRatio=0.8", "--set",
               "kvTiers.groupAccess=true")
    for role in ("prefill", "decode"):
        tiers = runtime_config(pdserve_parse(r.container(role)["args"]), "m").tiers
        assert (tiers.storage_max_bytes, tiers.storage_min_free_bytes, tiers.storage_eviction_ratio,
                tiers.storage_group_access) == (18 * 10**9, 2 * 2**30, 0.8, True), role


def test_a_bound_that_is_not_a_size_is_refused_by_the_schema(helm):
    from test_helm import CHART, RELEASE

    for value, key in (("kvTiers.maxSize=lots", "maxSize"), ("kvTiers.evictionRatio=1.5", "evictionRatio")):
        result = helm("template", RELEASE, str(CHART), "--set", "kvTiers.enabled=true", "--set-string", value)
        assert result.returncode != 0 and key in result.stderr, value
