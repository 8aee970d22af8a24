"""deploy/kubernetes: every object validates against the Kubernetes OpenAPI JSON schemas (bundled with the
kubernetes-validate package, so this works offline), and the pieces fit together: Services select the pods,
probes hit /health on a declared port, Prometheus annotations point at the serving port, and the router's
command line is accepted by `kestrel router`."""
import argparse
import copy
import glob
import os

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.30.0"
ROOT = os.path.join(os.path.dirname(__file__), "..", "deploy", "kubernetes")


def _docs():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.yaml"))):
        for d in yaml.safe_load_all(open(path)):
            if d and d.get("kind") != "Kustomization":  # kustomize's own file is not an API object
                out.append(d)
    return out


DOCS = _docs()


def test_manifests_exist():
    kinds = sorted(d["kind"] for d in DOCS)
    assert kinds.count("Deployment") == 2 and kinds.count("Service") == 2


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_schema_valid(doc):
    kv.validate(doc, K8S_VERSION, strict=True)  # strict: unknown fields are errors too


def test_validator_rejects_broken_manifest():
    dep = copy.deepcopy(next(d for d in DOCS if d["kind"] == "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)
    dep = copy.deepcopy(next(d for d in DOCS if d["kind"] == "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt field
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def _deployments():
    return [d for d in DOCS if d["kind"] == "Deployment"]


def test_services_select_pods_and_ports_exist():
    deps = _deployments()
    for svc in (d for d in DOCS if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        matches = [d for d in deps if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in matches[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in port_names
    for d in deps:
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_probes_and_scrape_annotations():
    for d in _deployments():
        tmpl = d["spec"]["template"]
        c = tmpl["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["port"] in ports
        assert "livenessProbe" in c
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) in ports.values()


def test_router_command_is_accepted_by_cli():
    from kestrel.router.cli import add_parser, build_config

    router = next(d for d in _deployments() if d["metadata"]["name"] == "kestrel-router")
    cmd = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["kestrel", "router"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    cfg = build_config(parser.parse_args(cmd[1:]))
    replica = next(d for d in _deployments() if d["metadata"]["name"] == "kestrel-replica")
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert dict(kv_.split("=") for kv_ in cfg.k8s_selector.split(",")) == labels
    rep_port = replica["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert cfg.k8s_port == rep_port
    # the ServiceAccount it runs as may list pods
    role = next(d for d in DOCS if d["kind"] == "Role")
    assert any("pods" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == next(
        d for d in DOCS if d["kind"] == "ServiceAccount")["metadata"]["name"]
