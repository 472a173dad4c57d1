"""prefill.nodes / decode.nodes: a tensor-parallel worker over several pods (--nnodes) as a LeaderWorkerSet, off by
default. Each group of `nodes` pods is one worker: the leader runs node 0 (gRPC, HTTP, probes, the only pod
behind the role's Service), the other pods node $(LWS_WORKER_INDEX)'s ranks, all meeting at
$(LWS_LEADER_ADDRESS):worker.distInitPort; the command lines are ones pdserve takes, the same but --node-rank."""
from __future__ import annotations

import pytest

from deploy_tools import pdserve_parse
from pdserve.shared.tp_nodes import plan_nodes
from test_helm import CHART, FULL, RELEASE, VALUE_SETS
from test_helm_security import selects

GPU = "nvidia.com/gpu"
LWS_ENV = {"$(LWS_LEADER_ADDRESS)": f"{FULL}-decode-0.{FULL}-decode.llm", "$(LWS_WORKER_INDEX)": "1"}
TWO_NODES = ["--set", "decode.tpSize=4", "--set", "decode.nodes=2", "--set", "gpu.enabled=true"]


def lws(r, role: str) -> dict:
    return r.get("LeaderWorkerSet", f"{FULL}-{role}")


def pod(r, role: str, which: str) -> dict:
    return lws(r, role)["spec"]["leaderWorkerTemplate"][f"{which}Template"]["spec"]


def expand(args: list[str]) -> list[str]:
    """What the kubelet makes of $(VAR) in args, with the variables an LWS gives a group's second pod."""
    for var, value in LWS_ENV.items():
        args = [a.replace(var, value) for a in args]
    return args


def test_one_pod_per_worker_by_default(render):
    for values in ([], VALUE_SETS["tensor-parallel"], VALUE_SETS["gpu"]):
        r = render(*values)
        assert r.kinds("LeaderWorkerSet") == []
        for role in ("prefill", "decode"):
            args = r.container(role)["args"]
            assert "--nnodes" not in args and pdserve_parse(args).nnodes == 1


def test_a_decode_worker_over_two_nodes_is_a_leader_worker_set_of_two_pods(render):
    r = render(*TWO_NODES)
    assert not [d for d in r.kinds("Deployment") if d["metadata"]["name"] == f"{FULL}-decode"]
    group = lws(r, "decode")
    assert group["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = group["spec"]
    assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, = pod(r, "decode", "leader")["containers"]
    worker, = pod(r, "decode", "worker")["containers"]
    # The flags: node 0 on the leader, the LWS worker index on the others, one meeting point.
    assert leader["args"][leader["args"].index("--node-rank") + 1] == "0"
    assert worker["args"][worker["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    for c in (leader, worker):
        assert c["args"][c["args"].index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):29500"
    strip = lambda args: [a for i, a in enumerate(args) if "--node-rank" not in (a, args[i - 1])]  # noqa: E731
    assert strip(leader["args"]) == strip(worker["args"])  # every node the same flags but --node-rank
    for c, node, ranks in ((leader, 0, [0, 1]), (worker, 1, [2, 3])):
        parsed = pdserve_parse(expand(c["args"]))
        assert (parsed.tp_size, parsed.nnodes, parsed.node_rank, parsed.device) == (4, 2, node, "cuda")
        nodes = plan_nodes(parsed.tp_size, parsed.nnodes, parsed.node_rank, parsed.dist_init_addr, {})
        assert list(nodes.local) == ranks and nodes.port == 29500
        assert c["resources"]["limits"][GPU] == "2"  # tpSize / nodes ranks a pod
    # Only the leader serves: its ports, its probes; the other pod holds ranks 2 and 3 and their KV ports.
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports == {"grpc": 50052, "http": 51052, "dist-init": 29500, "transfer": 52052, "transfer-r1": 52053}
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"transfer-r2": 52054, "transfer-r3": 52055}
    assert "readinessProbe" in leader and "readinessProbe" not in worker and "lifecycle" not in worker
    service = r.get("Service", f"{FULL}-decode")["spec"]
    assert service["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert [p["name"] for p in service["ports"]] == ["grpc", "http", "transfer", "transfer-r1"]
    # Prefill keeps its Deployment.
    assert pdserve_parse(r.container("prefill")["args"]).nnodes == 1


def test_the_pods_of_a_group_hold_the_cluster_token_and_reach_each_other_on_any_port(render):
    r = render(*TWO_NODES)
    templates = lws(r, "decode")["spec"]["leaderWorkerTemplate"]
    policy = r.get("NetworkPolicy", f"{FULL}-workers")["spec"]
    for which in ("leader", "worker"):
        labels = templates[f"{which}Template"]["metadata"]["labels"]
        assert selects(policy["podSelector"], labels)
        # from the other pod of its group: the rendezvous port, rank 0's link and gloo/NCCL's ports (all free ones)
        assert [rule for rule in policy["ingress"] if "ports" not in rule
                and any(selects(peer["podSelector"], labels) for peer in rule["from"])]
        container, = pod(r, "decode", which)["containers"]
        token, = [e for e in container["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-cluster-token"  # one token for the group


def test_prefill_over_nodes_on_cpus_and_an_autoscaled_group(render):
    r = render("--set", "prefill.tpSize=2", "--set", "prefill.nodes=2", "--set", "worker.distInitPort=20000",
               "--set", "autoscaling.prefill.enabled=true")
    leader, = pod(r, "prefill", "leader")["containers"]
    assert leader["args"][leader["args"].index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):20000"
    assert GPU not in str(leader["resources"])
    assert "replicas" not in lws(r, "prefill")["spec"]  # the autoscaler's
    target = r.get("HorizontalPodAutoscaler", f"{FULL}-prefill")["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                      "name": f"{FULL}-prefill"}


def test_the_chart_lints_with_workers_over_nodes(helm):
    lint = helm("lint", "--strict", str(CHART), *TWO_NODES, "--set", "prefill.tpSize=2", "--set", "prefill.nodes=2")
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("values,message", [
    (["--set", "decode.tpSize=3", "--set", "decode.nodes=2"], "decode.tpSize 3 does not spread evenly over "
                                                               "decode.nodes 2"),
    (["--set", "decode.nodes=0"], "schema"),
    (["--set", "prefill.nodes=17"], "schema"),
    (["--set", "worker.distInitPort=0"], "schema"),
])
def test_values_no_worker_takes_are_refused(helm, values, message):
    result = helm("template", RELEASE, str(CHART), *values)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
