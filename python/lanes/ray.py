"""Ray on Lanes: a node's services advertised to Ray, and a trial's client to
its node's service (docs/ray.md).

Node side, before ``ray start`` on a node whose GPUs each run ``lanes serve``
(``lanes host --directory /run/lanes/host.json``)::

    export LANES_DIRECTORY=/run/lanes/host.json
    ray start --address=HEAD:6379 \\
        --resources="$(python -m lanes.ray resources --directory $LANES_DIRECTORY)"

``lanes_gpu`` is then the number of Lanes services on the node and
``lanes_mem_mib`` the memory their lanes hold (MiB). Ray's resources are
logical and fixed at node start: they only keep Ray from placing more trials
on a node than it could hold; each service's admission stays the authority.

Trial side, in a Ray task or a Ray Tune trainable that asked for
``lanes.ray.resources(mem_mib)``::

    with lanes.ray.client() as client:        # the node's service
        job = lanes.torch.training_job(client, model, ...)
        ...

A node whose service is gone fails the trial with `ServiceLostError`, after
draining the Ray node (when none of its services answers) so that Ray places
nothing more there; Ray retries
the trial elsewhere when told to (``retry_exceptions=[ServiceLostError]`` and
``max_retries`` for tasks, ``FailureConfig(max_failures=...)`` for Tune).

Ray itself is optional: this module imports without it; only draining a node
uses it (and is skipped outside Ray).
"""

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ._lanes import Client, LanesError, NoServiceError, ServiceGoneError

#: Endpoints of the node's services, comma-separated (set at node start).
ENDPOINT_ENV = "LANES_ENDPOINT"
#: A `lanes host --directory` file listing the node's services.
DIRECTORY_ENV = "LANES_DIRECTORY"
#: Read when neither variable is set.
DEFAULT_DIRECTORY = "/run/lanes/host.json"
#: Ray custom resource: the Lanes services of a node (one per GPU).
GPU_RESOURCE = "lanes_gpu"
#: Ray custom resource: the memory of the node's Lanes services' lanes, MiB.
MEM_RESOURCE = "lanes_mem_mib"

_MIB = 1 << 20


class ServiceLostError(ServiceGoneError):
    """The Lanes service of the Ray node a trial ran on is gone (it stopped,
    was killed, or never answered). The node has been drained (Ray places
    nothing more there); retrying the trial runs it on another node.
    `endpoint` and `node_id` name the service and the Ray node."""

    def __init__(self, message: str, endpoint: Optional[str] = None, node_id: Optional[str] = None):
        super().__init__(message)
        self.endpoint = endpoint
        self.node_id = node_id
        self.code = None
        self.code_name = None

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (str(self), self.endpoint, self.node_id))


def _directory_endpoints(path: Path) -> List[str]:
    try:
        listing = json.loads(path.read_text())
        services = listing["services"]
        return [s["endpoint"] for s in services if s.get("running", True)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LanesError(f"cannot read the Lanes directory {path}: {e}") from e


def node_endpoints(endpoints: Optional[Sequence[str]] = None, directory: Optional[str] = None) -> List[str]:
    """The endpoints of this node's Lanes services: `endpoints` or
    `directory` when given, else ``$LANES_ENDPOINT`` (comma-separated), else
    the services running in ``$LANES_DIRECTORY``'s file, else in
    ``/run/lanes/host.json``. `LanesError` when none is configured."""
    if endpoints:
        return list(endpoints)
    if directory is not None:
        return _directory_endpoints(Path(directory))
    env = os.environ.get(ENDPOINT_ENV, "").strip()
    if env:
        return [e.strip() for e in env.split(",") if e.strip()]
    env_dir = os.environ.get(DIRECTORY_ENV, "").strip()
    if env_dir:
        return _directory_endpoints(Path(env_dir))
    default = Path(DEFAULT_DIRECTORY)
    if default.is_file():
        return _directory_endpoints(default)
    raise LanesError(
        f"no Lanes service configured on this node: set {ENDPOINT_ENV} or {DIRECTORY_ENV} "
        f"before `ray start`, or run `lanes host --directory {DEFAULT_DIRECTORY}`"
    )


def _capacity_bytes(status: Dict[str, Any]) -> int:
    """The memory a service's lanes hold: the lanes view's capacity, else
    `--memory`; 0 for a service without lanes (`--memory none`)."""
    view = status.get("lanes_json")
    if view:
        try:
            return int(json.loads(view)["capacity"])
        except (ValueError, KeyError, TypeError):
            pass
    return int(status.get("memory_bytes") or 0)


def node_resources(
    endpoints: Optional[Sequence[str]] = None,
    *,
    directory: Optional[str] = None,
    reserve_mib: int = 0,
    connect_timeout: float = 5.0,
) -> Dict[str, float]:
    """The Ray custom resources of this node's Lanes services, for ``ray
    start --resources`` or ``Cluster.add_node(resources=...)``:
    ``{"lanes_gpu": services answering, "lanes_mem_mib": their lanes'
    memory in MiB, less reserve_mib each}``. Services are found as by
    `node_endpoints`; one that does not answer is left out, and
    `NoServiceError` names each endpoint when none answers."""
    if reserve_mib < 0:
        raise ValueError(f"reserve_mib must not be negative, got {reserve_mib}")
    found = node_endpoints(endpoints, directory)
    gpus, mib, failures = 0, 0, []
    for endpoint in found:
        try:
            with Client(endpoint, connect_timeout=connect_timeout, timeout=max(connect_timeout, 10.0)) as c:
                status = c.status()
        except LanesError as e:
            failures.append(f"{endpoint} ({e})")
            continue
        gpus += 1
        mib += max(0, _capacity_bytes(status) // _MIB - reserve_mib)
    if gpus == 0:
        raise NoServiceError("no Lanes service of this node answered: " + ", ".join(failures))
    return {GPU_RESOURCE: float(gpus), MEM_RESOURCE: float(mib)}


def resources(mem_mib: float) -> Dict[str, float]:
    """What a trial asks Ray for: `mem_mib` of ``lanes_mem_mib`` (its P + T,
    or an estimate), e.g. ``@ray.remote(resources=lanes.ray.resources(800))``
    or ``tune.with_resources(trainable, {"cpu": 1, **lanes.ray.resources(800)})``."""
    if not mem_mib > 0:
        raise ValueError(f"mem_mib must be positive, got {mem_mib}")
    return {MEM_RESOURCE: float(mem_mib)}


def _ray_node_id() -> Optional[str]:
    """The Ray node this process works on, when it is a Ray worker (a task,
    an actor, a Tune trial); None in a driver or outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        worker = ray._private.worker
        if worker.global_worker.mode != worker.WORKER_MODE:
            return None
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - Ray's internals moved: no node known
        return None


def drain_node(node_id: Optional[str] = None, reason: str = "its Lanes service is gone") -> bool:
    """Asks Ray to place no more work on a node (by default this Ray
    worker's; none in a driver), through the drain request of Ray's
    autoscaler (`ray drain-node`, a developer API). Work already running
    there keeps running. Returns whether Ray accepted: False outside Ray,
    and, with a warning, if Ray refused or the request failed."""
    ray = sys.modules.get("ray")
    node_id = node_id or _ray_node_id()
    if ray is None or node_id is None:
        return False
    try:
        from ray.core.generated import autoscaler_pb2

        gcs = ray._private.worker.global_worker.gcs_client
        accepted, why = gcs.drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), reason, 0
        )
    except Exception as e:  # noqa: BLE001 - a developer API: never fail the caller over it
        warnings.warn(f"lanes.ray: could not drain Ray node {node_id}: {e}", stacklevel=2)
        return False
    if not accepted:
        warnings.warn(f"lanes.ray: Ray did not drain node {node_id}: {why}", stacklevel=2)
    return bool(accepted)


def _answering(endpoints: Sequence[str], connect_timeout: float) -> List[str]:
    """Those of `endpoints` whose service answers a handshake."""
    alive = []
    for endpoint in endpoints:
        try:
            Client(endpoint, connect_timeout=connect_timeout).close()
            alive.append(endpoint)
        except LanesError:
            pass
    return alive


def _lost(endpoint: str, others: Sequence[str], cause: BaseException, drain: bool,
          connect_timeout: float) -> ServiceLostError:
    """The error for a lost service; the Ray node drained first when `drain`
    and none of the node's `others` services answers either."""
    node_id = _ray_node_id()
    where = f"Ray node {node_id}" if node_id else "this node"
    message = f"the Lanes service of {where} ({endpoint}) is gone: {cause}"
    if drain and node_id is not None:
        alive = _answering([e for e in others if e != endpoint], connect_timeout)
        if alive:
            message += f"; the node's other service(s) {', '.join(alive)} still answer: not drained"
        elif drain_node(node_id, f"its Lanes service {endpoint} is gone: {cause}"):
            message += "; the node is drained, a retry runs elsewhere"
    return ServiceLostError(message, endpoint, node_id)


@contextlib.contextmanager
def client(
    endpoints: Optional[Sequence[str]] = None,
    *,
    directory: Optional[str] = None,
    persistent: Optional[int] = None,
    ephemeral: Optional[int] = None,
    timeout: float = 300.0,
    connect_timeout: float = 5.0,
    name: Optional[str] = None,
    drain: bool = True,
) -> Iterator[Client]:
    """A trial's client to its node's Lanes service, as a context manager:
    among the node's services (found as by `node_endpoints`), the one where a
    job of `persistent` + `ephemeral` bytes is admitted soonest
    (`Client.connect_best`). When no service answers, or one is lost while
    the block runs (`ServiceGoneError`, `NoServiceError`),
    `ServiceLostError` is raised from the original, for Ray to retry; first,
    in a Ray worker and unless `drain=False`, the Ray node is drained if
    none of its services answers any more (a node whose other GPUs' services
    answer keeps taking trials: `connect_best` skips the lost one). The
    client is closed on leaving the block."""
    found = node_endpoints(endpoints, directory)
    try:
        c = Client.connect_best(
            found,
            persistent=persistent,
            ephemeral=ephemeral,
            timeout=timeout,
            connect_timeout=connect_timeout,
            name=name,
        )
    except NoServiceError as e:
        # connect_best asked every service: none answered.
        raise _lost(",".join(found), [], e, drain, connect_timeout) from e
    try:
        with c:
            yield c
    except ServiceLostError:
        raise
    except (ServiceGoneError, NoServiceError) as e:
        raise _lost(c.endpoint, found, e, drain, connect_timeout) from e


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lanes.ray",
        description="Ray custom resources of this node's Lanes services (docs/ray.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    res = sub.add_parser("resources", help="print the JSON for `ray start --resources`")
    res.add_argument("--endpoint", action="append", help="a service's endpoint (repeatable)")
    res.add_argument("--directory", help="a `lanes host --directory` file")
    res.add_argument("--reserve-mib", type=int, default=0, help="MiB of each service not advertised")
    args = parser.parse_args(argv)
    try:
        found = node_resources(args.endpoint, directory=args.directory, reserve_mib=args.reserve_mib)
    except (LanesError, ValueError) as e:
        print(f"lanes.ray: {e}", file=sys.stderr)
        return 1
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
