"""deploy/kubernetes.yaml describes a working fleet: every setting it passes is a real `dsuf serve`
option, the probes and ports point at what the server listens on, and the pieces reference each
other correctly (no cluster is available here to apply it to)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from dsuf.serve import add_serve_arguments

REPO = Path(__file__).resolve().parents[1]


def manifest() -> dict[tuple[str, str], dict]:
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes.yaml").read_text())
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def dsuf_container(objs) -> dict:
    (container,) = objs[("Deployment", "dsuf")]["spec"]["template"]["spec"]["containers"]
    return container


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def serve_options() -> set[str]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return {"DSUF_" + a.dest.upper() for a in parser._actions if a.dest != "help"}


def size(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def test_every_environment_variable_is_a_serve_option():
    variables = set(env(dsuf_container(manifest())))
    assert variables <= serve_options(), variables - serve_options()
    assert {"DSUF_REDIS_URL", "DSUF_SERVER_ID", "DSUF_CLUSTER_SECRET", "DSUF_KV_ADVERTISE", "DSUF_KV_PORT"} <= variables


def test_several_replicas_sit_behind_one_service_and_become_ready_on_readyz():
    objs = manifest()
    deployment = objs[("Deployment", "dsuf")]
    assert deployment["spec"]["replicas"] >= 2
    service = objs[("Service", "dsuf")]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    c = dsuf_container(objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    e = env(c)
    assert ports["http"] == int(e["DSUF_PORT"]["value"]) and ports["kv"] == int(e["DSUF_KV_PORT"]["value"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(e["DSUF_GRACE"]["value"])  # the drain finishes before Kubernetes kills


def test_the_fleet_wiring_points_at_its_redis_secret_and_pod_address():
    objs = manifest()
    e = env(dsuf_container(objs))
    redis_service = objs[("Service", "dsuf-redis")]
    url = e["DSUF_REDIS_URL"]["value"]
    assert url == f"redis://{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}/0"
    assert redis_service["spec"]["selector"] == objs[("Deployment", "dsuf-redis")]["spec"]["template"]["metadata"]["labels"]
    assert e["DSUF_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "dsuf-cluster"
    assert e["DSUF_KV_ADVERTISE"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert e["DSUF_SERVER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_cache_arena_fits_the_shared_memory_volume():
    objs = manifest()
    pod = objs[("Deployment", "dsuf")]["spec"]["template"]["spec"]
    c = dsuf_container(objs)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    arena = int(env(c)["DSUF_KV_HOST_BYTES"]["value"])
    assert arena <= size(volume["emptyDir"]["sizeLimit"]) <= size(c["resources"]["limits"]["memory"])
