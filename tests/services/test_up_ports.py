"""`pdserve up`'s worker ports: chosen outside the kernel's ephemeral range (where an outgoing connection can
hold one for a moment just before a worker binds it) and free, moved past a busy one, and chosen again when a
worker still loses its port during start-up. Ports the user gives are kept as given."""
from __future__ import annotations

import re
import socket

import pytest

from pdserve.services import up, up_plan, up_preflight
from test_up import ALL_STAND_INS, get, port_is_free, run_up  # noqa: F401 (a fixture)
from up_plans import by_name, flag_values, parse

LINUX_DEFAULT = range(32768, 61000)  # ip_local_port_range "32768 60999"


def always_free(port: int) -> bool:
    return True


def test_the_default_block_lies_below_the_ephemeral_range():
    base = up_preflight.choose_worker_base(2, LINUX_DEFAULT, {30000, 30010, 6379}, always_free)
    assert base == up_preflight.DEFAULT_WORKER_PORT
    block = up_preflight.worker_block(base, 2)
    assert block == [20051, 21051, 22051, 20052, 21052, 22052]
    assert not any(port in LINUX_DEFAULT for port in block)


@pytest.mark.parametrize("ephemeral, expected", [
    (range(15000, 65536), 12951),  # the range covers the default and everything above: the block goes below it
    (range(10000, 61000), 61051),  # the range covers the default but not the top: the block goes above it
    (range(49152, 65536), 20051),  # macOS/BSD (IANA) range
])
def test_the_block_moves_out_of_a_wider_ephemeral_range(ephemeral, expected):
    base = up_preflight.choose_worker_base(3, ephemeral, set(), always_free)
    assert base == expected
    assert not any(port in ephemeral for port in up_preflight.worker_block(base, 3))


def test_a_busy_or_reserved_port_moves_the_whole_block():
    assert up_preflight.choose_worker_base(2, LINUX_DEFAULT, set(), lambda port: port != 22052) == 20151
    assert up_preflight.choose_worker_base(2, LINUX_DEFAULT, {21051}, always_free) == 20151  # e.g. the gateway's --port
    # A retry starts past the block that failed.
    assert up_preflight.choose_worker_base(2, LINUX_DEFAULT, set(), always_free, start=20151) == 20151


def test_no_room_outside_the_range_names_the_flag():
    with pytest.raises(up.UpError, match=r"outside the ephemeral range 1024-65535: choose one with --worker-port"):
        up_preflight.choose_worker_base(2, range(1024, 65536), set(), always_free)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert up_preflight.ephemeral_range(path) == range(40000, 50001)
    assert up_preflight.ephemeral_range(tmp_path / "missing") == up_preflight.FALLBACK_EPHEMERAL


def test_up_counts_every_worker_when_it_chooses(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "ephemeral_range", lambda: LINUX_DEFAULT)
    monkeypatch.setattr(up, "port_in_use", lambda host, port: port == 20053)  # the 3rd prefill's gRPC port
    args = parse("--prefill", "3", "--decode", "2", "--embedding-model", str(tmp_path))
    up.choose_ports(args)
    assert args.worker_port == 20151
    s = by_name(up_plan.build_plan(args, tmp_path, cpus=2))
    assert flag_values(s["embedding"].args, "--port") == ["20156"]
    assert flag_values(s["decode-1"].args, "--transfer-port") == ["22155"]


def test_a_given_worker_port_is_kept_even_in_the_ephemeral_range(tmp_path):
    s = by_name(up_plan.build_plan(parse("--worker-port", "50051"), tmp_path, cpus=2))
    assert flag_values(s["prefill"].args, "--port") == ["50051"]
    assert flag_values(s["decode"].args, "--transfer-port") == ["52052"]


# ---------------------------------------------------------------- real processes


def test_up_comes_up_on_other_ports_when_the_first_default_one_is_busy(run_up):  # noqa: F811
    reserved = set()
    first = up_preflight.choose_worker_base(2, up_preflight.ephemeral_range(), reserved, port_is_free)
    with socket.socket() as holder:  # the port `up` would choose first
        holder.bind(("127.0.0.1", first))
        holder.listen()
        run = run_up(substitute=ALL_STAND_INS, worker_port=False)
        run.wait_for(r"OpenAI base URL")
        base = int(re.search(r"^\[prefill\] argv: prefill .*--port (\d+)", run.output, re.M).group(1))
        assert base != first
        assert not any(port in up_preflight.ephemeral_range() for port in up_preflight.worker_block(base, 2))
        assert get(f"http://127.0.0.1:{base + 1000}/health") == 200  # prefill
        assert get(f"http://127.0.0.1:{base + 1001}/health") == 200  # decode
        assert get(f"http://127.0.0.1:{run.ports['port']}/health") == 200


def test_a_worker_that_loses_its_port_while_starting_makes_up_start_again_elsewhere(run_up, tmp_path):  # noqa: F811
    marker = tmp_path / "lost-once"
    run = run_up(substitute={**ALL_STAND_INS, "decode": f"--lose-port-once {marker}"}, worker_port=False)
    run.wait_for(r"OpenAI base URL", timeout=90)
    out = run.output
    lost = re.search(r"\[up\] decode lost a port to another process as it started: starting again with worker "
                     r"ports from (\d+)", out)
    assert lost, out
    decodes = re.findall(r"^\[decode\] argv: decode .*--port (\d+)", out, re.M)
    assert len(decodes) == 2 and int(decodes[1]) == int(lost.group(1)) + 1 != int(decodes[0])
    assert get(f"http://127.0.0.1:{int(decodes[1]) + 1000}/health") == 200
    assert get(f"http://127.0.0.1:{run.ports['port']}/health") == 200


def test_a_given_worker_port_lost_while_starting_stops_up_with_the_reason(run_up, tmp_path):  # noqa: F811
    run = run_up(substitute={**ALL_STAND_INS, "decode": f"--lose-port-once {tmp_path / 'lost-once'}"})
    assert run.wait_exit(60) == 1
    assert "error: decode exited with code 1 before the system was ready" in run.output
    assert "cannot listen on" in run.output and "starting again" not in run.output
    assert port_is_free(run.ports["worker_port"])
