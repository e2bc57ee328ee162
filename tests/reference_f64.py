"""Independent numpy float64 references of every deterministic registered normalizer.

Each is written from the formula of the normalizer's docstring (and the paper the
docstring cites), not from the library's code: a plain per-row evaluation over the
visible finite entries of the row, in float64, with the obvious stable forms (a max
subtracted before ``exp``, ``logaddexp`` for softplus). :func:`normalizer` adds the
library's shared rules around them (docs/numerics.md): masked and ``-inf`` entries get
0, a row with a visible NaN is NaN on its visible entries, a row with visible ``+inf``
entries follows the documented ``+inf`` rule, a row with nothing visible is zeros.

No JAX here: the references share no code with ``jaxsoft``. Stochastic normalizers (the
ones that take a key) have none.
"""

import numpy as np

# adaptive_temperature_softmax: the paper's fit of beta(H), highest degree first
ADAPTIVE_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)


def _softmax(z):
  e = np.exp(z - np.max(z))
  return e / e.sum()


def _sigmoid(z):
  return np.exp(-np.logaddexp(0.0, -z))


def _entmax15(z):
  """1.5-entmax of a finite row by the exact sort-based algorithm (Peters, Niculae &
  Martins 2019, Algorithm 2): on the support of the k largest, tau solves
  sum_j (z_j / 2 - tau)^2 = 1."""
  y = np.sort(np.asarray(z, np.float64) / 2.0)[::-1]
  k = np.arange(1, y.size + 1)
  mean = np.cumsum(y) / k
  delta = (1.0 - k * (np.cumsum(y * y) / k - mean ** 2)) / k
  tau = mean - np.sqrt(np.maximum(delta, 0.0))
  kz = k[tau <= y][-1]
  return np.maximum(np.asarray(z, np.float64) / 2.0 - tau[kz - 1], 0.0) ** 2


def _entmax(z, alpha, iters=64):
  """alpha-entmax of a finite row: [(alpha - 1) z - tau]_+^{1/(alpha-1)} summing to 1,
  tau by bisection in float64 (Peters, Niculae & Martins 2019, eq. of Prop. 2)."""
  y = (alpha - 1.0) * np.asarray(z, np.float64)
  f = lambda tau: np.sum(np.maximum(y - tau, 0.0) ** (1.0 / (alpha - 1.0)))  # noqa: E731
  lo, hi = y.max() - 1.0, y.max()  # f(lo) >= 1 (the max entry alone), f(hi) = 0
  for _ in range(iters):  # the bracket is 1 wide: 2^-64 is below float64's resolution
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if f(mid) >= 1.0 else (lo, mid)
  p = np.maximum(y - lo, 0.0) ** (1.0 / (alpha - 1.0))
  return p / p.sum()


def _sparsemax(z):
  """Martins & Astudillo 2016, Algorithm 1 (sort)."""
  zs = np.sort(z)[::-1]
  k = np.arange(1, z.size + 1)
  cs = np.cumsum(zs)
  support = 1 + k * zs > cs
  kz = k[support][-1]
  tau = (cs[kz - 1] - 1.0) / kz
  return np.maximum(z - tau, 0.0)


def _truncated(pi, keep):
  keep = keep | (pi == pi.max())
  w = np.where(keep, pi, 0.0)
  return w / w.sum()


def _entropy(p):
  nz = p > 0
  return -np.sum(p[nz] * np.log(p[nz]))


def _log_softplus(t):
  """log(softplus(t)) without the underflow of softplus below t ~ -745."""
  t = np.asarray(t, np.float64)
  small = t < -30.0  # log(log1p(e^t)) = t + log(1 - e^t / 2 + ...), error < e^{2t}
  with np.errstate(divide="ignore"):
    big = np.log(np.logaddexp(0.0, np.where(small, 0.0, t)))
  return np.where(small, t + np.log1p(-0.5 * np.exp(np.minimum(t, 0.0))), big)


def _length_scale(n, base, scale):
  return scale if base is None else scale * np.log(max(n, 1)) / np.log(base)


def _polar(z, n, alpha=0.0, null_bias=0.0, gamma=0.0):
  sp = lambda v: np.logaddexp(0.0, v)  # noqa: E731
  t = 1.0 + sp(alpha) * np.log(n)
  nu = null_bias + sp(gamma) * np.sqrt(np.log(n + 1.0))
  return _softmax(t * np.append(z, nu))[:-1]


def _multimax(z, t1=0.0, t2=0.0, t3=0.0, t4=0.0, b1=0.0, b2=0.0, b3=0.0, b4=0.0):
  r = lambda v: np.maximum(v, 0.0)  # noqa: E731
  return _softmax(z + t1 * r(b1 - z) + t2 * r(z - b2) + t3 * r(b3 - z) ** 2
                  + t4 * r(z - b4) ** 2)


def _congestion(z, gamma=1.0, temperature=1.0):
  """The fixed point p = softmax((z - gamma p) / T) by Newton's method on
  F(p) = p - softmax((z - gamma p) / T), F'(p) = I + (gamma / T)(diag(s) - s s^T), from
  softmax(z / T); the equilibrium is unique (the maximiser of a strictly concave objective)."""
  res = lambda p: p - _softmax((z - gamma * p) / temperature)  # noqa: E731
  p = _softmax(z / temperature)
  for _ in range(200):
    s = _softmax((z - gamma * p) / temperature)
    jac = np.eye(z.size) + (gamma / temperature) * (np.diag(s) - np.outer(s, s))
    step = np.linalg.solve(jac, p - s)
    t = 1.0  # backtracking: a full Newton step can overshoot on stiff rows
    while t > 1e-12 and np.max(np.abs(res(p - t * step))) > np.max(np.abs(p - s)):
      t /= 2
    p = p - t * step
    if np.max(np.abs(res(p))) <= 1e-15:  # float64's rounding of the map
      break
  residual = np.max(np.abs(p - _softmax((z - gamma * p) / temperature)))
  assert residual <= 1e-13, f"the congestion reference did not converge ({residual})"
  return p


def _top_p(pi, p):
  order = np.argsort(-pi, kind="stable")
  before = np.concatenate([[0.0], np.cumsum(pi[order])[:-1]])
  kept = pi[order][before < p]
  return _truncated(pi, pi >= kept.min())


def _stablemax_s(z):
  return np.where(z >= 0, z + 1.0, 1.0 / (1.0 - np.minimum(z, 0.0)))


# name -> f(z, n, **hp) on the finite visible entries z (n = z.size) of one row
FORMULAS = {
    "adaptive_temperature_softmax": lambda z, n, threshold=0.5: _softmax(z * (
        max(np.polyval(ADAPTIVE_POLY, _entropy(_softmax(z))), 1.0)
        if _entropy(_softmax(z)) > threshold else 1.0)),
    "affine_softmax": lambda z, n, alpha=1.0, beta=None: alpha * _softmax(z) + (
        (1.0 - alpha) / n if beta is None else beta),
    "asentmax": lambda z, n, alpha=1.5, delta=1.0, beta=0.5, gamma=1.0: _entmax(
        (delta + beta * np.log(n) ** gamma) * z, alpha),
    "clipped_softmax": lambda z, n, zeta=1.0, gamma=-0.03: np.clip(
        (zeta - gamma) * _softmax(z) + gamma, 0.0, 1.0),
    "congestion_softmax": lambda z, n, gamma=1.0, temperature=1.0: _congestion(
        z, gamma, temperature),
    "entmax": lambda z, n, alpha=1.5: _entmax(z, alpha),
    "entmax15": lambda z, n: _entmax15(z),
    "epsilon_softmax": lambda z, n, epsilon=3e-4: _truncated(
        _softmax(z), _softmax(z) >= epsilon),
    "eta_softmax": lambda z, n, eta=3e-4: _truncated(_softmax(z), _softmax(z) >= min(
        eta, np.sqrt(eta) * np.exp(-_entropy(_softmax(z))))),
    "gumbel_cdf": lambda z, n: np.exp(-np.exp(-z)),
    "idw_softmax": lambda z, n, power=1.0, eps=1e-12: _softmax(
        -0.5 * power * np.log(z * z + eps)),
    "lssar": lambda z, n, p=2.0, base=512.0, scale=1.0: _softmax(
        p * _log_softplus(_length_scale(n, base, scale) * z)),
    "moe_gate": lambda z, n, tau=1.0: _softmax(_sigmoid(z) / tau),
    "multimax": lambda z, n, **hp: _multimax(z, **hp),
    "multiscreen": lambda z, n, theta=0.0, power=1.0: np.clip(
        (z - theta) / (1.0 - theta), 0.0, 1.0) ** power,
    "nap": lambda z, n, eps=1e-8: (z - z.mean()) / np.sqrt(np.mean((z - z.mean()) ** 2) + eps),
    "nested_sigmoid": lambda z, n, kappa=1.0, start=-1.0, step=1.0, levels=3: np.mean(
        [_sigmoid(kappa * (z - (start + k * step))) for k in range(levels)], axis=0),
    "ovr_sigmoid": lambda z, n: _sigmoid(z),
    "polar_softmax": _polar,
    "relu": lambda z, n: np.maximum(z, 0.0),
    "relu2": lambda z, n: np.maximum(z, 0.0) ** 2,
    "relu_n": lambda z, n: np.maximum(z, 0.0) / n,
    "sa_softmax": lambda z, n: z * _softmax(z),
    "sa_softmax_normalized": lambda z, n: (
        np.zeros_like(z) if not np.any(z) else
        (z - min(z.min(), 0.0)) / (max(z.max(), 0.0) - min(z.min(), 0.0)) * _softmax(z)),
    "sdm": lambda z, n, q=0.0, d=1.0: _softmax(d * np.log(2.0 + q) * z),
    "sigmoid": lambda z, n, bias=None: _sigmoid(z + (-np.log(n) if bias is None else bias)),
    "softmax": lambda z, n, temperature=1.0: _softmax(z / temperature),
    "softmax_1": lambda z, n: _softmax(np.append(z, 0.0))[:-1],
    "softmax_n": lambda z, n, n_sink=1.0: _softmax(np.append(z, np.log(n_sink)))[:-1],
    "softmax_sink": lambda z, n, sink_logit=0.0: _softmax(np.append(z, sink_logit))[:-1],
    "softpick": lambda z, n: _softpick(z),
    "softplus_l1": lambda z, n, base=512.0, scale=1.0: _softmax(
        _log_softplus(_length_scale(n, base, scale) * z)),
    "sparsemax": lambda z, n: _sparsemax(z),
    "spherical_softmax": lambda z, n, eps=0.01: (z * z + eps) / np.sum(z * z + eps),
    "ssa_softmax": lambda z, n, alpha=0.0, token_temperature=0.0: _softmax(
        (token_temperature + 1.0 + _sigmoid(alpha) * np.log(n)) * z),
    "ssmax": lambda z, n, s=0.43, n_len=None, bias=0.0: _softmax(
        (s * np.log(n if n_len is None else n_len) + bias) * z),
    "stablemax": lambda z, n: _stablemax_s(z) / _stablemax_s(z).sum(),
    "standardized_softmax": lambda z, n, tau=1.0, eps=1e-7: _softmax(
        (z - z.mean()) / (tau * (np.sqrt(np.mean((z - z.mean()) ** 2)) + eps))),
    "taylor_softmax": lambda z, n, order=2: _taylor(z, order),
    "top_k_softmax": lambda z, n, k=8: _truncated(
        _softmax(z), z >= np.sort(z)[::-1][min(k, n) - 1]),
    "top_p_softmax": lambda z, n, p=0.9: _top_p(_softmax(z), p),
}
# hyperparameters whose name clashes with the row length argument above
RENAMED = {("softmax_n", "n"): "n_sink", ("ssmax", "n"): "n_len"}


def _softpick(z):
  """ReLU(e^z - 1) / sum |e^z - 1| (Zuhri et al. 2025); 0/0 -> 0. In logs, with
  |e^z - 1| = e^{max(z, 0)} (1 - e^{-|z|}), so that neither overflows nor cancels."""
  if not np.any(z):
    return np.zeros_like(z)
  with np.errstate(divide="ignore"):
    logs = np.maximum(z, 0.0) + np.log(-np.expm1(-np.abs(z)))
  a = np.exp(logs - logs.max())
  return np.where(z > 0, a, 0.0) / a.sum()


def _taylor(z, order):
  import math  # pylint: disable=g-import-not-at-top
  t = sum(z ** k / math.factorial(k) for k in range(order + 1))
  return t / t.sum()


def _inf_row(name, x, vis, hp):
  """The documented +inf rule (docs/numerics.md, ``normalizers/_common``) on one row."""
  posinf = vis & (x == np.inf)
  k = posinf.sum()
  n = vis.sum()
  if name in ("nap", "standardized_softmax"):  # the limit of the z-scores
    z = np.where(posinf, np.sqrt((n - k) / k), -np.sqrt(k / max(n - k, 1)) if n > k else 0.0)
    if name == "nap":
      return np.where(vis, z, 0.0)
    e = np.where(vis, np.exp(z / hp.get("tau", 1.0)), 0.0)
    return e / e.sum()
  if name == "affine_softmax":  # the limit alpha/k + beta (beta elsewhere)
    alpha = hp.get("alpha", 1.0)
    beta = (1.0 - alpha) / n if hp.get("beta") is None else hp["beta"]
    return np.where(vis, np.where(posinf, alpha / k, 0.0) + beta, 0.0)
  if name == "clipped_softmax":
    share = np.clip((hp.get("zeta", 1.0) - hp.get("gamma", -0.03)) / k
                    + hp.get("gamma", -0.03), 0.0, 1.0)
  elif name == "sa_softmax":
    share = np.inf
  else:
    share = 1.0 / k
  return np.where(posinf, share, 0.0)


POINTWISE = ("gumbel_cdf", "multiscreen", "nested_sigmoid", "ovr_sigmoid", "relu", "relu2",
             "relu_n", "sigmoid")


# N42 output activations (docstring formulas of _output_activations): pointwise, +inf -> 1
def _sinusoid(z, levels=None, theta=1.0):
  u = 0.5 * (1.0 + np.sin(np.clip(z, -np.pi / 2, np.pi / 2)))
  if levels is None:
    return u
  return u - theta * np.sin(2 * np.pi * levels * u) / (2 * np.pi * levels)


def _heaviside(z, threshold=0.0):
  return np.where(z > threshold, 1.0, np.where(z < threshold, 0.0, 0.5))


FORMULAS.update({
    "sinusoid": lambda z, n, levels=None, theta=1.0: _sinusoid(z, levels, theta),
    "step": lambda z, n, threshold=0.0: _heaviside(z, threshold),
    "step_straight_through": lambda z, n, threshold=0.0: _heaviside(z, threshold),
})
POINTWISE = POINTWISE + ("sinusoid", "step", "step_straight_through")


def normalizer(name, x, where=None, axis=-1, **hp):
  """``name``'s weights of ``x`` along ``axis`` in float64, masked by ``where``.

  ``hp``: the normalizer's hyperparameters as Python numbers (scalars, one value for
  every row).
  """
  x = np.asarray(x, np.float64)
  vis = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
  x, vis = np.moveaxis(x, axis, -1), np.moveaxis(vis & (x != -np.inf), axis, -1)
  hp = {RENAMED.get((name, k), k): v for k, v in hp.items()}
  f = FORMULAS[name]
  out = np.zeros(x.shape)
  for i in np.ndindex(x.shape[:-1]):
    row, v = x[i], vis[i]
    if not v.any():
      continue
    if np.isnan(row[v]).any():
      out[i] = np.where(v, np.nan, 0.0)
    elif name in POINTWISE:  # each entry on its own: +inf goes to the formula's limit
      with np.errstate(over="ignore", invalid="ignore"):
        vals = f(row[v], v.sum(), **hp)
        lim = f(np.full(1, 1e300), v.sum(), **hp)[0]  # the limit at +inf
      lim = np.inf if lim > 1e200 else lim  # (an unbounded one: relu's)
      out[i][v] = np.where(row[v] == np.inf, lim, vals)
    elif name == "moe_gate" or (name == "idw_softmax" and (row[v] < np.inf).any()):
      with np.errstate(divide="ignore", invalid="ignore"):  # the formula's own limit:
        out[i][v] = f(row[v], v.sum(), **hp)  # sigmoid(+inf) = 1, an infinite distance 0
    elif (row[v] == np.inf).any():
      out[i] = _inf_row(name, row, v, hp)
    else:
      out[i][v] = f(row[v], v.sum(), **hp)
  return np.moveaxis(out, -1, axis)


# --- checks of a normalizer against its float64 reference ---------------------------------
# (the references above use no JAX; these call the function under test)


def attention64(q, k, v, mask, weights):
  """Dense attention in float64: ``weights(logits, visible)`` on the logits
  ``q k^T / sqrt(H)`` [B, N, T, S] (GQA by repeating k, v), applied to v -> [B, T, N, Hv]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  vis = np.broadcast_to(np.asarray(mask, bool), logits.shape)
  return np.einsum("bnts,bsnh->btnh", weights(logits, vis), v)


def check_masks_low_precision_tile_rule(fn, name, reference, hp, seed=3):
  """``fn`` (a registered normalizer ``name``) against ``reference(x, mask, **hp)``, a
  float64 numpy reference of its formula over the last axis:

  * masks: each row under ``where`` equals the reference of the row with its masked
    entries deleted (no mask at all); masked entries are exactly 0;
  * low precision: bf16 / fp16 in, the same dtype out, equal to the reference of the
    rounded input up to one rounding of the result;
  * tile rule: ``js.attention`` ``xla_chunked`` with 8 x 8 blocks (so rows span several
    key blocks, a partial last one included) equals dense float64 attention with the
    reference as its weights (the chunked gradients against the dense path's are
    test_tile_users' and test_tile_rules').
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top

  import jaxsoft as js  # pylint: disable=g-import-not-at-top
  from jaxsoft.attention import _chunked  # pylint: disable=g-import-not-at-top
  from tests import helpers  # pylint: disable=g-import-not-at-top

  # masks. float32: the function's few roundings of 2^-24 on O(1) weights: 1e-6 absolute
  x, mask = helpers.random_rows(seed, scale=2.0)
  got, xs, m = np.asarray(fn(x, where=mask, **hp)), np.asarray(x, np.float64), np.asarray(mask)
  for r in range(x.shape[0]):
    assert (got[r, ~m[r]] == 0).all(), "masked entries"
    if m[r].any():
      kept = xs[r, m[r]][None]
      np.testing.assert_allclose(got[r, m[r]], reference(kept, np.ones(kept.shape, bool), **hp)[0],
                                 rtol=1e-5, atol=1e-6, err_msg=f"row {r}")
  # low precision: computed in float32 from the rounded input, the result rounded once to
  # the dtype: bf16 keeps 8 significant bits (relative rounding 2^-8 at most), fp16 11
  # (2^-11; below 2^-14 its subnormal step 2^-24 bounds it absolutely: 2^-25)
  xf = x.at[0].set(x[1])  # no masks here
  for dt, rel, absolute in ((jnp.bfloat16, 2.0 ** -8, 0.0), (jnp.float16, 2.0 ** -11, 2.0 ** -25)):
    xl = xf.astype(dt)
    out = fn(xl, **hp)
    assert out.dtype == dt
    want = reference(np.asarray(xl.astype(jnp.float32), np.float64), np.ones(xf.shape, bool),
                     **hp)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32), np.float64), want,
                               rtol=rel + 1e-6, atol=absolute + 1e-7, err_msg=str(dt))
  # the tile rule, through the chunked attention path
  q, k, v = helpers.make_qkv(seed, B=1, T=13, S=21, N=2, K=1, H=8)
  amask = np.random.default_rng(seed).random((1, 1, 13, 21)) < 0.7
  amask[..., 0] = True
  call = dict(mask=jnp.asarray(amask), normalizer=name, normalizer_params=hp)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_chunked, "BLOCK_Q", 8)
    mp.setattr(_chunked, "BLOCK_K", 8)
    out = js.attention.dot_product_attention(q, k, v, implementation="xla_chunked", **call)
    # float32 logits (8-term dots, 8 u relative) and 21-term sums of weights times
    # N(0, 1) values: within 2e-5 of float64
    rows = lambda z, vis: reference(  # noqa: E731  (the reference takes 2-d rows)
        z.reshape(-1, z.shape[-1]), vis.reshape(-1, z.shape[-1]), **hp).reshape(z.shape)
    want = attention64(q, k, v, amask, rows)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=2e-5)
