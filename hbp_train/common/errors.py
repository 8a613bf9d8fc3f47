"""The one error type for the user's mistakes: bad input files, bad config values, bad flags.

Raise ``UserError`` at the boundary where input is checked, with a message that names the file, line or field
and says what fixes it. Every CLI catches ``UserError`` alone and prints its message as one line (exit 2);
anything else — a ValueError from deep inside torch, numpy or our own code — is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input or configuration, reported to the user as one line (exit code ``EXIT_USER_ERROR``)."""


# The exit code of a one-line user error, the same for every command (argparse uses 2 for bad flags too).
EXIT_USER_ERROR = 2
