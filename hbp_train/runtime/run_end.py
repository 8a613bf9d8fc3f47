"""How a run ended, said once: the launcher's last line and RUN_DIR/status.json come from one record.

While the run goes on the workers keep status.json (runtime/status.py): rank 0 after every step and save, and for
a finished or stopped run its last line (``finished: steps 0..12 of 12, ...``); a failing rank its own error line.
Once every worker of its node has stopped, the launcher (hbp_train.launch) knows what none of them could: that a
node went silent, that a signal stopped them, that its shutdown timeout cut their save short. It makes one
``Ending`` of what it saw and what status.json says, prints its line last and writes the same state, line and
checkpoint into status.json (``record``), so that a scheduler reading the file and an operator reading the log are
told the same thing. The endings:

- **finished** (every worker exited 0, status.json says so): rank 0's line;
- **preempted** (a signal, or train.exit_after_steps): with the checkpoint saved after the signal, or, when the
  save did not finish (the workers were killed at the shutdown timeout, or a SIGHUP stopped them without one), the
  earlier complete checkpoint to resume from, or none;
- **failed**: the one line naming the rank or the node where it began (node_watch.blame) and what there is to
  resume from.

A launcher whose script is not hbp_train.train, or that cannot tell the run folder, has no status.json to write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from hbp_train.runtime import status as run_status

MANIFEST = "manifest.json"
"""runtime/manifest.py's file, which makes a checkpoint complete (not imported: it loads torch, and the launcher
quiets torch's logs before torch loads)."""


@dataclass
class Ending:
    """How a run ended: ``state`` (status.STATES), its one line (printed after "[launch] ") and the complete
    checkpoint it leaves to resume from (a tag folder), or None."""

    state: str
    line: str
    checkpoint: Optional[str] = None


def latest_checkpoint(out_dir: Optional[str]) -> tuple:
    """(the tag folder ``checkpoints/latest`` names, when its save finished (it has a manifest.json), the time its
    manifest was written) or (None, None)."""
    if not out_dir:
        return None, None
    root = os.path.join(out_dir, "checkpoints")
    try:
        with open(os.path.join(root, "latest")) as f:
            tag = f.read().strip()
        saved_at = os.path.getmtime(os.path.join(root, tag, MANIFEST)) if tag else None
    except (OSError, UnicodeDecodeError):
        return None, None
    return (os.path.join(root, tag), saved_at) if saved_at is not None else (None, None)


def checkpoint_state(out_dir: Optional[str], since: float) -> str:
    """What a failed or stopped run leaves to resume from, as the end of the launcher's line: the checkpoint
    ``latest`` names if its save finished, saved by this launch (after ``since``, a time.time()) or before it."""
    if not out_dir:
        return ""
    where, saved_at = latest_checkpoint(out_dir)
    if where is None:
        return f"no checkpoint in {os.path.join(out_dir, 'checkpoints')}, so a rerun starts from the beginning"
    if saved_at >= since:
        return f"checkpoint {where} was saved: resume with train.resume=auto"
    return f"no checkpoint was saved by this run; resume with train.resume=auto from the earlier {where}"


def _ours(out_dir: Optional[str], launch_id: Optional[str]) -> Optional[dict]:
    """status.json of the run this launcher started, or None."""
    record = run_status.read(out_dir) if out_dir else None
    return record if record and launch_id and record.get("launch_id") == launch_id else None


def finished(name: str, out_dir: Optional[str], launch_id: Optional[str]) -> Optional[Ending]:
    """Every worker exited 0: rank 0's last line from status.json; a plain line when there is no status of this
    run to read; None for a script other than hbp_train.train (``out_dir`` None), which says its own."""
    if out_dir is None:
        return None
    record = _ours(out_dir, launch_id)
    if record and record.get("state") in ("finished", "preempted") and record.get("message"):
        return Ending(record["state"], record["message"], record.get("last_checkpoint"))
    return Ending("finished", f"{name} finished (status.json of this run could not be read in {out_dir})")


def stopped(signal_name: str, out_dir: Optional[str], launch_id: Optional[str], since: float,
            signalled_at: Optional[float], shutdown_timeout: float, waited: float) -> Ending:
    """The workers were stopped by ``signal_name`` (received at ``signalled_at``, a time.time(), when known),
    ``waited`` seconds after it; SIGTERM and SIGINT let them save. A run that finished before the signal took hold
    is finished; one whose save came after the signal is preempted with it; otherwise the save did not happen (a
    signal that stops without saving) or did not finish (killed at ``shutdown_timeout``): preempted, with the
    earlier checkpoint, if any."""
    record = _ours(out_dir, launch_id)
    if record and record.get("state") == "finished" and record.get("message"):
        return Ending("finished", record["message"], record.get("last_checkpoint"))
    where, saved_at = latest_checkpoint(out_dir)
    line = f"stopped by {signal_name}"
    if out_dir is None:
        return Ending("preempted", line)
    saving = signal_name in ("SIGTERM", "SIGINT")
    if saving and where is not None and saved_at >= max(since, signalled_at or since):
        return Ending("preempted", f"{line}; checkpoint {where} was saved: resume with train.resume=auto", where)
    if saving and waited >= shutdown_timeout - 1:
        line += (f"; the workers were killed {shutdown_timeout:g} s after it, before their checkpoint was saved "
                 "(HBP_SHUTDOWN_TIMEOUT: give a save more time)")
    return Ending("preempted", f"{line}; {checkpoint_state(out_dir, since)}", where)


def failed(line: str, out_dir: Optional[str]) -> Ending:
    """A worker failed; ``line``: the launcher's one line (without "[launch] ")."""
    return Ending("failed", line, latest_checkpoint(out_dir)[0])


def record(out_dir: Optional[str], launch_id: Optional[str], ending: Ending) -> bool:
    """Write ``ending`` into status.json, if that file belongs to the run this launcher started."""
    if not out_dir:
        return False
    return run_status.conclude(out_dir, launch_id, ending.state, ending.line, ending.checkpoint)
