"""Other libraries' progress bars (transformers' "Loading weights", datasets' "Saving the dataset") off a log file.

Our own bars are drawn only on a terminal (``tqdm(disable=None)`` or an ``isatty`` test); in a log file a bar is a
run of ``\\r``-joined frames, noise beside our lines. transformers and datasets draw theirs unless told not to, so
the entry points turn them off when stderr is not a terminal, and the steps that save datasets (pack, preprocess,
an elastic resume's re-pack) turn datasets' off for the save when their own bar is off.
"""

from __future__ import annotations

import contextlib
import sys


def library_bars_on_a_terminal_only() -> None:
    """Turn transformers' and datasets' bars off for the process when stderr is not a terminal; else do nothing."""
    if sys.stderr.isatty():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:  # eval and export run without datasets installed
        return
    datasets.disable_progress_bars()


@contextlib.contextmanager
def datasets_bars_off(when: bool = True):
    """datasets' bars off inside the block when ``when``, restored after (an in-process caller keeps its own)."""
    import datasets

    silence = when and not datasets.utils.are_progress_bars_disabled()
    if silence:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if silence:
            datasets.enable_progress_bars()
