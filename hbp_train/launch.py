"""torchrun for hbp-train jobs, minus torchrun's own traceback when a worker fails.

    python -m hbp_train.launch [torchrun options] -m hbp_train.train [overrides]

Takes exactly torchrun's arguments (``--help`` lists them) and runs them through ``torch.distributed.run``. A worker
that meets bad input prints its one-line error and exits 2; plain torchrun then adds a ChildFailedError traceback
and a failure table, which bury that line. Here the launcher ends with one line naming the rank that failed first
and its message (the worker's one-line error, which hbp_train.train leaves in torchrun's per-rank error file) or its
exit code, and exits with the worker's code (so scripts still see 2 for bad input).
``./launch.sh train`` and the demo use it; the deepspeed launcher (HOSTFILE) is left as it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hbp_train.common.cli import ArgumentParser, float_range, int_range, nonneg_int, output_dir


def failure_line(name: str, rank: int, exitcode: int, message: str = "") -> str:
    """The one line that replaces torchrun's failure report: the worker's own message when it left one in its
    error file (hbp_train.train does for bad input), else where to look."""
    how = f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"
    if message:
        return f"[launch] {name} failed on rank {rank} ({how}): {message}"
    return (f"[launch] {name} failed: rank {rank} stopped first, with {how}; its output is above "
            "(HBP_DEBUG=1 prints the worker's traceback)")


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


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\ntorchrun's options:\n", flush=True)
    args = build_parser().parse_args(argv)
    os.environ["HBP_LAUNCHER"] = "1"  # workers leave their one-line error to us (train._fail)
    if not os.environ.get("HBP_DEBUG"):
        # torchrun logs "failed (exitcode: 2) ..." and "Sending process ... closing signal" before our one line,
        # which says the same; HBP_DEBUG=1 keeps them.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except DistNetworkError as e:  # the rendezvous port: in use (another job on this host) or not reachable
        print(port_failure_line(args, e), file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        # A message from the worker's error file; torchrun's made-up ones (no file) are not worth repeating.
        message = failure.message if isinstance(failure.message, str) and os.path.isfile(failure.error_file) else ""
        print(failure_line(e.name, rank, failure.exitcode, message), file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: torchrun passed it on to the workers, which
        # finished their step and saved (train.py says where); the launcher only has to end without a traceback
        print(f"[launch] stopped by signal {int(e.sigval)}; resume with train.resume=auto", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print("[launch] interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
