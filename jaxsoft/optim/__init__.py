"""Optimizer utilities for softmax cross-entropy training (optax transformations).

``ghost_radius`` and ``binary_ghost_radius`` give the safe step radius of softmax
cross-entropy along an update (its Taylor series' radius of convergence, set by the complex
zeros of the partition function); ``softmax_step_guard`` is an optax transformation that
shrinks each update to stay inside it.
"""

from jaxsoft.optim._step_guard import (
    SoftmaxStepGuardState,
    binary_ghost_radius,
    ghost_radius,
    softmax_step_guard,
)

__all__ = ["SoftmaxStepGuardState", "binary_ghost_radius", "ghost_radius", "softmax_step_guard"]
