"""`pdserve up` with tensor-parallel workers: --tp-size for every worker, --prefill-tp-size and --decode-tp-size
for one role (SGLang's names), the KV ports a tensor-parallel decode worker's ranks listen on (its KV port +
rank) reserved and checked, and the threads each rank gets (pure plan logic: nothing is started)."""
from __future__ import annotations

import pytest

from pdserve.services import up, up_flags, up_plan, up_preflight
from up_plans import by_name, flag_values, parse, parsed_args


def tp_sizes(plan: up_plan.Plan) -> dict[str, int]:
    """Each worker's --tp-size as its own command parses its command line."""
    return {s.name: parsed_args(s.args).tp_size for s in plan.services
            if s.args[0] in ("prefill", "decode", "colocated")}


@pytest.mark.parametrize("argv, expected", [
    (("--tp-size", "2"), {"prefill": 2, "decode": 2}),
    (("--tensor-parallel-size", "2"), {"prefill": 2, "decode": 2}),
    (("--decode-tp-size", "2"), {"prefill": 1, "decode": 2}),
    (("--prefill-tp-size", "4"), {"prefill": 4, "decode": 1}),
    # A role's own flag wins over --tp-size, which keeps going to the other role.
    (("--tp-size", "2", "--decode-tp-size", "4"), {"prefill": 2, "decode": 4}),
    (("--tp-size", "4", "--prefill-tp-size", "1"), {"prefill": 1, "decode": 4}),
    (("--colocated", "--tp-size", "2"), {"colocated": 2}),
    ((), {"prefill": 1, "decode": 1}),
])
def test_each_role_gets_its_own_tp_size(tmp_path, argv, expected):
    plan = up_plan.build_plan(parse(*argv), tmp_path, cpus=8)
    assert tp_sizes(plan) == expected
    s = by_name(plan)
    assert all(len(flag_values(s[name].args, "--tp-size")) <= 1 for name in expected)  # never given twice
    assert "--tp-size" not in s["gateway"].args and "--tp-size" not in s["jobs"].args


def test_the_embedding_worker_runs_in_one_process(tmp_path):
    s = by_name(up_plan.build_plan(parse("--colocated", "--tp-size", "2", "--embedding-model", "minilm"), tmp_path,
                                   cpus=8))
    assert parsed_args(s["colocated"].args).tp_size == 2
    assert parsed_args(s["embedding"].args).tp_size == 1


def test_a_tp_decode_workers_ranks_kv_ports_are_reserved_and_never_overlap(tmp_path):
    """Rank r of a decode worker receives KV on its transfer port + r: each of those ports is the plan's (so the
    preflight check covers it), and two decode workers' ranges stay apart."""
    plan = up_plan.build_plan(parse("--prefill", "2", "--decode", "2", "--decode-tp-size", "4", "--worker-port",
                                    "40000"), tmp_path, cpus=8)
    s = by_name(plan)
    transfer = [int(flag_values(s[f"decode-{i}"].args, "--transfer-port")[0]) for i in range(2)]
    for i, port in enumerate(transfer):
        reserved = {u.port for u in s[f"decode-{i}"].ports}
        assert {port + r for r in range(4)} <= reserved
        assert port == int(flag_values(s[f"decode-{i}"].args, "--port")[0]) + 2000  # the worker's own default
    assert transfer[1] >= transfer[0] + 4  # the second worker's KV range starts past the first's last rank
    ports = [u.port for x in plan.services for u in x.ports]
    assert len(ports) == len(set(ports))
    # The gateway and prefill still find every worker where it listens.
    decodes = [f"127.0.0.1:{flag_values(s[f'decode-{i}'].args, '--port')[0]}" for i in range(2)]
    assert flag_values(s["gateway"].args, "--decode") == decodes
    assert flag_values(s["gateway"].args, "--prefill") == ["127.0.0.1:40000", "127.0.0.1:40001"]


def test_preflight_names_a_busy_rank_kv_port(tmp_path, monkeypatch):
    plan = up_plan.build_plan(parse("--decode-tp-size", "3", "--worker-port", "40000"), tmp_path, cpus=8)
    busy = int(flag_values(by_name(plan)["decode"].args, "--transfer-port")[0]) + 2  # rank 2's
    monkeypatch.setattr(up_preflight, "port_in_use", lambda host, port: port == busy)
    with pytest.raises(up.UpError, match=rf"port {busy} is in use \(decode rank 2 KV transfer port"):
        up_preflight.check_ports(plan.services)


def test_up_chooses_a_block_free_for_every_rank_kv_port(tmp_path, monkeypatch):
    """The block `up` chooses holds the ranks' KV ports too: one of them busy moves the whole block."""
    monkeypatch.setattr(up, "ephemeral_range", lambda: range(32768, 61000))
    args = parse("--decode-tp-size", "2")
    default = up_preflight.DEFAULT_WORKER_PORT
    rank1 = default + 1 + 2000 + 1  # decode is the second worker: its KV port + 1
    monkeypatch.setattr(up, "port_in_use", lambda host, port: port == rank1)
    up.choose_ports(args)
    assert args.worker_port == default + up_preflight.WORKER_BASE_STEP
    s = by_name(up_plan.build_plan(args, tmp_path, cpus=8))
    assert flag_values(s["decode"].args, "--transfer-port") == [str(args.worker_port + 2001)]
    # Two workers after a TP decode worker: the embedding worker takes the port past its span.
    args = parse("--prefill", "2", "--decode", "2", "--decode-tp-size", "4", "--embedding-model", "minilm",
                 "--worker-port", "40000")
    assert up_plan.worker_count(args) == 2 + 2 * 4 + 1
    s = by_name(up_plan.build_plan(args, tmp_path, cpus=8))
    assert flag_values(s["embedding"].args, "--port") == ["40010"]


@pytest.mark.parametrize("argv, cpus, expected", [
    (("--tp-size", "2"), 8, {"prefill": "4", "decode": "4"}),  # each rank: half of the cores
    (("--decode-tp-size", "4"), 8, {"prefill": "4", "decode": "2"}),  # prefill keeps its share (8 / 2 runtimes)
    (("--prefill-tp-size", "2", "--decode", "3"), 12, {"prefill": "6", "decode-0": "4"}),
    (("--colocated", "--tp-size", "4"), 8, {"colocated": "2"}),
    (("--tp-size", "4"), 2, {"prefill": "1", "decode": "1"}),  # never below one
    (("--tp-size", "2", "--threads", "3"), 8, {"prefill": "3", "decode": "3"}),  # as given
])
def test_a_tp_worker_gets_the_threads_of_one_ranks_cores(tmp_path, argv, cpus, expected):
    s = by_name(up_plan.build_plan(parse(*argv), tmp_path, cpus=cpus))
    for name, threads in expected.items():
        assert flag_values(s[name].args, "--threads") == [threads]
        assert s[name].env["OMP_NUM_THREADS"] == threads


@pytest.mark.parametrize("argv, message", [
    (("--colocated", "--decode-tp-size", "2"), "--colocated runs one worker: give its size with --tp-size"),
    (("--colocated", "--prefill-tp-size", "2"), "--colocated runs one worker"),
    (("--prefill-tp-size", "0"), "--prefill-tp-size must be at least 1, got 0"),
    (("--decode-tp-size", "-1"), "--decode-tp-size must be at least 1, got -1"),
    (("--tp-size", "0"), "--tp-size must be at least 1, got 0"),
])
def test_bad_tp_flags_are_refused(argv, message):
    with pytest.raises(up.UpError, match=message):
        up_flags.validate(parse(*argv))


def test_the_help_says_what_threads_mean_for_a_tp_worker():
    import argparse

    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "--tp-size of the prefill workers" in helps["--prefill-tp-size"]
    assert "--tp-size of the decode workers" in helps["--decode-tp-size"]
    assert "per rank of a tensor-parallel one" in helps["--threads"]
