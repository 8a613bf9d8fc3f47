"""What every layer shares: the user-error type, the ignore index, safe file writes, the command-line helpers.

errors.py UserError (one line, exit 2) · labels.py IGNORE_INDEX · outputs.py atomic writes and folder swaps ·
cli.py the parser and flag checks every command uses (a bad flag is one line) · library_bars.py transformers' and
datasets' progress bars kept off log files.

The bottom layer: imports nothing of hbp_train, and no torch.
"""
