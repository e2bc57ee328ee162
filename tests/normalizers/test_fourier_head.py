"""N36 Fourier head: the PMF against |sum_l a_l e^{i pi l z}|^2 / (2 c_0) (the Fejér-Riesz form,
computed independently), the density's integral, the loss against a direct formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.normalizers import _fourier_head as F
from tests import helpers

RNG = np.random.default_rng(0)
A = (RNG.normal(size=(3, 6)) + 1j * RNG.normal(size=(3, 6))).astype(np.complex64)


def _ref_density(a, z):
  """|A(z)|^2 / (2 sum |a|^2), A(z) = sum_l a_l e^{i pi l z}, in float64."""
  a = np.asarray(a, np.complex128)
  amp = np.exp(1j * np.pi * np.outer(z, np.arange(a.shape[-1]))) @ a.T  # [len(z), batch]
  return (np.abs(amp) ** 2 / (2 * np.sum(np.abs(a) ** 2, -1))).T


@pytest.mark.parametrize("num_bins", [1, 7, 50])
def test_pmf_is_the_renormalised_density_at_bin_centres(num_bins):
  edges = np.linspace(-1, 1, num_bins + 1)
  dens = _ref_density(A, (edges[:-1] + edges[1:]) / 2)
  got = F.fourier_head(A, num_bins)
  np.testing.assert_allclose(got, dens / dens.sum(-1, keepdims=True), rtol=2e-5, atol=1e-7)
  assert np.all(np.asarray(got) >= 0)


def test_density_is_nonnegative_and_integrates_to_one():
  z = np.linspace(-1, 1, 20001)
  dens = _ref_density(A, z)
  assert np.all(dens >= 0)
  np.testing.assert_allclose(np.trapezoid(dens, z, axis=-1), 1.0, rtol=1e-6)
  # the autocorrelation form: 1/2 + Re sum_k (c_k / c_0) e^{i pi k z}
  c = np.asarray(F.fourier_autocorrelation(A.astype(np.complex128)))
  series = 0.5 + np.real((c[:, 1:] / c[:, :1].real) @ np.exp(
      1j * np.pi * np.outer(np.arange(1, 6), z[::1000])))
  np.testing.assert_allclose(series, dens[:, ::1000], rtol=1e-5, atol=1e-6)


def test_real_coefficients_and_degenerate_cases():
  real = np.concatenate([A.real, A.imag], -1)
  np.testing.assert_allclose(F.fourier_head(real, 9), F.fourier_head(A, 9), rtol=1e-6)
  np.testing.assert_allclose(F.fourier_head(A[:, :1], 5), np.full((3, 5), 0.2), rtol=1e-6)
  helpers.check_raises(("coefficients", lambda: F.fourier_head(np.ones(3), 4)),
                       ("num_bins", lambda: F.fourier_head(A, 0)),
                       ("gamma", lambda: F.fourier_head_cross_entropy(A, np.zeros(3, int), 4,
                                                                      gamma=-1.0)),
                       ("labels", lambda: F.fourier_head_cross_entropy(A, np.zeros(2, int), 4)))


def test_cross_entropy_and_regulariser():
  labels = np.array([0, 3, 9])
  loss = F.fourier_head_cross_entropy(A, labels, 10, gamma=1e-3)
  p = np.asarray(F.fourier_head(A, 10), np.float64) + 1e-5
  ce = -np.log(p[np.arange(3), labels] / p.sum(-1))
  c = np.asarray(F.fourier_autocorrelation(A.astype(np.complex128)))
  reg = 1e-3 * 4 * np.pi ** 2 * np.sum(np.arange(6) ** 2 * np.abs(c) ** 2, -1)
  np.testing.assert_allclose(loss, ce + reg, rtol=1e-5)
  # trainable: gradient descent on the coefficients lowers the loss
  real = jnp.asarray(np.concatenate([A.real, A.imag], -1))

  @jax.jit
  def step(r):
    val, g = jax.value_and_grad(lambda r_: F.fourier_head_cross_entropy(r_, labels, 10).mean())(r)
    return val, r - 0.5 * g

  first, r = step(real)
  for _ in range(10):
    last, r = step(r)
  assert np.isfinite(float(last)) and last < first - 0.1
