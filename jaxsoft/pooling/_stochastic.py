"""N41 STAR stochastic softmax pooling: a softmax-weighted sample in training, SoftPool at
evaluation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.pooling import _contract as u
from jaxsoft.pooling._smooth import soft_pool

__all__ = ["stochastic_softmax_pool"]


def stochastic_softmax_pool(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                            key: jax.Array | None = None, deterministic: bool = False,
                            keepdims: bool = False, temperature: ArrayLike = 1.0,
                            straight_through: bool = False) -> jax.Array:
  r"""STAR's stochastic pooling: one entry drawn with probability softmax(x) (feature N41).

  In training (``deterministic=False``) each pool gives one of its visible entries, drawn
  from the softmax of the pool itself; at evaluation (``deterministic=True``) the
  expectation of that draw, the softmax-weighted mean (:func:`soft_pool`):

  .. math::
    p_i = \frac{e^{x_i / T}}{\sum_{j \in V} e^{x_j / T}}, \qquad
    \text{training: } o = x_c,\ c \sim \mathrm{Categorical}(p), \qquad
    \text{evaluation: } o = \mathbb{E}[x_c] = \sum_{i \in V} p_i x_i

  over the visible entries V of each pool. This is the core of the STar Aggregate-Redistribute
  (STAR) module of SOFTS (L. Han, X.-Y. Chen, H.-J. Ye & D.-C. Zhan 2024), which pools the channel embeddings per
  feature this way before redistributing the core to every channel; T = 1 there (the
  temperature is an addition of this library, as in :func:`soft_pool`). The draw is the
  Gumbel-max trick, :math:`c = \arg\max_{i \in V} (x_i / T + g_i)` with the noise
  :math:`g_i` drawn from the explicit ``key`` (as :func:`jaxsoft.normalizers.gumbel_softmax`
  does), so a pool's draw is a function of the key: one key draws every pool of ``x``
  independently; under ``vmap`` give each mapped slice its own key. A masked entry is never
  drawn.

  Gradient of the draw: by default that of the value path, as in the reference code
  (``torch.multinomial`` then ``gather``): 1 for the drawn entry, 0 for the others, and no
  gradient through the probabilities (nor to ``temperature``). ``straight_through=True``
  keeps the drawn value forward but takes the gradient of the evaluation form,
  :math:`o = x_c + (\bar o - \mathrm{sg}(\bar o))` with :math:`\bar o = \sum_i p_i x_i`
  (a biased but lower-variance estimator, an addition of this library).

  Args:
    x: the values to pool (also their scores).
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted (``-inf`` entries too): never drawn, no weight.
    key: a ``jax.random`` key; required unless ``deterministic``.
    deterministic: the evaluation form (no key needed, no randomness).
    keepdims: keep the pooled axis with size 1.
    temperature: T > 0, a scalar or an array broadcast to the pools (size 1 along
      ``axis``).
    straight_through: in training, the gradient of the evaluation form instead of that of
      the drawn value.

  Returns:
    The pooled values in ``x``'s dtype (float32 for integers; noise and softmax computed
    in float32 for low precision, so a bf16 draw is exactly one of the bf16 entries); 0,
    with zero gradient, for a pool with no visible entry.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> pooling.stochastic_softmax_pool(x, deterministic=True)  # = soft_pool(x)
    Array(1.5752, dtype=float32)
    >>> keys = jax.random.split(jax.random.key(1), 4000)
    >>> draws = jax.jit(jax.vmap(lambda k: pooling.stochastic_softmax_pool(x, key=k)))(keys)
    >>> bool(abs(draws.mean() - 1.5752) < 0.05)  # the mean of the draws: the eval form
    True
    >>> o = pooling.stochastic_softmax_pool(x, where=jnp.array([False, True, True]),
    ...                                     key=jax.random.key(0))
    >>> float(o) in (1.0, 0.0)  # one of the entries; the masked 2.0 is never drawn
    True

  References:
    L. Han, X.-Y. Chen, H.-J. Ye & D.-C. Zhan, 2024, "SOFTS: Efficient Multivariate Time
    Series Forecasting with Series-Core Fusion" (NeurIPS 2024, arXiv 2404.14197).

    M. D. Zeiler & R. Fergus, 2013, "Stochastic Pooling for Regularization of Deep
    Convolutional Neural Networks".
  """
  name = "stochastic_softmax_pool"
  u.check_bool(deterministic, "deterministic", name)
  u.check_bool(straight_through, "straight_through", name)
  if deterministic:
    return soft_pool(x, axis, where, keepdims=keepdims, temperature=temperature)
  if key is None:
    raise ValueError(f"{name}: `key` (a jax.random key) is required when `deterministic` is "
                     "False (training); pass deterministic=True for the evaluation form")
  u.check_range(temperature, "temperature", name, low=0.0, low_open=True)

  def reduce(xs, mask, ax):
    t = c.row_param(temperature, xs.shape, ax, "temperature", name, xs.dtype)
    z = xs / t
    g = jax.random.gumbel(key, xs.shape, xs.dtype)
    # Gumbel-max over the visible entries only. A pool with nothing visible takes entry 0,
    # which `prepare` left holding 0 without gradient: the empty pool gives 0, zero gradient.
    idx = jnp.argmax(jnp.where(mask, z + g, -jnp.inf), axis=ax, keepdims=True)
    drawn = jnp.take_along_axis(xs, idx, axis=ax)
    if straight_through:
      mean = jnp.sum(c.exp_normalize(z, mask, ax) * xs, axis=ax, keepdims=True)
      # Parenthesised so the forward value is exactly the drawn entry; the drawn value
      # itself carries no gradient here.
      drawn = jax.lax.stop_gradient(drawn) + (mean - jax.lax.stop_gradient(mean))
    return drawn

  return u.pool(reduce, x, axis, where, keepdims, name)
