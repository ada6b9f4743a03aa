"""Tests of the optional integrations whose frameworks are heavy to import (Lightning,
Transformers + accelerate, IPython, matplotlib).

They run in processes of their own (``tests/integration/test_frameworks.py`` starts one per
file), so
that the rest of the suite's heap is not two and a half times larger than a user's: every
census and holder search a test makes walks that heap, and the frameworks' 250 k objects
made the leak tests ~4x slower. ``pytest tests/integration/frameworks`` runs them directly.
"""
