"""`python -m hbp_train.profiler`: the auto group selection profiler CLI (hbp_train.profiler.cli)."""
import sys

from hbp_train.profiler.cli import main

sys.exit(main())
