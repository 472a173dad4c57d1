"""`pdserve up`'s plan: which services it starts, with which flags, on which ports and cores, and how the flags
it takes reach the services that take them (pure logic: nothing is started)."""
from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

import pytest

from pdserve.services import up, up_flags, up_plan
from up_plans import by_name, flag_values, parse, parsed_args


# ---------------------------------------------------------------- plan


def test_plan_pd_pair_wires_every_service_to_the_others(tmp_path):
    plan = up_plan.build_plan(parse(state_dir=str(tmp_path)), tmp_path / "SmolLM2", cpus=2)
    s = by_name(plan)
    assert [x.name for x in sorted(plan.services, key=lambda x: x.stage)][:1] == ["redis"]
    assert s["redis"].stage < s["prefill"].stage < s["decode"].stage < s["gateway"].stage
    assert s["jobs"].stage < s["gateway"].stage
    assert s["redis"].argv[:1] == ["redis-server"]
    assert flag_values(s["redis"].args, "--appendonly") == ["yes"]
    assert flag_values(s["redis"].args, "--dir") == [str(tmp_path / "redis")]
    assert flag_values(s["redis"].args, "--bind") == ["127.0.0.1"]
    for name in ("prefill", "decode", "jobs", "gateway"):
        assert s[name].argv[:4] == [sys.executable, "-m", "pdserve", name]
    for name in ("prefill", "decode", "gateway"):
        assert flag_values(s[name].args, "--model-path") == [str(tmp_path / "SmolLM2")]
    # The default worker block (before `prepare` checks it is free), below the ephemeral range.
    assert flag_values(s["prefill"].args, "--port") == ["20051"]
    assert flag_values(s["prefill"].args, "--http-port") == ["21051"]
    assert s["prefill"].health_url == "http://127.0.0.1:21051/health"
    assert flag_values(s["decode"].args, "--port") == ["20052"]
    assert flag_values(s["decode"].args, "--transfer-port") == ["22052"]
    assert flag_values(s["decode"].args, "--prefill") == ["127.0.0.1:20051"]
    assert flag_values(s["gateway"].args, "--prefill") == ["127.0.0.1:20051"]
    assert flag_values(s["gateway"].args, "--decode") == ["127.0.0.1:20052"]
    assert flag_values(s["gateway"].args, "--jobs-url") == ["http://127.0.0.1:30010"]
    assert flag_values(s["gateway"].args, "--port") == ["30000"]
    # Not named by the user: the gateway serves any `model` (SGLang without --served-model-name)
    assert flag_values(s["gateway"].args, "--served-model-name") == []
    # Redis requires a password of this run, which reaches jobs in its environment only.
    password = urlsplit(s["jobs"].env["PDSERVE_REDIS_URL"]).password
    assert len(password) >= 32 and flag_values(s["jobs"].args, "--redis-url") == []
    assert s["jobs"].env["PDSERVE_REDIS_URL"] == f"redis://:{password}@127.0.0.1:6379/0"
    # The admin key of this run reaches the gateway only, and is left in a file only this user can read.
    admin = s["gateway"].env["PDSERVE_ADMIN_API_KEY"]
    assert len(admin) >= 32 and all("PDSERVE_ADMIN_API_KEY" not in s[name].env for name in ("jobs", "prefill", "decode"))
    assert plan.private_files == {tmp_path / "redis.conf": f'requirepass "{password}"\n',
                                  tmp_path / "admin-api-key": admin + "\n"}
    assert s["redis"].args[0] == str(tmp_path / "redis.conf")
    assert flag_values(s["jobs"].args, "--gateway-url") == ["http://127.0.0.1:30000"]
    assert s["gateway"].health_url == "http://127.0.0.1:30000/health"
    assert s["jobs"].health_url == "http://127.0.0.1:30010/health"
    assert plan.base_url == "http://127.0.0.1:30000/v1"
    # No API key configured: none is passed.
    assert all("--api-key" not in x.args for x in plan.services)


@pytest.mark.parametrize("argv, cpus, expected", [
    ((), 2, {"prefill": "1", "decode": "2"}),
    (("--colocated",), 2, {"colocated": "2"}),
    (("--prefill", "3", "--decode", "2"), 16, {"prefill-0": "3", "decode-1": "8"}),
    (("--prefill", "3", "--decode", "2"), 2, {"prefill-2": "1", "decode-0": "1"}),
    (("--threads", "4",), 2, {"prefill": "4", "decode": "4"}),
    (("--threads", "1",), 2, {"prefill": "1", "decode": "1"}),
])
def test_plan_gives_decode_the_cores_and_prefill_a_share(tmp_path, argv, cpus, expected):
    s = by_name(up_plan.build_plan(parse(*argv), tmp_path, cpus=cpus))
    for name, threads in expected.items():
        assert flag_values(s[name].args, "--threads") == [threads]
        assert s[name].env["OMP_NUM_THREADS"] == threads
    assert s["gateway"].env["OMP_NUM_THREADS"] == "1" and s["jobs"].env["OMP_NUM_THREADS"] == "1"


def test_plan_colocated_runs_one_worker_that_the_gateway_uses(tmp_path):
    s = by_name(up_plan.build_plan(parse("--colocated"), tmp_path, cpus=2))
    assert [x for x in s if x not in ("redis", "jobs", "gateway")] == ["colocated"]
    assert s["colocated"].args[0] == "colocated"
    assert "--transfer-port" not in s["colocated"].args and "--transfer-backend" not in s["colocated"].args
    assert flag_values(s["gateway"].args, "--worker") == ["127.0.0.1:20051"]
    assert "--prefill" not in s["gateway"].args and "--decode" not in s["gateway"].args


def test_plan_three_prefill_two_decode(tmp_path):
    plan = up_plan.build_plan(parse("--prefill", "3", "--decode", "2", "--worker-port", "40000"), tmp_path, cpus=2)
    s = by_name(plan)
    prefills = ["127.0.0.1:40000", "127.0.0.1:40001", "127.0.0.1:40002"]
    assert [flag_values(s[f"prefill-{i}"].args, "--port") for i in range(3)] == [["40000"], ["40001"], ["40002"]]
    assert [flag_values(s[f"decode-{i}"].args, "--port") for i in range(2)] == [["40003"], ["40004"]]
    assert [flag_values(s[f"decode-{i}"].args, "--transfer-port") for i in range(2)] == [["42003"], ["42004"]]
    for i in range(2):
        assert flag_values(s[f"decode-{i}"].args, "--prefill") == prefills
    assert flag_values(s["gateway"].args, "--prefill") == prefills
    assert flag_values(s["gateway"].args, "--decode") == ["127.0.0.1:40003", "127.0.0.1:40004"]
    ports = [u.port for x in plan.services for u in x.ports]
    assert len(ports) == len(set(ports))


def test_plan_with_external_redis_and_api_key(tmp_path):
    plan = up_plan.build_plan(parse("--redis-url", "redis://cache:6380/2", "--api-key", "sk-secret-1",
                                    "--transfer-backend", "tcp"), tmp_path / "m", cpus=2)
    s = by_name(plan)
    assert "redis" not in s
    assert flag_values(s["jobs"].args, "--redis-url") == ["redis://cache:6380/2"]
    for name in ("gateway", "jobs"):  # through the environment: a command line shows in `ps`
        assert s[name].env["PDSERVE_API_KEY"] == "sk-secret-1"
        assert not any("sk-secret-1" in a for a in s[name].args)
    assert all("PDSERVE_API_KEY" not in s[name].env for name in ("prefill", "decode"))
    assert flag_values(s["prefill"].args, "--transfer-backend") == ["tcp"]
    text = up.banner(plan, tmp_path)
    assert "Authorization: Bearer" in text and "sk-secret-1" not in text


def test_gateway_on_all_interfaces_is_reached_over_loopback(tmp_path):
    plan = up_plan.build_plan(parse("--host", "0.0.0.0", "--port", "8080", "--api-key", "k"), tmp_path / "m", cpus=2)
    s = by_name(plan)
    assert flag_values(s["gateway"].args, "--host") == ["0.0.0.0"]
    assert plan.base_url == "http://127.0.0.1:8080/v1"
    assert flag_values(s["jobs"].args, "--gateway-url") == ["http://127.0.0.1:8080"]


def test_banner_has_base_url_and_a_runnable_curl(tmp_path):
    plan = up_plan.build_plan(parse(), tmp_path / "SmolLM2-135M-Instruct", cpus=2)
    text = up.banner(plan, tmp_path / "logs")
    assert "OpenAI base URL: http://127.0.0.1:30000/v1" in text
    assert "curl http://127.0.0.1:30000/v1/chat/completions" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert str(tmp_path / "logs") in text


@pytest.mark.parametrize("argv, message", [
    (("--colocated", "--prefill", "2"), "--colocated runs one worker"),
    (("--prefill", "0"), "--prefill must be between 1 and 64"),
    (("--decode", "65"), "--decode must be between 1 and 64"),
    (("--threads", "0"), "--threads must be at least 1"),
])
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(up.UpError, match=message):
        up_flags.validate(parse(*argv))


def test_worker_command_lines_parse_with_the_worker_cli(tmp_path):
    """Every worker command line `up` builds is accepted by `pdserve prefill|decode|colocated` itself."""
    from pdserve import cli

    for argv in ((), ("--colocated",), ("--prefill", "2", "--decode", "2", "--transfer-backend", "tcp")):
        for service in up_plan.build_plan(parse(*argv), tmp_path, cpus=2).services:
            if service.args[0] in ("prefill", "decode", "colocated"):
                parser, command = cli.build_parser(service.args)
                parsed = parser.parse_args(service.args)
                assert command == service.args[0]
                assert parsed.threads >= 1 and parsed.http_port == parsed.port + 1000
                if command == "decode":
                    assert parsed.prefill and parsed.transfer_port == parsed.port + 2000


@pytest.mark.parametrize("role", ["gateway", "jobs"])
def test_gateway_and_jobs_command_lines_parse_with_their_cli(tmp_path, role):
    """The gateway and jobs command lines match the flags of `pdserve gateway` and `pdserve jobs`."""
    from pdserve import cli

    for argv in ((), ("--colocated", "--api-key", "k"), ("--prefill", "2", "--decode", "2")):
        service = by_name(up_plan.build_plan(parse(*argv), tmp_path, cpus=2))[role]
        parser, command = cli.build_parser(service.args)
        parsed = parser.parse_args(service.args)
        assert command == role and parsed.port in (30000, 30010)


def test_gateway_flags_pass_through_up(tmp_path):
    from pdserve import cli

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    argv = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--chat-template", str(template),
            "--enable-cache-report", "--gateway-workers", "3")
    gateway = by_name(up_plan.build_plan(parse(*argv), tmp_path, cpus=2))["gateway"]
    parsed = cli.build_parser(gateway.args)[0].parse_args(gateway.args)
    assert (parsed.reasoning_parser, parsed.tool_call_parser, parsed.chat_template, parsed.enable_cache_report,
            parsed.gateway_workers) == ("qwen3", "qwen25", str(template), True, 3)


# ---------------------------------------------------------------- flags passed through


def test_every_flag_of_the_workers_gateway_and_jobs_is_taken_by_up():
    """A flag added to a service reaches `up` with no change to up: each is passed through, or `up` sets it."""
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    accepted = {option for action in parser._actions for option in action.option_strings}
    for command, child in up_flags.child_parsers().items():
        for action in child._actions:
            missing = set(action.option_strings) - accepted - up_flags.PLANNED
            assert not missing, f"`pdserve {command}` flag {missing} is not taken by `pdserve up`"


def test_flags_reach_the_services_that_take_them_under_sglang_names(tmp_path):
    plan = up_plan.build_plan(parse(
        "--mem-fraction-static", "0.6", "--context-length", "1024", "--max-running-requests", "7",
        "--chunked-prefill-size", "256", "--page-size", "32", "--schedule-policy", "lpm", "--dtype", "float32",
        "--log-level", "DEBUG", "--random-seed", "11", "--transfer-backend", "tcp", "--log-format", "json",
        "--max-queued-requests", "5", "--log-requests", "--retries", "1", "--served-model-name", "smol"),
        tmp_path / "m", cpus=2)
    s = by_name(plan)
    for name in ("prefill", "decode"):
        w = parsed_args(s[name].args)
        assert (w.mem_fraction, w.context_length, w.max_running_requests, w.chunked_prefill_size, w.page_size,
                w.schedule_policy, w.dtype, w.log_level, w.random_seed, w.transfer_backend, w.log_format,
                w.served_model_name) == (0.6, 1024, 7, 256, 32, "lpm", "float32", "debug", 11, "tcp", "json", "smol")
    g = parsed_args(s["gateway"].args)
    assert (g.max_queued_requests, g.log_requests, g.log_level, g.log_format, g.served_model_name) == \
        (5, True, "debug", "json", "smol")
    j = parsed_args(s["jobs"].args)
    assert (j.retries, j.log_level, j.log_format) == (1, "debug", "json")
    # Each goes only where it is a flag, and a flag not given is not passed: the service keeps its default.
    assert "--page-size" not in s["gateway"].args and "--max-queued-requests" not in s["prefill"].args
    default = by_name(up_plan.build_plan(parse(), tmp_path / "m", cpus=2))
    assert "--page-size" not in default["prefill"].args and "--log-level" not in default["gateway"].args


def test_the_embedding_worker_takes_only_the_flags_that_concern_it(tmp_path):
    s = by_name(up_plan.build_plan(parse("--colocated", "--embedding-model", "minilm", "--device", "cpu", "--page-size",
                                         "32", "--log-format", "json"), tmp_path, cpus=2))
    embedding, colocated = parsed_args(s["embedding"].args), parsed_args(s["colocated"].args)
    assert (embedding.device, embedding.log_format, embedding.page_size) == ("cpu", "json", 16)
    assert (colocated.device, colocated.log_format, colocated.page_size) == ("cpu", "json", 32)


def test_kv_tier_flags_reach_the_workers_that_compute_prompts(tmp_path):
    """The storage tier's flags go to every generative worker, which builds the tier from them (decode computes a
    conversation's next turn itself); the embedding worker and the gateway get none."""
    from pdserve.services.worker.cli import runtime_config

    tier = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir",
            str(tmp_path / "kv"), "--hicache-write-policy", "write_back")
    for argv, roles in (((), ("prefill", "decode")), (("--colocated", "--embedding-model", "minilm"), ("colocated",))):
        s = by_name(up_plan.build_plan(parse(*argv, *tier), tmp_path, cpus=2))
        for name in roles:
            tiers = runtime_config(parsed_args(s[name].args), "m").tiers
            assert (tiers.storage_dir, tiers.write_policy) == (str(tmp_path / "kv"), "write_back")
        for name in ("embedding", "gateway"):
            assert name not in s or "--enable-hierarchical-cache" not in s[name].args
    # GPU workers: the host-memory tier too
    s = by_name(up_plan.build_plan(parse("--device", "cuda", "--enable-hierarchical-cache", "--hicache-ratio", "3"),
                                   tmp_path, cpus=2))
    for name in ("prefill", "decode"):
        assert runtime_config(parsed_args(s[name].args), "m").tiers.host_ratio == 3.0
