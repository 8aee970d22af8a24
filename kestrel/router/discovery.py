"""Replica discovery inside Kubernetes: list the pods matching a label selector through the API server (with the
pod's service-account token) and keep the router's replica set equal to the Ready ones. Only plain REST, so no
kubernetes client library is needed; outside a cluster the router takes --replica URLs instead."""
from __future__ import annotations

import asyncio
import logging
import os

import httpx

log = logging.getLogger("kestrel.router")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(f"{SA_DIR}/token")


def ready_pod_urls(pod_list: dict, port: int) -> list[str]:
    """Base URLs of pods that have an IP and a Ready=True condition (the same readiness the Service uses)."""
    urls = []
    for pod in pod_list.get("items", []):
        status = pod.get("status", {})
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        if ready and status.get("podIP") and not pod.get("metadata", {}).get("deletionTimestamp"):
            urls.append(f"http://{status['podIP']}:{port}")
    return sorted(urls)


async def k8s_discovery_loop(router, interval_s: float = 5.0) -> None:
    cfg = router.cfg
    if not in_cluster():
        log.warning("--k8s-selector given but not running inside Kubernetes; discovery disabled")
        return
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    ns = cfg.k8s_namespace or open(f"{SA_DIR}/namespace").read().strip()
    url = f"https://{host}:{port}/api/v1/namespaces/{ns}/pods"
    discovered: set[str] = set()
    async with httpx.AsyncClient(verify=f"{SA_DIR}/ca.crt", timeout=10.0) as client:
        while True:
            try:
                token = open(f"{SA_DIR}/token").read().strip()  # re-read: projected tokens rotate
                resp = await client.get(url, params={"labelSelector": cfg.k8s_selector},
                                        headers={"Authorization": f"Bearer {token}"})
                resp.raise_for_status()
                now = set(ready_pod_urls(resp.json(), cfg.k8s_port))
                for u in now - discovered:
                    log.info("discovered replica %s", u)
                    router.add_replica(u)
                for u in discovered - now:
                    log.info("replica %s left", u)
                    router.remove_replica(u)
                discovered = now
                router.scheduler.pump()
            except (httpx.HTTPError, OSError, ValueError) as e:
                log.warning("kubernetes discovery failed: %s", e)
            await asyncio.sleep(interval_s)
