"""parent_watch: a worker whose launcher is killed with SIGKILL gets SIGTERM (and so saves and exits), even in its
own session as torchrun starts it. (The whole path, launcher killed -> checkpoint -> exact resume, is in
tests/test_chaos.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hbp_train.runtime import parent_watch

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import signal, sys, time
from hbp_train.runtime.parent_watch import watch_parent
def on_term(signum, frame):
    open(sys.argv[1], "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
watch_parent(0.1)
open(sys.argv[1] + ".ready", "w").write("")
time.sleep(60)
"""

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(60)
"""


def test_the_launchers_death_reaches_the_worker_as_sigterm(tmp_path):
    marker = tmp_path / "child"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker)], env=env)
    deadline = time.time() + 60
    while not Path(f"{marker}.ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert Path(f"{marker}.ready").exists() and not marker.exists()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 20
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "SIGTERM"


def test_the_watch_can_be_stopped_and_is_on_only_under_a_launcher(monkeypatch):
    stop = parent_watch.watch_parent(0.01)
    stop.set()
    for name in ("TORCHELASTIC_RUN_ID", "HBP_LAUNCHER", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not parent_watch.under_launcher()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert parent_watch.under_launcher()
