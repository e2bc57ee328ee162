"""softmax_1 / softmax_n / softmax_sink keep only their output for the backward pass (issue 37,
defect 7).

They kept 10.3x (softmax_1) and 7.8x (softmax_n, softmax_sink) their float32 input between
the forward and the backward pass; their derivative is now written from the output
``y = e^x / (n e^s + sum e^x)``: ``dy = y (dx - <y, dx>) - y e^{s - log D} (dn + n ds)``,
with ``log D`` one per-row scalar kept only when ``n`` or ``s`` is differentiated. The
residuals are counted as tests/normalizers/test_residuals.py counts them (the leaves of the
VJP closure of the jitted function); the rule is checked against the formula in numpy
float64 (both modes, masked entries, empty and one-entry rows, n = 0) and its second order
against the autodiff of softmax over the row with the sink's logit appended.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

# the output plus per-row statistics (a bool flag, log D): 1.25x leaves a quarter of the
# input for them (each is 1/96 of the input's elements here), as test_residuals.py's BOUND
BOUND = 1.25


def residual_bytes(f, *args):
  """Bytes of the arrays the VJP of ``jit(f)`` keeps between forward and backward."""
  vjp = jax.eval_shape(lambda *a: jax.vjp(jax.jit(f), *a)[1], *args)
  return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(vjp))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sink_family_keeps_only_its_output(dtype):
  x = helpers.standard_normal(0, (64, 96)).astype(dtype)
  where = jax.random.bernoulli(jax.random.key(1), 0.8, x.shape)
  p = jnp.full((64, 1), 0.7)
  cases = {
      "softmax_1": (lambda v: N.softmax_1(v), (x,)),
      "softmax_1 where": (lambda v: N.softmax_1(v, where=where), (x,)),
      "softmax_1 axis 0": (lambda v: N.softmax_1(v, axis=0), (x,)),
      "softmax_n": (lambda v: N.softmax_n(v, n=3.0), (x,)),
      "softmax_sink": (lambda v: N.softmax_sink(v, where=where, sink_logit=-1.0), (x,)),
      "learned n": (lambda v, n: N.softmax_n(v, where=where, n=n), (x, p)),
      "learned sink": (lambda v, s: N.softmax_sink(v, where=where, sink_logit=s), (x, p)),
      "learned scalar sink": (lambda v, s: N.softmax_sink(v, sink_logit=s), (x, jnp.float32(0.3))),
  }
  for case, (f, args) in cases.items():
    size = sum(a.nbytes for a in args)
    got = residual_bytes(f, *args)
    assert got <= BOUND * size, f"{case}: {got / size:.2f}x the input"


def test_declared():
  for name in ("softmax_1", "softmax_n", "softmax_sink"):
    assert N.get(name).residuals == "output", name


def _rows64():
  """[6, 7] float64 scores with masked entries, a fully masked row (0) and a one-entry row."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(6, 7)) * 2
  where = rng.random((6, 7)) > 0.25
  where[0] = False
  where[1] = False
  where[1, 3] = True
  return x, where


def test_gradients_against_the_formula():
  """y = e^x / D, D = n e^s + sum_V e^x: dy/dx = diag(y) - y y^T, dy/dn = -y e^s / D,
  dy/ds = -y n e^s / D, in numpy float64: x and s on softmax_sink (n = 1), n on softmax_n
  (s = 0; n = 0 on one row: softmax, whose dy/dn is -y / S); reverse and forward mode;
  masked entries and the empty row get exactly 0."""
  x, where = _rows64()
  n = np.array([[0.5], [2.0], [0.0], [1.0], [3.0], [0.7]])
  s = np.array([[0.3], [-1.0], [0.5], [2.0], [-0.4], [0.0]])
  ct = np.random.default_rng(4).normal(size=x.shape)
  e = np.where(where, np.exp(x), 0.0)
  sum_e = e.sum(-1, keepdims=True)
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    xj, nj, sj, cj = map(jnp.asarray, (x, n, s, ct))

    @jax.jit
    def grads(v, nn, ss):
      gx_s, gs = jax.grad(lambda a, b: jnp.sum(N.softmax_sink(a, where=w, sink_logit=b) * cj),
                          (0, 1))(v, ss)
      gn = jax.grad(lambda b: jnp.sum(N.softmax_n(v, where=w, n=b) * cj))(nn)
      _, jx = jax.jvp(lambda a: N.softmax_sink(a, where=w, sink_logit=ss), (v,), (cj,))
      _, js_ = jax.jvp(lambda b: N.softmax_sink(v, where=w, sink_logit=b), (ss,),
                       (jnp.ones_like(ss),))
      _, jn = jax.jvp(lambda b: N.softmax_n(v, where=w, n=b), (nn,), (jnp.ones_like(nn),))
      return gx_s, gs, gn, jx, js_, jn

    gx, gs, gn, jx, js_, jn = grads(xj, nj, sj)
  # float64 throughout, a handful of operations per entry: 1e-12 relative is ~5000 ulp
  tol = dict(rtol=1e-12, atol=1e-14)
  d1 = np.exp(s) + sum_e  # softmax_sink's D (n = 1)
  y1 = e / d1
  y1c = np.sum(y1 * ct, -1, keepdims=True)
  np.testing.assert_allclose(gx, y1 * (ct - y1c), **tol)
  np.testing.assert_allclose(jx, y1 * (ct - y1c), **tol)  # J is symmetric
  np.testing.assert_allclose(gs, -np.exp(s) / d1 * y1c, **tol)
  np.testing.assert_allclose(js_, -y1 * np.exp(s) / d1, **tol)
  dn = n + sum_e  # softmax_n's D (s = 0); 0 on the empty row with n = 0 (none here)
  yn = e / dn
  np.testing.assert_allclose(gn, -np.sum(yn * ct, -1, keepdims=True) / dn, **tol)
  np.testing.assert_allclose(jn, -yn / dn, **tol)
  assert (np.asarray(gx)[~where] == 0).all() and (np.asarray(gx)[0] == 0).all()
  assert np.asarray(gs)[0, 0] == 0 and np.asarray(gn)[0, 0] == 0  # nothing visible


def _oracle(x, where, n, s):
  """softmax over the visible entries and the sink logit s + log n, sink entry dropped
  (plain jnp: jax.nn.softmax's own derivative, not the rule under test)."""
  z = jnp.concatenate([jnp.where(where, x, -jnp.inf), s + jnp.log(n)], axis=-1)
  out = jax.nn.softmax(z, axis=-1)[..., :-1]
  return jnp.where(where, out, 0.0)


def test_second_order_against_softmax_with_the_sink_appended():
  """The Hessian of a loss in (x, n, s) through softmax_sink (sink logit s + log n) and
  softmax_n (n e^s) -- the rule differentiated again -- equals that of softmax([x, s + log n])."""
  x, where = _rows64()
  where[0, :2] = True  # no empty row here: the oracle's softmax of (-inf, ..., logit) is fine
  x, where = x[:4, :5], where[:4, :5]
  rng = np.random.default_rng(5)
  n, s = rng.uniform(0.5, 3.0, (4, 1)), rng.normal(size=(4, 1))
  ct = rng.normal(size=x.shape)
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    args = tuple(map(jnp.asarray, (x, n, s)))
    cj = jnp.asarray(ct)

    def loss(sink, sink_n):  # both functions, through n and s, in one scalar
      return lambda v, nn, ss: jnp.sum(jnp.sin(sink(v, nn, ss)) * cj
                                       + jnp.cos(sink_n(v, nn, ss)))

    mine = loss(lambda v, nn, ss: N.softmax_sink(v, where=w, sink_logit=ss + jnp.log(nn)),
                lambda v, nn, ss: N.softmax_n(v, where=w, n=nn * jnp.exp(ss)))
    ref = loss(lambda v, nn, ss: _oracle(v, w, nn, ss), lambda v, nn, ss: _oracle(v, w, nn, ss))
    # jax.hessian is forward over reverse: the rule's transpose, differentiated in forward mode
    hm, hr = jax.jit(lambda *a: (jax.hessian(mine, (0, 1, 2))(*a),
                                 jax.hessian(ref, (0, 1, 2))(*a)))(*args)
  # float64, a few dozen operations per entry: 1e-10 relative leaves room for cancellation
  for a, b in zip(jax.tree.leaves(hm), jax.tree.leaves(hr), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_nonfinite_rows_keep_a_zero_finite_gradient():
  """A row with a visible +inf (1 on it) or NaN keeps its rule, with a zero and finite
  gradient in x, n and the sink logit (both modes); a finite row keeps its gradient."""
  inf, nan = np.inf, np.nan
  x = jnp.array([[1.0, inf, 0.0, -1.0], [1.0, nan, 0.0, 2.0], [0.5, -1.0, 2.0, 0.0]])
  ct = jnp.array([0.3, -1.2, 0.7, 2.0])
  p = jnp.array([[0.5], [1.5], [2.0]])

  @jax.jit
  def run(v, q):
    def loss(a, b, c):
      o = N.softmax_n(a, n=b) + N.softmax_sink(a, sink_logit=c)
      return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * jnp.broadcast_to(ct, o.shape))
    g = jax.grad(loss, (0, 1, 2))(v, q, q)
    _, t = jax.jvp(lambda a, b: N.softmax_sink(a, sink_logit=b), (v, q),
                   (jnp.ones_like(v), jnp.ones_like(q)))
    _, tn = jax.jvp(lambda a, b: N.softmax_n(a, n=b), (v, q), (jnp.ones_like(v), jnp.ones_like(q)))
    return g, t, tn

  (gx, gn, gs), t, tn = run(x, p)
  for g in (gx, gn, gs, t, tn):
    g = np.asarray(g)
    assert np.isfinite(g).all() and (g[:2] == 0).all() and np.abs(g[2]).max() > 0


@pytest.mark.slow
def test_check_grads_second_order_with_masks():
  """check_grads (float64 central differences, order 2, both modes) with masked entries and
  a one-entry row, per-row n and sink logits."""
  x, where = _rows64()
  where[0, 1] = True
  rng = np.random.default_rng(6)
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    xj = jnp.asarray(x)
    n, s = jnp.asarray(rng.uniform(0.5, 3.0, (6, 1))), jnp.asarray(rng.normal(size=(6, 1)))
    check_grads(jax.jit(lambda v, b: N.softmax_n(v, where=w, n=b)), (xj, n), order=2,
                modes=("fwd", "rev"))
    check_grads(jax.jit(lambda v, b: N.softmax_sink(v, where=w, sink_logit=b)), (xj, s),
                order=2, modes=("fwd", "rev"))
