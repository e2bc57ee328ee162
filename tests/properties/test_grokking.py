"""Grokking without regularisation (catalogue E14; L. Prieto, M. Barsbey, P. A. M. Mediano &
T. Birdal, 2025, "Grokking at the Edge of Numerical Stability", ICLR, arXiv 2501.04697), the claim
notebooks/04_softmax_collapse.py shows, as tests:

* modular addition (a + b) mod p learned by a two-hidden-layer ReLU MLP without biases on one-hot
  inputs, full-batch Adam (the authors' lr 0.01, beta2 0.99, eps 1e-25) and no weight decay, in
  float32: softmax cross-entropy fits the training pairs and stays at (near) zero held-out
  accuracy, while the same run with ⊥Grad (``js.losses.orthogonal_gradient`` before Adam)
  generalises, from the same data, initialisation and step budget;
* (slow) the notebook's full-size run (p = 47, 40 % of the pairs, width 200, 1500 steps): ⊥Grad
  generalises, softmax CE does not, and its training examples enter Softmax Collapse (float32 CE
  exactly 0) as the logits keep growing.

The test accuracy is measured by exact argmax counts, the collapse fraction by
``js.losses.softmax_collapse_fraction`` (itself tested against optax in
tests/losses/test_stablemax.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js


def _grok(p, train_fraction, width, steps, variant, every=10):
  """One full-batch run; returns (train acc, test acc, collapse fraction), each every `every` steps."""
  pairs = np.array([(a, b) for a in range(p) for b in range(p)])
  labels = (pairs[:, 0] + pairs[:, 1]) % p
  perm = np.random.default_rng(0).permutation(len(pairs))
  n_train = int(train_fraction * len(pairs))
  x_tr, y_tr = jnp.asarray(pairs[perm[:n_train]]), jnp.asarray(labels[perm[:n_train]])
  x_te, y_te = jnp.asarray(pairs[perm[n_train:]]), jnp.asarray(labels[perm[n_train:]])
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  uniform = lambda k, i, o: jax.random.uniform(k, (i, o), minval=-1.0, maxval=1.0) / np.sqrt(i)
  params = {"w1": uniform(k1, 2 * p, width), "w2": uniform(k2, width, width),
            "w3": uniform(k3, width, p)}

  def apply(w, ab):  # one-hot([a, b]) @ w1, written as the sum of two rows
    h = jax.nn.relu(w["w1"][ab[:, 0]] + w["w1"][p + ab[:, 1]])
    return jax.nn.relu(h @ w["w2"]) @ w["w3"]

  loss_fn = (js.losses.stablemax_cross_entropy if variant == "stablemax"
             else js.losses.softmax_cross_entropy_with_integer_labels)
  adam = optax.adam(1e-2, b2=0.99, eps=1e-25)
  opt = optax.chain(js.losses.orthogonal_gradient(), adam) if variant == "orthogonal" else adam

  def step(carry, _):
    w, state = carry
    grads = jax.grad(lambda w: loss_fn(apply(w, x_tr), y_tr).mean())(w)
    updates, state = opt.update(grads, state, w)
    return (optax.apply_updates(w, updates), state), None

  def chunk(carry, _):
    carry, _ = jax.lax.scan(step, carry, None, length=every)
    logits = apply(carry[0], x_tr)
    return carry, (jnp.mean(jnp.argmax(logits, -1) == y_tr),
                   jnp.mean(jnp.argmax(apply(carry[0], x_te), -1) == y_te),
                   js.losses.softmax_collapse_fraction(logits, y_tr))

  run = jax.jit(lambda c: jax.lax.scan(chunk, c, None, length=steps // every)[1])
  return tuple(np.asarray(a) for a in run((params, opt.init(params))))


def test_orthogonal_gradient_generalises_where_softmax_ce_memorises():
  # p = 23 from 70 % of the pairs: small enough for the default suite; ⊥Grad passes 0.8 test
  # accuracy near step 100, softmax CE fits the training pairs by step 10 and stays at ~0.
  size = dict(p=23, train_fraction=0.7, width=128, steps=150)
  ortho = _grok(variant="orthogonal", **size)
  softmax = _grok(variant="softmax", **size)
  assert ortho[0][-1] == 1.0 and softmax[0][-1] == 1.0  # both fit the training pairs
  assert ortho[1][-1] > 0.75, ortho[1]
  assert softmax[1].max() < 0.1, softmax[1]  # chance is 1/23


@pytest.mark.slow  # three 1500-step full-batch runs at p = 47 (the notebook's size)
def test_notebook_size_softmax_ce_collapses_and_orthogonal_gradient_groks():
  size = dict(p=47, train_fraction=0.4, width=200, steps=1500)
  ortho = _grok(variant="orthogonal", **size)
  softmax = _grok(variant="softmax", **size)
  assert ortho[0][-1] == 1.0 and softmax[0][-1] == 1.0
  assert ortho[1][-1] > 0.9, ortho[1][::10]
  assert softmax[1].max() < 0.05, softmax[1][::10]
  # softmax CE: the logits keep growing after the fit, more and more examples collapse
  assert softmax[2][-1] > 0.1 and softmax[2][:50].max() < softmax[2][-1], softmax[2][::10]
  assert ortho[2].max() == 0.0  # ⊥Grad removes the direction that scales the logits
