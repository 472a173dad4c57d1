"""prefill.tpSize / decode.tpSize: a tensor-parallel worker's --tp-size, its ranks as processes of its one pod
(N x gpu.perWorker GPUs, a memory-backed /dev/shm for their shared memory), decode's ranks' KV ports (transferPort +
rank) declared; the schema refuses a size the workers would refuse. Lint and strict validation of ci/tp-values.yaml
run with every value set in test_helm.py."""
from __future__ import annotations

import pytest

from deploy_tools import pdserve_parse
from test_helm import CHART, FULL, RELEASE, VALUE_SETS, flag

GPU = "nvidia.com/gpu"


def pod(r, role: str) -> dict:
    return r.get("Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]


def container_ports(r, role: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in r.container(role)["ports"]}


def test_one_rank_by_default(render):
    for r in (render(), render(*VALUE_SETS["gpu"])):
        for role in ("prefill", "decode"):
            assert "--tp-size" not in r.container(role)["args"]
            assert pdserve_parse(r.container(role)["args"]).tp_size == 1
            assert not [v for v in pod(r, role)["volumes"] if v["name"] == "dshm"]
        assert sorted(container_ports(r, "decode")) == ["grpc", "http", "transfer"]
    assert render(*VALUE_SETS["gpu"]).container("decode")["resources"]["requests"][GPU] == "1"


def test_a_tp_decode_worker_on_gpus_gets_its_flag_its_gpus_and_its_ranks_kv_ports(render):
    r = render("--set", "decode.tpSize=2", "--set", "gpu.enabled=true")
    decode = r.container("decode")
    parsed = pdserve_parse(decode["args"])
    assert (parsed.tp_size, parsed.device, parsed.transfer_port) == (2, "cuda", 52052)
    assert decode["resources"]["requests"][GPU] == "2" and decode["resources"]["limits"][GPU] == "2"
    # Rank 1 receives KV on the transfer port + 1: declared on the pod and its Service.
    assert container_ports(r, "decode")["transfer"] == 52052
    assert container_ports(r, "decode")["transfer-r1"] == 52053
    service = {p["name"]: p for p in r.get("Service", f"{FULL}-decode")["spec"]["ports"]}
    assert service["transfer-r1"]["port"] == 52053 and service["transfer-r1"]["targetPort"] == "transfer-r1"
    # The ranks' shared memory: a memory-backed /dev/shm, not the runtime's 64 MiB.
    assert {"name": "dshm", "mountPath": "/dev/shm"} in decode["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod(r, "decode")["volumes"]
    # Prefill keeps one rank, one GPU, no extra ports.
    prefill = r.container("prefill")
    assert pdserve_parse(prefill["args"]).tp_size == 1 and "--tp-size" not in prefill["args"]
    assert prefill["resources"]["requests"][GPU] == "1"
    assert not [v for v in pod(r, "prefill")["volumes"] if v["name"] == "dshm"]


def test_each_role_has_its_own_size_and_gpus_per_rank(render):
    r = render("--set", "prefill.tpSize=4", "--set", "decode.tpSize=2", "--set", "gpu.enabled=true",
               "--set", "gpu.perWorker=2")
    assert flag(r.container("prefill")["args"], "--tp-size") == ["4"]
    assert flag(r.container("decode")["args"], "--tp-size") == ["2"]
    assert r.container("prefill")["resources"]["limits"][GPU] == "8"
    assert r.container("decode")["resources"]["limits"][GPU] == "4"
    assert "transfer-r1" not in container_ports(r, "prefill")  # prefill receives no KV
    ci = render(*VALUE_SETS["tensor-parallel"])
    assert [p for p in container_ports(ci, "decode") if p.startswith("transfer")] == [
        "transfer", "transfer-r1", "transfer-r2", "transfer-r3"]
    assert ci.container("decode")["resources"]["requests"][GPU] == "4"


def test_a_tp_worker_on_cpus_gets_the_flag_and_no_gpu(render):
    r = render("--set", "decode.tpSize=2", "--set", "prefill.tpSize=2")
    for role in ("prefill", "decode"):
        assert pdserve_parse(r.container(role)["args"]).tp_size == 2
        assert GPU not in str(r.container(role)["resources"])
        assert {"name": "dshm", "mountPath": "/dev/shm"} in r.container(role)["volumeMounts"]


@pytest.mark.parametrize("value", ["decode.tpSize=0", "prefill.tpSize=0", "decode.tpSize=17", "decode.tpSize=1.5"])
def test_the_schema_refuses_a_size_no_worker_takes(helm, value):
    result = helm("template", RELEASE, str(CHART), "--set", value)
    assert result.returncode != 0
    assert "schema" in result.stderr and value.split("=")[0] in result.stderr, result.stderr
