"""Softmax-weighted and power-mean pooling (features N35 and A23; see docs/feature_ids.md).

Every function reduces one axis with the masking contract of the normalizers:
``f(x, axis, where=None, *, keepdims=False, **hparams)``, hyperparameters keyword-only;
``where`` leaves entries out exactly as if they were deleted (a ``-inf`` entry counts as
masked, as everywhere in jaxsoft); a pool with no visible entry gives 0 with a zero
gradient, never NaN; bf16/fp16 inputs are computed in float32 and returned in their dtype
(integers promote to float32); an out-of-range hyperparameter raises ValueError naming it;
a pooled axis of length 0 gives zeros of the reduced shape. Visible entries are expected
to be finite (a NaN or ``+inf`` there gives NaN or inf); masked entries may hold anything.

* scalars along ``axis`` (default -1): :func:`soft_pool`, :func:`ada_pool`,
  :func:`log_mean_exp`, :func:`linear_softmax_pool`, :func:`gem`,
  :func:`power_mean_pool`;
* sets of vectors ``[..., N, d]`` over a token axis (default -2), ``where`` a token
  mask: :func:`ggem`, :func:`attention_pool` (SimPool), :func:`entropic_ot_pool` and
  :func:`entropic_ot_weights`;
* signal against distractors (A53): :func:`adaptive_attention_pool` (one query, any
  normalizer), the signal-optimal quantiser :func:`signal_optimal_pool`, :func:`signal_loss`,
  softmax pooling's :func:`adaptive_pool_error_bound` and :func:`snr_oracle_query`;
* a random draw: :func:`stochastic_softmax_pool` (N41, STAR), one entry drawn with
  probability softmax(x) from an explicit key in training, :func:`soft_pool` at evaluation.
"""

from jaxsoft.pooling._adaptive import (
    adaptive_attention_pool,
    adaptive_pool_error_bound,
    signal_loss,
    signal_optimal_pool,
    snr_oracle_query,
)
from jaxsoft.pooling._power import gem, ggem, power_mean_pool
from jaxsoft.pooling._sets import attention_pool, entropic_ot_pool, entropic_ot_weights
from jaxsoft.pooling._smooth import (
    ada_pool,
    ada_unpool,
    linear_softmax_pool,
    log_mean_exp,
    soft_pool,
)
from jaxsoft.pooling._stochastic import stochastic_softmax_pool

__all__ = [
    "soft_pool", "ada_pool", "ada_unpool", "log_mean_exp", "linear_softmax_pool", "gem", "ggem",
    "power_mean_pool", "attention_pool", "entropic_ot_weights", "entropic_ot_pool",
    "stochastic_softmax_pool",
    "adaptive_attention_pool", "signal_optimal_pool", "signal_loss", "adaptive_pool_error_bound",
    "snr_oracle_query",
]
