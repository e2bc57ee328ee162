"""The zoo's machinery (train.zoo): its entrants agree with the registries, a tiny zoo runs end
to end, resumes without rerunning a finished record, and the report is written."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxsoft import losses as js_losses
from jaxsoft import normalizers
from train import config, kinds, model, zoo, zoo_tasks
from train import train as train_lib


def test_entrants_agree_with_the_registries():
  # Computed from the registries now: a new normalizer or layer kind must show up as an
  # entrant or as a listed exclusion, never silently go missing.
  names = {e.name for e in zoo.entrants()}
  excluded = zoo.exclusions()
  expected = ({f"normalizer:{n}" for n in normalizers.names()}
              | {f"attention:{k}" for k in kinds.LAYER_KINDS}
              | {f"attention:{k}" for k in kinds.BIDIRECTIONAL_KINDS})
  attention_excluded = {n for n in excluded if not n.startswith("loss:")}
  assert expected == (names - {n for n in names if n.startswith("hybrid:")}) | attention_excluded
  assert not names & set(excluded)
  for n in normalizers.names():  # excluded only by a declared property: needs_key
    assert (f"normalizer:{n}" in excluded) == normalizers.get(n).needs_key
  assert [n for n in names if n.startswith("hybrid:")] == ["hybrid:gated_delta_rulex3+softmax"]
  hybrid = next(e for e in zoo.entrants() if e.name.startswith("hybrid:"))
  cfg = config.Config(**{**zoo_tasks.TASKS["lm"].config, **hybrid.fields}, workdir="x")
  assert config.layer_kinds(cfg).count("full") == 1 and len(config.layer_kinds(cfg)) == 4
  # every entrant's config is valid at every attention task's size
  for task in zoo_tasks.TASKS.values():
    for entrant in zoo.entrants(task.name):
      zoo._task_config(task, entrant, 0, task.lrs[0], tiny=False)
  # the loss task: softmax CE, StableMax CE, the orthogonal gradient, the Fenchel-Young losses
  # of jaxsoft.losses.fenchel_young_loss except softmax's (= CE) and the free-alpha entmax
  losses = {e.name for e in zoo.entrants("grok")}
  assert {"loss:softmax_ce", "loss:stablemax_ce", "loss:softmax_ce_orthogonal_gradient",
          "loss:fy_sparsemax", "loss:fy_entmax15"} == losses
  fy = {f"loss:fy_{n}" for n in js_losses._fenchel_young._ALPHA}
  assert fy <= losses | set(excluded)


@pytest.mark.slow  # ~7-10 s of compilation; the tiny zoo keeps the plumbing in the default run
def test_first_token_mass_and_stats_match_a_dense_reference():
  cfg = config.Config(d_model=16, num_layers=1, num_heads=2, mlp_dim=16, workdir="x",
                      normalizer="sparsemax")
  net = model.make_model(cfg, 32, 0)
  tokens = jnp.arange(12, dtype=jnp.int32)[None] % 32
  stats = jax.device_get(jax.jit(lambda t: zoo.attention_weight_stats(net, t, cfg))(tokens))
  # the reference: the layer's weights rebuilt in numpy float64 from q, k
  positions = jnp.arange(12)[None]
  block = net.blocks[0]
  q, k = block.attn.qk(block.attn_norm(net.embed(tokens)), positions)
  s = np.einsum("btnh,bsnh->bnts", np.float64(q), np.float64(k)) / np.sqrt(8.0)
  w = np.zeros_like(s)
  for h in range(2):
    for i in range(12):  # sparsemax of row i over keys 0..i (sort-based, Martins & Astudillo)
      z = np.sort(s[0, h, i, :i + 1])[::-1]
      cs = np.cumsum(z)
      kk = np.arange(1, i + 2)
      support = kk[1 + kk * z > cs].max()
      tau = (cs[support - 1] - 1) / support
      w[0, h, i, :i + 1] = np.maximum(s[0, h, i, :i + 1] - tau, 0)
  np.testing.assert_allclose(stats["attn_first_token"], w[0, :, 1:, 0].mean(), atol=1e-5)
  visible = np.tril(np.ones((12, 12), bool))
  zeros = ((w[0] < 1e-7) & visible).sum() / (2 * visible.sum())
  np.testing.assert_allclose(stats["attn_sparsity"], zeros, atol=2.0 / (2 * visible.sum()))


def test_task_generators():
  rng = np.random.default_rng(0)
  b = zoo_tasks.mqar_batch(rng, 3, 4, 24)
  for r in range(3):  # each weighted target is the value that followed the query key
    pairs = dict(zip(b["inputs"][r, :8:2], b["inputs"][r, 1:8:2], strict=True))
    for t in np.flatnonzero(b["weights"][r]):
      assert b["targets"][r, t] == pairs[b["inputs"][r, t]]
  evals = zoo_tasks.TASKS["length"].eval_sets(False)  # held-out text at the three lengths
  assert [b["inputs"].shape[1] for b in (evals[f"len{t}"][0] for t in zoo_tasks.LENGTHS)] == [
      256, 1024, 4096]
  assert zoo_tasks.listops_value(("SM", [9, ("MAX", [3, 7]), 5])) == 1
  assert zoo_tasks.listops_value(("MED", [4, 1, 9, 2])) == 2
  lb = zoo_tasks.listops_batch(rng, 2, 24, depth=2)
  assert lb["weights"].sum() == 2 and lb["inputs"][:, -1].tolist() == [2, 2]  # QUERY last
  train, held = zoo_tasks.grok_split(7)
  assert len(train["inputs"]) + len(held["inputs"]) == 49
  np.testing.assert_array_equal(train["targets"][:, -1],
                                (train["inputs"][:, 0] + train["inputs"][:, 1]) % 7)
  assert (train["inputs"][:, 2] == 7).all()  # the "=" token


def test_tiny_zoo_runs_resumes_and_reports(tmp_path):
  out = str(tmp_path)
  only = ["task=lm", "entrant=normalizer:softmax,normalizer:relu"]
  assert zoo.run_zoo(out, only, limit=1, tiny=True, log=lambda _: None) == 1  # stopped
  path = os.path.join(out, "results.jsonl")
  first = zoo.read_results(path)
  assert len(first) == 1 and first[0]["status"] == "ok", first
  assert first[0]["seed"] == 0 and first[0]["lr"] == zoo_tasks.TASKS["lm"].lrs[0]
  # resumed: the finished record is not rerun; the rest of both entrants' five runs are done
  assert zoo.run_zoo(out, only, tiny=True, log=lambda _: None) == 9
  records = zoo.read_results(path)
  assert records[0] == first[0]
  keys = [zoo.record_key(r) for r in records]
  assert len(set(keys)) == 10
  for name in ("normalizer:softmax", "normalizer:relu"):
    mine = [r for r in records if r["entrant"] == name]
    lr = zoo.chosen_lr(zoo_tasks.TASKS["lm"], [r for r in mine if r["seed"] == 0])
    assert sorted((r["seed"], r["lr"]) for r in mine if r["seed"] > 0) == [(1, lr), (2, lr)]
  softmax = next(r for r in records if r["entrant"] == "normalizer:softmax")
  assert 0.0 < softmax["attn_first_token"] <= 1.0 and softmax["attn_sparsity"] == 0.0
  assert softmax["tokens_per_s"] > 0 and softmax["params"] > 0
  assert {"date", "commit", "jax", "machine"} <= set(softmax)
  assert zoo.run_zoo(out, only, tiny=True, log=lambda _: None) == 0  # nothing left
  # one compiled program per unit: the initial parameters are train.model.make_model's
  task = zoo_tasks.TASKS["lm"]
  last = zoo.Entrant("normalizer:relu", {"normalizer": "relu"})  # (the reference runs first)
  programs, compiled_now = zoo._programs(task, last, tiny=True)
  assert not compiled_now
  want = nnx.to_pure_dict(nnx.state(model.make_model(programs.cfg, task.vocab_size, 2)))
  # (eager, as make_model itself: the same values, bit for bit)
  jax.tree.map(np.testing.assert_array_equal, programs.init(jnp.int32(2)), want)
  readme = open(zoo.write_report(out, tiny=True)).read()
  assert "| normalizer:softmax |" in readme and "| normalizer:relu |" in readme
  assert "| normalizer:sparsemax | — |" in readme  # missing cells are marked
  assert os.path.exists(os.path.join(out, "lm_loss.png"))
  json.dumps(records)


def test_bad_selection_is_refused(tmp_path):
  with pytest.raises(SystemExit, match="not an entrant"):
    zoo.run_zoo(str(tmp_path), ["entrant=normalizer:nope"], tiny=True)
  with pytest.raises(SystemExit, match="i/n"):
    zoo.run_zoo(str(tmp_path), [], parts="x", tiny=True)


@pytest.mark.slow  # ~7-10 s of compilation; the tiny zoo keeps the plumbing in the default run
def test_learning_rate_in_the_state_is_adamw_at_that_rate():
  # make_optimizer at peak 1, then the rate from the state, against make_optimizer at the
  # rate itself: the same updates up to float32 rounding (a product of two factors instead of
  # one), over warm-up, decay, clipping and weight decay.
  cfg = config.Config(workdir="x", steps=6, warmup_steps=2, learning_rate=3e-3)
  params = {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "bias": jnp.ones(4)}
  ours = optax.chain(train_lib.make_optimizer(dataclasses.replace(cfg, learning_rate=1.0)),
                     zoo.scale_by_lr_state(3e-3))
  ref = train_lib.make_optimizer(cfg)
  s_ours, s_ref, p_ours, p_ref = ours.init(params), ref.init(params), params, params
  for step in range(6):
    grads = jax.tree.map(lambda x, k=step + 1: jnp.sin(x * k) * 5.0, p_ref)
    u_ours, s_ours = ours.update(grads, s_ours, p_ours)
    u_ref, s_ref = ref.update(grads, s_ref, p_ref)
    p_ours, p_ref = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_ref, u_ref)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               p_ours, p_ref)
  assert float(jnp.max(jnp.abs(p_ref["kernel"] - params["kernel"]))) > 1e-3  # it moved


def _fake_unit(entrant, task, values, lrs=None, **stats):
  """Five records of a finished unit: the sweep on seed 0 (the middle rate best), then seeds 1
  and 2 at it; ``values`` the metric of seeds 0, 1, 2 at the chosen rate."""
  t = zoo_tasks.TASKS[task]
  lrs = lrs or t.lrs
  worse = -1.0 if t.higher_is_better else 99.0
  out = []
  for lr in lrs:
    v = values[0] if lr == lrs[1] else worse
    out.append(dict(protocol=zoo.PROTOCOL, entrant=entrant, task=task, seed=0, lr=lr,
                    status="ok", value=v, results={}, **stats))
  for seed, v in ((1, values[1]), (2, values[2])):
    out.append(dict(protocol=zoo.PROTOCOL, entrant=entrant, task=task, seed=seed, lr=lrs[1],
                    status="ok", value=v, results={}, **stats))
  return out


def test_guide_rows_quote_the_records_and_say_what_is_missing(tmp_path):
  records = (_fake_unit("normalizer:softmax", "lm", [2.0, 2.2, 2.1], attn_sparsity=0.0,
                        attn_first_token=0.6, tokens_per_s=1000.0)
             + _fake_unit("normalizer:sparsemax", "lm", [2.1, 2.2, 2.3], attn_sparsity=0.7,
                          attn_first_token=0.2, tokens_per_s=900.0)
             + _fake_unit("normalizer:entmax15", "lm", [2.6, 2.6, 2.6], attn_sparsity=0.5,
                          attn_first_token=0.1, tokens_per_s=800.0))
  rows = {r["need"].split(" (")[0]: r for r in zoo.guide_rows(records)}
  sparse = rows["exact sparsity"]
  # the sparse normalizers only (softmax is not), ranked by held-out loss: sparsemax, mean 2.2
  assert sparse["best"]["entrant"] == "normalizer:sparsemax" and sparse["status"] == "provisional"
  np.testing.assert_allclose([sparse["best"]["mean"], sparse["best"]["std"]],
                             [2.2, np.std([2.1, 2.2, 2.3], ddof=1)])
  # (means of three float64 values: a few ulps)
  assert sparse["best"]["attn_sparsity"] == pytest.approx(0.7, rel=1e-12)
  assert sparse["reference"]["mean"] == pytest.approx(2.1, rel=1e-12)
  # no sink among those as good as softmax (2.1 ± 0.1): sparsemax ties (2.2 - 2.1 <= 0.1 +
  # 0.1); entmax15 (2.6 ± 0) does not, so its 0.1 is out and sparsemax's 0.2 beats softmax's 0.6
  assert rows["no attention sink"]["best"]["entrant"] == "normalizer:sparsemax"
  assert rows["speed at softmax's quality"]["best"]["entrant"] == "normalizer:softmax"
  assert rows["length robustness"]["status"] == "waiting"
  assert rows["length robustness"]["best"] is None
  text = zoo.guide_markdown(records)
  assert "waits for the zoo's runs" in text and "`normalizer:sparsemax`" in text
  assert "0 of 7 rows backed by complete zoo results" in text
  doc = tmp_path / "guide.md"
  doc.write_text(f"intro\n{zoo.GUIDE_BEGIN}\nold\n{zoo.GUIDE_END}\nafter\n")
  zoo.write_guide(records, str(doc))
  written = doc.read_text()
  assert written.startswith("intro\n") and written.endswith(f"{zoo.GUIDE_END}\nafter\n")
  assert "old" not in written and text in written
