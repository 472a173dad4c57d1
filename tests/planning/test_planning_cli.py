"""profile -> simulate -> plan through the `pdserve` command, on a tiny random model measured on this machine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures import make_tiny_model
from pdserve.planning.traces import synthetic, write_azure


def pdserve(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("planning")
    model = make_tiny_model("llama", root / "tiny")
    out = root / "profile.json"
    result = pdserve("profile", "--out", str(out), "--model-path", str(model), "--quick", "--dtype", "float32",
                     "--transfer-backend", "tcp")
    assert result.returncode == 0, result.stderr[-3000:]
    trace = root / "trace.csv"
    write_azure(trace, synthetic(rate=2, duration_s=30, input_median=100, output_median=20, max_input=400, seed=1))
    return out, trace, root


def test_the_profile_holds_what_simulate_needs(measured):
    out, _, _ = measured
    profile = json.loads(out.read_text())
    assert profile["model"] == "tiny" and profile["dtype"] == "float32" and profile["transfer_backend"] == "tcp"
    assert profile["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, head_dim, fp32
    assert {p["cached"] for p in profile["prefill"]} == {0, 64}
    assert all(p["seconds"] > 0 for key in ("prefill", "decode", "transfer") for p in profile[key])
    assert profile["overheads"]["gateway_request_s"] > 0


def test_simulate_prints_and_writes_the_figures(measured):
    out, trace, root = measured
    figures = root / "sim.json"
    # SLOs no step measured on a busy machine can miss: the goodput is then every request's rate
    result = pdserve("simulate", "--profile", str(out), "--trace", str(trace), "--prefill", "1", "--decode", "1",
                     "--ttft-slo-ms", "1e7", "--itl-slo-ms", "1e7", "--json", str(figures))
    assert result.returncode == 0, result.stderr
    assert "TTFT p50" in result.stdout and "goodput" in result.stdout
    data = json.loads(figures.read_text())
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s", "goodput_rps"):
        assert data[key] > 0, key
    assert data["completed"] == data["requests"] > 20
    assert data["ttft_p99_s"] >= data["ttft_p50_s"] and data["e2e_p50_s"] > data["ttft_p50_s"]
    assert data["goodput_rps"] == pytest.approx(data["request_rps"])


def test_simulate_with_the_planner_switches_roles_and_says_when(measured):
    """A TTFT target no prompt meets: the planner moves a decode worker to prefill, once (one decode worker is
    left, the floor), and the run prints and writes the switch, and draws latency over the run."""
    out, trace, root = measured
    figures = root / "planned.json"
    result = pdserve("simulate", "--profile", str(out), "--trace", str(trace), "--prefill", "1", "--decode", "2",
                     "--planner", "slo", "--ttft-slo-ms", "0.001", "--itl-slo-ms", "1e7", "--planner-interval-s", "1",
                     "--planner-window-s", "3", "--switch-s", "0.5", "--json", str(figures),
                     "--plot", str(root / "latency.png"))
    assert result.returncode == 0, result.stderr
    assert "PD 1:2 + planner" in result.stdout and "decode -> prefill (ttft)" in result.stdout
    data = json.loads(figures.read_text())
    assert [(s["from"], s["to"]) for s in data["switches"]] == [("decode", "prefill")]
    assert data["switches"][0]["done_s"] >= data["switches"][0]["at_s"] + 0.5
    assert data["completed"] == data["requests"]
    assert (root / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # latency over the run, drawn


def test_plan_names_the_best_split_and_the_runner_up(measured):
    out, trace, root = measured
    result = pdserve("plan", "--profile", str(out), "--trace", str(trace), "--workers", "3", "--ttft-slo-ms", "2000",
                     "--itl-slo-ms", "200", "--json", str(root / "plan.json"))
    assert result.returncode == 0, result.stderr
    assert "best: " in result.stdout and "runner-up: " in result.stdout and "limited by" in result.stdout
    data = json.loads((root / "plan.json").read_text())
    assert {s["deployment"] for s in data["all"]} == {"colocated 3", "PD 1:2", "PD 2:1"}
    assert data["best"]["slo_attainment"] >= max(s["slo_attainment"] for s in data["all"])


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--profile", "{trace}", "--trace", "{trace}", "--colocated", "1"], "not JSON"),
    (["simulate", "--profile", "{profile}", "--trace", "{profile}", "--colocated", "1"], "line 1: not JSON"),
    (["simulate", "--profile", "{profile}", "--trace", "{trace}", "--prefill", "1"], "both --prefill N and --decode M"),
    (["plan", "--profile", "{profile}", "--trace", "{trace}", "--workers", "0"], "--workers must be >= 1"),
    (["simulate", "--profile", "{profile}", "--trace", "{trace}", "--colocated", "2", "--planner", "slo"],
     "moves workers between prefill and decode"),
])
def test_bad_input_is_one_clear_line(measured, argv, message):
    out, trace, _ = measured
    result = pdserve(*[a.format(trace=trace, profile=out) for a in argv])
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
