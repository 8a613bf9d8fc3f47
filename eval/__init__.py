"""Evaluation of exported hbp-train checkpoints (HF safetensors directories).

- ``eval/run.py``        the CLI (``python -m eval.run``, ``./launch.sh eval``): subcommands ``offline`` and
                         ``opencompass``, plus ``--setup-opencompass``
- ``eval/model_io.py``   loading an exported model and its tokenizer (one-line errors, device and dtype)
- ``eval/needle.py``     local needle-in-a-haystack retrieval (RULER-style), scored by log-likelihood and greedy
- ``eval/perplexity.py`` held-out loss and perplexity on a tokenized dataset (label tokens only)
- ``eval/opencompass.py`` OpenCompass config generation, its own virtual environment, data checks, results
- ``eval/report.py``     markdown tables and the length x depth heatmap
"""
