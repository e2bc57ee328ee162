"""Knowledge transfer over finite domains, by how much the teacher tells the student
(catalogue row E21).

Q. Zhao & B. Zhu, 2023, "Towards the Fundamental Limits of Knowledge Transfer over Finite
Domains": with hard labels the student's error falls like n^-1/2; with the teacher's
probability of each sampled label the squared-error logit loss does much better, while the
naive weighted cross-entropy is asymptotically biased (its population minimiser is
pi*^2 / Z, not pi*); full soft labels (a KL minimiser) do at least as well as the former.
The students are tabular and trained by jaxsoft's distillation losses
(``tests/properties/knowledge_transfer.py``); the references are the teacher itself and the
closed-form biased minimiser pi*^2 / Z, in numpy float64.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tests.properties.knowledge_transfer import fit_tabular_student, teacher

# ---------------------------------------------------------------- transfer rates by level

_S, _A = 4, 6


def test_knowledge_transfer_rates_by_level_of_teacher_information():
  sizes = np.array([128, 512, 2048, 8192])
  trials = 16
  with jax.enable_x64(True):
    pi = teacher(_S, _A)
    rng = np.random.default_rng(6)
    counts = np.zeros((sizes.size, trials, _S, _A))
    for i, n in enumerate(sizes):  # states uniform, labels from the teacher
      for r in range(trials):
        s = rng.integers(0, _S, n)
        a = (rng.uniform(size=n)[:, None] > np.cumsum(pi[s], -1)).sum(-1)
        np.add.at(counts[i, r], (s, a), 1.0)
    flat = jnp.asarray(counts.reshape(-1, _S, _A))
    err = {}
    for protocol in ("hard", "naive", "se_logit", "soft"):
      q = np.asarray(fit_tabular_student(flat, jnp.asarray(pi), protocol)).reshape(counts.shape)
      # expected TV error over the (uniform) state distribution, averaged over trials
      err[protocol] = 0.5 * np.abs(q - pi).sum(-1).mean((-1, -2))
  slope = lambda e: np.polyfit(np.log(sizes), np.log(e), 1)[0]  # noqa: E731
  # level 1: the MLE's error falls like n^-1/2 (16 trials: measured -0.49 to -0.52 over
  # six sample seeds)
  assert -0.6 < slope(err["hard"]) < -0.4, err["hard"]
  # level 2: the squared-error logit loss beats hard labels by far at every n (for a fixed
  # teacher its error, the mass of the labels never sampled, falls exponentially; the
  # paper's |S||A|/n is the worst case over teachers) ...
  assert np.all(err["se_logit"] < 0.02 * err["hard"]), err  # measured <= 0.002 x, 6 seeds
  # ... while the naive weighted cross-entropy stalls at its bias TV(pi^2 / Z, pi)
  sq = pi ** 2 / np.sum(pi ** 2, -1, keepdims=True)
  bias = 0.5 * np.abs(sq - pi).sum(-1).mean()
  np.testing.assert_allclose(err["naive"][-1], bias, rtol=0.1)
  assert err["naive"][-1] > 0.9 * bias and err["hard"][-1] < 0.25 * err["naive"][-1], err
  # level 3: full soft labels are at least as good as level 2 (200 Adam steps leave an
  # optimisation error ~1e-6 in both; level 2's sampling error at n = 128 is ~3e-4)
  assert np.all(err["soft"] <= err["se_logit"] + 1e-5), err


# ---------------------------------------------------------------- the naive CE's bias


def test_naive_weighted_cross_entropy_learns_pi_squared_and_the_unbiased_losses_learn_pi():
  S, A, R = _S, _A, 64  # the shapes of the rates test above: its compiled programs
  with jax.enable_x64(True):
    pi = teacher(S, A, seed=7)
    # population objective: counts proportional to rho(s) pi*(a | s), rho uniform
    counts = jnp.broadcast_to(jnp.asarray(pi) * 1000.0, (R, S, A))
    q = {p: np.asarray(fit_tabular_student(counts, jnp.asarray(pi), p))[0]
         for p in ("naive", "se_logit", "soft")}
  sq = pi ** 2 / np.sum(pi ** 2, -1, keepdims=True)
  # the naive loss sum_a pi(a)^2 (-log q(a)) is minimised by q = pi^2 / sum pi^2 (Gibbs'
  # inequality), not by pi; the other two by pi. 200 decaying Adam steps reach ~1e-6.
  np.testing.assert_allclose(q["naive"], sq, rtol=0, atol=1e-4)
  np.testing.assert_allclose(q["se_logit"], pi, rtol=0, atol=1e-4)
  np.testing.assert_allclose(q["soft"], pi, rtol=0, atol=1e-4)
  # the bias is large: the naive student is far from the teacher (mean TV measured 0.088)
  assert 0.5 * np.abs(q["naive"] - pi).sum(-1).mean() > 0.05
