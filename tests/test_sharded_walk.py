"""The walk of the registries with a sharded batch (issue 37's "Transformations" guard: a batch
sharded on an Explicit mesh and inside ``jax.shard_map`` with its default checks, equal to the
unsharded result; item 13 found the fast paths failing there).

Every case of tests/test_transformation_walk.py (every registered normalizer, every CPU
attention implementation with a normalizer of each kernel class, every ``jaxsoft.linear``
family in each of its forms, every loss with a class ``axis``: a function of arrays whose
leading axis is the batch) runs on 2 fake CPU devices, the batch of 4 split in two:

* **Explicit mesh**: the arguments placed with ``NamedSharding(mesh, P("data"))`` on
  ``jax.make_mesh((2,), ("data",), axis_types=(Explicit,))`` and the jitted call made under
  ``jax.set_mesh``: the value and the gradient of the walk's functional
  (``sum sin(1.3 y + 0.2)``) equal the unsharded call's, and each gradient keeps its argument's
  sharding (an Explicit sharding is part of the type: a loop carry or a select that drops it
  is a type error, the failure item 13 reported).
* **shard_map**: ``jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"))``
  with the default ``check_vma=True`` (every output given a leading axis of one per shard, so
  a loss that reduces over the batch comes back per shard): each shard's value equals the
  unsharded call on that shard's half of the batch, and the gradient taken through the
  shard_map equals the per-half gradients put back together.

Tolerance: the walk's (:func:`tests.test_transformation_walk._assert_same`): the same float32
computation compiled into a different program (XLA partitions, fuses and reorders
differently), 2e-5 relative with an absolute floor of 2e-5 of the largest entry; integer
outputs equal; the unsharded reference finite.

The device count is fixed when JAX starts, so each test runs its cases, both checks, in one
child process (the pytest process has one device; start-up and compilation dominate, hence one
process for many cases, not one per case). The child reports each case and check it ran, with
its error if it failed and its seconds (printed by the test); one it did not report fails the
test. The default run takes one case per registry (:data:`SAMPLE`); ``-m slow`` runs every
case, one child per registry (the Pallas cases in the Pallas interpreter, as the walk runs
them).
"""

import functools
import json
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.backends import INTERPRET_ENV
from tests import helpers
from tests.test_transformation_walk import CASES, _assert_same, _case, _with_grads

BATCH = 4  # split in two: two rows per device
DEVICES = 2
# One case per registry by default, on paths a sharded batch broke (issue 37, item 13, and
# this walk): a threshold solve (sparsemax), the blockwise attention's loops and block table
# (xla_chunked with key lengths), a chunked linear form's carried state, and a per-bin
# histogram over the batch (ece, a scatter before); the cheapest of each kind (measured).
SAMPLE = ("normalizer-sparsemax", "attention-xla_chunked-sigmoid",
          "linear-simple_gla-chunked", "loss-ece")
REGISTRIES = ("normalizer", "attention", "linear", "loss")


def _registry(cid):
  return cid.split("-", 1)[0]


# ----------------------------------------------------------------------------- in the child


def _mesh():
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))


@functools.cache
def _jitted(cid):
  """The plain jitted value and gradients of case ``cid`` (``_with_grads`` reads only which
  arguments are floating, the same at every batch size)."""
  case = _case(cid)
  return jax.jit(_with_grads(case.fn, case.make(2, 0)))


def _unsharded(cid, args):
  """The reference: the plain call on one device, as numpy, finite."""
  want = jax.tree.map(np.asarray, _jitted(cid)(*args))
  for leaf in jax.tree.leaves(want):
    if np.issubdtype(leaf.dtype, np.inexact):
      assert np.all(np.isfinite(leaf)), f"{cid}: the unsharded call is not finite"
  return want


def _on_mesh(mesh, args):
  return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]


def _explicit_mesh(cid, mesh):
  """The batch sharded on the Explicit mesh under jit: the unsharded value and gradient."""
  case = _case(cid)
  args = case.make(BATCH, 0)
  want = _unsharded(cid, args)
  sharded = _on_mesh(mesh, args)
  with jax.set_mesh(mesh):
    got = jax.jit(_with_grads(case.fn, args))(*sharded)
  floating = [a for a in sharded if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]
  for i, (g, a) in enumerate(zip(got[1], floating, strict=True)):
    assert g.sharding.is_equivalent_to(a.sharding, a.ndim), (
        f"{cid}: the gradient of floating argument {i} is {g.sharding.spec}, its argument "
        f"{a.sharding.spec}")
  _assert_same(got, want, f"{cid}: batch sharded on an Explicit mesh")


def _shard_map(cid, mesh):
  """Inside shard_map (default check_vma): each shard's value equals the unsharded call on
  its half of the batch; the gradient through the shard_map is the halves' gradients."""
  case = _case(cid)
  args = case.make(BATCH, 0)
  size = BATCH // DEVICES
  halves = [_unsharded(cid, [a[i * size:(i + 1) * size] for a in args])
            for i in range(DEVICES)]
  want = (jax.tree.map(lambda *o: np.stack(o), *(h[0] for h in halves)),
          jax.tree.map(lambda *g: np.concatenate(g), *(h[1] for h in halves)))

  def per_shard(*shard):  # a leading axis of one per shard: out_specs stacks the shards
    return jax.tree.map(lambda leaf: leaf[None], case.fn(*shard))

  mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with jax.set_mesh(mesh):
    got = jax.jit(_with_grads(mapped, args))(*_on_mesh(mesh, args))
  _assert_same(got, want, f"{cid}: inside shard_map")


CHECKS = {"explicit_mesh": _explicit_mesh, "shard_map": _shard_map}


def _child(cids):
  """Runs every check on each case; prints one JSON line per case and check (its error if it
  failed, and its seconds)."""
  if len(jax.devices()) != DEVICES:
    raise SystemExit(f"{len(jax.devices())} devices, want {DEVICES}")
  mesh = _mesh()
  for cid in cids:
    for check, run in CHECKS.items():
      start = time.perf_counter()
      try:
        run(cid, mesh)
        error = None
      except Exception as e:  # pylint: disable=broad-except  (reported per case to the test)
        error = f"{type(e).__name__}: {str(e)[:2000]}"
      print("RESULT " + json.dumps({"case": cid, "check": check, "error": error,
                                    "seconds": round(time.perf_counter() - start, 2)}),
            flush=True)


# ----------------------------------------------------------------------------- the tests


def _run(cids):
  script = f"from tests.test_sharded_walk import _child; _child({list(cids)!r})"
  proc = helpers.run_on_cpu_devices(script, DEVICES, env={INTERPRET_ENV: "1"}, timeout=3600)
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      result = json.loads(line[len("RESULT "):])
      results[result["case"], result["check"]] = result
  ran = sorted({cid for cid, _ in results})
  print(f"ran {len(ran)} cases under {', '.join(CHECKS)} (seconds each):", file=sys.stderr)
  for cid in ran:
    print(f"  {cid}: " + ", ".join(f"{check} {results[cid, check]['seconds']}"
                                   for check in CHECKS if (cid, check) in results),
          file=sys.stderr)
  want = {(cid, check) for cid in cids for check in CHECKS}
  assert set(results) == want, (sorted(want - set(results)), proc.stderr[-3000:])
  failures = [r for r in results.values() if r["error"] is not None]
  assert not failures, f"{len(failures)} of {len(want)} checks fail:\n" + "\n".join(
      f"{r['case']} ({r['check']}): {r['error']}" for r in failures)


def _params():
  params = [pytest.param("sample", id="sample")]
  for registry in REGISTRIES:
    # the attention and linear registries hold the Pallas (interpreted) cases
    marks = [pytest.mark.slow] + ([pytest.mark.kernels] if registry in ("attention", "linear")
                                  else [])
    params.append(pytest.param(registry, id=registry, marks=marks))
  return params


@pytest.mark.parametrize("which", _params())
def test_a_sharded_batch_gives_the_unsharded_result(which):
  """Both checks (Explicit mesh, shard_map) on :data:`SAMPLE`, or with ``-m slow`` on every
  case of one registry: one child process each."""
  _run(SAMPLE if which == "sample" else tuple(c for c in CASES if _registry(c) == which))


def test_the_sample_covers_every_registry():
  assert set(SAMPLE) <= set(CASES)
  assert sorted(_registry(c) for c in SAMPLE) == sorted(REGISTRIES)
  assert {_registry(c) for c in CASES} == set(REGISTRIES)
