"""Compatibility patch that ``--setup-opencompass`` installs into the OpenCompass venv (not imported by hbp-train).

OpenCompass 0.5.4's HuggingFace model wrappers call ``tokenizer.batch_encode_plus``, which transformers 5 removed
(OpenCompass issue #2573). transformers 4 is no way out: it cannot load a tokenizer that transformers 5 saved (our
exports), so the venv keeps transformers 5 and gets this patch instead. ``eval/opencompass.py`` copies this file
into the venv's site-packages as ``hbp_opencompass_compat.py`` with a ``.pth`` line that imports it at interpreter
start, so it covers the ``opencompass`` CLI and every task process it spawns, and a config re-run by hand.

Importing transformers at every interpreter start would slow pip and every OpenCompass process, so the patch waits
for ``transformers.tokenization_utils_base`` to be imported and adds the method then: ``batch_encode_plus(texts,
**kwargs)`` is ``tokenizer(texts, **kwargs)``, which is what it did in transformers 4 for a list of texts.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "transformers.tokenization_utils_base"


def _batch_encode_plus(self, batch_text_or_text_pairs, **kwargs):
    return self(batch_text_or_text_pairs, **kwargs)


def patch(module) -> None:
    """Give ``PreTrainedTokenizerBase`` a ``batch_encode_plus`` when it has none."""
    base = module.PreTrainedTokenizerBase
    if "batch_encode_plus" not in dir(base):
        base.batch_encode_plus = _batch_encode_plus


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``TARGET`` is imported, lets the normal finders load it, then patches it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once is enough; also keeps find_spec below from recursing into us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch now if transformers is already imported, else when it is."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
