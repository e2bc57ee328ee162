"""L18 ACOL: pooled class probabilities and the GAR terms against float64 numpy references
written from the paper's matrix definitions (N = B^T B, V = v v^T as explicit n x n arrays)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, rows

E = js.losses


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _probs_ref(z):
  """Softmax over all C*k nodes of each example, then the sum of each class's k nodes."""
  z = np.asarray(z, np.float64)
  flat = z.reshape(*z.shape[:-2], -1)
  return _softmax(flat).reshape(z.shape).sum(-1)


def _gar_ref(z):
  """The paper's affinity and balance from the explicit n x n matrices."""
  b = np.maximum(np.asarray(z, np.float64), 0.0)
  b = b.reshape(-1, b.shape[-2] * b.shape[-1])
  n = b.shape[1]
  big_n = b.T @ b
  v = np.diag(big_n)[None]
  big_v = v.T @ v
  off = lambda a: a.sum() - np.trace(a)  # noqa: E731
  return off(big_n) / ((n - 1) * np.trace(big_n)), off(big_v) / ((n - 1) * np.trace(big_v))


def _loss_ref(z, y, ca, cb, cf):
  z64 = np.asarray(z, np.float64)
  lse = lambda a, ax: np.log(np.exp(a - a.max(ax, keepdims=True)).sum(ax)) + a.max(ax)  # noqa: E731
  flat = z64.reshape(z64.shape[0], -1)
  picked = z64[np.arange(z64.shape[0]), np.asarray(y)]          # the label's k nodes
  ce = (lse(flat, -1) - lse(picked, -1)).mean()                 # -log p_y in log space
  a, b = _gar_ref(z)
  return ce + ca * a + cb * (1 - b) + cf * np.sum(np.asarray(z, np.float64) ** 2)


def _inputs(m=6, c=3, k=4):
  return rows(0, (m, c, k), scale=2.0), jax.random.randint(jax.random.key(1), (m,), 0, c)


@jax.jit
def _all(z, y):
  p = E.acol_probabilities(z)
  a, b = E.acol_gar(z)
  loss = E.acol_loss(z, y, affinity_weight=0.7, balance_weight=0.3, frobenius_weight=1e-3)
  return p, a, b, loss, jax.grad(lambda v: E.acol_loss(v, y))(z)


def test_values_and_gradients_against_float64():
  z, y = _inputs()
  p, a, b, loss, g = _all(z, y)
  # float32: a few roundings of 2^-24 per term, sums of ~24 terms of size <= 40
  np.testing.assert_allclose(p, _probs_ref(z), rtol=1e-5, atol=1e-6)
  ra, rb = _gar_ref(z)
  np.testing.assert_allclose([a, b], [ra, rb], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, _loss_ref(z, y, 0.7, 0.3, 1e-3), rtol=1e-5, atol=1e-6)
  assert np.isfinite(np.asarray(g)).all()
  # float64: the value to the reference's rounding; the gradient against central
  # differences of the numpy reference along random directions (rows(0) * 2 keeps every
  # logit > 1e-3 away from the ReLU kink, so h = 1e-6 never crosses it)
  with jax.enable_x64(True):
    z64 = jnp.asarray(np.asarray(z, np.float64))
    assert np.abs(np.asarray(z64)).min() > 1e-3
    val, g64 = jax.jit(jax.value_and_grad(lambda v: E.acol_loss(
        v, y, affinity_weight=0.7, balance_weight=0.3, frobenius_weight=1e-3)))(z64)
    assert val.dtype == g64.dtype == jnp.float64
  np.testing.assert_allclose(val, _loss_ref(z, y, 0.7, 0.3, 1e-3), rtol=1e-12)
  rng = np.random.default_rng(0)
  z_np = np.asarray(z, np.float64)
  for _ in range(3):
    d = rng.normal(size=z.shape)
    h = 1e-6
    fd = (_loss_ref(z_np + h * d, y, 0.7, 0.3, 1e-3)
          - _loss_ref(z_np - h * d, y, 0.7, 0.3, 1e-3)) / (2 * h)
    # truncation h^2 |f'''| ~ 1e-12, rounding 2^-52 |L| / h ~ 1e-10
    np.testing.assert_allclose(np.sum(np.asarray(g64) * d), fd, rtol=1e-7, atol=1e-8)


def test_identities_and_extremes():
  z, y = _inputs()

  @jax.jit
  def f(z, y):
    one = z[..., :1]
    return dict(
        k1=E.acol_probabilities(one), softmax=jax.nn.softmax(one[..., 0]),
        pooled=jax.nn.softmax(jax.nn.logsumexp(z, -1)), probs=E.acol_probabilities(z),
        onehot=jnp.stack(E.acol_gar(jnp.array([[[4.0, -1.0]], [[-2.0, 4.0]]]))),
        uniform=jnp.stack(E.acol_gar(jnp.ones((3, 2, 2)))),
        collapsed=jnp.stack(E.acol_gar(jnp.array([[[3.0, -1.0]], [[2.0, -5.0]]]))),
        dead=jnp.stack(E.acol_gar(-jnp.ones((3, 2, 2)))),
        unsup=E.acol_loss(z[:, :1], jnp.zeros_like(y), affinity_weight=0.0,
                          balance_weight=0.0, frobenius_weight=0.0),
        shift=E.acol_probabilities(z + 100.0))

  got = f(z, y)
  # k = 1 is the softmax; the class probabilities are the softmax of LSE-pooled logits
  np.testing.assert_allclose(got["k1"], got["softmax"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got["probs"], got["pooled"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got["probs"]).sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(got["shift"], got["probs"], rtol=1e-5, atol=1e-7)
  # one-hot, evenly used nodes: affinity 0, balance 1; every node equal: affinity 1;
  # one node carries everything: balance 0; no positive activation: both 0 (by convention)
  np.testing.assert_allclose(got["onehot"], [0.0, 1.0], atol=1e-7)
  np.testing.assert_allclose(got["uniform"], [1.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(got["collapsed"][1], 0.0, atol=1e-7)
  np.testing.assert_array_equal(got["dead"], [0.0, 0.0])
  assert got["unsup"] == 0.0  # one class: nothing to classify
  a, b = _gar_ref(rows(3, (50, 4, 5), scale=3.0))
  assert 0 <= a <= 1 and 0 <= b <= 1


def test_masks_bf16_vmap_and_infinities():
  z, y = _inputs()
  keep = jnp.array([True, False, True, True, False, True])
  node = jnp.ones((3, 4), bool).at[1, 3].set(False)

  @jax.jit
  def f(z, y):
    grad = jax.grad(lambda v: E.acol_loss(v, y, where=keep))(z)
    return dict(
        loss=E.acol_loss(z, y, where=keep), kept=E.acol_loss(z[keep], y[keep]),
        gar=jnp.stack(E.acol_gar(z, where=keep)), gar_kept=jnp.stack(E.acol_gar(z[keep])),
        grad=grad, node=E.acol_probabilities(z, where=node),
        neg_inf=E.acol_probabilities(z.at[:, 1, 3].set(-jnp.inf)),
        cls=E.acol_probabilities(z, where=jnp.array([True, False, True])[:, None]),
        bf16=E.acol_loss(z.astype(jnp.bfloat16), y), bf16_p=E.acol_probabilities(
            z.astype(jnp.bfloat16)),
        vmap=jax.vmap(lambda a, b: E.acol_loss(a, b))(jnp.stack([z, -z]), jnp.stack([y, y])),
        big=E.acol_loss(1e3 * z, y, frobenius_weight=0.0),
        bad_label=E.acol_loss(z.at[0, 1].set(-jnp.inf), y.at[0].set(1)))

  got = f(z, y)
  # an example mask is deleting those examples (from the mean and the batch statistics)
  np.testing.assert_allclose(got["loss"], got["kept"], rtol=1e-6)
  np.testing.assert_allclose(got["gar"], got["gar_kept"], rtol=1e-6)
  assert np.all(np.asarray(got["grad"])[~np.asarray(keep)] == 0)
  # a masked node (or a -inf logit) is a deleted node; a masked class gets 0
  zr = np.asarray(z, np.float64).copy()
  zr[:, 1, 3] = -np.inf
  np.testing.assert_allclose(got["node"], _probs_ref(zr), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got["neg_inf"], _probs_ref(zr), rtol=1e-5, atol=1e-7)
  cls = np.asarray(got["cls"])
  assert np.all(cls[:, 1] == 0)
  np.testing.assert_allclose(cls[:, [0, 2]], _probs_ref(np.asarray(z)[:, [0, 2]]), rtol=1e-5,
                             atol=1e-7)
  # bf16: computed in float32 on the rounded input, the output rounded to 8 bits
  assert got["bf16"].dtype == got["bf16_p"].dtype == jnp.bfloat16
  zb = np.asarray(z.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.float32(got["bf16"]), _loss_ref(zb, y, 1.0, 1.0, 1e-6),
                             rtol=1e-2)
  np.testing.assert_allclose(np.float32(got["bf16_p"]), _probs_ref(zb), rtol=1e-2, atol=4e-3)
  np.testing.assert_allclose(got["vmap"], [_loss_ref(z, y, 1, 1, 1e-6),
                                           _loss_ref(-np.asarray(z), y, 1, 1, 1e-6)], rtol=1e-5)
  # logits ~1e3: finite, the LSE form has no overflow
  np.testing.assert_allclose(got["big"], _loss_ref(1e3 * np.asarray(z, np.float64), y, 1, 1, 0),
                             rtol=1e-4)
  assert got["bad_label"] == np.inf  # the label's class has no visible node


def test_bad_inputs_name_the_argument():
  z, y = _inputs()
  check_raises(
      ("`logits`", lambda: E.acol_probabilities(z[0, 0])),
      ("`logits`", lambda: E.acol_gar(z[..., :0])),
      ("`labels`", lambda: E.acol_loss(z, y[:3])),
      ("`labels`", lambda: E.acol_loss(z, y.astype(jnp.float32))),
      ("`where`", lambda: E.acol_gar(z, where=jnp.ones((6, 3), bool))),
      ("`affinity_weight`", lambda: E.acol_loss(z, y, affinity_weight=-1.0)),
      ("`balance_weight`", lambda: E.acol_loss(z, y, balance_weight=float("nan"))),
      ("`frobenius_weight`", lambda: E.acol_loss(z, y, frobenius_weight=-1e-3)),
  )
