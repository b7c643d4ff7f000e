"""The Kubernetes manifests under deploy/ are consistent with Conveyor itself: every document parses and
is of a known kind; selectors match the pods' labels; the container runs a command Conveyor's own
`serve` parser accepts, on the port the Service and the InferencePool target; the probes' paths are
routes of the app; and every metric name the endpoint picker is told to read is one /metrics serves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conveyor.cli import build_parser
from conveyor.core.stats import EngineStats
from conveyor.model.loader import demo_model_path, load_tokenizer
from conveyor.server.app import build_app
from conveyor.server.cli import cmd_serve
from conveyor.server.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KNOWN = {
    ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
}
EPP_CONFIG = ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")


def all_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("**/*.y*ml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def documents() -> list[tuple[Path, dict]]:
    """The Kubernetes objects (the other YAML files here are Ray Serve configs: docs/scale-out.md)."""
    return [(p, d) for p, d in all_documents() if "applications" not in d]


def of_kind(kind: str) -> list[dict]:
    return [d for _, d in documents() if d["kind"] == kind]


def pod_labels() -> list[dict]:
    return [d["spec"]["template"]["metadata"]["labels"] for d in of_kind("Deployment")]


def containers() -> list[dict]:
    return [c for d in of_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]]


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class _RoutesOnly:
    """Just enough of an engine client for build_app to register its routes (none is called)."""

    model_name = "smollm2-135m"
    max_model_len = 8192

    def __init__(self):
        self.tokenizer = load_tokenizer(demo_model_path())

    def add_finished_listener(self, listener) -> None:
        pass


def served_metric_names() -> set[str]:
    """Family and sample names of a real /metrics rendering (one replica, one request finished)."""
    metrics = ServerMetrics(lambda: [(EngineStats(block_size=16, num_kv_blocks=256), True)], "smollm2-135m")
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_every_document_parses_and_is_a_known_kind():
    for path, d in all_documents():
        assert isinstance(d, dict), path
        if "applications" in d:   # a Ray Serve config: Conveyor's own application builder
            assert all(a["import_path"].startswith("conveyor.") for a in d["applications"]), path
    docs = documents()
    assert {p.name for p, _ in docs} >= {"conveyor-cpu.yaml", "inferencepool.yaml", "epp-config.yaml"}
    for path, d in docs:
        assert (d.get("apiVersion"), d.get("kind")) in KNOWN, (path, d.get("apiVersion"), d.get("kind"))
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", d["metadata"]["name"]), path


def test_selectors_match_the_pods():
    labels = pod_labels()
    assert labels
    for d in of_kind("Deployment"):
        assert matches(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
    for svc in of_kind("Service"):
        assert any(matches(svc["spec"]["selector"], lab) for lab in labels), svc["metadata"]["name"]
        names = {p.get("name") for c in containers() for p in c["ports"]}
        numbers = {p["containerPort"] for c in containers() for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names | numbers
    pools = of_kind("InferencePool")
    assert pools
    ports = {p["containerPort"] for c in containers() for p in c["ports"]}
    for pool in pools:
        assert any(matches(pool["spec"]["selector"]["matchLabels"], lab) for lab in labels)
        assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
        assert pool["spec"]["endpointPickerRef"]["name"]
    pool_names = {p["metadata"]["name"] for p in pools}
    for objective in of_kind("InferenceObjective"):
        assert objective["spec"]["poolRef"]["name"] in pool_names


def test_the_container_runs_a_valid_conveyor_serve():
    parser = build_parser()
    for c in containers():
        argv = c["command"] + c.get("args", [])
        assert argv[0] == "conveyor"
        args = parser.parse_args(argv[1:])   # exits (SystemExit) on an unknown flag or a bad value
        assert args.func is cmd_serve
        assert args.host == "0.0.0.0"
        assert args.data_parallel_size == 1   # one engine per pod: the picker reads one series per name
        assert args.port in {p["containerPort"] for p in c["ports"]}
        assert args.shutdown_timeout < 40 or pytest.fail("the grace period must outlast --shutdown-timeout")


def test_probe_paths_are_routes_of_the_app():
    app = build_app(_RoutesOnly(), log_interval=0)
    routes = {getattr(r, "path", None) for r in app.routes}
    for c in containers():
        probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
        assert len(probes) == 3
        for probe in probes:
            assert probe["httpGet"]["path"] in routes
            port = probe["httpGet"]["port"]
            assert port in {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
    assert {"/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"} <= routes


def test_the_endpoint_pickers_metric_names_are_served():
    served = served_metric_names()
    configs = [yaml.safe_load(text) for cm in of_kind("ConfigMap") for text in cm["data"].values()]
    epp = [c for c in configs if (c.get("apiVersion"), c.get("kind")) == EPP_CONFIG]
    assert epp
    specs = []
    for config in epp:
        for plugin in config["plugins"]:
            for engine in plugin.get("parameters", {}).get("engineConfigs", []):
                specs += [v for k, v in engine.items() if k.endswith("Spec")]
    flags = re.findall(r"--[a-z-]+-metric=(\S+)", (DEPLOY / "epp-config.yaml").read_text())
    assert len(specs) == len(flags) == 5
    for spec in specs + flags:
        name = spec.split("{")[0]   # a spec may select labels: name{label="value"}
        assert name in served, name
    engine_label = {e["name"] for c in epp for p in c["plugins"]
                    for e in p.get("parameters", {}).get("engineConfigs", [])}
    key = next(p["parameters"]["engineLabelKey"] for c in epp for p in c["plugins"]
               if "engineLabelKey" in p.get("parameters", {}))
    assert all(lab.get(key) in engine_label for lab in pod_labels())   # the pods get the mapping
