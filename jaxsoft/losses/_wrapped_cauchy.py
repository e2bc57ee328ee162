"""The wrapped Cauchy distribution on the circle and WCDAS, the softmax over wrapped-Cauchy
angular kernels (feature L17)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, concrete
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import EMBEDDING_BATCH, cosine_logits
from jaxsoft.normalizers import common as nc

__all__ = ["wcdas_loss", "wrapped_cauchy_log_density"]


def wrapped_cauchy_log_density(theta: ArrayLike, concentration: ArrayLike,
                               loc: ArrayLike = 0.0) -> jax.Array:
  r"""Log density of the wrapped Cauchy distribution on the circle.

  .. math::
    \mathrm{wC}(\theta; \mu, \rho) = \frac{1}{2\pi}
      \frac{1 - \rho^2}{1 + \rho^2 - 2\rho\cos(\theta - \mu)}, \qquad \rho \in [0, 1),

  uniform at :math:`\rho = 0`, concentrating at :math:`\mu` as :math:`\rho \to 1`;
  heavier-tailed than the von Mises with the same peak.

  Args:
    theta: angles (radians).
    concentration: ρ in [0, 1), broadcast with ``theta``.
    loc: μ, broadcast with ``theta``.

  Returns:
    :math:`\log \mathrm{wC}` in float32 (float64 for float64 inputs).

  Examples:
    >>> theta = jnp.array([0.0, jnp.pi / 2, jnp.pi])
    >>> print(js.losses.wrapped_cauchy_log_density(theta, 0.0))  # uniform: -log(2 pi)
    [-1.8379 -1.8379 -1.8379]
    >>> print(js.losses.wrapped_cauchy_log_density(theta, 0.5))  # peaked at loc = 0
    [-0.7393 -2.3487 -2.9365]

  References:
    K. V. Mardia & P. E. Jupp, 2000, "Directional Statistics" (Wiley).

    B. Han et al., 2023, "Wrapped Cauchy Distributed Angular Softmax for Long-Tailed Visual
    Recognition" (ICML).
  """
  t = jnp.asarray(theta)
  rho = jnp.asarray(concentration)
  dtype = nc.compute_dtype(jnp.result_type(t.dtype, rho.dtype, jnp.float32))
  mu = jnp.asarray(loc, dtype)
  shape = jnp.broadcast_shapes(t.shape, rho.shape, mu.shape)  # numpy's broadcast, explicit
  t, rho, mu = (jnp.broadcast_to(a, shape) for a in (t.astype(dtype), rho.astype(dtype), mu))
  return _wc_log_kernel(jnp.cos(t - mu), rho) - math.log(2 * math.pi)


def _wc_log_kernel(cos, rho):
  """log((1 - rho^2) / (1 + rho^2 - 2 rho cos)) = log(2 pi wC), written with log1p."""
  return jnp.log1p(-jnp.square(rho)) - jnp.log(jnp.square(1.0 - rho) + 2.0 * rho * (1.0 - cos))


def wcdas_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike,
               concentration: ArrayLike, *, scale: float = 1.0,
               where: ArrayLike | None = None,
               ignore_index: int | None = None) -> jax.Array:
  r"""WCDAS: softmax CE over wrapped-Cauchy angular kernel logits (feature L17) [R].

  From B. Han et al., "Wrapped Cauchy Distributed Angular Softmax for Long-Tailed Visual
  Recognition" (ICML 2023): each class's angular distribution is a mixture of wrapped
  Cauchy kernels around its centres, with a trainable per-class concentration
  :math:`\rho_c`, and the log of that mixture is the class logit. The exact logit is not
  recorded; this reconstruction [R], with :math:`\theta_{ck}` the angle between the
  embedding and the k-th of the K centres of class c (:math:`\cos\theta` from the
  L2-normalised vectors, no ``arccos``), is

  .. math::
    z_c = s \log\frac1K \sum_{k=1}^{K} 2\pi\,\mathrm{wC}(\theta_{ck}; 0, \rho_c)
        = s \log\frac1K \sum_k \frac{1 - \rho_c^2}{1 + \rho_c^2 - 2\rho_c\cos\theta_{ck}},
    \qquad \ell = -\log\mathrm{softmax}(z)_y.

  :math:`\rho_c = 0` gives :math:`z_c = 0` (no preference for class c); a larger
  :math:`\rho_c` sharpens class c's kernel (more compact, larger margin), and a class's
  logit is bounded by :math:`s\log\frac{1+\rho_c}{1-\rho_c}`. Keep :math:`\rho \in [0, 1)`
  by construction (e.g. a sigmoid of a free parameter).

  Args:
    embeddings: ``[..., d]`` features (L2-normalised inside).
    class_weights: ``[d, C]`` class centres, or ``[d, C, K]`` with K kernels per class.
    labels: integer classes of ``embeddings``' shape without the last axis.
    concentration: ρ, ``[C]`` (or a scalar) in [0, 1); differentiable.
    scale: s > 0.
    where: optional class or example mask, as :func:`arcface_loss`.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x, w = jnp.array([[1.0, 0.0]]), jnp.eye(2)
    >>> print(js.losses.wcdas_loss(x, w, jnp.array([0]), jnp.array([0.5, 0.5])))
    [0.1823]

  References:
    B. Han et al., 2023, "Wrapped Cauchy Distributed Angular Softmax for Long-Tailed Visual
    Recognition" (ICML).
  """
  fn = "wcdas_loss"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  check_positive(scale, "scale", fn)
  out_dtype = nc.output_dtype(jnp.result_type(embeddings))
  w = jnp.asarray(class_weights)
  if w.ndim not in (2, 3):
    raise ValueError(f"{fn}: `class_weights` must be [d, C] or [d, C, K] (K kernels per "
                     f"class), got shape {w.shape}")
  if w.ndim == 2:
    w = w[..., None]
  n_cls, n_ker = w.shape[1], w.shape[2]
  # every kernel's cosine (cosine_logits would keep only the largest of a class's K)
  cos = cosine_logits(embeddings, w.reshape(w.shape[0], n_cls * n_ker), fn)
  cos = cos.reshape(cos.shape[:-1] + (n_cls, n_ker))
  rho_np = concrete(concentration, np.float64)  # None when traced (a learned concentration)
  if rho_np is not None and not np.all((rho_np >= 0) & (rho_np < 1)):
    raise ValueError(f"{fn}: `concentration` must lie in [0, 1), got {concentration!r}")
  rho = jnp.asarray(concentration, cos.dtype)
  if rho.ndim > 1 or (rho.ndim == 1 and rho.shape[0] not in (1, n_cls)):
    raise ValueError(f"{fn}: `concentration` must be a scalar or [C] = [{n_cls}], got "
                     f"{rho.shape}")
  rho = jnp.broadcast_to(rho, (n_cls,))[:, None]
  logits = scale * (jax.nn.logsumexp(_wc_log_kernel(cos, lc.at_rank(rho, cos.ndim)), axis=-1)
                    - math.log(n_ker))
  labels = lc.check_labels(labels, logits.shape[:-1], fn, what=EMBEDDING_BATCH)
  z, mask, axis = lc.prepare(logits, logits.ndim - 1, where, fn)
  loss, visible, label_visible = lc.integer_cross_entropy(z, mask, labels, axis)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, out_dtype)
