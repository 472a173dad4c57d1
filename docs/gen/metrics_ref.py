"""The metrics reference, read from the Prometheus registries the services build.

Each service's metrics class is instantiated on a registry of its own, as the service does at start-up, and every
collector registered on it becomes a row: name as scraped, type, labels, help. A worker's optional series (LoRA,
the KV tiers) are those its registry gains when the option is on. Series a service registers outside those
classes (the worker front's own) are found in the source: every `Counter(...)`, `Gauge(...)` or `Histogram(...)`
call naming its series with a literal, in the services' modules that import prometheus_client.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from mdtable import code, table, text

REPO = Path(__file__).resolve().parents[2]
KINDS = ("Counter", "Gauge", "Histogram", "Summary")
CLASS_MODULES = {"services/gateway/metrics.py", "services/worker/engine/worker_metrics.py",
                 "services/worker/engine/tier_metrics.py",
                 "services/worker/encoder_metrics.py", "services/jobs/metrics.py"}  # instantiated below


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # counter, gauge, histogram, summary
    labels: tuple[str, ...]
    help: str



def registered(registry) -> list[Series]:
    """Every collector on a prometheus_client registry (labelled ones with no child yet included)."""
    found = []
    for collector in registry._collector_to_names:
        found.append(Series(collector._name, collector._type, tuple(collector._labelnames), collector._documentation))
    return sorted(found, key=lambda s: s.name)


def gateway() -> list[Series]:
    from pdserve.services.gateway.metrics import GatewayMetrics

    return registered(GatewayMetrics().registry)


def worker(lora: bool = False, host: bool = False, storage: bool = False) -> list[Series]:
    from pdserve.services.worker.engine.worker_metrics import WorkerMetrics

    metrics = WorkerMetrics("MODEL", page_size=16, num_pages=64, max_lora=8 if lora else None)
    if host or storage:
        metrics.watch_tiers(host=host, storage=storage)
    return registered(metrics.registry)


def encoder() -> list[Series]:
    from pdserve.services.worker.encoder_metrics import EncoderMetrics

    return registered(EncoderMetrics("MODEL").registry)


def jobs() -> list[Series]:
    from pdserve.services.jobs.metrics import JobsMetrics

    return registered(JobsMetrics().registry)


def in_source(folder: str) -> list[tuple[Series, str]]:
    """Series named by a literal in a registration call of the modules under `folder`, with the module."""
    found: list[tuple[Series, str]] = []
    for path in sorted((REPO / folder).rglob("*.py")):
        source = path.read_text()
        if "prometheus_client" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and node.args and _callee(node.func) in KINDS):
                continue
            name = node.args[0]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            doc = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
            labels = ()
            if len(node.args) > 2 and isinstance(node.args[2], ast.List):
                labels = tuple(e.value for e in node.args[2].elts if isinstance(e, ast.Constant))
            found.append((Series(name.value, _callee(node.func).lower(), labels, doc), str(path.relative_to(REPO))))
    return found


def _callee(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def sections() -> list[tuple[str, str, list[Series]]]:
    """(title, where it is scraped, series) per service and option, each series in the first section it joins."""
    base = worker()
    with_lora = worker(lora=True)
    host = worker(host=True)
    storage = worker(storage=True)
    out = [("Gateway", "Scraped from the gateway's port, `GET /metrics` (no API key needed)", gateway()),
           ("Workers", "Scraped from each worker's HTTP port (its gRPC port + 1000), `GET /metrics`", base),
           ("Workers with LoRA", "On a worker's `/metrics` with `--enable-lora`", with_lora),
           ("Workers with a host-memory KV tier",
            "On a worker's `/metrics` with `--enable-hierarchical-cache` and a host tier", host),
           ("Workers with a storage KV tier", "On a worker's `/metrics` with `--enable-hierarchical-cache "
            "--hicache-storage-backend file`", storage),
           ("Embedding workers", "Scraped from an `--is-embedding` worker's HTTP port, `GET /metrics`", encoder()),
           ("Jobs service", "Scraped from the jobs service's port, `GET /metrics`, read from Redis at each scrape",
            jobs())]
    seen: set[tuple[str, str]] = set()
    unique = []
    for title, where, series in out:
        key = "worker" if title.startswith("Workers") else title
        fresh = [s for s in series if (key, s.name) not in seen]
        seen.update((key, s.name) for s in fresh)
        unique.append((title, where, fresh))
    # What the classes above register is on the registries already; the rest is registered where it is served.
    elsewhere = [(series, module) for series, module in in_source("services") if module not in CLASS_MODULES]
    front = [series for series, module in elsewhere if module.startswith("services/worker/")]
    unique.insert(2, ("Worker fronts", "On each worker's `/metrics` too, from its front process (the gRPC side)",
                      front))
    others = [series for series, module in elsewhere if not module.startswith("services/worker/")]
    unique.append(("Other series", "Registered outside the services' metrics classes", others))
    return [(title, where, series) for title, where, series in unique if series]


def page() -> str:
    lines = ["# Metrics reference", "",
             "Every series the services register, read from their Prometheus registries when this site is "
             "built. The workers use SGLang's names (`sglang:*`) with a `model_name` label where SGLang has the "
             "series, so dashboards and endpoint pickers made for SGLang read pdserve as they are; what SGLang has "
             "no name for is `pdserve_*`. A counter `x` is scraped as `x_total`, a histogram as `x_bucket`, "
             "`x_sum` and `x_count`. How to read them, the dashboard and the alerts: "
             "[Metrics](../operating/metrics.md).", ""]
    anchored: set[str] = set()  # a series on two services' /metrics gets its anchor at its first row
    for title, where, series in sections():
        lines += [f"## {title}", "", f"{where}.", ""]
        rows = []
        for s in series:
            anchor = "" if s.name in anchored else f'<span id="{s.name.replace(":", "-")}"></span>'
            anchored.add(s.name)
            rows.append([anchor + code(s.name), s.kind, ", ".join(code(label) for label in s.labels), text(s.help)])
        lines += [table(["series", "type", "labels", "meaning"], rows)]
    return "\n".join(lines)
