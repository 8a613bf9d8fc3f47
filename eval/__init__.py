"""Evaluation of exported hbp-train checkpoints (HF safetensors directories).

- ``eval/run.py``               the CLI (``python -m eval.run``, ``./launch.sh eval``): subcommands ``offline``,
                                ``opencompass`` and ``compare``, plus ``--setup-opencompass``
- ``eval/model_io.py``          loading an exported model and tokenizer (one-line errors, device, dtype, stop tokens)
- ``eval/tasks/``               tasks generated locally, one generator each (needle, variable tracking, demo QA)
- ``eval/needle.py``            the offline needle check: generated samples scored by log-likelihood and greedy
- ``eval/perplexity.py``        held-out loss and perplexity on a tokenized dataset (label tokens only)
- ``eval/suite.py``             the generated tasks written as OpenCompass datasets, and their per-group re-scoring
- ``eval/benchmarks.py``        OpenCompass's stock benchmarks: config modules, data folders, what is missing
- ``eval/opencompass.py``       an OpenCompass run: config, subprocess, failed tasks, scores
- ``eval/opencompass_venv.py``  OpenCompass's own venv: paths, pins, stamp, the readiness check
- ``eval/opencompass_setup.py`` --setup-opencompass: build the venv, self-test it, stamp it
- ``eval/opencompass_compat.py`` the transformers 5 shim installed into that venv
- ``eval/requirements-opencompass.txt`` that venv's requirements
- ``eval/report.py``            output folder, markdown tables, heatmaps
- ``eval/compare.py``           several evaluations side by side (table + plot)
"""
