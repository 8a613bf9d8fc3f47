"""torchrun for hbp-train jobs: a failure ends in one line naming the rank or node that caused it, nodes never wait
in silence, and a preemption save is never cut short.

    python -m hbp_train.launch [torchrun options] -m hbp_train.train [overrides]

Takes exactly torchrun's arguments (``--help`` lists them) and runs them through ``torch.distributed.run``, adding:

- **One line per failure.** A worker that meets bad input prints its one-line error and exits 2; plain torchrun then
  adds a ChildFailedError traceback and a failure table, which bury that line. Here the launcher ends with one line
  naming the rank that caused the failure and its message (the worker's one-line error, which hbp_train.train
  leaves in torchrun's per-rank error file) or its exit code, and exits with that code (2 for bad input). Unless
  the failure was bad input, the line ends by saying whether a checkpoint exists to resume from (the run folder's
  ``checkpoints/latest`` and that checkpoint's ``manifest.json``, read when the script is ``hbp_train.train``).
- **A save that is never cut short.** torchrun passes a SIGTERM on to the workers (which finish their step and
  save) and SIGKILLs them ``--shutdown-timeout`` seconds later, 30 by default: less than a step and a ZeRO save of
  a large model. The default here is HBP_SHUTDOWN_TIMEOUT (300 s); the SLURM script's ``--signal=TERM@N`` gives
  the same N (docs/reliability.md, "Preemption").
- **Several nodes** (``--nnodes N --node_rank K --master_addr A --master_port P``, torchrun's static rendezvous, as
  ``./launch.sh train`` and scripts/slurm_train.sbatch use it): before torchrun's own rendezvous the nodes answer a
  roll call on node 0's port (the same key store torchrun then uses). Node 0 says every HBP_RDZV_REPORT seconds
  (30) which nodes are still missing, and every node gives up after HBP_RDZV_TIMEOUT seconds (600) with one line;
  a node pointed at a port where something else answers says so. During the run each launcher adds to a heartbeat
  counter every HBP_HEARTBEAT seconds (5): a node that falls silent is reported once while the others wait, and
  when a worker fails the launchers tell a node that stopped answering (killed, frozen, cut off) from a rank that
  failed by itself, so the line names the node or rank where it began, not the first local rank that noticed.
  (Collective timeouts are hbp_train/distributed/groups.py's: HBP_PG_TIMEOUT.)
- **Signals.** torchrun's "Received 15 death signal" log becomes one line saying what happens next, and the last
  line says whether the workers saved a checkpoint (a SIGHUP, say, stops them without one) or whether the shutdown
  timeout cut their save short. SIGTERM, SIGINT and SIGHUP are heard at every stage: during the roll call, the
  training, the failure report and the exit barrier.
- **Every ending said once.** For ``-m hbp_train.train`` the last line is the run's ending, finished (rank 0's own
  line, which the worker leaves to the launcher), preempted with its checkpoint, or failed naming the rank or node,
  and the same state and line are written into the run's status.json (runtime/run_end.py), so a scheduler and an
  operator are told the same. torchrun's exit barrier (after this node's workers finished, up to 300 s for every
  other launcher, in one blocking call deaf to signals) is replaced by one that a signal ends and that does not wait
  for a launcher that stopped answering (distributed/node_watch.py).

``./launch.sh train``, the demo and the profiler use it; the deepspeed launcher (HOSTFILE) is left as it is.
HBP_DEBUG=1 keeps torchrun's own log lines and tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from hbp_train.common.cli import ArgumentParser, float_range, int_range, nonneg_int, output_dir
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.distributed.node_watch import HEARTBEAT, NodeWatch, blame, failure_record
from hbp_train.runtime import run_end
from hbp_train.runtime.run_end import checkpoint_state  # noqa: F401  (the launcher's hint, tests read it here)

# Defaults of the HBP_* environment variables above (seconds).
SHUTDOWN_TIMEOUT = 300
RDZV_TIMEOUT = 600
RDZV_REPORT = 30


def failure_line(name: str, rank: int, exitcode: int, message: str = "", where: str = "") -> str:
    """The one line that replaces torchrun's failure report: the worker's own message when it left one in its
    error file (hbp_train.train does for bad input), else where to look. ``where``: the rank's node, when another
    node's launcher reported it."""
    how = f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"
    at = f"rank {rank}{f' ({where})' if where else ''}"
    if message:
        return f"[launch] {name} failed on {at} ({how}): {message}"
    output = f"its output is in {where}'s log" if where else "its output is above"
    return (f"[launch] {name} failed: {at} stopped first, with {how}; {output} (HBP_DEBUG=1 prints the worker's "
            "traceback)")


def port_failure_line(args, exc: BaseException) -> str:
    """One line for a rendezvous that could not listen on or reach its port (torchrun's is a 40-line traceback)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"{args.master_addr}:{args.master_port}"
    if "EADDRINUSE" in text or "address already in use" in text:
        return (f"[launch] port {where} is in use (another job on this host?): on one node leave MASTER_PORT unset "
                "and a free port is chosen, or set another MASTER_PORT")
    return f"[launch] rendezvous at {where} failed ({text}); check MASTER_ADDR/MASTER_PORT and that node 0 is up"


def nproc_per_node(text: str) -> str:
    """--nproc-per-node's ``type=``: a count >= 1, or one of torchrun's device words (it counts them itself)."""
    if text in ("auto", "cpu", "gpu", "xpu") or text.isdigit() and int(text) >= 1:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a process count (give a whole number >= 1, or auto, cpu, "
                                     "gpu)")


def nnodes(text: str) -> str:
    """--nnodes' ``type=``: N or MIN:MAX nodes, 1 <= MIN <= MAX."""
    parts = text.split(":")
    if len(parts) in (1, 2) and all(p.isdigit() for p in parts) and 1 <= int(parts[0]) <= int(parts[-1]):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a node count (give N >= 1, or MIN:MAX with 1 <= MIN <= MAX)")


nproc_per_node.bad_values = ("two", "0")  # for tests/test_cli_walk.py: a wrong type and one out of range
nnodes.bad_values = ("two", "0")

# torchrun's flags that take a number or a path, checked here before torchrun starts anything (its own parser
# takes any int, and a 0 or a negative value fails later, deep inside the elastic agent, with a traceback).
TORCHRUN_TYPES = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "max_restarts": nonneg_int,
                  "monitor_interval": float_range(0.0, low_open=True), "node_rank": nonneg_int,
                  "master_port": int_range(1, 65535), "shutdown_timeout": nonneg_int, "log_dir": output_dir}


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (its flags, defaults and PET_* environment variables) with one-line errors and the
    range checks above."""
    from torch.distributed.run import get_args_parser

    parser = ArgumentParser(prog="python -m hbp_train.launch", parents=[get_args_parser()], add_help=False)
    for action in parser._actions:
        action.type = TORCHRUN_TYPES.get(action.dest, action.type)
    return parser


def env_seconds(name: str, default: float, environ=os.environ, low: float = 0.0) -> float:
    """A number of seconds from the environment variable ``name`` (``default`` when unset); UserError naming it for
    anything but a number >= ``low``."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or value < low or value != value:
        raise UserError(f"{name}={text}: not a number of seconds >= {low:g}; unset it for the default ({default:g})")
    return value


def shutdown_timeout(flag: Optional[int], environ=os.environ) -> int:
    """Seconds torchrun waits for the workers after passing a signal on, before SIGKILL: the --shutdown-timeout
    flag, else HBP_SHUTDOWN_TIMEOUT, else torchrun's own TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else SHUTDOWN_TIMEOUT
    (torchrun's 30 s would cut a large model's save short)."""
    if flag is not None:
        return flag
    if environ.get("HBP_SHUTDOWN_TIMEOUT", "").strip():
        return int(env_seconds("HBP_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT, environ))
    if environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip():
        return int(env_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT, environ))
    return SHUTDOWN_TIMEOUT


# --- Where a run stands: its checkpoint -------------------------------------------------------------------------


def run_dir(args) -> Optional[str]:
    """The run folder (train.out_dir) of an ``-m hbp_train.train`` job, from its overrides as the workers compose
    them; None for another script or when the config does not compose (the workers have said why)."""
    if not (args.module and args.training_script == "hbp_train.train"):
        return None
    try:
        from hbp_train.config import load, user_overrides

        return load(user_overrides(list(args.training_script_args))).train.out_dir
    except Exception:  # noqa: BLE001 (a hint, never a second failure)
        return None


# --- Signals ----------------------------------------------------------------------------------------------------


class _SignalNote(logging.Filter):
    """Replaces torchrun's "Received 15 death signal, shutting down workers" (a WARNING that reads like a crash)
    with one line of ours saying what happens next."""

    def __init__(self, timeout: int, say: Callable[[str], None], quiet: bool = True):
        super().__init__()
        self.timeout, self.say, self.quiet = timeout, say, quiet
        self.at: Optional[float] = None
        """When torchrun passed the signal on (time.time()): a save finished after it was the signal's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Received %s death signal"):
            return True
        self.at = self.at or time.time()
        if not self.quiet:
            return True
        try:
            name = signal.Signals(int(record.args[0])).name
        except (ValueError, TypeError, IndexError):
            name = str(record.args[0]) if record.args else "a signal"
        if name in ("SIGTERM", "SIGINT"):
            self.say(f"[launch] {name}: passed on to the workers, which finish their step and save a checkpoint "
                     f"(killed if not done within {self.timeout} s: HBP_SHUTDOWN_TIMEOUT)")
        else:
            self.say(f"[launch] {name}: the workers are stopped without saving (SIGTERM or Ctrl-C saves)")
        return False


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _quiet_torch_logs() -> None:
    """Before torch is imported in this process: its C++ log lines (TCPStore connection retries, each with a stack
    of frames) are what the launcher's own lines replace. The workers, started later, keep the user's setting."""
    if os.environ.get("HBP_DEBUG") or "torch" in sys.modules:
        return
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    import torch  # noqa: F401  (reads TORCH_CPP_LOG_LEVEL once, when its library loads)

    if previous is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = previous


def _node_watch(args, say) -> Optional[NodeWatch]:
    """A NodeWatch for a multi-node static rendezvous (torchrun's --nnodes N>1 with --master_addr/--master_port);
    None for one node or another rendezvous backend."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.standalone or args.rdzv_backend != "static" or max_nodes < 2 or args.rdzv_endpoint:
        return None
    return NodeWatch(args.master_addr, args.master_port or 29500, args.node_rank, max_nodes,
                     determine_local_world_size(args.nproc_per_node), say,
                     heartbeat=env_seconds("HBP_HEARTBEAT", HEARTBEAT, low=0.1))


def _raise_signal(signum, frame):
    """Until torchrun installs its own handler (the roll call), and after the workers stopped (the failure report):
    a SIGTERM, SIGINT or SIGHUP ends the launcher with its line, as torchrun's own handler does."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _launch_id(watch: Optional[NodeWatch]) -> str:
    """The id of this launch, the same on every node (node 0's, shared by the roll call): the workers write it into
    status.json, so that the launcher rewrites the ending of its own run only."""
    return watch.launch_id if watch is not None else secrets.token_hex(8)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _quiet_torch_logs()
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\ntorchrun's options:\n", flush=True)
    args = build_parser().parse_args(argv)
    try:
        args.shutdown_timeout = shutdown_timeout(args.shutdown_timeout)
        rdzv_timeout = env_seconds("HBP_RDZV_TIMEOUT", RDZV_TIMEOUT, low=1)
        rdzv_report = env_seconds("HBP_RDZV_REPORT", RDZV_REPORT, low=1)
        from hbp_train.distributed.groups import collective_timeout

        collective_timeout()  # the workers' HBP_PG_TIMEOUT: a bad value is one line here, before they start
    except UserError as e:
        print(f"python -m hbp_train.launch: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_signal)
    started = time.time()
    os.environ["HBP_LAUNCHER"] = "1"  # workers leave their one-line error and their last line to us (train.py)
    quiet = not os.environ.get("HBP_DEBUG")
    if quiet:
        # torchrun logs "failed (exitcode: 2) ..." and "Sending process ... closing signal" before our one line,
        # which says the same; HBP_DEBUG=1 keeps them.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    note = _SignalNote(args.shutdown_timeout, _say, quiet)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(note)
    watch = None
    launch_id = None
    # Where rank 0 says which run folder it writes (runtime/status.py): the run's status.json, read at the end.
    os.environ["HBP_LAUNCH_RECORD"] = record_file = os.path.join(tempfile.gettempdir(),
                                                                 f"hbp-launch-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        watch = _node_watch(args, _say)
        if watch is not None:
            watch.join(rdzv_timeout, rdzv_report)
            watch.start()
            watch.replace_exit_barrier()  # a frozen peer launcher no longer holds this one after its run ended
            if "timeout=" not in (args.rdzv_conf or ""):  # torchrun's own wait after the roll call: the same limit
                args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"timeout={int(rdzv_timeout)}"]))
        launch_id = os.environ["HBP_LAUNCH_ID"] = _launch_id(watch)
        run(args)
        outcome = None
    except DistNetworkError as e:  # the rendezvous port: in use (another job on this host) or not reachable
        _say(port_failure_line(args, e))
        return 1
    except UserError as e:  # the roll call: a node missing, node 0 unreachable, a foreign program on the port
        _say(f"[launch] {e}")
        return 1
    except DistStoreError as e:  # torchrun's rendezvous, after the roll call: a node vanished in between
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        _say(f"[launch] rendezvous at {args.master_addr}:{args.master_port} failed after every node had answered "
             f"({first}); a node stopped in between: see its log")
        return 1
    except (ChildFailedError, SignalException) as e:
        outcome = e
    except KeyboardInterrupt:
        _say("[launch] interrupted")
        return 130
    try:  # the workers have stopped: one record of how the run ended, its line last and in status.json
        out_dir = _run_dir(args, record_file)
        if isinstance(outcome, ChildFailedError):
            ending, code = _failure(outcome, out_dir, watch, started)
        elif isinstance(outcome, SignalException):  # Ctrl-C or a scheduler's SIGTERM: torchrun passed it on to the
            # workers, which finish their step and save; any other signal stopped them. The line says which.
            ending = run_end.stopped(signal.Signals(int(outcome.sigval)).name, out_dir, launch_id, started, note.at,
                                     args.shutdown_timeout, time.time() - (note.at or time.time()))
            code = 0 if ending.state == "finished" else 128 + int(outcome.sigval)
        else:
            ending, code = run_end.finished(_job_name(args), out_dir, launch_id), 0
        if ending is not None:
            run_end.record(out_dir, launch_id, ending)
            _say(f"[launch] {ending.line}")
        return code
    except SignalException as e:  # a second signal while the end is told: it ends the launcher at once
        _say(f"[launch] stopped by {signal.Signals(int(e.sigval)).name} while reporting the end of the run")
        return 128 + int(e.sigval)
    finally:
        if watch is not None:
            watch.stop()
        _remove(record_file)


def _run_dir(args, record_file: str) -> Optional[str]:
    """The run folder: as rank 0 reported it into ``record_file`` (when it runs on this node), else read from the
    overrides (``run_dir``: composes the config, seconds)."""
    try:
        with open(record_file) as f:
            return f.read().strip() or None
    except OSError:
        return run_dir(args)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _job_name(args) -> str:
    """torchrun's name of the job: the module or the script."""
    return args.training_script if args.module else os.path.basename(args.training_script)


def _failure(e, out_dir: Optional[str], watch: Optional[NodeWatch], started: float) -> tuple:
    """(the Ending of a ChildFailedError, the exit code): the one line naming the culprit (see ``blame``) and the
    exit code, the culprit rank's, 1 for a signal or a silent node. A signal while the other nodes are asked stops
    the asking: the line then says what is known."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    local = {rank: failure_record(f) for rank, f in e.failures.items()}
    notes, silent = {}, []
    if watch is not None:
        try:
            watch.post_failures(local)
            notes, silent = watch.survey()
            watch.linger()
        except SignalException:
            pass
    kind, detail = blame(local, notes, silent)
    if kind == "silent":
        who = "; ".join(f"{node} stopped answering {seconds:.0f} s ago" for node, seconds in detail)
        line = f"{e.name} stopped: {who} (killed, frozen or cut off from the network)"
        code = 1
    else:
        rank, rec, node = detail if detail else (e.get_first_failure()[0], failure_record(e.get_first_failure()[1]),
                                                 None)
        where = str(watch.nodes[node]).split(" (")[0] if watch is not None and node is not None else ""
        line = failure_line(e.name, rank, rec["exitcode"], rec["message"], where)[len("[launch] "):]
        code = rec["exitcode"] if rec["exitcode"] > 0 else 1
    if code != EXIT_USER_ERROR:  # bad input: fix it and start again; anything else: where the run stands
        state = run_end.checkpoint_state(out_dir, started)
        if state:
            line += f"; {state}"
    return run_end.failed(line, out_dir), code


def _exit(code: int) -> None:
    """End the launcher with ``code``. While a daemon thread is alive (a key-store call that has not returned: node 0
    frozen), the interpreter's end would abort the process from inside that call (exit -6, "terminate called without
    an active exception") and lose the code; then the launcher ends without the interpreter's clean-up, its output
    flushed first. Everything the run needs was done in main()."""
    if any(t.daemon and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
