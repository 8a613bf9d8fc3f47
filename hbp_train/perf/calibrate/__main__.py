"""python -m hbp_train.perf.calibrate: see the package docstring."""

import sys

from hbp_train.perf.calibrate.cli import main

sys.exit(main())
