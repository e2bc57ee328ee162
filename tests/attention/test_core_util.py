"""The attention-core helpers now live in tests/helpers.py; these names are kept for the
modules that still import them from here (no tests here)."""

from tests.helpers import assert_same, make_qkv, sampled, segment_mask, value_and_grads

__all__ = ["assert_same", "make_qkv", "sampled", "segment_mask", "value_and_grads"]
