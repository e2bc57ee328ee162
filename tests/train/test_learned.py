"""--learned: normalizer hyperparameters learned per head train, and checkpoints hold them."""

import numpy as np
import pytest

from jaxsoft import normalizers
from jaxsoft.nn import param_transform
from tests import helpers
from train import checkpoint, config, sharding
from train import train as train_lib

# A learning rate large enough that a few steps visibly move a per-head scalar.
TINY = helpers.train_argv("--learning_rate", "3e-2", "--warmup_steps", "1")


@pytest.mark.parametrize("normalizer,learned,param", [
    ("ssmax", "s", "s"),                  # SSMax's length scale (A09)
    ("softmax", "sink", "sink_logit"),    # a learned sink logit: softmax becomes softmax_sink
])
def test_learned_normalizer_parameters_train_and_are_checkpointed(tmp_path, normalizer, learned,
                                                                  param):
  workdir = str(tmp_path / "run")
  argv = TINY + ["--workdir", workdir, "--normalizer", normalizer, "--learned", learned]
  assert train_lib.main(argv) == 0
  cfg = config.from_argv(argv)[0]
  name, names = config.attention_normalizer(cfg)
  assert names == (param,)
  spec = normalizers.get(name)
  _, _, _, _, abstract_state, _, _ = train_lib.build(cfg, sharding.make_mesh(cfg))
  params, step = checkpoint.restore_params(workdir, abstract_state["params"])
  assert step == helpers.TRAIN_STEPS
  free = np.asarray(params["blocks"][0]["attn"]["learned"][param])
  assert free.shape == (cfg.num_heads,)
  # Each head started at the normalizer's default and moved, staying in the valid range.
  spec_param = spec.param(param)
  start = spec_param.default if spec_param.default is not None else spec_param.sample
  values = np.asarray(param_transform(spec_param)[0](free))
  assert np.all(np.abs(values - start) > 1e-4), values
  assert np.all(np.isfinite(values))
  if spec_param.low is not None:
    assert np.all(values > spec_param.low)
