"""The engine's ``custom_vjp`` and the driver choice, above ``engine`` and both drivers.

``engine`` holds the per-tile math, ``triton`` and ``tpu`` the Pallas drivers (which
import ``engine``); this module picks the driver for ``Config.backend``, so that neither
``engine`` nor a driver imports another driver.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxsoft.attention.differentiation import first_order_only
from jaxsoft.normalizers import tile
from kernels_pallas import engine as E
from kernels_pallas import tpu, triton

# who raises when a custom VJP below is differentiated again (jaxsoft.attention.differentiation's
# ``first_order_only``): the Pallas kernels have no derivative rules of their own
WHERE = "dot_product_attention(implementation='pallas')"

__all__ = ["WHERE", "attention_core", "threshold_core", "row_statistic", "driver", "sum_to_shape",
           "block_lists", "output_delta", "input_cotangents"]

_DRIVERS = {"triton": triton, "mosaic_tpu": tpu}


def driver(backend: str):
  """The driver module (``forward``, ``backward_dq``, ``backward_dkv``) of ``backend``."""
  try:
    return _DRIVERS[backend]
  except KeyError:
    raise ValueError(f"`backend` must be one of {tuple(_DRIVERS)}, got {backend!r}") from None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_core(cfg: E.Config, q, k, v, dyn, aux: E.Aux, bias=None, decay=None):
  """The kernel on padded inputs: q [B, T_pad, N, Hp], k [B, S_pad, K, Hp], v [B, S_pad, K,
  Hvp].

  ``dyn`` are the per-row hyperparameters [B, N, T_pad, 1] float32; ``bias`` the dense
  bias [B|1, N|1, T_pad|1, S_pad|1] in the compute dtype (``cfg.bias_full``) or None;
  ``decay`` Forgetting attention's ``(cq [B, N, T_pad, W], ck [B, N, W, S_pad])`` or None
  (W = ``cfg.terms``: 2 with score="distance", whose squared norms come first).
  Returns ``(o [B, T_pad, N, Hvp] in v's dtype, residual [B, N, T_pad, 1])``, the residual
  of ``return_residual`` (:func:`row_statistic`); its cotangent is ignored (the caller
  stops its gradient).
  """
  o, m, d = _forward(cfg, q, k, v, dyn, _with_bias(aux, bias, decay))
  return o, row_statistic(cfg, m, d)


def row_statistic(cfg: E.Config, m, d):
  """The residual of ``return_residual`` from the forward's per-row ``(m, D)`` (natural
  units): ``m + log D`` for classes E and S (the log-sum-exp for softmax, the offset's mass
  included; ``-inf`` where D = 0), 0 for class P (its D is 1), as the XLA paths."""
  if cfg.kernel_class == "P":
    return jnp.zeros_like(m)
  return m + jnp.log(d)


def _forward(cfg: E.Config, q, k, v, dyn, aux: E.Aux):
  """The driver's forward; with ``cfg.fp8_dot`` on the float8 q and k of ``aux`` (q and k
  are then their dequantised values, which the backward passes read)."""
  if cfg.fp8_dot:
    q, k = aux.q8, aux.k8
  return driver(cfg.backend).forward(cfg, q, k, v, dyn, aux)


def _with_bias(aux: E.Aux, bias, decay=None) -> E.Aux:
  """``aux`` carrying the differentiable per-call arrays the drivers read."""
  if bias is not None:
    aux = dataclasses.replace(aux, bias=bias)
  if decay is not None:
    aux = dataclasses.replace(aux, cq=decay[0], ck=decay[1])
  return aux


def sum_to_shape(x, shape):
  """Sums ``x`` over the axes that ``shape`` broadcasts (size 1): the cotangent of a
  broadcast."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def output_delta(cfg: E.Config, o, do):
  """Delta_i = dO_i . O_i per query row, [B, N, T_pad, 1] in the compute dtype (o, do [B,
  T_pad, N, Hvp])."""
  return jnp.einsum("btnh,btnh->bnt", o.astype(cfg.acc_dtype),
                    do.astype(cfg.acc_dtype))[..., None]


def input_cotangents(aux: E.Aux, bias, decay, ds, dcq, dck):
  """The cotangents of a core's non-tensor inputs: ``(aux's (None everywhere), the dense
  bias's (dS summed to its shape), the decay's ((d cq, d ck) in their dtypes))``, each None
  where the input is."""
  aux_ct = jax.tree_util.tree_map(lambda x: None, aux)
  dbias = None if bias is None else sum_to_shape(ds, bias.shape).astype(bias.dtype)
  ddecay = None if decay is None else (dcq.astype(decay[0].dtype), dck.astype(decay[1].dtype))
  return aux_ct, dbias, ddecay


def _core_fwd(cfg, q, k, v, dyn, aux, bias, decay):
  return first_order_only(functools.partial(_core_fwd_impl, cfg), WHERE)(
      q, k, v, dyn, aux, bias, decay)


def _core_fwd_impl(cfg, q, k, v, dyn, aux, bias, decay):
  o, m, d = _forward(cfg, q, k, v, dyn, _with_bias(aux, bias, decay))
  return (o, row_statistic(cfg, m, d)), (q, k, v, dyn, aux, bias, decay, o, m, d)


def _core_bwd(cfg, res, cotangents):
  return first_order_only(functools.partial(_core_bwd_impl, cfg), WHERE)(res, cotangents)


def _core_bwd_impl(cfg, res, cotangents):
  do, _ = cotangents  # the residual has no gradient
  q, k, v, dyn, aux, bias, decay, o, m, d = res
  cfg = dataclasses.replace(cfg, fp8_dot=False)  # the backward reads the dequantised q, k
  delta = output_delta(cfg, o, do)
  drv = driver(cfg.backend)
  aux_b = _with_bias(aux, bias, decay)
  dq, ddyn, ds, dcq = drv.backward_dq(cfg, q, k, v, do, m, d, delta, dyn, aux_b)
  dk, dv, dck = drv.backward_dkv(cfg, q, k, v, do, m, d, delta, dyn, aux_b)
  # the offset's hyperparameters (a learned sink logit) enter only D: dL/dD = -Delta / D
  static, arrays = E._hp(cfg, dyn)
  d_off = tile.offset_vjp(cfg.tile, m, d, delta, E.row_lengths(cfg, aux), static, arrays)
  if d_off is not None:
    ddyn = tuple(a + d_off[name] for a, name in zip(ddyn, cfg.dyn_hp, strict=True))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(ddyn),
          *input_cotangents(aux, bias, decay, ds, dcq, dck))


attention_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------- class T (AdaSplash)


def block_lists(cfg: E.Config, table):
  """From a block table [B, N, nq, >= nk] (nonzero = the tile is computed): the compacted
  key-block lists of each query block (forward, dQ) and query-block lists of each key
  block (dK/dV), ``(idx [B, N, nq, width], cnt [B, N, nq, 1], idx_t [B, N, nk, width_q],
  cnt_t [B, N, nk, 1])``; the widths are powers of two for Triton (its block shapes)."""
  nq, nk = cfg.t_pad // cfg.blocks.block_q, cfg.s_pad // cfg.blocks.block_k
  width = E.num_k_flags(cfg)
  f = jnp.pad(table[..., :nk], ((0, 0), (0, 0), (0, 0), (0, width - nk)))
  idx, cnt = E.live_block_tables(f)
  ft = jnp.swapaxes(f[..., :nk], 2, 3)  # [B, N, nk, nq]
  width_q = E._next_pow2(nq) if cfg.backend == "triton" else nq
  ft = jnp.pad(ft, ((0, 0), (0, 0), (0, 0), (0, width_q - nq)))
  idx_t, cnt_t = E.live_block_tables(ft)
  return idx, cnt[..., None], idx_t, cnt_t[..., None]


def _live_tables(cfg: E.Config, flags):
  """From the search's live flags [B, N, nq, 1, width]: :func:`block_lists`."""
  return block_lists(cfg, flags[:, :, :, 0, :])


def _threshold_forward(cfg, q, k, v, dyn, aux):
  """Search and weighted pass (``aux`` carries the dense bias, if any)."""
  drv = driver(cfg.backend)
  m, tau, flags, tau_search = drv.threshold_search(cfg, q, k, dyn, aux)
  m = E.t_weight_m(m)
  tables = _live_tables(cfg, flags)
  o, d = drv.threshold_forward(cfg, q, k, v, m, tau, tables[0], tables[1], dyn, aux)
  # the residual: the search's tau (top-k/top-p weigh at a tau moved into the gap below
  # it), -inf for a row with no visible key (its weights sum to 0), as the XLA paths
  return (o, jnp.where(d > 0, tau_search, -jnp.inf)), (m, tau, d, tables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def threshold_core(cfg: E.Config, q, k, v, dyn, aux: E.Aux, bias=None, decay=None):
  """Class T on padded inputs (the engine's class-T section): search, then the weighted
  pass over the live key blocks (``bias``, ``decay`` as in :func:`attention_core`).
  Returns ``(o [B, T_pad, N, Hvp] in q's dtype, residual [B, N, T_pad, 1])``: the
  residual is the threshold tau (its cotangent is ignored)."""
  return _threshold_forward(cfg, q, k, v, dyn, _with_bias(aux, bias, decay))[0]


def _threshold_fwd(cfg, q, k, v, dyn, aux, bias, decay):
  return first_order_only(functools.partial(_threshold_fwd_impl, cfg), WHERE)(
      q, k, v, dyn, aux, bias, decay)


def _threshold_fwd_impl(cfg, q, k, v, dyn, aux, bias, decay):
  out, res = _threshold_forward(cfg, q, k, v, dyn, _with_bias(aux, bias, decay))
  return out, (q, k, v, dyn, aux, bias, decay, out[0], res)


def _threshold_bwd(cfg, res, cotangents):
  return first_order_only(functools.partial(_threshold_bwd_impl, cfg), WHERE)(res, cotangents)


def _threshold_bwd_impl(cfg, res, cotangents):
  do, _ = cotangents  # the residual has no gradient
  q, k, v, dyn, aux, bias, decay, o, (m, tau, d, (idx, cnt, idx_t, cnt_t)) = res
  delta = output_delta(cfg, o, do)
  drv = driver(cfg.backend)
  aux_b = _with_bias(aux, bias, decay)
  dq, coef, ddyn, ds, dcq = drv.threshold_backward_dq(cfg, q, k, v, do, m, tau, d, delta, idx,
                                                      cnt, dyn, aux_b)
  dk, dv, dck = drv.threshold_backward_dkv(cfg, q, k, v, do, m, tau, d, delta, coef, idx_t,
                                           cnt_t, dyn, aux_b)
  d_target = E.t_target_vjp(cfg, coef, E.row_lengths(cfg, aux), dyn)
  if d_target is not None:
    ddyn = tuple(a + x for a, x in zip(ddyn, d_target, strict=True))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(ddyn),
          *input_cotangents(aux, bias, decay, ds, dcq, dck))


threshold_core.defvjp(_threshold_fwd, _threshold_bwd)
