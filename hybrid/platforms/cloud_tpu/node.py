"""A Cloud TPU node: connect this process to its TPU system, and read its state and health.

:func:`resolve` finds the node, connects to it and initialises its TPU system (at the start
of every training attempt); :func:`client` reads the node's ``state``, ``health`` and
``symptoms`` from the Cloud TPU API, and :func:`read_status`, :func:`fresh_oom` and
:func:`is_permanent` interpret what it reads (what the supervisor in
:mod:`hybrid.platforms.cloud_tpu.supervisor` decides from).

Errors name the node as the arguments that identify it, ``tpu='my-node', zone='us-central1-b',
project='my-project'``, and say ``tpu, zone and project`` for the three together; launchers
may reword those forms.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple, Protocol

import tensorflow as tf

__all__ = [
    "NodeStatus",
    "TPUConnectionError",
    "TPUNodeClient",
    "TPUSystem",
    "client",
    "fresh_oom",
    "is_permanent",
    "read_status",
    "resolve",
]

_OOM_COOL_DOWN = datetime.timedelta(seconds=90)  # the same window as cloud_tpu_client's

_INSTALL_HINT = (
    "install the tpu extra in the same pip call as everything else, e.g. "
    "`make install EXTRAS=test,plot,tpu` or `pip install -e '.[tpu]'`"
)


class TPUConnectionError(RuntimeError):
    """The TPU named by ``resolve()``'s tpu, zone and project could not be found or
    initialised."""


class TPUSystem(NamedTuple):
    """A connected, initialised TPU system."""

    resolver: Any  # tf.distribute.cluster_resolver.TPUClusterResolver
    topology: Any  # tf.tpu.experimental.Topology
    devices: tuple[str, ...]


class TPUNodeClient(Protocol):
    """What the supervisor reads of a node (``cloud_tpu_client.Client`` has all of it)."""

    def name(self) -> str:
        """The node's name."""
        ...

    def state(self) -> str | None:
        """The node's ``state`` field (READY, PREEMPTED, ...), None if the API gave none."""
        ...

    def health(self) -> str | None:
        """The node's ``health`` field (HEALTHY, ...), None if the API gave none."""
        ...

    def symptoms(self) -> list[dict[str, Any]] | None:
        """The node's ``symptoms`` (``symptomType``, ``createTime``, ``details``), if any."""
        ...


class NodeStatus(NamedTuple):
    """A node's ``state`` and ``health`` fields (None where the API reported none)."""

    state: str | None
    health: str | None

    def __str__(self) -> str:
        return f"state {self.state or '-'}, health {self.health or '-'}"


def read_status(node: TPUNodeClient) -> NodeStatus:
    """The node's state and health, read now (two API calls)."""
    return NodeStatus(node.state(), node.health())


def _http_status(err: BaseException) -> int | None:
    """The HTTP status behind an API error (cloud_tpu_client wraps HttpError in ValueError)."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            return None
        resp = getattr(seen, "resp", None)
        status = getattr(resp, "status", None)
        if isinstance(status, int):
            return status
        seen = seen.__cause__ or seen.__context__
    return None


def is_permanent(err: BaseException) -> bool:
    """Whether ``err``, raised reading the API, is a client error (HTTP 4xx but 408 and 429:
    a wrong name, project or permission) that asking again will not fix."""
    status = _http_status(err)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _recent_oom(symptoms: list[dict[str, Any]] | None, now: datetime.datetime) -> str | None:
    """The details of an OUT_OF_MEMORY symptom created less than 90 s before ``now``."""
    for symptom in reversed(symptoms or []):
        if symptom.get("symptomType") != "OUT_OF_MEMORY":
            continue
        try:
            created = datetime.datetime.strptime(
                str(symptom.get("createTime", ""))[:19], "%Y-%m-%dT%H:%M:%S"
            ).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
        if now - created < _OOM_COOL_DOWN:
            return str(symptom.get("details") or "runtime out of memory")
    return None


def fresh_oom(node: TPUNodeClient) -> str | None:
    """The details of the node's runtime OOM of the last 90 s; None if none (or unreadable)."""
    try:
        symptoms = node.symptoms()
    except Exception:  # symptoms are advisory: the state and health decide
        return None
    return _recent_oom(symptoms, datetime.datetime.now(datetime.timezone.utc))


def _node_args(tpu: str, zone: str | None, project: str | None) -> str:
    """``tpu='...', zone='...', project='...'``: the node as errors name it."""
    return f"tpu={tpu!r}, zone={zone!r}, project={project!r}"


def resolve(
    tpu: str,
    zone: str | None = None,
    project: str | None = None,
    *,
    discovery_url: str | None = None,
    credentials: Any = "default",
) -> TPUSystem:
    """Finds the TPU, connects this process to it and initialises its TPU system.

    Computes ``TPUClusterResolver(tpu, zone, project)``, then
    ``experimental_connect_to_cluster`` and ``initialize_tpu_system`` on it. Call it at the
    start of every attempt: after a preemption the TPU system must be initialised again.

    Args:
      tpu: the node's name, a ``grpc://`` address, or ``"local"`` on a TPU VM.
      zone: its zone; None lets the resolver ask the GCE metadata server.
      project: its GCP project; None: as for ``zone``.
      discovery_url: a Cloud TPU API discovery URL other than Google's.
      credentials: as for ``client()``.

    Returns:
      The resolver, the TPU topology and the names of the TPU devices.

    Raises:
      ValueError: ``tpu`` is empty.
      TPUConnectionError: the TPU could not be looked up, reached or initialised.
    """
    if not tpu:
        raise ValueError("tpu is empty; pass the Cloud TPU node's name (or 'local' on a TPU VM)")
    where = _node_args(tpu, zone, project)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=tpu,
            zone=zone,
            project=project,
            credentials=credentials,
            discovery_url=discovery_url,
        )
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        raise TPUConnectionError(
            f"could not connect to the Cloud TPU {where}: {err}. Check that the node exists "
            "and is READY (`gcloud compute tpus list --zone=ZONE --project=PROJECT`), that "
            "tpu, zone and project name it, and that this VM may use it"
        ) from err
    devices = tuple(d.name for d in tf.config.list_logical_devices("TPU"))
    if not devices:
        raise TPUConnectionError(f"the TPU system of {where} is initialised but has no TPU cores")
    return TPUSystem(resolver, topology, devices)


def client(
    tpu: str,
    zone: str,
    project: str,
    *,
    discovery_url: str | None = None,
    service: Any = None,
    credentials: Any = "default",
) -> TPUNodeClient:
    """A ``cloud_tpu_client.Client`` that reads node ``projects/project/locations/zone/nodes/tpu``.

    Zone and project must be given: the client would otherwise ask the GCE metadata server.

    Args:
      tpu: the node's name; not a ``grpc://`` address or ``"local"``, which name no node the
        API could describe.
      zone: the node's zone.
      project: the node's GCP project.
      discovery_url: the API's discovery URL template (``{api}``, ``{apiVersion}``), e.g. a
        local fake; the ``TPU_API_DISCOVERY_URL`` environment variable, when set, wins (a
        rule of cloud_tpu_client).
      service: a ready ``googleapiclient`` service to use instead of building one per call.
      credentials: ``"default"`` (application default credentials) or a google-auth /
        oauth2client credentials object, e.g. ``google.auth.credentials.AnonymousCredentials()``
        for a local fake.

    Returns:
      The client.

    Raises:
      ValueError: a missing or unusable ``tpu``, ``zone`` or ``project``.
      ImportError: cloud-tpu-client is not installed.
    """
    _check_node_name(tpu, zone, project)
    try:
        from cloud_tpu_client import Client
    except ImportError as err:
        raise ImportError(f"the TPU supervisor needs cloud-tpu-client; {_INSTALL_HINT}") from err
    node: TPUNodeClient = Client(
        tpu=tpu,
        zone=zone,
        project=project,
        credentials=credentials,
        service=service,
        discovery_url=discovery_url,
    )
    return node


def _check_node_name(tpu: str, zone: str, project: str) -> None:
    """Raises ValueError unless tpu, zone and project are given and ``tpu`` names a node."""
    for name, value in (("tpu", tpu), ("zone", zone), ("project", project)):
        if not value:
            raise ValueError(
                f"{name} is empty; the TPU supervisor asks the Cloud TPU API about node "
                "projects/<project>/locations/<zone>/nodes/<tpu> and needs all three"
            )
    if tpu.startswith("grpc://") or tpu == "local":
        raise ValueError(
            f"tpu={tpu!r} names no Cloud TPU node, so the supervisor cannot ask for its state; "
            "pass the node's name as shown by `gcloud compute tpus list`"
        )
