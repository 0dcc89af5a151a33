"""A fake Cloud TPU REST API on 127.0.0.1, for driving ``cloud_tpu_client.Client`` in tests.

It serves exactly what the client reads:

    GET /discovery/tpu/v1                              a hand-written discovery document that
                                                       declares projects.locations.nodes.get
    GET /v1/projects/P/locations/Z/nodes/N             the node: name, state, health, symptoms

The node follows a timeline of ``(at_s, state, health)`` entries on a clock (a ``FakeClock``
shared with the code under test, or ``time.monotonic``): a GET answers with the last entry
whose time has come. Every request is recorded.

``loopback_only()`` makes any Python socket that tries to reach beyond 127.0.0.1 fail, so a
test proves that nothing (no metadata server, no googleapis.com) is contacted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["FakeClock", "FakeCloudTpu", "NetworkGuardError", "discovery_document", "loopback_only"]

_NODE_PATTERN = "^projects/[^/]+/locations/[^/]+/nodes/[^/]+$"


def discovery_document(root_url: str) -> dict[str, Any]:
    """The smallest ``tpu``/``v1`` discovery document googleapiclient builds a service from.

    No ``auth`` section: the service needs no OAuth scopes, so googleapiclient asks for no
    default credentials.
    """
    return {
        "kind": "discovery#restDescription",
        "discoveryVersion": "v1",
        "id": "tpu:v1",
        "name": "tpu",
        "version": "v1",
        "title": "Fake Cloud TPU API (tests)",
        "protocol": "rest",
        "rootUrl": root_url,
        "servicePath": "",
        "batchPath": "batch",
        "parameters": {
            "alt": {"type": "string", "location": "query", "default": "json"},
        },
        "schemas": {
            "Symptom": {
                "id": "Symptom",
                "type": "object",
                "properties": {
                    "createTime": {"type": "string"},
                    "symptomType": {"type": "string"},
                    "details": {"type": "string"},
                },
            },
            "Node": {
                "id": "Node",
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "state": {"type": "string"},
                    "health": {"type": "string"},
                    "symptoms": {"type": "array", "items": {"$ref": "Symptom"}},
                },
            },
        },
        "resources": {
            "projects": {
                "resources": {
                    "locations": {
                        "resources": {
                            "nodes": {
                                "methods": {
                                    "get": {
                                        "id": "tpu.projects.locations.nodes.get",
                                        "path": "v1/{+name}",
                                        "flatPath": "v1/projects/{p}/locations/{l}/nodes/{n}",
                                        "httpMethod": "GET",
                                        "parameters": {
                                            "name": {
                                                "type": "string",
                                                "location": "path",
                                                "required": True,
                                                "pattern": _NODE_PATTERN,
                                            }
                                        },
                                        "parameterOrder": ["name"],
                                        "response": {"$ref": "Node"},
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
    }


class FakeClock:
    """A monotonic clock that moves only when someone sleeps on it (thread-safe)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the fake received."""

    method: str
    path: str


class FakeCloudTpu:
    """A fake Cloud TPU API serving one node ``projects/P/locations/Z/nodes/N``.

    Use as a context manager: the server runs on 127.0.0.1 (a free port) in a thread between
    ``__enter__`` and ``__exit__``.
    """

    def __init__(
        self,
        project: str = "fake-project",
        zone: str = "fake-zone",
        node: str = "fake-tpu",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.project, self.zone, self.node = project, zone, node
        self._clock = clock
        self._lock = threading.Lock()
        self._timeline: list[tuple[float, str, str | None]] = [(clock(), "READY", "HEALTHY")]
        self._symptoms: list[dict[str, str]] = []
        self._failures: list[int] = []  # HTTP statuses the next node GETs answer with
        self.requests: list[Request] = []
        self.served: list[tuple[str, str | None]] = []  # (state, health) of every node GET
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- the node ---------------------------------------------------------------------------

    @property
    def node_name(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}/nodes/{self.node}"

    def set_node(self, state: str, health: str | None = None) -> None:
        """From now on the node is in ``state`` with ``health`` (None: no health field)."""
        self.timeline([(0.0, state, health)])

    def timeline(self, entries: Sequence[tuple[float, str, str | None]]) -> None:
        """Replaces the node's future: ``(seconds from now, state, health)`` entries."""
        now = self._clock()
        with self._lock:
            self._timeline = sorted((now + at, state, health) for at, state, health in entries)

    def add_symptom(self, symptom_type: str, create_time: str, details: str = "") -> None:
        with self._lock:
            self._symptoms.append(
                {"symptomType": symptom_type, "createTime": create_time, "details": details}
            )

    def fail_next(self, count: int, status: int = 503) -> None:
        """The next ``count`` node GETs fail with HTTP ``status`` (an API outage)."""
        with self._lock:
            self._failures.extend([status] * count)

    def current(self) -> tuple[str, str | None]:
        """The (state, health) a GET would answer now."""
        now = self._clock()
        with self._lock:
            due = [(state, health) for at, state, health in self._timeline if at <= now]
            return due[-1] if due else ("CREATING", None)

    def node_resource(self) -> dict[str, Any]:
        state, health = self.current()
        resource: dict[str, Any] = {"name": self.node_name, "state": state}
        if health is not None:
            resource["health"] = health
        with self._lock:
            if self._symptoms:
                resource["symptoms"] = list(self._symptoms)
            self.served.append((state, health))
        return resource

    # -- counts -----------------------------------------------------------------------------

    def count(self, path_prefix: str) -> int:
        with self._lock:
            return sum(r.path.startswith(path_prefix) for r in self.requests)

    @property
    def node_gets(self) -> int:
        return self.count("/v1/")

    # -- the server -------------------------------------------------------------------------

    @property
    def root_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake Cloud TPU API is not running; use it as a context manager")
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    @property
    def discovery_url(self) -> str:
        """A discovery URL template, as ``discovery.build(discoveryServiceUrl=...)`` takes it."""
        return self.root_url + "discovery/{api}/{apiVersion}"

    def __enter__(self) -> FakeCloudTpu:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _answer(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests.append(Request(method, path))
        path = path.split("?", 1)[0]
        if method != "GET":
            return 405, _error(405, f"{method} is not served by the fake", "UNIMPLEMENTED")
        if path == "/discovery/tpu/v1":
            return 200, discovery_document(self.root_url)
        if path == "/v1/" + self.node_name:
            with self._lock:
                failure = self._failures.pop(0) if self._failures else None
            if failure is not None:
                return failure, _error(failure, "the fake API is failing on purpose", "UNAVAILABLE")
            return 200, self.node_resource()
        if path.startswith("/v1/projects/"):
            return 404, _error(404, f"Resource '{path[4:]}' was not found", "NOT_FOUND")
        return 404, _error(404, f"no such path {path}", "NOT_FOUND")


def _error(code: int, message: str, status: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


def _handler_for(fake: FakeCloudTpu) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            status, body = fake._answer(self.command, self.path)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _reply

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output clean

    return Handler


# -- the network guard -----------------------------------------------------------------------


class NetworkGuardError(OSError):
    """Raised when test code tries to reach anything but the loopback interface."""


def _is_loopback(host: object) -> bool:
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Within the block, resolving or connecting to any non-loopback host raises.

    Covers everything that goes through Python's ``socket`` module (urllib, httplib2,
    googleapiclient, oauth2client, google-auth), DNS lookups included.
    """
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(address: object) -> None:
        if isinstance(address, tuple) and not _is_loopback(address[0]):
            raise NetworkGuardError(f"test tried to reach {address!r} outside 127.0.0.1")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _is_loopback(
            host.decode() if isinstance(host, bytes) else host
        ):
            raise NetworkGuardError(f"test tried to resolve {host!r} (outside 127.0.0.1)")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign, assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign, assignment]
    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = real_connect_ex  # type: ignore[method-assign]
        socket.getaddrinfo = real_getaddrinfo
