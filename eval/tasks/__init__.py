"""Evaluation tasks generated locally (no download), one generator per task.

- ``haystack.py``          filler sentences and the fitting of facts + filler to a token length (shared)
- ``needle.py``            needle in a haystack, single-key and multi-key (RULER's NIAH)
- ``variable_tracking.py`` a chain of variable assignments to follow (RULER's VT)
- ``demo_qa.py``           short instructions whose answers the demo's training data teaches

``eval/suite.py`` writes them as OpenCompass datasets; ``eval/needle.py`` scores the needle samples offline.
"""
