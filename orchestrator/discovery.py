"""Where the trunk and jury replicas are: `static` addresses, or `kubernetes`, which
follows the EndpointSlices of the trunk's and each shard's Service.

Terms
- component: "trunk", "jury0", "jury1", ... — one role in the stack; a jury shard is one
  component however many replicas serve it.
- target: what the operator named for a component: an address (static) or a Service
  (kubernetes).
- ready replicas: the addresses currently able to take calls. Static: the one address.
  Kubernetes: every address of a ready endpoint (a missing `ready` condition counts as
  ready, as the API asks) in the Service's slices, with the port named `grpc` (or the
  slices' only port), updated live by a watch.

Over TLS (`--internal-tls-ca`) a replica's certificate is verified for the host of its
address: kubernetes discovery's are pod IPs, which no certificate names, so it needs
`--internal-tls-server-name`, a name every service's certificate carries.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

log = logging.getLogger("hydra_jury.discovery")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def component_names(shards: int) -> list[str]:
    return ["trunk", *(f"jury{i}" for i in range(shards))]


class Discovery(ABC):
    targets: dict[str, str]  # component -> what the operator named

    @abstractmethod
    def ready(self, component: str) -> list[str]:
        """The component's ready replicas, in a stable order."""

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until every component has a ready replica; a `TimeoutError` naming
        the ones without."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [c for c in self.targets if not self.ready(c)]
            if not missing:
                return
            if time.monotonic() > deadline:
                named = ", ".join(f"{c} ({self.targets[c]})" for c in missing)
                raise TimeoutError(f"no ready replica within {timeout_s:g} s for {named}")
            time.sleep(0.05)

    def close(self) -> None:
        """Stops following changes (nothing to stop for fixed addresses)."""
        return None


REPLICA_SEPARATOR = "+"


class StaticDiscovery(Discovery):
    """Fixed addresses: a target is HOST:PORT, or several joined by `+` for replicas."""

    def __init__(self, trunk: str, jury: list[str]) -> None:
        self.targets = dict(zip(component_names(len(jury)), [trunk, *jury], strict=True))

    def ready(self, component: str) -> list[str]:
        return [a for a in self.targets[component].split(REPLICA_SEPARATOR) if a]


def ready_addresses(endpoint_slice: Any, port_name: str) -> list[str]:
    """HOST:PORT of every ready endpoint of one EndpointSlice."""
    ports = endpoint_slice.ports or []
    named = [p.port for p in ports if p.name == port_name]
    if named:
        port = named[0]
    elif len(ports) == 1:
        port = ports[0].port
    else:
        return []
    addresses = []
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:
            continue
        host_port = "[{}]:{}" if endpoint_slice.address_type == "IPv6" else "{}:{}"
        addresses += [host_port.format(address, port) for address in endpoint.addresses]
    return addresses


class KubernetesDiscovery(Discovery):
    """Follows the EndpointSlices of one Service per component (list, then watch from
    the list's version; on any error or expiry, list again after a short pause)."""

    def __init__(
        self,
        services: dict[str, str],
        namespace: str | None = None,
        *,
        api_client: Any = None,
        port_name: str = "grpc",
        watch_timeout_s: int = 300,
    ) -> None:
        from kubernetes import client, config

        if api_client is None:
            config.load_incluster_config()
            api_client = client.ApiClient()
        if namespace is None:
            try:
                namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
            except OSError:
                raise ValueError(
                    "--namespace is needed outside a pod (no service account namespace)"
                ) from None
        self.targets = dict(services)
        self.namespace = namespace
        self._api = client.DiscoveryV1Api(api_client)
        self._port_name = port_name
        self._watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        self._slices: dict[str, dict[str, list[str]]] = {c: {} for c in services}
        self._stopped = threading.Event()
        self._watches: list[Any] = []
        self._threads = [
            threading.Thread(target=self._follow, args=(c, s), daemon=True, name=f"discover-{c}")
            for c, s in services.items()
        ]
        for thread in self._threads:
            thread.start()

    def ready(self, component: str) -> list[str]:
        with self._lock:
            return self._ready_unlocked(component)

    def _set(self, component: str, name: str, addresses: list[str] | None) -> None:
        with self._lock:
            before = self._ready_unlocked(component)
            if addresses is None:
                self._slices[component].pop(name, None)
            else:
                self._slices[component][name] = addresses
            after = self._ready_unlocked(component)
        if before != after:
            log.info("%s (%s): ready replicas %s", component, self.targets[component], after)

    def _ready_unlocked(self, component: str) -> list[str]:
        slices = self._slices[component]
        return sorted({a for addresses in slices.values() for a in addresses})

    def _follow(self, component: str, service: str) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={service}"
        while not self._stopped.is_set():
            try:
                listing = self._api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=selector
                )
                names = {item.metadata.name for item in listing.items}
                with self._lock:
                    self._slices[component] = {
                        item.metadata.name: ready_addresses(item, self._port_name)
                        for item in listing.items
                    }
                log.info("%s (%s): %d slices listed", component, service, len(names))
                stream = watch.Watch()
                self._watches.append(stream)
                for event in stream.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=self._watch_timeout_s,
                ):
                    if self._stopped.is_set():
                        break
                    item = event["object"]
                    if event["type"] == "DELETED":
                        self._set(component, item.metadata.name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        addresses = ready_addresses(item, self._port_name)
                        self._set(component, item.metadata.name, addresses)
            except Exception as error:  # the API server restarted, a 410 Gone, ...
                if self._stopped.is_set():
                    break
                log.warning(
                    "%s (%s): discovery failed, listing again: %s", component, service, error
                )
                self._stopped.wait(1.0)

    def close(self) -> None:
        self._stopped.set()
        for stream in self._watches:
            stream.stop()
