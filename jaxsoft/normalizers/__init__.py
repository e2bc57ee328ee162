"""Softmax-like normalizers: ``f(x, axis=-1, where=None, **hparams) -> weights``.

Every normalizer is registered with a :class:`NormalizerSpec`; ``get(name)`` returns it
and ``REGISTRY`` maps names to specs. As in ``jax.nn.softmax``, ``axis`` may be a tuple:
the entries of all the named axes form one row (a row hyperparameter array then has size 1
along each of them). Scores must be real: complex ``x`` is a ValueError. Each family lives in its own private module and
lists its public names in that module's ``__all__``.
"""

# ruff: noqa: F401, F403
from jaxsoft.normalizers._affine import *
from jaxsoft.normalizers._asentmax import *
from jaxsoft.normalizers._calibration import *
from jaxsoft.normalizers._clipped import *
from jaxsoft.normalizers._congestion import *
from jaxsoft.normalizers._dirichlet import *
from jaxsoft.normalizers._entmax import *
from jaxsoft.normalizers._fourier_head import *
from jaxsoft.normalizers._gumbel import *
from jaxsoft.normalizers._idw import *
from jaxsoft.normalizers._kernel_softmax import *
from jaxsoft.normalizers._logsumexp import *
from jaxsoft.normalizers._moe_gate import *
from jaxsoft.normalizers._multimax import *
from jaxsoft.normalizers._nested import *
from jaxsoft.normalizers._output_activations import *
from jaxsoft.normalizers._ovr import *
from jaxsoft.normalizers._pointwise import *
from jaxsoft.normalizers._polar import *
from jaxsoft.normalizers._quantized import *
from jaxsoft.normalizers._row_stats import *
from jaxsoft.normalizers._sa import *
from jaxsoft.normalizers._screen import *
from jaxsoft.normalizers._sdm import *
from jaxsoft.normalizers._sdm_estimator import *
from jaxsoft.normalizers._sdm_partition import *
from jaxsoft.normalizers._sink import *
from jaxsoft.normalizers._softmax import *
from jaxsoft.normalizers._softpick import *
from jaxsoft.normalizers._softplus import *
from jaxsoft.normalizers._sparsemax import *
from jaxsoft.normalizers._spherical import *
from jaxsoft.normalizers._ssa import *
from jaxsoft.normalizers._ssmax import *
from jaxsoft.normalizers._stablemax import *
from jaxsoft.normalizers._taylor import *
from jaxsoft.normalizers._topk import *
from jaxsoft.normalizers._tropical import *
from jaxsoft.normalizers.single_pass import single_pass_softmax
from jaxsoft.normalizers.spec import (
    REGISTRY,
    NormalizerSpec,
    Param,
    ThresholdRule,
    TileRule,
    get,
    names,
    register,
    resolve,
)
