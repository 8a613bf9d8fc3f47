"""The launchers of a multi-node job watching each other: a roll call before torchrun's rendezvous, heartbeats while
the job runs, and, when a worker fails, which node or rank it began on (hbp_train/launch.py says the one line).

Everything goes through a small key store on node 0's rendezvous port (torch's TCPStore, shared with torchrun's
static rendezvous). No clocks are compared: a heartbeat is a counter each launcher adds to. Torch is imported
only inside the methods: the launcher quiets torch's C++ logs before torch loads.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from hbp_train.common.errors import UserError

HEARTBEAT = 5  # seconds between a launcher's beats (HBP_HEARTBEAT)
STORE_TIMEOUT = 30  # a key-store operation that takes longer than this means node 0 is gone or frozen
FOREIGN_PORT_WAIT = 30  # a port that accepts but does not answer as a key store this long is someone else's

# The start of a worker's one-line message when a collective failed because of a peer (groups.COLLECTIVE_FAILED;
# not imported: groups imports torch, which the launcher loads only after quieting its logs): such a rank is the
# last one to blame.
PEER_FAILURE_MARKER = "a collective failed"


@dataclass
class Node:
    """One node of a multi-node job as the roll call saw it."""

    index: int
    host: str
    first_rank: int
    nproc: int

    def __str__(self) -> str:
        last = self.first_rank + self.nproc - 1
        ranks = f"rank {last}" if self.nproc == 1 else f"ranks {self.first_rank}-{last}"
        return f"node {self.index} ({self.host}, {ranks})"


class NodeWatch:
    """The launchers of a multi-node job watching each other through a small key store on node 0's rendezvous port
    (the store torchrun's static rendezvous then shares: TCPStore's multi_tenant).

    Keys: ``hbp/node/<k>`` (host and process count, the roll call), ``hbp/joined`` (how many answered),
    ``hbp/launch`` (node 0's launch id, the same for every node: runtime/run_end.py), ``hbp/beat/<k>`` (a counter
    each launcher adds to; a counter, not a time, so no clocks are compared), ``hbp/failed/<k>`` (the failures a
    launcher saw on its node), ``hbp/done/<k>`` (it has read the others') and ``hbp/exit/<k>`` (its workers
    finished: the exit barrier)."""

    def __init__(self, addr: str, port: int, index: int, count: int, nproc: int, say: Callable[[str], None],
                 heartbeat: float = HEARTBEAT):
        self.addr, self.port, self.index, self.count, self.nproc = addr, port, index, count, nproc
        self.say, self.heartbeat = say, heartbeat
        self.store = None
        self.nodes: list = []
        self.launch_id = ""  # node 0's id of this launch (the roll call shares it)
        self._seen: dict = {}  # node -> (last counter value, time.monotonic() it changed)
        self._store_down = False  # the last read of the store failed: node 0 is gone or frozen
        self._warned: set = set()
        self._reporting = False  # a worker failed: the last line says who went quiet, no more warnings
        self._stop = threading.Event()
        self._threads: list = []  # this watch's threads: joined by stop() before the interpreter ends
        self._lock = threading.Lock()  # _seen
        self._say_lock = threading.Lock()  # a warning is said whole before the failure report starts, or not at all

    # The roll call.
    def join(self, timeout: float, report_every: float) -> None:
        """Answer the roll call and wait for every node; node 0 says who is missing every ``report_every`` s.
        UserError (one line) after ``timeout`` s, or when node 0's port is held by something else."""
        from torch.distributed import TCPStore

        deadline = time.monotonic() + timeout
        where = f"{self.addr}:{self.port}"
        if self.index == 0:  # DistNetworkError for a port in use: main's one line
            self.store = TCPStore(self.addr, self.port, None, True, timedelta(seconds=STORE_TIMEOUT),
                                  wait_for_workers=False, multi_tenant=True)
        else:
            self.store = self._connect(deadline, timeout, report_every)
        me = {"host": socket.gethostname(), "nproc": self.nproc}
        if self.index == 0:
            self.store.set("hbp/launch", secrets.token_hex(8))
        self.store.set(f"hbp/beat/{self.index}", "0")
        self.store.set(f"hbp/node/{self.index}", json.dumps(me))
        self.store.add("hbp/joined", 1)
        start = next_report = time.monotonic()
        next_report += report_every
        reported = False
        while self.store.add("hbp/joined", 0) < self.count:
            now = time.monotonic()
            if now >= deadline:
                raise UserError(f"rendezvous at {where}: {self._missing()} did not join within {timeout:g} s "
                                "(HBP_RDZV_TIMEOUT): check that they were started with the same --nnodes and "
                                "master address, and their own logs")
            if self.index == 0 and now >= next_report:
                self.say(f"[launch] rendezvous at {where}: waiting for {self._missing()} ({now - start:.0f} s; "
                         f"gives up after {timeout:g} s, HBP_RDZV_TIMEOUT)")
                next_report += report_every
                reported = True
            time.sleep(0.2)
        if reported:
            self.say(f"[launch] rendezvous at {where}: all {self.count} nodes joined after "
                     f"{time.monotonic() - start:.0f} s")
        self.launch_id = self.store.get("hbp/launch").decode()  # set by node 0 before it joined, as every node has
        first = 0
        for k in range(self.count):
            info = json.loads(self.store.get(f"hbp/node/{k}"))
            self.nodes.append(Node(k, info["host"], first, int(info["nproc"])))
            first += int(info["nproc"])
        now = time.monotonic()
        self._seen = {k: (b"0", now) for k in range(self.count)}

    def _missing(self) -> str:
        absent = [k for k in range(self.count) if not self.store.check([f"hbp/node/{k}"])]
        return f"node{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} of {self.count}"

    def _connect(self, deadline: float, timeout: float, report_every: float):
        """A key-store client of node 0's port, once it listens; says so every ``report_every`` s while it does
        not. A TCPStore client of a port where another program listens waits for ever, so it is made in a thread
        and given FOREIGN_PORT_WAIT seconds."""
        from torch.distributed import TCPStore

        where = f"{self.addr}:{self.port}"
        start = time.monotonic()
        next_report = start + report_every
        while True:
            try:
                socket.create_connection((self.addr, self.port), timeout=2).close()
                break
            except OSError as exc:
                now = time.monotonic()
                if now >= deadline:
                    raise UserError(f"rendezvous at {where}: node 0 was not reachable within {timeout:g} s "
                                    f"(HBP_RDZV_TIMEOUT; last: {exc.strerror or exc}): check that node 0 started and "
                                    "MASTER_ADDR/MASTER_PORT") from None
                if now >= next_report:
                    self.say(f"[launch] node {self.index}: waiting for node 0 at {where} ({exc.strerror or exc}; "
                             f"{now - start:.0f} s, gives up after {timeout:g} s, HBP_RDZV_TIMEOUT)")
                    next_report += report_every
                time.sleep(1.0)
        made: list = []

        def connect():
            try:
                made.append(TCPStore(self.addr, self.port, None, False, timedelta(seconds=STORE_TIMEOUT),
                                     wait_for_workers=False))
            except Exception as exc:  # noqa: BLE001 (reported below)
                made.append(exc)

        thread = threading.Thread(target=connect, daemon=True, name="hbp-store-connect")
        self._threads.append(thread)
        thread.start()
        thread.join(max(1.0, min(FOREIGN_PORT_WAIT, deadline - time.monotonic())))
        if not made or isinstance(made[0], Exception):
            why = f" ({str(made[0]).splitlines()[0]})" if made else ""
            raise UserError(f"rendezvous at {where}: something listens there but does not answer as node 0's "
                            f"rendezvous{why}: another program holds that port? Give every node another "
                            "MASTER_PORT")
        return made[0]

    # Heartbeats.
    def start(self) -> None:
        """Add to this node's counter every ``heartbeat`` s and watch the others' (a daemon thread)."""
        thread = threading.Thread(target=self._beat, daemon=True, name="hbp-heartbeat")
        self._threads.append(thread)
        thread.start()

    def stop(self, wait: float = 2.0) -> bool:
        """Stop the heartbeats and wait up to ``wait`` s for this watch's threads; True when none is left. Why wait:
        a daemon thread still inside a store call when the interpreter ends aborts the process ("terminate called
        without an active exception", exit -6) instead of its exit code; the launcher ends hard when one is left."""
        self._stop.set()
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self.store.add(f"hbp/beat/{self.index}", 1)
                self.look()
            except Exception:  # noqa: BLE001 (node 0 gone or frozen: no counter moves, node 0 is the silent one)
                self._store_down = True
            self._warn_silent()

    def look(self) -> None:
        """Read every node's counter and remember when each last moved."""
        values = self.store.multi_get([f"hbp/beat/{k}" for k in range(self.count)])
        now = time.monotonic()
        self._store_down = False
        with self._lock:
            for k, value in enumerate(values):
                if self._seen.get(k, (None,))[0] != value:
                    self._seen[k] = (value, now)

    def silent_for(self, k: int) -> float:
        """Seconds since node ``k``'s counter last moved, as this launcher saw it."""
        with self._lock:
            return time.monotonic() - self._seen.get(k, (None, time.monotonic()))[1]

    def silence_limit(self) -> float:
        """A node whose counter has not moved for this long has stopped answering (a few missed beats)."""
        return 3 * self.heartbeat + 1

    def silent_nodes(self) -> list:
        """The other nodes whose counters have not moved for ``silence_limit()`` s; only node 0 while its store
        does not answer (then no counter can be read)."""
        if self._store_down:
            return [0] if self.index != 0 and self.silent_for(0) >= self.silence_limit() else []
        return [k for k in range(self.count) if k != self.index and self.silent_for(k) >= self.silence_limit()]

    def _warn_silent(self) -> None:
        """Once per silent node, by the lowest node still answering: which node went quiet, while the others wait
        in a collective for it (until its timeout, HBP_PG_TIMEOUT)."""
        with self._say_lock:
            if self._reporting:
                return
            silent = self.silent_nodes()
            live = [k for k in range(self.count) if k not in silent]
            if not live or live[0] != self.index:
                return
            for k in silent:
                if k not in self._warned:
                    self._warned.add(k)
                    self.say(f"[launch] {self.nodes[k]} has given no sign of life for {self.silent_for(k):.0f} s "
                             "(its launcher frozen, dead or cut off?); if its workers stopped too, the others stop "
                             "when a collective times out (HBP_PG_TIMEOUT)")
            self._warned &= set(silent)

    # After this node's workers finished.
    def replace_exit_barrier(self) -> None:
        """Make torchrun's exit barrier this watch's (``exit_barrier``) in this process. torchrun's waits up to 300 s
        for every launcher inside one blocking store call, which a signal cannot interrupt: a launcher frozen on
        another node (its workers finished) held this one for minutes after its run had finished, deaf to SIGTERM."""
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

        watch = self
        SimpleElasticAgent._exit_barrier = lambda agent: watch.exit_barrier(agent._exit_barrier_timeout)

    def exit_barrier(self, timeout: float) -> None:
        """Wait until every other launcher's workers have finished too (node 0 holds the store they use), at most
        ``timeout`` s, in short steps that a signal interrupts; and not for a launcher that stopped answering
        (``silence_limit``): this node's run has ended, so it says so and goes."""
        from datetime import timedelta

        self.store.set_timeout(timedelta(seconds=max(1.0, 2 * self.heartbeat)))  # node 0 frozen: a short wait
        try:
            self.store.set(f"hbp/exit/{self.index}", "1")
        except Exception:  # noqa: BLE001 (node 0's store gone or frozen: nobody to wait for)
            return
        deadline = time.monotonic() + timeout
        others = [k for k in range(self.count) if k != self.index]
        while True:
            try:
                pending = [k for k in others if not self.store.check([f"hbp/exit/{k}"])]
            except Exception:  # noqa: BLE001 (node 0 left after its own barrier, or froze)
                return
            if not pending:
                return
            silent = [k for k in pending if self.silent_for(k) >= self.silence_limit()]
            late = time.monotonic() >= deadline
            if late or len(silent) == len(pending):
                with self._say_lock:
                    self._reporting = True  # no warning after this line
                names = ", ".join(str(self.nodes[k]) for k in pending)
                why = (f"did not finish within {timeout:g} s of this node" if late else
                       f"gave no sign of life for {max(self.silent_for(k) for k in pending):.0f} s")
                self.say(f"[launch] {names} {why}: not waiting for {'it' if len(pending) == 1 else 'them'} "
                         "(this node's workers have finished)")
                return
            time.sleep(0.25)

    # After a failure.
    def post_failures(self, failures: dict) -> None:
        """Tell the other launchers what failed here: {rank: {"exitcode", "message", "timestamp"}}."""
        with self._say_lock:
            self._reporting = True
        try:
            self.store.set(f"hbp/failed/{self.index}", json.dumps(failures))
        except Exception:  # noqa: BLE001 (node 0 gone: nobody to tell)
            pass

    def survey(self) -> tuple:
        """(every other node's posted failures {node: {rank: failure}}, [(Node, seconds silent)]) once the picture
        has settled: each other node has posted its failures or been silent for ``silence_limit()`` s (at most
        that long a wait). A node 0 that no longer answers is silent."""
        limit = self.silence_limit()
        deadline = time.monotonic() + limit
        others = [k for k in range(self.count) if k != self.index]
        notes: dict = {}
        while True:
            try:
                self.look()
                for k in others:
                    if k not in notes and self.store.check([f"hbp/failed/{k}"]):
                        notes[k] = {int(r): f for r, f in json.loads(self.store.get(f"hbp/failed/{k}")).items()}
            except Exception:  # noqa: BLE001 (node 0's store gone or frozen: node 0 is the silent one)
                return notes, ([(self.nodes[0], self.silent_for(0))] if self.index != 0 else [])
            silent = [k for k in self.silent_nodes() if k not in notes]
            if all(k in notes or k in silent for k in others) or time.monotonic() >= deadline:
                return notes, [(self.nodes[k], self.silent_for(k)) for k in silent]
            time.sleep(0.25)

    def linger(self) -> None:
        """Node 0 holds the store: keep it up until the other nodes have read it (or are silent), at most
        ``silence_limit()`` s."""
        try:
            self.store.set(f"hbp/done/{self.index}", "1")
        except Exception:  # noqa: BLE001
            return
        if self.index != 0:
            return
        deadline = time.monotonic() + self.silence_limit()
        while time.monotonic() < deadline:
            try:
                self.look()
                pending = [k for k in range(1, self.count) if not self.store.check([f"hbp/done/{k}"])
                           and self.silent_for(k) < self.silence_limit()]
            except Exception:  # noqa: BLE001
                return
            if not pending:
                return
            time.sleep(0.25)


def failure_record(failure) -> dict:
    """A torchrun ProcessFailure as plain values; its message only when the worker wrote it (torchrun makes one up
    when there is no error file, not worth repeating), and the exit code the worker recorded with it
    (hbp_train.train records it before its tear-down, during which torchrun may stop it with SIGTERM: the code it
    chose is the run's, not the signal's)."""
    written = isinstance(failure.message, str) and os.path.isfile(failure.error_file)
    data = failure.error_file_data if written and isinstance(failure.error_file_data, dict) else {}
    recorded = data.get("exitcode")
    chosen = isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0
    code = recorded if chosen else failure.exitcode
    return {"exitcode": int(code), "message": failure.message if written else "", "timestamp": int(failure.timestamp)}


def blame(local: dict, notes: dict, silent: list) -> tuple:
    """Which failure to report: (kind, detail). ``local``: this node's {rank: failure record}; ``notes``: the other
    nodes' {node: {rank: record}}; ``silent``: [(Node, seconds)] of nodes that stopped answering.

    In order: a rank's own message that is not about a peer (bad input, a diverged run): what the user must fix;
    then a node that stopped answering (killed, frozen, cut off: its ranks could not say anything); then a rank
    killed by a signal (the OOM killer); then a rank that exited with a code and a traceback; last a rank whose
    collective failed because of a peer. Ties go to the earliest timestamp, then the lowest rank. Returns
    ("silent", [(Node, seconds)]) or ("rank", (rank, record, node or None))."""
    candidates = [(rank, rec, None) for rank, rec in local.items()]
    candidates += [(rank, rec, node) for node, recs in notes.items() for rank, rec in recs.items()]

    def order(item) -> tuple:
        rank, rec, _ = item
        message, code = rec.get("message", ""), rec["exitcode"]
        peer = PEER_FAILURE_MARKER in message
        kind = 0 if message and not peer else 2 if code < 0 else 3 if not peer else 4
        return kind, rec["timestamp"], rank

    ranked = sorted(candidates, key=order)
    if ranked and order(ranked[0])[0] == 0:
        return "rank", ranked[0]
    if silent:
        return "silent", sorted(silent, key=lambda s: s[0].index)
    if ranked:
        return "rank", ranked[0]
    return "rank", None
