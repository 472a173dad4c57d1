"""helm/pdserve's planner.* values: the gateway's --planner flags, accepted by the pdserve CLI, and refused where
several gateway pods would each run a planner."""
from __future__ import annotations

from deploy_tools import pdserve_parse
from test_helm import CHART, RELEASE, flag

PLANNER = ["--set", "planner.enabled=true", "--set", "planner.ttftSloMs=500", "--set", "planner.itlSloMs=80"]


def test_planner_values_become_the_gateways_flags(render):
    args = render(*PLANNER, "--set", "planner.dryRun=true", "--set", "planner.dwellSeconds=120").container(
        "gateway")["args"]
    assert flag(args, "--planner") == ["slo"]
    assert (flag(args, "--ttft-slo-ms"), flag(args, "--itl-slo-ms")) == (["500"], ["80"])
    assert flag(args, "--planner-dwell-s") == ["120"] and "--planner-dry-run" in args
    parsed = pdserve_parse(args)
    assert (parsed.planner, parsed.ttft_slo_ms, parsed.planner_dry_run) == ("slo", 500.0, True)
    off = render().container("gateway")["args"]
    assert "--planner" not in off and "--planner-dry-run" not in off
    assert "--planner-dry-run" not in render(*PLANNER).container("gateway")["args"]


def test_lint_with_the_planner_on(helm):
    result = helm("lint", str(CHART), *PLANNER)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planner_behind_several_gateway_pods_is_refused(helm):
    result = helm("template", RELEASE, str(CHART), *PLANNER, "--set", "gateway.replicaCount=2")
    assert result.returncode != 0 and "use one gateway pod" in result.stderr
    bad = helm("template", RELEASE, str(CHART), "--set", "planner.ttftSloMs=0")
    assert bad.returncode != 0 and "ttftSloMs" in bad.stderr
