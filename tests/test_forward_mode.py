"""Forward-mode differentiation (jax.jvp, jax.jacfwd) of the paths whose gradient is a custom
rule: the linear families' chunked and parallel forms, fenchel_young_loss and
linear_cross_entropy (issue 37, defect 11). Each tangent is checked against an independent
path in float64: the linear families' recurrent form (a plain scan, no custom VJP), the
dense cross-entropy written from its formula, the normalizer's own Jacobian, a central
difference; and against reverse mode by the adjoint identity <ct, J t> = <J^T ct, t>. The
Pallas implementations refuse forward mode with UnsupportedDifferentiation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.attention import UnsupportedDifferentiation

# float64 throughout: the forms agree to rounding (~1e-15 relative); 1e-9 leaves room for
# the chunked products' different summation order and the UT inverse's solve.
TOL = 1e-9


def _rand(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _linear_inputs(seed=0, B=1, T=10, N=2, K=4, V=3):
  q, k, v = _rand(seed, (B, T, N, K)), _rand(seed + 1, (B, T, N, K)), _rand(seed + 2, (B, T, N, V))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's unit keys
  g = -0.3 * jnp.abs(_rand(seed + 3, (B, T, N)))
  beta = jax.nn.sigmoid(_rand(seed + 4, (B, T, N)))
  return q, k, v, g, beta


_LINEAR = {
    "simple_gla": lambda q, k, v, g, beta, **kw: js.linear.simple_gla(q, k, v, g, **kw),
    "delta_rule": lambda q, k, v, g, beta, **kw: js.linear.delta_rule(q, k, v, beta, **kw),
    "gated_delta_rule": lambda q, k, v, g, beta, **kw: js.linear.gated_delta_rule(
        q, k, v, g, beta, **kw),
}


# default: each custom rule once (the chunked VJP, the Gram matrix of the parallel delta
# rule); the full matrix under -m slow
_DEFAULT_LINEAR = {("simple_gla", "chunked"), ("delta_rule", "parallel")}


@pytest.mark.parametrize("name,implementation", [
    pytest.param(n, i, marks=() if (n, i) in _DEFAULT_LINEAR else pytest.mark.slow)
    for n in sorted(_LINEAR) for i in ("chunked", "parallel")])
def test_linear_forms_jvp_equals_recurrent_and_reverse(name, implementation):
  """jax.jvp of the chunked form (a custom VJP) and of the parallel form (the delta rules'
  Gram matrix had a custom VJP) in every input equals that of the recurrent form, and
  matches reverse mode: <ct, J t> = <J^T ct, t>."""
  with jax.enable_x64(True):
    args = _linear_inputs()
    tangents = tuple(_rand(10 + i, a.shape) for i, a in enumerate(args))
    ct = _rand(20, args[2].shape[:-1] + (args[2].shape[-1],))

    def f(impl, *a):
      kw = {"chunk_size": 4} if impl == "chunked" else {}
      return _LINEAR[name](*a, implementation=impl, **kw)

    @jax.jit
    def run(args, tangents, ct):
      out, jt = jax.jvp(lambda *a: f(implementation, *a), args, tangents)
      _, jt_ref = jax.jvp(lambda *a: f("recurrent", *a), args, tangents)
      _, vjp = jax.vjp(lambda *a: f(implementation, *a), *args)
      jct = vjp(ct)
      return jt, jt_ref, jnp.vdot(ct, jt), sum(jnp.vdot(a, b) for a, b in zip(jct, tangents, strict=True))

    jt, jt_ref, lhs, rhs = run(args, tangents, ct)
    np.testing.assert_allclose(jt, jt_ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lhs, rhs, rtol=TOL)


def test_linear_pallas_refuses_forward_mode():
  q, k, v, g, beta = (a.astype(jnp.float32) for a in _linear_inputs())
  f = lambda q: js.linear.simple_gla(q, k, v, g, implementation="pallas", chunk_size=4)
  with pytest.raises(UnsupportedDifferentiation, match=r"simple_gla.*'pallas'.*'chunked'"):
    jax.jvp(f, (q,), (q,))


_FY = [pytest.param("sparsemax", {}, id="sparsemax"),
       pytest.param("softmax", {}, id="softmax", marks=pytest.mark.slow),
       pytest.param("entmax15", {}, id="entmax15", marks=pytest.mark.slow),
       pytest.param("entmax", {"alpha": 1.3}, id="entmax", marks=pytest.mark.slow)]


def _fy(normalizer, hparams):
  x, labels = _rand(0, (2, 5)), jnp.array([1, 3])
  loss = lambda x: js.losses.fenchel_young_loss(x, labels, normalizer, **hparams).sum()
  p = lambda x: getattr(js.normalizers, normalizer)(x, **hparams)
  return x, labels, loss, p


@pytest.mark.parametrize("normalizer,hparams", _FY)
def test_fenchel_young_jacfwd_equals_jacrev(normalizer, hparams):
  """jax.jacfwd = jax.jacrev in the logits = p - y (p the normalizer: Danskin)."""
  with jax.enable_x64(True):
    x, labels, loss, p = _fy(normalizer, hparams)
    grads = jax.jit(lambda x: (jax.jacfwd(loss)(x), jax.jacrev(loss)(x)))(x)
    np.testing.assert_allclose(grads[0], grads[1], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(grads[0], p(x) - jax.nn.one_hot(labels, 5), rtol=TOL, atol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("normalizer,hparams", [p.values for p in _FY])
def test_fenchel_young_hessian_is_normalizer_jacobian(normalizer, hparams):
  """The Hessian (forward over reverse) is the normalizer's own Jacobian, that of Omega^*'s
  gradient p."""
  with jax.enable_x64(True):
    x, labels, loss, p = _fy(normalizer, hparams)
    hess = jax.jit(jax.hessian(loss))(x)          # [2, 5, 2, 5]: rows are independent
    for r in range(2):
      np.testing.assert_allclose(hess[r, :, r], jax.jacfwd(p)(x[r]), rtol=1e-7, atol=1e-9)


@pytest.mark.slow
def test_fenchel_young_jvp_in_alpha_matches_central_difference():
  """The tangent in entmax's alpha (-d_alpha Omega_alpha(p), Danskin) against a central
  difference of the loss (h = 1e-5: truncation ~h^2 ~ 1e-10, rounding ~1e-16 / h)."""
  with jax.enable_x64(True):
    x, labels = _rand(1, (3, 6)), jnp.array([0, 2, 5])
    loss = lambda a: js.losses.fenchel_young_loss(x, labels, "entmax", alpha=a)
    a, h = 1.4, 1e-5
    _, t = jax.jit(lambda a: jax.jvp(loss, (a,), (1.0,)))(a)
    fd = (loss(a + h) - loss(a - h)) / (2 * h)
    np.testing.assert_allclose(t, fd, rtol=1e-7, atol=1e-9)


def _dense_lce(h, w, labels, keep, eps, lam, cap):
  """The loss of linear_cross_entropy's docstring, on the whole [n, V] logits."""
  z = h @ w
  z = cap * jnp.tanh(z / cap)
  lse = jax.nn.logsumexp(z, axis=-1)
  z_y = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
  loss = (1 - eps) * (lse - z_y) + eps * (lse - z.mean(-1)) + lam * lse ** 2
  return jnp.where(keep, loss, 0.0)


def test_linear_cross_entropy_jvp_equals_dense_and_reverse():
  """jax.jvp in (h, w) through the chunked forward pass (tokens 7 in chunks of 3, vocabulary
  11 in chunks of 4: padded tokens and a shifted last vocabulary chunk) equals that of the
  dense formula, and matches the custom VJP's reverse mode."""
  with jax.enable_x64(True):
    h, w = _rand(0, (7, 5)), _rand(1, (5, 11))
    labels = jnp.array([0, 3, 10, 4, -100, 7, 2])
    th, tw, ct = _rand(2, h.shape), _rand(3, w.shape), _rand(4, (7,))
    opts = dict(label_smoothing=0.1, z_loss=0.01, softcap=4.0)

    def lce(h, w):
      return js.losses.linear_cross_entropy(h, w, labels, ignore_index=-100, token_chunk_size=3,
                                            vocab_chunk_size=4, **opts)

    @jax.jit
    def run(h, w, th, tw, ct):
      out, t = jax.jvp(lce, (h, w), (th, tw))
      keep = labels != -100
      dense = lambda h, w: _dense_lce(h, w, jnp.where(keep, labels, 0), keep, 0.1, 0.01, 4.0)
      out_ref, t_ref = jax.jvp(dense, (h, w), (th, tw))
      _, vjp = jax.vjp(lce, h, w)
      dh, dw = vjp(ct)
      return out, out_ref, t, t_ref, jnp.vdot(ct, t), jnp.vdot(dh, th) + jnp.vdot(dw, tw)

    out, out_ref, t, t_ref, lhs, rhs = run(h, w, th, tw, ct)
    np.testing.assert_allclose(out, out_ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(t, t_ref, rtol=TOL, atol=TOL)
    assert t[4] == 0.0  # the ignored token
    np.testing.assert_allclose(lhs, rhs, rtol=TOL)


def test_linear_cross_entropy_pallas_refuses_forward_mode():
  h, w = _rand(0, (4, 5)).astype(jnp.float32), _rand(1, (5, 6)).astype(jnp.float32)
  f = lambda h: js.losses.linear_cross_entropy(h, w, jnp.arange(4), implementation="pallas")
  with pytest.raises(UnsupportedDifferentiation, match=r"linear_cross_entropy.*'pallas'.*'xla'"):
    jax.jvp(f, (h,), (h,))
