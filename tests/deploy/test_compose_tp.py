"""compose.yaml's tensor-parallel knobs: PDSERVE_PREFILL_TP_SIZE and PDSERVE_DECODE_TP_SIZE become each worker's
--tp-size (1 unless set), on the CPU and the GPU services, which get a /dev/shm large enough for the ranks."""
from __future__ import annotations

import pytest

from deploy_tools import pdserve_parse
from test_compose import config, flag

WORKERS = {"prefill": "prefill", "decode": "decode", "prefill-gpu": "prefill", "decode-gpu": "decode"}


def test_one_rank_unless_set(compose_binary):
    services = config(compose_binary, "gpu")["services"]
    for name in WORKERS:
        assert flag(services[name]["command"], "--tp-size") == ["1"], name
        assert pdserve_parse(services[name]["command"]).tp_size == 1


@pytest.mark.parametrize("env, expected", [
    ({"PDSERVE_DECODE_TP_SIZE": "2"}, {"prefill": 1, "decode": 2}),
    ({"PDSERVE_PREFILL_TP_SIZE": "4", "PDSERVE_DECODE_TP_SIZE": "2"}, {"prefill": 4, "decode": 2}),
])
def test_each_role_takes_its_own_size(compose_binary, env, expected):
    services = config(compose_binary, "gpu", env=env)["services"]
    for name, role in WORKERS.items():
        assert pdserve_parse(services[name]["command"]).tp_size == expected[role], name
    for name in ("gateway", "jobs"):
        assert "--tp-size" not in services[name]["command"]
    # The decode worker's ranks receive KV on its transfer port + rank, on the compose network: nothing is
    # published but the gateway's port.
    assert [name for name, s in services.items() if s.get("ports")] == ["gateway"]


def test_workers_get_a_shared_memory_large_enough_for_their_ranks(compose_binary):
    services = config(compose_binary, "gpu")["services"]
    for name in WORKERS:
        assert int(services[name]["shm_size"]) >= 1 << 30, name  # Docker's default: 64 MB
