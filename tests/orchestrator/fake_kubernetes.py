"""A small HTTP server that speaks the part of the Kubernetes API discovery uses: list
and watch of EndpointSlices in a namespace, filtered by the `kubernetes.io/service-name`
label, in the API's JSON. Tests drive the real `kubernetes` client against it and change
the endpoints while it watches (one slice per replica: loopback replicas differ only by
port, and a slice has one port set)."""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SERVICE_LABEL = "kubernetes.io/service-name"


class FakeKubernetes:
    def __init__(self, namespace: str = "hydra") -> None:
        self.namespace = namespace
        self.version = 1
        self.slices: dict[str, dict] = {}  # slice name -> object
        self.watchers: list[tuple[str, queue.Queue]] = []  # (service, events)
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked watch streams, as the API server sends

            def log_message(self, *args) -> None:  # quiet
                return None

            def do_GET(self) -> None:
                fake.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def api_client(self):
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    # --- what tests change -------------------------------------------------------------

    def set_endpoint(self, service: str, port: int, ready: bool = True) -> None:
        name = f"{service}-{port}"
        with self.lock:
            self.version += 1
            event = "MODIFIED" if name in self.slices else "ADDED"
            self.slices[name] = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": {SERVICE_LABEL: service},
                    "resourceVersion": str(self.version),
                },
                "addressType": "IPv4",
                "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}],
            }
            self._publish(service, event, self.slices[name])

    def delete_endpoint(self, service: str, port: int) -> None:
        with self.lock:
            self.version += 1
            removed = self.slices.pop(f"{service}-{port}")
            self._publish(service, "DELETED", removed)

    def _publish(self, service: str, kind: str, item: dict) -> None:
        for watched, events in self.watchers:
            if watched == service:
                events.put({"type": kind, "object": item})

    def close(self) -> None:
        with self.lock:
            for _service, events in self.watchers:
                events.put(None)
        self.server.shutdown()
        self.server.server_close()

    # --- the API ------------------------------------------------------------------------

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request.path)
        expected = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        if parts.path != expected:
            request.send_error(404)
            return
        query = parse_qs(parts.query)
        selector = query.get("labelSelector", [""])[0]
        service = selector.removeprefix(f"{SERVICE_LABEL}=")
        if query.get("watch", ["false"])[0] in ("true", "1", "True"):
            self._watch(request, service)
            return
        with self.lock:
            items = [
                s for s in self.slices.values() if s["metadata"]["labels"][SERVICE_LABEL] == service
            ]
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        data = json.dumps(body).encode()
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
        request.close_connection = True

    def _watch(self, request: BaseHTTPRequestHandler, service: str) -> None:
        events: queue.Queue = queue.Queue()
        with self.lock:
            self.watchers.append((service, events))
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        try:
            while True:
                event = events.get()
                if event is None:
                    request.wfile.write(b"0\r\n\r\n")
                    return
                line = json.dumps(event).encode() + b"\n"
                request.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                request.wfile.flush()
        except OSError:
            return
        finally:
            with self.lock:
                self.watchers.remove((service, events))
