"""run_lock: one live run per train.out_dir; stale locks (dead pid on this host, reused pid, silent other host)
are taken over with a warning; a live holder is refused in one line naming it. (The CLI refusal of a second run
into a live folder is in tests/test_chaos.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hbp_train.runtime import run_lock
from hbp_train.common.errors import UserError


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write(path, **record):
    path.write_text(json.dumps({"host": socket.gethostname(), "started_at": "then", "token": "x", **record}))


def test_a_live_holder_is_refused_in_one_line_and_release_frees_the_folder(tmp_path):
    first = run_lock.RunLock(str(tmp_path / "run"))
    assert first.acquire() is None
    record = json.loads((tmp_path / "run" / "run.lock").read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["process_start"] == run_lock.process_start(os.getpid())
    with pytest.raises(UserError) as info:
        run_lock.RunLock(str(tmp_path / "run")).acquire()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"train.out_dir={tmp_path / 'run'} is in use by another run "
                                                      f"(host {socket.gethostname()}, pid {os.getpid()}, started ")
    first.release()
    assert not (tmp_path / "run" / "run.lock").exists()
    second = run_lock.RunLock(str(tmp_path / "run"))
    assert second.acquire() is None
    first.release()  # not the holder any more: leaves the other run's lock alone
    assert (tmp_path / "run" / "run.lock").exists()
    second.release()


@pytest.mark.parametrize("case", ["dead_pid", "reused_pid", "silent_other_host", "empty_old"])
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, case):
    lock_file = tmp_path / "run.lock"
    if case == "dead_pid":
        _write(lock_file, pid=_dead_pid(), process_start=None)
        why = "that process is gone"
    elif case == "reused_pid":  # our pid, but the holder was a process that started at another time
        _write(lock_file, pid=os.getpid(), process_start="1")
        why = "that process is gone"
    elif case == "silent_other_host":
        _write(lock_file, pid=1, process_start=None, host="elsewhere")
        old = time.time() - run_lock.STALE_AFTER_S - 5
        os.utime(lock_file, (old, old))
        why = "no heartbeat for"
    else:  # killed between creating the file and writing its record
        lock_file.write_text("")
        old = time.time() - 60
        os.utime(lock_file, (old, old))
        why = "its record is empty or unreadable"
    lock = run_lock.RunLock(str(tmp_path))
    warning = lock.acquire()
    assert warning.startswith(f"[train] warning: took over the stale lock {lock_file}") and why in warning
    assert json.loads(lock_file.read_text())["token"] == lock.token
    lock.release()


def test_a_fresh_lock_of_another_host_or_one_being_written_is_respected(tmp_path):
    lock_file = tmp_path / "run.lock"
    _write(lock_file, pid=1, process_start=None, host="elsewhere")
    with pytest.raises(UserError, match="in use by another run \\(host elsewhere, pid 1"):
        run_lock.RunLock(str(tmp_path)).acquire()
    lock_file.write_text("")  # just created by a run that is writing its record
    with pytest.raises(UserError, match="in use by another run \\(holder unknown\\)"):
        run_lock.RunLock(str(tmp_path)).acquire()


def test_the_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = run_lock.RunLock(str(tmp_path))
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / "run.lock", (old, old))
    time.sleep(0.5)
    assert time.time() - os.path.getmtime(tmp_path / "run.lock") < 10
    lock.release()


def test_out_dir_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"^train.out_dir=.*afile: is a file, not a folder; choose another"):
        run_lock.lock_run_dir(str(tmp_path / "afile"))
