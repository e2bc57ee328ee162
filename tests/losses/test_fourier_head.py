"""fourier_head_cross_entropy, re-exported by jaxsoft.losses from jaxsoft.normalizers,
against a float64 reference."""

import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.losses.references import jitted_losses, np_ce

L = jitted_losses({
    "fourier_head_cross_entropy": ("num_bins", "gamma"),
})


def test_fourier_head_cross_entropy_is_reexported_and_matches_reference():
  assert js.losses.fourier_head_cross_entropy is js.normalizers.fourier_head_cross_entropy
  a = np.random.default_rng(2).normal(size=(2, 3)) + 1j * np.random.default_rng(3).normal(
      size=(2, 3))
  labels = np.array([1, 4])
  c = np.stack([np.sum(a[:, k:] * np.conj(a[:, :3 - k]), -1) for k in range(3)], -1)
  z = (np.linspace(-1, 1, 7)[:-1] + np.linspace(-1, 1, 7)[1:]) / 2
  dens = 0.5 + np.real(np.einsum("bk,kz->bz", c[:, 1:] / np.real(c[:, :1]),
                                 np.exp(1j * np.pi * np.arange(1, 3)[:, None] * z)))
  p = dens / dens.sum(-1, keepdims=True)
  want = np_ce(np.log(p + 1e-5), labels)
  got = L.fourier_head_cross_entropy(jnp.asarray(a, jnp.complex64), labels, 6)
  np.testing.assert_allclose(got, want, rtol=1e-5)

