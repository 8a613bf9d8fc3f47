"""Hydra entry point for training: ``python -m hbp_train.train [experiment=NAME] [group=option] [key=value ...]``.

Launch with torchrun (``./launch.sh train ...``), the deepspeed launcher (its ``--local_rank`` is stripped) or as a
single process. The config is checked before anything is built: a bad value prints one line naming the field and
exits with code 2. Then: init distributed, save the resolved config, ``trainer.train()``, tear down. SIGTERM/SIGINT
finish the current step, save a checkpoint and exit 0. ``--help`` lists the config groups and every field with its
default and meaning (``--cfg job`` prints the composed config, ``--hydra-help`` Hydra's own help).
"""

from __future__ import annotations

import os
import random
import signal
import sys


def _strip_local_rank(argv: list) -> list:
    """Drop the deepspeed launcher's --local_rank[=N] (Hydra rejects it); keep its value in LOCAL_RANK."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            if "=" in arg:
                os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            elif i + 1 < len(argv):
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
                skip = True
            continue
        out.append(arg)
    return out


def _record_failure(message: str, code: int) -> None:
    """Leave this rank's one-line error and its exit code in torchrun's error file (if any), where hbp_train.launch
    reads them: the code too, since the launcher may stop this rank with SIGTERM before it exits by itself."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json
        import time

        with open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time()), "exitcode": int(code)}, f)


def _user_error_line(exc: BaseException) -> str:
    return f"error: {str(exc).splitlines()[0]} (HBP_DEBUG=1 shows the traceback)"


def _fail(message: str, code: int):
    """Exit with a one-line message. Under torchrun every rank also writes it to its error file, from which
    hbp_train.launch prints the first failed rank's line (so a failure on any rank is shown once); without our
    launcher, rank 0 prints it."""
    _record_failure(message, code)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get("RANK", "0") == "0" and not (error_file and os.environ.get("HBP_LAUNCHER")):
        print(message, file=sys.stderr, flush=True)
    sys.exit(code)


CUDA_ALLOC_CONF = "expandable_segments:True"


def set_cuda_allocator(environ=os.environ) -> str:
    """Training with packs of varying shapes fragments CUDA's caching allocator (a 128K pack after many 16K ones
    finds no block large enough although enough memory is free); expandable segments grow one mapping instead.
    Set before the first CUDA allocation; a PYTORCH_CUDA_ALLOC_CONF the user set is left as it is. Returns the
    setting in effect."""
    return environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run(cfg, config_yaml: str) -> dict:
    """Everything after the config: distributed set-up, the training, the tear-down."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hbp_train import trainer

    from hbp_train.runtime import parent_watch, preflight
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.runtime.run_lock import lock_run_dir
    from hbp_train.runtime.status import RunStatus, ended_by

    set_cuda_allocator()  # before init_distributed: NCCL's set-up is the first CUDA allocation
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    init_distributed()
    lock = status = None
    # A SIGTERM outside the loop (set-up, tear-down; the loop installs its own finish-save-exit handler, e.g. when
    # the launcher dies just as the run ends) still runs the finally below, so the folder's lock is released.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # A launcher killed with SIGKILL cannot pass anything on: each worker notices by itself (parent_watch.py).
    watch = parent_watch.watch_parent() if parent_watch.under_launcher() else None
    try:
        # Every rank sees the folder rank 0 writes and can write there, before anything is built (preflight.py).
        run_id = preflight.check_shared_run_dir(cfg.train.out_dir)
        status = RunStatus(cfg.train.out_dir, dist.get_rank(), run_id)  # written once the run owns the folder
        # One live run per folder, decided before anything is built or written there (run_lock.py).
        lock = lock_run_dir(cfg.train.out_dir, warn=lambda line: print(line, file=sys.stderr, flush=True))
        if dist.get_rank() == 0:
            with open(os.path.join(cfg.train.out_dir, "config.yaml"), "w") as f:
                f.write(config_yaml)
        summary = trainer.train(cfg, config_yaml, status)
    except BaseException as exc:
        from hbp_train.common.errors import EXIT_USER_ERROR, UserError

        if isinstance(exc, UserError) and not os.environ.get("HBP_DEBUG"):
            # Recorded before the tear-down below: destroying the process group ends a peer's pending collective,
            # that peer can exit first, and torchrun then stops this rank with SIGTERM mid-tear-down. Unrecorded,
            # the launcher would report that signal (exit 1) instead of this line (exit 2).
            _record_failure(_user_error_line(exc), EXIT_USER_ERROR)
        if status is not None:
            status.end(*ended_by(exc, dist.get_rank()))
        raise
    finally:
        if watch is not None:
            watch.set()
        if lock is not None:
            lock.release()
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary


def _task(dict_cfg) -> None:
    from hbp_train.config import ConfigError, resolved_yaml, to_dataclass
    from hbp_train.common.errors import EXIT_USER_ERROR, UserError

    try:
        cfg = to_dataclass(dict_cfg)
    except ConfigError as e:
        _fail(f"config error: {e}", EXIT_USER_ERROR)
    try:
        summary = run(cfg, resolved_yaml(cfg))
    except UserError as e:  # user input found while building (plan/world-size mismatch, bad shards, ...)
        if os.environ.get("HBP_DEBUG"):
            raise
        _fail(_user_error_line(e), EXIT_USER_ERROR)
    except FloatingPointError as e:  # train.on_nan=abort
        _fail(f"error: {e}", 1)
    except KeyboardInterrupt:  # a second Ctrl-C: the user does not want to wait for the step and the save
        _fail(f"interrupted: stopped without saving; train.resume=auto continues from the last checkpoint in "
              f"{cfg.train.out_dir}/checkpoints", 130)
    except RuntimeError as e:  # a peer died or froze inside a collective: not this rank's bug, the launcher names it
        from hbp_train.distributed import groups

        if not groups.is_collective_failure(e) or os.environ.get("HBP_DEBUG"):
            raise
        _fail(groups.collective_failure_line(e), 1)
    # The run's last line; under hbp_train.launch the launcher says it, from status.json (runtime/run_end.py).
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("HBP_LAUNCHER"):
        print(f"[train] {summary['message']}", flush=True)


def main() -> None:
    import hydra

    from hbp_train.common.errors import EXIT_USER_ERROR
    from hbp_train.common.library_bars import library_bars_on_a_terminal_only
    from hbp_train.config import CONF_DIR, ConfigError, check_command_line, check_paths, load, user_overrides

    library_bars_on_a_terminal_only()
    argv = _strip_local_rank(sys.argv[1:])
    sys.argv = [sys.argv[0]] + argv
    if any(a in ("-h", "--help") for a in argv):
        from hbp_train.config import help_text

        print(help_text())
        sys.exit(0)
    try:
        check_command_line(argv)
        if not any(a.startswith("-") for a in argv):  # --cfg, --info ... are Hydra's business
            check_paths(load(user_overrides(argv)))  # fail fast, one line, before any rank builds anything
    except ConfigError as e:
        _fail(f"config error: {e}", EXIT_USER_ERROR)
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_task)()


if __name__ == "__main__":
    main()
