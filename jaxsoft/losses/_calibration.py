"""L16 calibration and out-of-distribution scores of a softmax classifier: ECE, temperature
fitting, maximum softmax probability, the energy score and ODIN."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = [
    "dirichlet_calibrate",
    "ece",
    "energy_score",
    "fit_dirichlet_calibration",
    "fit_temperature",
    "msp",
    "odin",
]


def msp(logits: ArrayLike, *, temperature: ArrayLike = 1.0, axis: lc.Axis = -1,
        where: ArrayLike | None = None) -> jax.Array:
  r"""Maximum softmax probability, the baseline confidence / OOD score (feature L16).

  From D. Hendrycks & K. Gimpel, "A Baseline for Detecting Misclassified and
  Out-of-Distribution Examples in Neural Networks" (ICLR 2017):
  :math:`\mathrm{MSP}(x) = \max_k \mathrm{softmax}(f(x)/T)_k \in [1/K, 1]`, computed as
  :math:`\exp(\max_k f_k/T - \mathrm{LSE}(f/T))`. Higher means more in-distribution.
  Shift invariant. A row with no visible class gets 0.

  Args:
    logits: ``[..., K, ...]`` logits.
    temperature: T > 0 (ODIN uses 1000).
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class or example mask (as the losses).

  Returns:
    One score per example, in ``logits``' dtype.

  Examples:
    >>> print(js.losses.msp(jnp.array([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])))
    [0.787  0.3333]

  References:
    D. Hendrycks & K. Gimpel, 2017, "A Baseline for Detecting Misclassified and
    Out-of-Distribution Examples in Neural Networks" (ICLR).
  """
  fn = "msp"
  t = check_positive(temperature, "temperature", fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  x = x / t
  lse, visible = lc.masked_logsumexp(x, mask, axis)
  top = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis)
  top = jnp.where(visible, top, 0.0)
  return lc.finish(jnp.exp(top - lse), visible, dtype)


def energy_score(logits: ArrayLike, *, temperature: ArrayLike = 1.0, axis: lc.Axis = -1,
                 where: ArrayLike | None = None) -> jax.Array:
  r"""Negative free energy :math:`-E(x) = T \log\sum_k e^{f_k(x)/T}` (feature L16).

  From W. Liu, X. Wang, J. D. Owens & Y. Li, "Energy-based Out-of-distribution Detection"
  (NeurIPS 2020). Higher means more in-distribution. :math:`\max_k f_k \le -E \le
  \max_k f_k + T\log K`; :math:`\log \mathrm{MSP} = \max_k f_k + E` at T = 1; unlike MSP it
  is not shift invariant (:math:`-E(f + c) = -E(f) + c`). Its gradient is
  :math:`\mathrm{softmax}(f/T)`. A row with no visible class gets 0.

  Args:
    logits, axis, where: as in :func:`msp`.
    temperature: T > 0.

  Returns:
    One score per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    >>> print(js.losses.energy_score(logits))
    [2.2395 2.0986]
    >>> print(jnp.log(js.losses.msp(logits)) + js.losses.energy_score(logits))  # max logit
    [2. 1.]

  References:
    W. Liu, X. Wang, J. D. Owens & Y. Li, 2020, "Energy-based Out-of-distribution Detection"
    (NeurIPS).
  """
  fn = "energy_score"
  t = check_positive(temperature, "temperature", fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  lse, visible = lc.masked_logsumexp(x / t, mask, axis)
  return lc.finish(t * lse, visible, dtype)


def odin(model_fn: Callable[[jax.Array], jax.Array], inputs: ArrayLike, *,
         temperature: float = 1000.0, epsilon: float = 0.0014) -> jax.Array:
  r"""ODIN out-of-distribution score: temperature scaling plus input perturbation (L16).

  From S. Liang, Y. Li & R. Srikant, "Enhancing The Reliability of Out-of-distribution
  Image Detection in Neural Networks" (ICLR 2018). With
  :math:`S(x; T) = \max_k \mathrm{softmax}(f(x)/T)_k` (:func:`msp`):

  .. math::
    \tilde x = x - \epsilon\,\operatorname{sign}\bigl(-\nabla_x \log S(x; T)\bigr),
    \qquad \mathrm{ODIN}(x) = S(\tilde x; T),

  a small step that raises the max softmax score, more for in-distribution inputs than
  for OOD ones. ``model_fn`` maps inputs ``[B, ...]`` to logits ``[B, K]`` and must treat
  examples independently (no batch statistics), so the gradient of the summed
  :math:`\log S` is each example's own. The paper uses T = 1000 and tunes
  :math:`\epsilon` (0.0014 for DenseNet on CIFAR-10). Higher means more in-distribution.

  Args:
    model_fn: the classifier, ``inputs -> logits [B, K]``.
    inputs: ``[B, ...]`` inputs (integers promote to float, as in jax.nn).
    temperature: T > 0.
    epsilon: perturbation size >= 0 (0 gives the temperature-scaled MSP).

  Returns:
    ``[B]`` scores in [1/K, 1]: float32, or float64 for float64 logits.

  Examples:
    >>> w = jnp.array([[2.0, -1.0, 0.0], [0.0, 1.0, -1.0]])
    >>> x = jnp.array([[1.0, 0.5], [0.1, 0.1]])
    >>> print(js.losses.odin(lambda v: v @ w, x, temperature=2.0, epsilon=0.0))  # msp of logits / 2
    [0.6357 0.3616]
    >>> print(js.losses.odin(lambda v: v @ w, x, temperature=2.0, epsilon=0.1))  # the step raises it
    [0.6641 0.3907]

  References:
    S. Liang, Y. Li & R. Srikant, 2018, "Enhancing The Reliability of Out-of-distribution Image
    Detection in Neural Networks" (ICLR).
  """
  fn = "odin"
  if not callable(model_fn):
    raise ValueError(f"{fn}: `model_fn` must be callable (inputs -> logits), got {model_fn!r}")
  t = check_positive(temperature, "temperature", fn)
  try:
    eps_ok = float(epsilon) >= 0
  except (TypeError, jax.errors.ConcretizationTypeError):
    eps_ok = True
  if not eps_ok:
    raise ValueError(f"{fn}: `epsilon` must be >= 0, got {epsilon!r}")
  x = lc.float_input(inputs, "inputs", fn)  # integers promote, as jax.nn's inputs do

  def log_score(v):
    logits = jnp.asarray(model_fn(v))
    if logits.ndim != 2 or logits.shape[0] != v.shape[0]:
      raise ValueError(f"{fn}: `model_fn` must return logits [B, K] with B = {v.shape[0]}, "
                       f"got shape {logits.shape}")
    return jnp.log(msp(logits.astype(nc.compute_dtype(logits.dtype)), temperature=t))

  grad = jax.grad(lambda v: jnp.sum(log_score(v)))(x)
  x_tilde = x + epsilon * jnp.sign(grad).astype(x.dtype)   # x - eps * sign(-grad)
  return jnp.exp(log_score(x_tilde))


def ece(logits: ArrayLike, labels: ArrayLike, *, num_bins: int = 15, axis: lc.Axis = -1,
        where: ArrayLike | None = None) -> jax.Array:
  r"""Expected calibration error of the softmax confidence (feature L16).

  As in C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, "On Calibration of Modern Neural
  Networks" (ICML 2017): the examples are binned by confidence
  :math:`\hat p = \max_k \mathrm{softmax}(z)_k` into ``num_bins`` equal-width bins
  :math:`(\frac{b-1}{M}, \frac{b}{M}]` and

  .. math::
    \mathrm{ECE} = \sum_{b=1}^{M} \frac{|B_b|}{n}\,
      \bigl|\mathrm{acc}(B_b) - \mathrm{conf}(B_b)\bigr|.

  The prediction is the arg-max (ties: lowest index). Masked examples and rows with no
  visible class are not counted. Not differentiable (a binned count).

  Args:
    logits: ``[..., K, ...]`` logits.
    labels: integer labels of ``logits``' shape without ``axis``.
    num_bins: M >= 1.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class or example mask.

  Returns:
    A scalar in [0, 1] (0 when no example counts): float32, or float64 for float64
    logits.

  Examples:
    >>> logits = jnp.array([[3.0, 0.0], [3.0, 0.0], [0.0, 0.1]])
    >>> print(round(float(js.losses.ece(logits, jnp.array([0, 1, 1]), num_bins=10)), 4))
    0.4601

  References:
    C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, 2017, "On Calibration of Modern Neural
    Networks" (ICML).

    M. P. Naeini, G. F. Cooper & M. Hauskrecht, 2015, "Obtaining Well Calibrated Probabilities
    Using Bayesian Binning" (AAAI).
  """
  fn = "ece"
  positive_int(num_bins, "num_bins", fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  z = lc.check_logits(logits, fn)
  x, mask, axis = lc.prepare(z.astype(nc.compute_dtype(z.dtype)), axis, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, axis, fn)
  conf = jax.lax.stop_gradient(msp(x, axis=axis, where=mask))
  pred = jnp.argmax(jnp.where(mask, x, -jnp.inf), axis=axis)
  counted = jnp.any(mask, axis=axis)
  correct = (pred == labels).astype(x.dtype)
  bins = jnp.clip(jnp.ceil(conf * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1)
  w = counted.astype(x.dtype)
  # per-bin sums as masked reductions, not a scatter (segment_sum): a scatter from a batch
  # sharded on an Explicit mesh into replicated bins is a sharding type error
  in_bin = bins[..., None] == jnp.arange(num_bins, dtype=bins.dtype).reshape(
      (1,) * bins.ndim + (num_bins,))
  lead = tuple(range(bins.ndim))
  n_b, acc_b, conf_b = (jnp.sum(jnp.where(in_bin, a[..., None], 0), axis=lead)
                        for a in (w, w * correct, w * conf))
  return nc.safe_divide(jnp.sum(jnp.abs(acc_b - conf_b)), jnp.sum(n_b))


def fit_temperature(logits: ArrayLike, labels: ArrayLike, *, num_steps: int = 50,
                    init: float = 1.0, where: ArrayLike | None = None) -> jax.Array:
  r"""Temperature scaling: the T minimising the held-out NLL of ``softmax(logits / T)`` (L16).

  From C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, "On Calibration of Modern Neural
  Networks" (ICML 2017); the special case :math:`W = I/T, b = 0` of Dirichlet / matrix
  scaling. Solves

  .. math::
    T^\star = \arg\min_{T > 0} \frac{1}{n}\sum_i \bigl[\mathrm{LSE}(z_i / T) - z_{i y_i} / T\bigr]

  over :math:`\log T` (so T stays positive by construction) with ``optax.lbfgs`` and its
  zoom line search, ``num_steps`` iterations inside one ``lax.fori_loop`` (jittable). The
  NLL is convex in :math:`1/T`, so the minimum is unique when it exists; if every
  example is already classified correctly with margin the NLL keeps falling as T → 0 and
  the result is just the last iterate. Divide the logits by the result at test time.

  Non-finite logits follow the losses' rule (``jaxsoft.losses``): a ``-inf`` logit is a
  class of probability zero, left out of the sums exactly as a class ``where`` False (the
  limit of a logit going to ``-inf``); an example with no visible class is left out. A NaN
  or a visible ``+inf`` logit (``inf - inf`` in the log-sum-exp) makes the result NaN, and
  so does a counted example whose label names a class of probability zero (its likelihood
  is 0 at every T: the minimum does not exist).

  Args:
    logits: ``[n, K]`` held-out logits.
    labels: ``[n]`` integer labels.
    num_steps: L-BFGS iterations.
    init: the starting temperature, > 0.
    where: optional ``[n]`` example mask (False: left out of the fit) or ``[n, K]`` class
      mask (False: that class is left out of that example, as a ``-inf`` logit).

  Returns:
    The fitted temperature, a scalar: float32, or float64 for float64 logits.

  Examples:
    >>> logits = 5.0 * jax.random.normal(jax.random.key(0), (500, 4))
    >>> labels = jax.random.categorical(jax.random.key(1), logits / 5.0)  # T = 5 is right
    >>> t = js.losses.fit_temperature(logits, labels)
    >>> bool(3.5 < t < 6.5)
    True

  References:
    C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, 2017, "On Calibration of Modern Neural
    Networks" (ICML).

    D. C. Liu & J. Nocedal, 1989, "On the Limited Memory BFGS Method for Large Scale
    Optimization" (Mathematical Programming).
  """
  fn = "fit_temperature"
  init = check_positive(init, "init", fn)
  x, mask, labels, weights, n, defined = _held_out(logits, labels, where, num_steps, 1, fn)
  x = jax.lax.stop_gradient(x)
  x_y = lc.gather_label(x, mask, labels, 1)[0]

  def nll(log_t):
    beta = jnp.exp(-log_t)
    lse = lc.masked_logsumexp(beta * x, mask, 1)[0]
    return jnp.sum(weights * (lse - beta * x_y)) / n

  t = jnp.exp(_lbfgs(nll, jnp.log(jnp.asarray(init, x.dtype)), num_steps))
  return jnp.where(defined, t, jnp.nan)


def dirichlet_calibrate(logits: ArrayLike, weights: ArrayLike, bias: ArrayLike) -> jax.Array:
  r"""Dirichlet calibration map: calibrated logits :math:`W \log\mathrm{softmax}(z) + b` (L16).

  From M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach,
  "Beyond temperature scaling: Obtaining well-calibrated multi-class probabilities with
  Dirichlet calibration" (NeurIPS 2019): :math:`q = \mathrm{softmax}(W \ln p + b)` with
  :math:`p = \mathrm{softmax}(z)`. :math:`W = I/T, b = 0` is temperature scaling exactly
  (the log-sum-exp shift of :math:`\ln p` cancels in the softmax); a diagonal W is vector
  scaling. Fit W and b with :func:`fit_dirichlet_calibration`.

  A ``-inf`` logit is a class of probability zero (the losses' rule, ``jaxsoft.losses``):
  it stays at probability zero (calibrated logit ``-inf``) and its :math:`\ln p_j` enters
  no sum, so the visible classes get the map restricted to them,
  :math:`q_i = \sum_{j\,\mathrm{visible}} W_{ij} \ln p_j + b_i` with :math:`p` the softmax
  over the visible classes (the formula itself meets :math:`0 \cdot (-\infty)`, NaN,
  where :math:`W_{ij} = 0`). A row with no visible class is all ``-inf``; a NaN or ``+inf`` logit makes its row
  NaN (``inf - inf`` in the log-softmax, as ``jax.nn.log_softmax``).

  Args:
    logits: ``[..., K]`` uncalibrated logits (class axis last).
    weights: ``[K, K]`` W.
    bias: ``[K]`` b.

  Returns:
    ``[..., K]`` calibrated logits (apply a softmax for probabilities): float32, or
    float64 for float64 logits.

  Examples:
    >>> z = jnp.array([[2.0, 0.0, -1.0]])
    >>> cal = js.losses.dirichlet_calibrate(z, jnp.eye(3) / 2.0, jnp.zeros(3))  # W = I/T, T = 2
    >>> print(bool(jnp.allclose(jax.nn.softmax(cal), jax.nn.softmax(z / 2.0))))
    True

  References:
    M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach, 2019, "Beyond
    temperature scaling: Obtaining well-calibrated multi-class probabilities with Dirichlet
    calibration" (NeurIPS).
  """
  fn = "dirichlet_calibrate"
  z = lc.check_logits(logits, fn)
  z = z.astype(nc.compute_dtype(z.dtype))
  w, b = jnp.asarray(weights, z.dtype), jnp.asarray(bias, z.dtype)
  k = z.shape[-1]
  if w.shape != (k, k):
    raise ValueError(f"{fn}: `weights` must have shape [K, K] = {(k, k)} for logits of shape "
                     f"{z.shape}, got {w.shape}")
  if b.shape != (k,):
    raise ValueError(f"{fn}: `bias` must have shape [K] = {(k,)}, got {b.shape}")
  x, mask, _ = lc.prepare(z, -1, None, fn)
  q = _log_probs(x, mask) @ w.T + b.reshape((1,) * (z.ndim - 1) + b.shape)
  return jnp.where(mask, q, -jnp.inf)


def fit_dirichlet_calibration(logits: ArrayLike, labels: ArrayLike, *,
                              off_diagonal_weight: float = 0.0, bias_weight: float = 0.0,
                              num_steps: int = 100,
                              where: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Fits Dirichlet calibration (W, b) by regularised NLL on held-out data (feature L16).

  Minimises, as Kull et al. (NeurIPS 2019) with their ODIR regulariser,

  .. math::
    \frac1n \sum_i -\log \mathrm{softmax}(W \ln p_i + b)_{y_i}
      + \lambda \frac{\sum_{i \ne j} W_{ij}^2}{K(K-1)} + \mu \frac{\sum_j b_j^2}{K},

  a convex problem (multinomial logistic regression on :math:`\ln p`), with
  ``optax.lbfgs`` from :math:`W = I, b = 0` (the identity map) for ``num_steps``
  iterations inside one ``lax.fori_loop``. Use the result with :func:`dirichlet_calibrate`.

  A ``-inf`` logit is a class of probability zero, as in :func:`dirichlet_calibrate`: in
  its example the class is left out of the log-sum-exp and its :math:`\ln p` enters no
  sum (the same fit as a class ``where`` False there). An example with no visible class
  is left out; a NaN or visible ``+inf`` logit, or a counted example whose label names a
  class of probability zero, makes W and b NaN (as :func:`fit_temperature`).

  Args:
    logits: ``[n, K]`` held-out logits.
    labels: ``[n]`` integer labels.
    off_diagonal_weight: :math:`\lambda \ge 0`.
    bias_weight: :math:`\mu \ge 0`.
    num_steps: L-BFGS iterations.
    where: optional ``[n]`` example mask or ``[n, K]`` class mask (as
      :func:`fit_temperature`).

  Returns:
    ``(W [K, K], b [K])``: float32, or float64 for float64 logits.

  Examples:
    >>> logits = jnp.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 3.0], [0.5, 0.0, 0.0]])
    >>> w, b = js.losses.fit_dirichlet_calibration(logits, jnp.array([0, 1, 2, 1]), num_steps=2)
    >>> print(w.shape, b.shape)
    (3, 3) (3,)

  References:
    M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach, 2019, "Beyond
    temperature scaling: Obtaining well-calibrated multi-class probabilities with Dirichlet
    calibration" (NeurIPS).

    D. C. Liu & J. Nocedal, 1989, "On the Limited Memory BFGS Method for Large Scale
    Optimization" (Mathematical Programming).
  """
  fn = "fit_dirichlet_calibration"
  lam = lc.nonnegative_float(off_diagonal_weight, "off_diagonal_weight", fn)
  mu = lc.nonnegative_float(bias_weight, "bias_weight", fn)
  x, mask, labels, weights, n, defined = _held_out(logits, labels, where, num_steps, 2, fn)
  k = x.shape[1]
  log_p = jax.lax.stop_gradient(_log_probs(x, mask))
  off = 1.0 - jnp.eye(k, dtype=x.dtype)

  def objective(params):
    w, b = params
    q = log_p @ w.T + b[None]
    q_y = lc.gather_label(q, mask, labels, 1)[0]
    nll = lc.masked_logsumexp(q, mask, 1)[0] - q_y
    reg = lam * jnp.sum(jnp.square(w * off)) / (k * (k - 1)) + mu * jnp.sum(jnp.square(b)) / k
    return jnp.sum(weights * nll) / n + reg

  params = (jnp.eye(k, dtype=x.dtype), jnp.zeros((k,), x.dtype))
  return jax.tree.map(lambda p: jnp.where(defined, p, jnp.nan), _lbfgs(objective, params,
                                                                       num_steps))


def _held_out(logits, labels, where, num_steps, min_classes, fn):
  """The held-out set of a fit, checked: ``(x, mask, labels, weights, n, defined)``.

  ``x`` ``[n, K]`` (K >= ``min_classes``; float32, or float64 as given) holds 0 at masked
  classes, ``mask`` is False there (a ``-inf`` logit, a class ``where`` False, every class
  of an example ``where`` False); ``weights`` ``[n]`` is 1 for an example with a visible
  class, ``n`` their number (at least 1); ``defined`` is False when a counted example's
  label names no visible class (no parameter gives it a finite likelihood: the fit is NaN).
  """
  positive_int(num_steps, "num_steps", fn)
  z = lc.check_logits(logits, fn)
  z = z.astype(nc.compute_dtype(z.dtype))
  if z.ndim != 2 or z.shape[1] < min_classes:
    raise ValueError(f"{fn}: `logits` must be [n, K] with K >= {min_classes}, got shape "
                     f"{z.shape}")
  labels = jnp.asarray(lc.check_integer_labels(labels, z.shape, 1, fn))
  if where is not None and jnp.shape(where) not in (z.shape[:1], z.shape):
    raise ValueError(f"{fn}: `where` must be an [n] example mask or an [n, K] class mask "
                     f"for logits of shape {z.shape}, got shape {jnp.shape(where)}")
  x, mask, _ = lc.prepare(z, 1, where, fn)
  x = jnp.where(mask, x, jnp.zeros_like(x))
  counted = jnp.any(mask, axis=1)
  label_visible = lc.gather_label(x, mask, labels, 1)[1]
  weights = counted.astype(x.dtype)
  defined = jnp.all(label_visible | ~counted)
  return x, mask, labels, weights, jnp.maximum(jnp.sum(weights), jnp.ones((), x.dtype)), defined


def _log_probs(x, mask):
  """``log softmax`` over the visible classes of the last axis, 0 at masked classes (their
  feature enters no sum: a class of probability zero is left out, as a class mask)."""
  lse = lc.masked_logsumexp(x, mask, -1)[0]
  return jnp.where(mask, x - lse[..., None], jnp.zeros_like(x))


def _lbfgs(objective, params, num_steps):
  """``num_steps`` iterations of optax.lbfgs (zoom line search) in one fori_loop."""
  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(objective)

  def step(_, carry):
    p, state = carry
    value, grad = value_and_grad(p, state=state)
    updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=objective)
    return optax.apply_updates(p, updates), state

  return jax.lax.fori_loop(0, num_steps, step, (params, opt.init(params)))[0]
