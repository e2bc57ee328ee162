"""Independent float64 numpy references: a plain Python loop over t, written from the
recurrences (no jaxsoft code). Layouts as the library: ``[B, T, N, ...]``."""

import numpy as np


def _f64(x):
  return None if x is None else np.asarray(x, dtype=np.float64)


def elu1(x):
  """Katharopoulos et al.'s feature map ``elu(x) + 1`` in float64."""
  x = _f64(x)
  return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def recurrence(q, k, v, *, g=None, beta=None, initial_state=None, segment_ids=None,
               scale=None, write_gate=None, read_gate=None):
  """``S_t = diag(e^{g_t}) S_{t-1}`` (reset at a segment change), then
  ``S_t += γ^k_t k_t u_t^T`` with ``u_t = v_t`` or ``beta_t (v_t - S_t^T k_t)``;
  ``o_t = γ^q_t S_t^T q_t scale``.

  ``g``: None, ``[B, T, N]`` or ``[B, T, N, K]``; the gates ``γ^k`` (``write_gate``) and
  ``γ^q`` (``read_gate``): None (1) or ``[B, T, N]``. Returns ``(o, S_T)`` in float64.
  """
  q, k, v, g, beta, S0 = map(_f64, (q, k, v, g, beta, initial_state))
  B, T, N, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  gk = np.ones((B, T, N)) if write_gate is None else _f64(write_gate)
  gq = np.ones((B, T, N)) if read_gate is None else _f64(read_gate)
  o = np.zeros((B, T, N, V))
  S_T = np.zeros((B, N, K, V))
  for b in range(B):
    for n in range(N):
      S = np.zeros((K, V)) if S0 is None else S0[b, n].copy()
      for t in range(T):
        if segment_ids is not None and t > 0 and segment_ids[b][t] != segment_ids[b][t - 1]:
          S = np.zeros((K, V))
        if g is not None:
          decay = np.exp(g[b, t, n])
          S = S * (decay[:, None] if np.ndim(decay) == 1 else decay)
        if beta is None:
          u = v[b, t, n]
        else:
          u = beta[b, t, n] * (v[b, t, n] - S.T @ k[b, t, n])
        S = S + gk[b, t, n] * np.outer(k[b, t, n], u)
        o[b, t, n] = gq[b, t, n] * (S.T @ (q[b, t, n] * scale))
      S_T[b, n] = S
  return o, S_T


def normalized_linear_attention(q, k, v, *, initial_state=None, segment_ids=None, scale=None,
                                eps=1e-6):
  """Katharopoulos et al.: ``o_t = S_t^T q'_t / (q'_t · z_t)``, ``z_t = z_{t-1} + k_t``
  (``q, k`` already feature-mapped). ``initial_state`` is ``(S, z)``. Returns ``(o, (S, z))``."""
  q, k, v = map(_f64, (q, k, v))
  B, T, N, K = q.shape
  scale = K ** -0.5 if scale is None else scale
  S0, z0 = (None, None) if initial_state is None else map(_f64, initial_state)
  num, S_T = recurrence(q, k, v, initial_state=S0, segment_ids=segment_ids, scale=scale)
  den = np.zeros((B, T, N))
  z_T = np.zeros((B, N, K))
  for b in range(B):
    for n in range(N):
      z = np.zeros(K) if z0 is None else z0[b, n].copy()
      for t in range(T):
        if segment_ids is not None and t > 0 and segment_ids[b][t] != segment_ids[b][t - 1]:
          z = np.zeros(K)
        z = z + k[b, t, n]
        den[b, t, n] = (q[b, t, n] * scale) @ z
      z_T[b, n] = z
  den = np.where(np.abs(den) >= eps, den, np.where(den < 0, -eps, eps))
  return num / den[..., None], (S_T, z_T)


def weighted_causal_attention(weight, q, k, v, *, segment_ids=None, eps=1e-6):
  """The quadratic form ``o_i = Σ_{j<=i} w_ij v_j / Σ_{j<=i} w_ij`` with
  ``w_ij = weight(q_i, k_j, i, j)`` (a Python function of float64 vectors), ``j`` in the
  same segment as ``i``; a denominator below ``eps`` in magnitude becomes ``±eps`` (the
  library's convention). Returns ``o`` in float64."""
  q, k, v = map(_f64, (q, k, v))
  B, T, N, _ = q.shape
  o = np.zeros(v.shape)
  for b in range(B):
    for n in range(N):
      for i in range(T):
        num, den = np.zeros(v.shape[-1]), 0.0
        for j in range(i + 1):
          if segment_ids is not None and np.any(segment_ids[b][j:i + 1] != segment_ids[b][i]):
            continue
          w = weight(q[b, i, n], k[b, j, n], i, j)
          num, den = num + w * v[b, j, n], den + w
        o[b, i, n] = num / (den if abs(den) >= eps else (-eps if den < 0 else eps))
  return o


def taylor_weight(order, scale):
  """``P_m(scale q·k) = Σ_{i<=m} (scale q·k)^i / i!`` (the truncated exponential series)."""
  def weight(q, k, i, j):
    s = scale * (q @ k)
    return sum(s ** p / float(np.prod(np.arange(1, p + 1))) for p in range(order + 1))
  return weight


def cosformer_weight(max_len):
  """Qin et al. 2022: ``relu(q)·relu(k) · cos(π/2 · (i - j)/M)``."""
  def weight(q, k, i, j):
    return np.maximum(q, 0) @ np.maximum(k, 0) * np.cos(np.pi / 2 * (i - j) / max_len)
  return weight


def mala(q, k, v, *, scale, segment_ids=None, eps=1e-6):
  """Fan et al. 2025, written per query from the weights: with the ``n`` keys ``j <= i`` of
  ``i``'s segment, ``s_j = scale φ(q_i)·φ(k_j) / n``, ``z = Σ s_j``, ``w_j = (1 + 1/(z + eps))
  s_j - z / n``, ``o_i = Σ w_j v_j`` (``φ = elu + 1``). Returns ``o`` in float64."""
  q, k, v = map(_f64, (q, k, v))
  phi = elu1
  B, T, N, _ = q.shape
  o = np.zeros(v.shape)
  for b in range(B):
    for n_ in range(N):
      for i in range(T):
        js = [j for j in range(i + 1) if segment_ids is None
              or np.all(segment_ids[b][j:i + 1] == segment_ids[b][i])]
        s = np.array([scale * phi(q[b, i, n_]) @ phi(k[b, j, n_]) for j in js]) / len(js)
        z = s.sum()
        w = (1 + 1 / (z + eps)) * s - z / len(js)
        o[b, i, n_] = w @ v[b, js, n_]
  return o


def _softmax(x, axis=-1):
  e = np.exp(x - np.max(x, axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def ttt_linear(q, k, v, eta, *, mini_batch_size, initial_state=None, scale=None):
  """Sun et al. 2024, TTT-Linear as mini-batch gradient descent written out: in each
  mini-batch, every token's gradient of ``½‖W^T k - v‖²`` is taken at the mini-batch's
  start weights and the weights after token t are the start minus the summed steps so far.
  Returns ``(o, W_T)`` in float64."""
  q, k, v, eta, W0 = map(_f64, (q, k, v, eta, initial_state))
  B, T, N, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  o = np.zeros((B, T, N, V))
  W_T = np.zeros((B, N, K, V))
  for b in range(B):
    for n in range(N):
      W = np.zeros((K, V)) if W0 is None else W0[b, n].copy()
      for s in range(0, T, mini_batch_size):
        W_start, step = W.copy(), np.zeros((K, V))
        for t in range(s, min(s + mini_batch_size, T)):
          grad = np.outer(k[b, t, n], W_start.T @ k[b, t, n] - v[b, t, n])
          step += eta[b, t, n] * grad
          W = W_start - step
          o[b, t, n] = W.T @ (q[b, t, n] * scale)
      W_T[b, n] = W
  return o, W_T


def softmax_linear_attention(q, k, v, q_logits, k_logits=None, *, g=None, beta=None,
                             temperature=1.0, segment_ids=None, initial_state=None):
  """The [R] SLA equations as a loop: gates softmax over heads;
  ``S_{t,n} = e^g S + γ^k k u^T`` (``u = v`` or ``β (v - S^T k)``), ``o = γ^q S^T q scale``
  (the gated :func:`recurrence`)."""
  gq = _softmax(_f64(q_logits) / temperature)
  gk = None if k_logits is None else _softmax(_f64(k_logits) / temperature)
  return recurrence(q, k, v, g=g, beta=beta, initial_state=initial_state,
                    segment_ids=segment_ids, write_gate=gk, read_gate=gq)


def ccq(q, k, v, *, g=None, beta=None, strength=1.0, segment_ids=None):
  """The [R] CCQ read: per query the decayed weights ``w_j = e^{g_{j+1} + ... + g_t}`` over
  its segment's keys ``j <= t``, ``μ = Σ w k / Σ w``, ``C = Σ w k k^T / Σ w - μ μ^T``,
  ``q~ = q - λ C q``; then the backbone's recurrence read with ``q~``."""
  q, k, v, g = map(_f64, (q, k, v, g))
  B, T, N, K = q.shape
  q_tilde = np.zeros_like(q)
  for b in range(B):
    for n in range(N):
      for t in range(T):
        js = [j for j in range(t + 1) if segment_ids is None
              or np.all(segment_ids[b][j:t + 1] == segment_ids[b][t])]
        w = np.array([np.exp(0.0 if g is None else g[b, j + 1:t + 1, n].sum()) for j in js])
        ks = k[b, js, n]
        mu = (w[:, None] * ks).sum(0) / w.sum()
        C = (w[:, None, None] * ks[:, :, None] * ks[:, None, :]).sum(0) / w.sum() - np.outer(mu, mu)
        q_tilde[b, t, n] = q[b, t, n] - strength * C @ q[b, t, n]
  return recurrence(q_tilde, k, v, g=g, beta=beta, segment_ids=segment_ids)[0]


def interdomain(fq, fk, v, basis_in, basis_out, log_decay, *, scale, segment_ids=None):
  """The [R] interdomain recurrence: ``C_t[r] = e^{a_r} C_{t-1}[r] + b_{t,r} φ(k_t) v_t^T``,
  ``o_t = Σ_r ψ_{t,r} C_t[r]^T φ(q_t) scale`` (``fq, fk`` already feature-mapped)."""
  fq, fk, v, bi, bo, a = map(_f64, (fq, fk, v, basis_in, basis_out, log_decay))
  B, T, N, K = fq.shape
  R, V = bi.shape[-1], v.shape[-1]
  o = np.zeros((B, T, N, V))
  for b in range(B):
    for n in range(N):
      C = np.zeros((R, K, V))
      for t in range(T):
        if segment_ids is not None and t > 0 and segment_ids[b][t] != segment_ids[b][t - 1]:
          C = np.zeros((R, K, V))
        for r in range(R):
          C[r] = np.exp(a[n, r]) * C[r] + bi[b, t, n, r] * np.outer(fk[b, t, n], v[b, t, n])
          o[b, t, n] += bo[b, t, n, r] * (C[r].T @ fq[b, t, n]) * scale
  return o


def native_hybrid_attention(q, k, v, log_gates, *, window, segment_ids=None, scale=None,
                            initial_state=None):
  """Du et al. 2025 as a loop: slots ``K~ = α K~ + (1 - α) k^T`` (likewise V~; reset at a
  segment change), then one softmax over the slots' and the window's scores. Returns ``o``."""
  q, k, v, a = map(_f64, (q, k, v, log_gates))
  B, T, N, K = q.shape
  M, V = a.shape[-1], v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  o = np.zeros((B, T, N, V))
  for b in range(B):
    for n in range(N):
      Ks, Vs = ((np.zeros((M, K)), np.zeros((M, V))) if initial_state is None
                else (_f64(initial_state[0])[b, n], _f64(initial_state[1])[b, n]))
      start = 0
      for t in range(T):
        if segment_ids is not None and t > 0 and segment_ids[b][t] != segment_ids[b][t - 1]:
          Ks, Vs, start = np.zeros((M, K)), np.zeros((M, V)), t
        alpha = np.exp(a[b, t, n])
        Ks = alpha[:, None] * Ks + (1 - alpha)[:, None] * k[b, t, n]
        Vs = alpha[:, None] * Vs + (1 - alpha)[:, None] * v[b, t, n]
        js = list(range(max(start, t - window + 1), t + 1))
        keys = np.concatenate([Ks, k[b, js, n]])
        vals = np.concatenate([Vs, v[b, js, n]])
        o[b, t, n] = _softmax(keys @ q[b, t, n] * scale) @ vals
  return o


def mhla(fq, fk, v, C, *, block, causal):
  """The [R] MHLA weights per query: ``w_tj = C[β(t), β(j)] φ(q_t)·φ(k_j)`` (``j <= t``
  when causal), ``o_t = Σ w v / Σ w`` (``fq, fk`` feature-mapped, ``C [N, M, M]``)."""
  fq, fk, v, C = map(_f64, (fq, fk, v, C))
  B, T, N, _ = fq.shape
  o = np.zeros(v.shape)
  for b in range(B):
    for n in range(N):
      for t in range(T):
        js = range(t + 1) if causal else range(T)
        w = np.array([C[n, t // block, j // block] * fq[b, t, n] @ fk[b, j, n] for j in js])
        o[b, t, n] = w @ v[b, list(js), n] / w.sum()   # the tests' C > 0 and φ > 0
  return o


def rala(fq, fk, q, k, v, gate):
  """The [R] RALA read, per query: ``α_j = T softmax_j(q̄·k_j/√K)``,
  ``y_i = Σ_j α_j (φ(q_i)·φ(k_j)) v_j / Σ_j α_j φ(q_i)·φ(k_j) ⊙ gate_i``."""
  fq, fk, q, k, v, gate = map(_f64, (fq, fk, q, k, v, gate))
  B, T, N, K = q.shape
  y = np.zeros(v.shape)
  for b in range(B):
    for n in range(N):
      q_mean = q[b, :, n].mean(0)
      alpha = T * _softmax(k[b, :, n] @ q_mean / np.sqrt(K))
      for i in range(T):
        w = alpha * (fk[b, :, n] @ fq[b, i, n])
        y[b, i, n] = (w @ v[b, :, n]) / w.sum() * gate[b, i, n]
  return y
