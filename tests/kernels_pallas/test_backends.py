"""Bad input to the driver choice and the block-size resolution names the argument."""

import pytest

import kernels_pallas as kp
from kernels_pallas.backends import check_backend


def test_check_backend_names_the_owner_and_the_argument():
  assert check_backend("triton", "f") == "triton"
  with pytest.raises(ValueError, match=r"f: `backend` must be one of"):
    check_backend("cuda", "f")


def test_pick_backend_refuses_an_unknown_driver():
  with pytest.raises(ValueError, match="`backend`"):
    kp.pick_backend("gpu")


def test_resolve_block_sizes_names_the_bad_field():
  with pytest.raises(ValueError, match="num_warps"):
    kp.resolve_block_sizes({"block_q": 16, "block_k": 16, "num_warps": 4}, "mosaic_tpu",
                           16, 16, 16, False)
