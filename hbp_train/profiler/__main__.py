"""`python -m hbp_train.profiler`: the auto group selection profiler CLI."""
import sys

from hbp_train.profiler.search import main

sys.exit(main())
