"""gla's recursive secondary chunking (``recurrence.channel_scores``) on chunks that are not
a power of two (padded), with run changes inside the chunk, strong decays and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.linear import recurrence
from tests.linear import cases


@pytest.mark.parametrize("C", [37, 1])
def test_channel_scores_equal_the_full_tensor(C):
  """The recursive scores (C padded to a power of two, run changes inside the chunk, a mask
  broadcast over heads) equal the masked ``[C, C, K]`` computation in float64; strong
  decays (log decays down to -3 per token) stay finite and exactly 0 off the mask."""
  rng = np.random.default_rng(C)
  x, y = (jnp.asarray(rng.normal(size=(2, 3, C, 5)), jnp.float32) for _ in range(2))
  G = jnp.cumsum(jnp.asarray(-rng.uniform(0, 3, size=(2, 3, C, 5)), jnp.float32), axis=-2)
  run = np.cumsum(rng.uniform(size=(2, 1, C)) < 0.1, axis=-1)
  i = np.arange(C)
  mask = jnp.asarray((run[..., :, None] == run[..., None, :]) & (i[:, None] >= i[None, :]))
  got = jax.jit(recurrence.channel_scores)(x, y, G, mask)
  diff = np.asarray(G, np.float64)[..., :, None, :] - np.asarray(G, np.float64)[..., None, :, :]
  m = np.asarray(mask)[..., None]
  want = np.einsum("...ik,...jk,...ijk->...ij", np.asarray(x, np.float64),
                   np.asarray(y, np.float64), np.where(m, np.exp(np.where(m, diff, 0.0)), 0.0))
  assert np.all(np.isfinite(got)) and np.all(np.asarray(got)[~np.asarray(mask).repeat(3, 1)] == 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


def test_gla_long_chunks_match_loop_and_recurrent_gradients():
  """gla, T = 70 in chunks of 24 (padded to 32 inside channel_scores; the last chunk short),
  segments and an initial state: the chunked output and final state equal the float64 loop,
  and every gradient equals the recurrent form's (1e-5 relative to its largest entry)."""
  args = cases.inputs("gla", B=1, T=70, N=2, K=4, V=3, seed=11)
  seg = cases.segments(1, 70, seed=12)
  # the chunked output and state come out of its gradient's program (has_aux): no
  # separate forward compilation
  o, S = jax.eval_shape(functools.partial(cases._call, "gla", implementation="chunked",
                                          chunk_size=24, segment_ids=seg), args)
  w = jax.random.normal(jax.random.key(13), o.shape)
  ws = jax.random.normal(jax.random.key(14), S.shape)

  def loss(form, a):
    o, S = cases._call("gla", a, implementation=form, chunk_size=24, segment_ids=seg)
    return jnp.sum(o * w) + jnp.sum(S * ws), (o, S)

  (got_v, (o, S)), got_g = jax.jit(jax.value_and_grad(functools.partial(loss, "chunked"),
                                                     has_aux=True))(args)
  (want_v, _), want_g = jax.jit(jax.value_and_grad(functools.partial(loss, "recurrent"),
                                                   has_aux=True))(args)
  got, want = (got_v, got_g), (want_v, want_g)
  o_ref, S_ref = cases.reference_call("gla", args, seg)
  np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(S, S_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for name in args:
    scale = float(jnp.max(jnp.abs(want[1][name])))
    np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)
