"""Every registered normalizer of class E, S or P through the kernel (read from the registry,
so a new normalizer is covered with no change here): output and every cotangent."""

from __future__ import annotations

import pytest

from tests.helpers import registry_sample
from tests.kernels_pallas.test_engine import (
    ENGINE_NAMES,
    assert_matches,
    inputs,
    kernel,
    reference,
)


@pytest.mark.parametrize("name", registry_sample(ENGINE_NAMES))
def test_every_normalizer_forward_and_cotangents(name):
  # Causal + GQA + a length (40) that is not a multiple of the block (16): padding,
  # skipped blocks and partial blocks all occur.
  q, k, v, ct = inputs(t=40, n=2, kh=1)
  assert_matches(kernel(normalizer=name, is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer=name, is_causal=True),
                 (q, k, v), ct)
