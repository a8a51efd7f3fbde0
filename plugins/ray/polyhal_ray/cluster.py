"""The cluster as the driver sees it: reaching it, one :class:`NodeSession` per node.

A NodeSession owns the node's :class:`~polyhal_ray.worker.NodeRuntime` actor and its *command
stream*: device operations are appended to it without a round trip, and :meth:`NodeSession.flush`
sends what is pending as one numbered submission. Each submission's answer signals the node's
timeline semaphore (:class:`polyhal.hal.queue.Semaphore`) to its number -- a remote device is a
device whose queue completes asynchronously: a completion thread takes the answers of ordinary
actor calls in order; while a replayed plan keeps the node's compiled graph, the submitting thread
executes the graph and reads its answer itself (one hop; Ray's compiled graph is driven from one
thread). A node that dies fails the semaphore with :class:`~polyhal_ray.errors.NodeLostError`,
so every waiter, now or later, learns which node was lost.
"""

from __future__ import annotations

import collections
import itertools
import queue as _stdqueue
import socket
import threading
import warnings
from typing import Any, Callable

from polyhal import BufferUsage
from polyhal.hal.queue import Semaphore, default_timeout

from polyhal_ray.errors import ClusterUnreachableError, NodeLostError, VersionSkewError, rebuild
from polyhal_ray.settings import RaySettings
from polyhal_ray.worker import CLEANUP, READ, NodeRuntime, runtime_versions

#: The versions that must match between the driver and a node (Ray itself refuses a node whose
#: Ray or Python differs, before polyhal sees it).
MATCHED = ("polyhal", "polyhal-ray", "polyhal API")


#: Reads this large go as an ordinary actor call even while the node's compiled graph lives: its
#: answer then comes back through the object store, not copied through the graph's channel.
BULK_READ_BYTES = 1 << 20

#: Seconds a node's compiled graph outlives the last replayed plan that used it.
GRAPH_IDLE_SECONDS = 2.0


def node_died(exc: BaseException) -> bool:
    """Whether Ray's ``exc`` means the node's runtime is gone (actor died, channel closed)."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayChannelTimeoutError):  # slow, not gone
        return False
    return isinstance(exc, (rex.RayActorError, rex.RayChannelError, rex.ObjectLostError, rex.NodeDiedError))


def short_id(node_id: str) -> str:
    """The node's name in device names: the first 8 hex digits of its Ray node id."""
    return node_id[:8]


def connect(address: str | None = None, timeout: float | None = None) -> None:
    """Make sure this process is connected to a Ray cluster: ``address`` (default
    ``POLYHAL_RAY_ADDRESS``), or the Ray already initialised in the process.

    :class:`~polyhal_ray.errors.ClusterUnreachableError` when the address answers nothing
    (checked with a plain TCP connection first, so that an unreachable address fails within
    ``timeout`` seconds instead of Ray's own minute of retries).
    """
    import ray

    settings = RaySettings.from_env()
    address = address or settings.address
    timeout = settings.connect_timeout if timeout is None else timeout
    if ray.is_initialized():
        return
    if not address:
        raise ClusterUnreachableError("no Ray cluster: set POLYHAL_RAY_ADDRESS=host:port (the head node's GCS "
                                      "address) or call ray.init() before polyhal lists devices")
    if address != "auto":
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
                pass
        except (OSError, ValueError) as exc:
            raise ClusterUnreachableError(
                f"no Ray cluster answers at POLYHAL_RAY_ADDRESS={address} ({exc}); start one (ray start --head) "
                "or fix the address. Local devices are not affected") from exc
    try:
        ray.init(address=address, log_to_driver=False, logging_level="warning")
    except Exception as exc:  # noqa: BLE001 -- Ray's own errors vary by version
        raise ClusterUnreachableError(f"could not join the Ray cluster at {address}: {type(exc).__name__}: "
                                      f"{exc}. Local devices are not affected") from exc


class NodeSession:
    """One node: its runtime actor, its command stream and its completion timeline."""

    def __init__(self, node_id: str, actor: Any, description: dict[str, Any]) -> None:
        self.node_id = node_id
        self.name = short_id(node_id)
        self.actor = actor
        self.description = description
        #: Why the node is no longer usable (it died); None while it lives.
        self.lost: NodeLostError | None = None
        # Appended by any thread (a buffer's finalizer too) without a lock: a deque's append and
        # popleft are atomic, so a flush never loses a command appended while it drains.
        self._pending: collections.deque = collections.deque()
        #: Ids of buffers and kernels on the node, chosen here so that creating one needs no round trip.
        self.new_id = itertools.count(1).__next__
        self._callbacks: dict[int, list[tuple[Callable[[], None], Callable[[BaseException], None]]]] = {}
        self._lock = threading.Lock()     # the stream and submission numbers
        self._seq = 0                     # number of the last submission sent
        self.completed = Semaphore(0, f"ray:{self.name}/completed")
        self._answers: dict[int, tuple[list, Any]] = {}   # answers someone waits for, by number
        self._wanted: set[int] = set()
        self._unreported: list = []       # errors of submissions nobody waited for
        self._inflight: _stdqueue.SimpleQueue = _stdqueue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._graph: Any = None           # the compiled graph, while replayed plans use it
        self._graph_timeout = 60.0        # seconds an answer through it may take (read when it is made)
        self._graph_users = 0
        self._idle_timer: threading.Timer | None = None
        self.timeout = RaySettings.from_env().connect_timeout

    def __repr__(self) -> str:
        return f"<NodeSession {self.name}{' (lost)' if self.lost else ''}>"

    # -- the command stream ------------------------------------------------------------------

    def enqueue(self, command: tuple) -> None:
        """Append ``command``; it is sent with the next flush."""
        if self.lost is not None:
            raise self._told_lost()
        self._pending.append(command)

    def discard(self, command: tuple) -> None:
        """Append a command that frees something (from a finalizer): dropped once the node is lost."""
        if self.lost is None:
            self._pending.append(command)

    def flush(self, extra: tuple = (), want: bool = False, empty: bool = False) -> int:
        """Send the pending commands (and ``extra``) as one submission, unless there are none
        (``empty``: even then); return the number that completes them. ``want``: keep the answer
        for :meth:`answer`."""
        with self._lock:
            if self.lost is not None:
                raise self._told_lost()
            commands = self._drain()
            commands.extend(extra)
            if not commands and not empty:
                return self._seq
            self._seq += 1
            seq = self._seq
            if want:
                self._wanted.add(seq)
            # (reads come only as ``extra``, from call)
            if self._graph is not None and not any(c[0] == READ and c[3] >= BULK_READ_BYTES for c in extra):
                self._run_on_graph(seq, commands)
                return seq
            try:
                ref = self.actor.submit.remote(seq, commands, self.timeout)
            except Exception as exc:
                if node_died(exc):
                    self._lose(exc)
                    raise self._told_lost() from exc
                raise
            self._inflight.put((seq, ref))
            self._start()
            return seq

    def _run_on_graph(self, seq: int, commands: list) -> None:
        """Submission ``seq`` through the compiled graph, complete on return (the caller holds
        the stream's lock). A compiled graph is driven from one thread at a time -- Ray's is not
        thread-safe -- so this thread executes it and reads the answer: one hop, no hand-over to
        the completion thread, which is what a replayed plan's latency is made of."""
        if self.completed.value < seq - 1:
            self._wait(seq - 1)  # earlier submissions sent as ordinary calls complete first
        try:  # (a graph's ref is read once, with a timeout of its own: Ray's default is 10 s)
            answer = self._graph.execute((seq, commands)).get(timeout=self._graph_timeout)
        except Exception as exc:
            if node_died(exc):
                self._lose(exc)
                raise self._told_lost() from exc
            answer = ([], (type(exc).__name__, f"node {self.name}: {type(exc).__name__}: {exc}"))
        self._settle(seq, answer)

    def _drain(self) -> list:
        pending, commands = self._pending, []
        while pending:
            commands.append(pending.popleft())
        return commands

    def call(self, *commands: tuple) -> list:
        """Flush with ``commands`` and wait: the read results of the submission."""
        seq = self.flush(commands, want=True)
        return self.answer(seq)

    def wait(self, seq: int | None = None) -> None:
        """Wait until submission ``seq`` (default: everything sent) completed; raise the error of
        any earlier submission nobody has seen yet."""
        self._wait(self._seq if seq is None else seq)
        if self._unreported:
            self._raise_unreported()

    def synchronize(self) -> None:
        """Flush and wait for everything. Frees alone are not sent (nobody waits for them): they
        ride with the next submission, so that a run followed by a synchronize is one round trip
        even when the run's previous outputs were just dropped."""
        if all(command[0] in CLEANUP for command in list(self._pending)):
            self.wait()
        else:
            self.wait(self.flush())

    def answer(self, seq: int) -> list:
        """The read results of submission ``seq`` (flushed with ``want=True``), after waiting."""
        self._wait(seq)
        results, error = self._answers.pop(seq)
        self._raise_unreported()
        if error is not None:
            raise rebuild(error, node=self.name)
        return results

    def submit_outside(self, send: Callable[[int], Any]) -> None:
        """Send work that does not go through the stream (node-to-node sends and receives):
        ``send(seq)`` makes the actor call for submission number ``seq``, after what is pending
        was flushed; the call completes ``seq`` like any submission."""
        with self._lock:
            if self.lost is not None:
                raise self._told_lost()
            commands = self._drain()
            if commands:
                self._seq += 1
                self._inflight.put((self._seq, self.actor.submit.remote(self._seq, commands, self.timeout)))
            self._seq += 1
            self._inflight.put((self._seq, send(self._seq)))
        self._start()

    def notify(self, seq: int, done: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        """Call ``done()`` once submission ``seq`` completed (``failed(error)`` if the node is lost
        first), from the completion thread: how a queue signals its semaphores."""
        with self._thread_lock:
            if self.lost is None and self.completed.value < seq:
                self._callbacks.setdefault(seq, []).append((done, failed))
                return
        if self.lost is not None:
            failed(self.lost)
        else:
            done()

    def _wait(self, seq: int) -> None:
        if self.completed.value >= seq and self.lost is None:
            return  # (a replayed plan's submissions are complete when sent: no lock to take)
        try:
            self.completed.wait(seq, None)
        except Exception as exc:
            if self.lost is not None:
                raise self._told_lost() from exc
            raise

    def _told_lost(self) -> NodeLostError:
        """A new error for the node's loss (the stored one is never raised: its traceback would
        keep the failed run's frames, and what they hold, alive), noted as told to a caller
        (see :attr:`reported_losses`)."""
        NodeSession.reported_losses.add(self.name)
        return NodeLostError(str(self.lost), node=self.name)

    #: Nodes whose loss a caller has been told of: a receive that failed because its sender was
    #: one of them is not reported a second time by the receiving node.
    reported_losses: set[str] = set()

    def _raise_unreported(self) -> None:
        errors = [e for e in self._unreported
                  if not (e[0] == "NodeLostError" and len(e) > 2 and e[2] in NodeSession.reported_losses)]
        self._unreported.clear()
        if errors:
            if errors[0][0] == "NodeLostError" and len(errors[0]) > 2:
                NodeSession.reported_losses.add(errors[0][2])
            raise rebuild(errors[0], node=self.name)

    # -- completion ---------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._complete, name=f"polyhal ray:{self.name}",
                                                    daemon=True)
                    self._thread.start()

    def _complete(self) -> None:
        import ray

        while True:
            seq, ref = self._inflight.get()
            try:
                answer = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 -- the actor or its node died
                if node_died(exc):
                    self._lose(exc)
                    return
                answer = ([], (type(exc).__name__, f"node {self.name}: {type(exc).__name__}: {exc}"))
            self._settle(seq, answer)

    def _settle(self, seq: int, answer: tuple[list, Any]) -> None:
        """Submission ``seq`` answered: keep the answer (or its error), signal the timeline and
        run the callbacks of the queue submissions it completes."""
        if seq in self._wanted:
            self._wanted.discard(seq)
            self._answers[seq] = answer
        elif answer[1] is not None:
            self._unreported.append(answer[1])
        self.completed.signal(seq)
        if not self._callbacks:  # (one registered before the signal is seen here; one after runs at once)
            return
        with self._thread_lock:
            due = [self._callbacks.pop(n) for n in [n for n in self._callbacks if n <= seq]]
        for callbacks in due:
            for done, _ in callbacks:
                done()

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = NodeLostError(
                f"Ray node {self.name} ({self.node_id}) was lost: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. Its devices and the data on them are gone; "
                "other devices keep working, and later compiles leave this node out", node=self.name)
        self.completed.fail(self.lost)
        with self._thread_lock:
            due, self._callbacks = list(self._callbacks.values()), {}
        for callbacks in due:
            for _, failed in callbacks:
                failed(self.lost)

    # -- compiled graph -----------------------------------------------------------------------

    def use_graph(self) -> Callable[[], None]:
        """Route this node's submissions through a Ray compiled graph (made on first use) while
        the returned ``release()`` is not called: replayed plans hold one each. A compiled graph
        keeps a polling loop on the actor, so it is torn down :data:`GRAPH_IDLE_SECONDS` after
        the last replayed plan goes (not at once: plans made and dropped in a row, as in a test
        suite, would each compile one)."""
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            if self._graph is None:
                from ray.dag import InputNode

                with InputNode() as inp:
                    dag = self.actor.execute.bind(inp)
                self._graph = dag.experimental_compile()
                self._graph_timeout = default_timeout()
                warm = True
            else:
                warm = False
            self._graph_users += 1
        if warm:  # Ray's first execution of a graph sets up its channels: not in a plan's first call
            self.wait(self.flush(empty=True))
        released = []

        def release() -> None:
            if released:
                return
            released.append(True)
            with self._lock:
                self._graph_users -= 1
                if self._graph_users == 0 and self._graph is not None:
                    self._idle_timer = threading.Timer(GRAPH_IDLE_SECONDS, self._drop_graph, (self._graph,))
                    self._idle_timer.daemon = True
                    self._idle_timer.start()

        return release

    def _drop_graph(self, graph: Any) -> None:
        """Tear ``graph`` down, unless a replayed plan took it up again meanwhile."""
        with self._lock:
            if self._graph_users or self._graph is not graph:
                return
            self._idle_timer = None
        try:  # the graph's answers are all taken before it goes
            self.synchronize()
        except Exception:  # noqa: BLE001 -- a lost node's graph is torn down all the same
            pass
        with self._lock:
            if self._graph_users or self._graph is not graph:
                return
            self._graph = None
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001
            pass


class Cluster:
    """The nodes of the connected cluster whose runtimes answered, and why others are missing."""

    def __init__(self) -> None:
        self.sessions: dict[str, NodeSession] = {}
        #: Reasons nodes (or the whole cluster) contribute no device, for ``polyhal devices``.
        self.unavailable: list[str] = []
        #: Nodes left out (versions differ, runtime did not start): not asked again.
        self.refused: set[str] = set()

    @classmethod
    def discover(cls, timeout: float | None = None, previous: "Cluster | None" = None) -> "Cluster":
        """Start (or find) a runtime actor on every alive node and read its devices and versions
        (``previous``: a cluster found before, whose nodes are kept and not asked again).
        Nodes whose versions differ from the driver's, or that do not answer in ``timeout``,
        are left out with a reason."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        timeout = RaySettings.from_env().connect_timeout if timeout is None else timeout
        cluster = cls()
        if previous is not None:
            cluster.sessions = dict(previous.sessions)
            cluster.unavailable = list(previous.unavailable)
            cluster.refused = set(previous.refused)
        mine = runtime_versions()
        remote = ray.remote(num_cpus=0, max_concurrency=8)(NodeRuntime)
        pending = {}
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in cluster.sessions or node_id in cluster.refused:
                continue
            # The runtime holds the node's GPUs (Ray hides them from actors that ask for none).
            actor = remote.options(
                num_gpus=node.get("Resources", {}).get("GPU", 0),
                name=f"polyhal-node-{node_id}", namespace="polyhal", get_if_exists=True, lifetime=None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(short_id(node_id))
            pending[node_id] = (actor, actor.describe.remote())
        for node_id, (actor, ref) in pending.items():
            name = short_id(node_id)
            try:
                description = ray.get(ref, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 -- a node that cannot run polyhal
                cluster.refused.add(node_id)
                cluster.unavailable.append(f"node {name}: its polyhal runtime did not start: {type(exc).__name__}: "
                                           f"{str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            theirs = description["versions"]
            skew = [k for k in MATCHED if theirs.get(k) != mine.get(k)]
            if skew:
                what = ", ".join(f"{k} {theirs.get(k)} on the node, {mine.get(k)} here" for k in skew)
                error = VersionSkewError(f"node {name} runs another polyhal than this driver ({what}); its devices "
                                         "are left out. Install the same versions on every node", plugin="ray")
                cluster.refused.add(node_id)
                cluster.unavailable.append(str(error))
                warnings.warn(f"polyhal: {error}", RuntimeWarning, stacklevel=2)
                continue
            cluster.sessions[node_id] = NodeSession(node_id, actor, description)
        return cluster


def alive_node_ids() -> set[str]:
    """Ids of the nodes Ray currently reports alive."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


#: One end of a measured link: (node session, device name on the node, memory type there), or
#: None for this process.
LinkEnd = "tuple[NodeSession, str, int] | None"


def send_to(src: NodeSession, src_key: tuple, dst: NodeSession, dst_key: tuple) -> None:
    """Move tensor ``src_key`` of node ``src`` into ``dst_key`` of node ``dst``, node to node: the
    source puts it in its object store, the destination pulls it from there. Neither call waits
    here; only ObjectRefs pass through this process, never the bytes."""
    sent = []

    def send(seq: int) -> Any:
        sent.append(src.actor.send.remote(seq, src_key, src.timeout))
        return sent[0]

    src.submit_outside(send)
    dst.submit_outside(lambda seq: dst.actor.recv.remote(seq, sent, dst_key, src.name, dst.timeout))


def measure_bandwidth(src: LinkEnd, dst: LinkEnd, nbytes: int = 4 << 20) -> float:
    """Bytes per second of moving ``nbytes`` from ``src`` to ``dst`` the way a plan's transfer
    does -- node to node through the object store, or up to and down from a node -- the best of
    two moves after a warm-up."""
    import time

    import numpy as np

    from polyhal_ray.worker import ALLOC, FREE, WRITE

    ends = [end for end in (src, dst) if end is not None]
    keys = []
    for session, device, memory_type in ends:
        bid = session.new_id()
        session.call((ALLOC, bid, device, nbytes, memory_type, int(BufferUsage.DEFAULT)))
        keys.append((bid, 0, (nbytes,), np.dtype(np.uint8), (1,)))
    host = np.zeros(nbytes, np.uint8)

    def move() -> None:
        if src is not None and dst is not None:
            send_to(src[0], keys[0], dst[0], keys[1])
            dst[0].synchronize()
        elif dst is not None:
            dst[0].enqueue((WRITE, keys[0][0], 0, host))
            dst[0].synchronize()
        else:
            src[0].call((READ, keys[0][0], 0, nbytes))

    times = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            move()
            times.append(time.perf_counter() - t0)
    finally:
        for (session, _, _), key in zip(ends, keys):
            session.discard((FREE, key[0]))
            session.flush()
    return nbytes / max(min(times[1:]), 1e-9)
