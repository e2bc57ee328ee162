"""``python -m jaxsoft``: every registered normalizer applied to one sample row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js

ROW = jnp.array([2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0], jnp.float32)


def gallery(row=ROW) -> str:
  lines = [f"jaxsoft {js.__version__} on JAX {jax.__version__}: each normalizer on x = "
           f"{np.array2string(np.asarray(row), precision=2)}", ""]
  header = f"{'name':<21}{'id':<5}{'class':<6}{'sum':>6}  weights"
  lines += [header, "-" * len(header)]
  key = jax.random.key(0)
  for name in js.normalizers.names():
    spec = js.normalizers.get(name)
    w = spec.fn(key, row) if spec.needs_key else spec.fn(row)
    w = np.asarray(w)
    lines.append(f"{name:<21}{spec.catalogue_id:<5}{spec.kernel_class:<6}{w.sum():6.3f}  "
                 + " ".join(f"{v:6.3f}" for v in w))
  return "\n".join(lines)


if __name__ == "__main__":
  print(gallery())
