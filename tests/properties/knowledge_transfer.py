"""A tabular student trained by jaxsoft's distillation losses (Zhao & Zhu 2023, "Towards the
Fundamental Limits of Knowledge Transfer over Finite Domains"), for the property tests of
``test_knowledge_transfer.py``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoft as js

PROTOCOLS = ("hard", "naive", "se_logit", "soft")


def teacher(S: int, A: int, seed: int = 5):
  """A fixed teacher pi*(a | s) [S, A] with every probability >= 0.05 / 1.3."""
  p = np.random.default_rng(seed).dirichlet(np.full(A, 4.0), size=S) + 0.05
  return p / p.sum(-1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("protocol", "steps"))
def fit_tabular_student(counts, pi, protocol: str, steps: int = 200):
  """Trains tabular students [R, S, A] (logits from 0) on samples summarised by their
  (state, label) counts [R, S, A] with one jaxsoft loss: Adam with a step decaying from 0.2
  to 0.002; the objective is the sum over the sampled pairs divided by n (with counts
  proportional to rho(s) pi*(a | s), the population objective). Returns the students'
  probabilities.

  Protocols (the paper's levels of teacher information): ``"hard"`` cross-entropy on the
  sampled labels (level 1); ``"naive"`` that cross-entropy weighted by the teacher's
  probability of the label, and ``"se_logit"`` the squared-error logit loss (level 2);
  ``"soft"`` the KL to the teacher's full distribution at each sampled state (level 3).
  """
  A = counts.shape[-1]
  labels = jnp.broadcast_to(jnp.arange(A), counts.shape)
  log_pi = jnp.broadcast_to(jnp.log(pi), counts.shape)
  n = counts.sum((-1, -2), keepdims=True)

  def pair_losses(z):  # the loss of label a at state s: [R, S, A]
    zz = jnp.broadcast_to(z[..., None, :], counts.shape + (A,))  # [R, S, A(label), A]
    if protocol == "hard":
      return js.losses.softmax_cross_entropy_with_integer_labels(zz, labels)
    if protocol == "naive":
      return jnp.exp(log_pi) * js.losses.softmax_cross_entropy_with_integer_labels(zz, labels)
    if protocol == "se_logit":
      return js.losses.squared_error_logit_loss(zz, labels, log_pi)
    if protocol == "soft":  # one teacher: its softmax is pi itself (the same for every label)
      kd = js.losses.averaged_teacher_kd_loss(z, jnp.broadcast_to(jnp.log(pi), z.shape)[None])
      return jnp.broadcast_to(kd[..., None], counts.shape)
    raise ValueError(f"unknown protocol {protocol!r}")

  def loss(z):
    return jnp.sum(counts * pair_losses(z) / n)

  opt = optax.adam(optax.exponential_decay(0.2, steps, 0.01))
  z0 = jnp.zeros(counts.shape, counts.dtype)

  def step(carry, _):
    z, state = carry
    updates, state = opt.update(jax.grad(loss)(z), state)
    return (optax.apply_updates(z, updates), state), None

  return jax.nn.softmax(jax.lax.scan(step, (z0, opt.init(z0)), None, length=steps)[0][0])
