"""Bad configurations stop with a message naming the problem, before any work is done."""

import dataclasses
import os

import pytest

from train import config
from train import train as train_lib
from train.sharding import check_batch

TINY = ["--seq_len", "8", "--batch_size", "4", "--d_model", "16", "--num_layers", "1",
        "--num_heads", "2", "--mlp_dim", "16", "--steps", "2", "--warmup_steps", "1",
        "--progress", "off"]


def _fails(argv, *needles):
  """main(argv) exits 2 with one ``train.py: error: ...`` line on stderr naming ``needles``."""
  with pytest.raises(SystemExit) as info:
    train_lib.main(argv)
  err = _CAPTURE.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("train.py:")]
  assert info.value.code == 2, (info.value.code, err)
  assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
  message = lines[0]
  for needle in needles:
    assert needle in message, message
  return message


_CAPTURE = None


@pytest.fixture(autouse=True)
def _capture(capsys):
  global _CAPTURE
  _CAPTURE = capsys
  yield
  _CAPTURE = None


def test_unknown_normalizer_is_named_and_nothing_is_written(tmp_path):
  workdir = tmp_path / "run"
  _fails(TINY + ["--workdir", str(workdir), "--normalizer", "no_such_max"],
         "--normalizer", "no_such_max", "softmax")
  assert not workdir.exists()


def test_unknown_normalizer_in_compare_is_named(tmp_path):
  workdir = tmp_path / "cmp"
  _fails(TINY + ["--workdir", str(workdir), "--compare", "softmax,nope_max"], "nope_max")
  assert not workdir.exists()


def test_bad_normalizer_hyperparameter_is_named(tmp_path):
  _fails(TINY + ["--workdir", str(tmp_path / "r"), "--normalizer", "softmax",
                 "--normalizer_params", '{"temperature": -1}'], "temperature")


def test_batch_not_divisible_by_devices_is_named():
  with pytest.raises(config.ConfigError, match=r"--batch_size \(12\).*number of devices \(8\)"):
    check_batch(12, 1, 8)
  with pytest.raises(config.ConfigError, match=r"micro-batch.*\(6\).*devices \(4\)"):
    check_batch(12, 2, 4)
  check_batch(16, 2, 8)  # divisible: no error


def test_batch_not_divisible_by_grad_accum_is_named(tmp_path):
  workdir = tmp_path / "run"
  _fails(TINY + ["--workdir", str(workdir), "--grad_accum", "3"], "--batch_size (4)",
         "--grad_accum (3)")


def test_unwritable_workdir_is_named(tmp_path):
  if os.geteuid() == 0:
    # root ignores file permissions; sysfs refuses new directories even to root.
    workdir = "/sys/jaxsoft_train_test/run"
  else:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    workdir = str(locked / "run")
  message = _fails(TINY + ["--workdir", workdir], "--workdir", workdir)
  assert "cannot be created" in message or "not writable" in message


def test_missing_workdir_and_unknown_field_are_named():
  _fails(TINY, "--workdir")
  _fails(TINY + ["--workdir", "/tmp/x", "--set", "no_such_field=1"], "no_such_field")


def test_resuming_with_a_different_model_is_refused(tmp_path):
  cfg = config.Config(workdir=str(tmp_path), d_model=64)
  config.save(cfg, str(tmp_path / "config.json"))
  _fails(["--workdir", str(tmp_path), "--d_model", "32", "--num_heads", "2"], "d_model",
         "saved 64", "now 32")
  # Training-only fields may change on resume, and JSON spelling does not matter.
  saved = config.load(str(tmp_path / "config.json"))
  config.check_resume_compatible(dataclasses.replace(cfg, batch_size=8, weight_decay=0.0), saved)
  config.check_resume_compatible(dataclasses.replace(cfg, normalizer_params=" { } "), saved)
  # A config.json from before a field existed: the missing field counts as its default.
  del saved["learned"]
  config.check_resume_compatible(cfg, saved)


@pytest.mark.parametrize("flag,value", [("steps", "999"), ("learning_rate", "1.0"),
                                        ("warmup_steps", "7"), ("min_lr_ratio", "0.5")])
def test_resuming_with_a_different_schedule_is_refused_without_reschedule(tmp_path, flag, value):
  cfg = dataclasses.replace(config.from_argv(TINY)[0], workdir=str(tmp_path))
  config.save(cfg, str(tmp_path / "config.json"))
  _fails(TINY + ["--workdir", str(tmp_path), f"--{flag}", value], flag, "--reschedule",
         "learning-rate schedule")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # nothing written
  # --reschedule accepts it (the schedule is recomputed; see test_resume).
  config.check_resume_compatible(
      dataclasses.replace(cfg, **{flag: type(getattr(cfg, flag))(value)}, reschedule=True),
      config.load(str(tmp_path / "config.json")))


def test_pallas_on_cpu_is_refused_naming_interpret_mode_before_any_write(tmp_path, monkeypatch):
  monkeypatch.delenv("JAXSOFT_PALLAS_INTERPRET", raising=False)
  for impl in ("pallas", "pallas_triton", "pallas_mosaic_tpu"):
    workdir = tmp_path / impl
    _fails(TINY + ["--workdir", str(workdir), "--implementation", impl],
           f"--implementation {impl}", "JAXSOFT_PALLAS_INTERPRET=1")
    assert not workdir.exists()
  # In interpret mode it is accepted (checked, not run: the kernels are slow on CPU).
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  config.check_implementation(config.from_argv(TINY + ["--implementation", "pallas"])[0])


def test_missing_init_from_is_refused_before_any_write(tmp_path):
  workdir = tmp_path / "run"
  missing = tmp_path / "no_such_run"
  _fails(TINY + ["--workdir", str(workdir), "--init_from", str(missing)], "--init_from",
         str(missing), "does not exist")
  assert not workdir.exists()
  empty = tmp_path / "empty"
  empty.mkdir()
  _fails(TINY + ["--workdir", str(workdir), "--init_from", str(empty)], "--init_from",
         "no checkpoint")
  assert not workdir.exists()


def test_unknown_learned_hyperparameter_is_named(tmp_path):
  workdir = tmp_path / "run"
  _fails(TINY + ["--workdir", str(workdir), "--normalizer", "ssmax", "--learned", "alpha"],
         "--learned", "'alpha'", "'s'")
  _fails(TINY + ["--workdir", str(workdir), "--normalizer", "ssmax", "--learned", "s",
                 "--normalizer_params", '{"s": 1.0}'], "--learned", "'s'", "fixed")
  assert not workdir.exists()
  cfg = config.from_argv(TINY + ["--workdir", str(workdir), "--learned", " sink , sink,"])[0]
  assert config.attention_normalizer(cfg) == ("softmax_sink", ("sink_logit",))
  config.validate(cfg, check_workdir=False)


def test_precedence_defaults_preset_set_flags():
  cfg, _ = config.from_argv(["--preset", "smoke", "--set", "d_model=32", "--set", "steps=7",
                             "--steps", "9", "--set", "fsdp=true"])
  assert cfg.d_model == 32 and cfg.steps == 9 and cfg.fsdp is True
  assert cfg.seq_len == config.PRESETS["smoke"]["seq_len"]
  assert cfg.mlp_dim == config.PRESETS["smoke"]["mlp_dim"]
  # Every field is a flag.
  parser = config.make_parser()
  flags = {a.dest for a in parser._actions}  # pylint: disable=protected-access
  assert {f.name for f in dataclasses.fields(config.Config)} <= flags


def test_compare_without_workdir_is_named(tmp_path):
  """(--compare checks each compared run; their workdirs are under --workdir, which is needed.)"""
  _fails(TINY + ["--compare", "softmax,sigmoid"], "--workdir is required")


def test_bare_boolean_flag_means_true():
  cfg, _ = config.from_argv(TINY + ["--workdir", "w", "--check_numerics", "--fsdp", "false"])
  assert cfg.check_numerics is True and cfg.fsdp is False


def test_bare_fsdp_flag_means_true():
  assert config.from_argv(TINY + ["--workdir", "w", "--fsdp"])[0].fsdp is True
  assert config.from_argv(TINY + ["--workdir", "w", "--fsdp", "false"])[0].fsdp is False
  assert config.from_argv(TINY + ["--workdir", "w"])[0].fsdp is False


def _group_actions():
  """{group title: [flags]} of train.py's parser, in the order --help shows them."""
  parser = config.make_parser()
  return {group.title: [a for a in group._group_actions]  # pylint: disable=protected-access
          for group in parser._action_groups}  # pylint: disable=protected-access


def test_every_field_is_in_exactly_one_help_topic():
  keys = [key for key, _, _ in config.GROUPS]
  assert len(set(keys)) == len(keys)
  for field in dataclasses.fields(config.Config):
    assert field.metadata["group"] in keys, field.name
  titles = {key: title for key, title, _ in config.GROUPS}
  where: dict[str, list[str]] = {}
  for title, actions in _group_actions().items():
    for action in actions:
      where.setdefault(action.dest, []).append(title)
  for field in dataclasses.fields(config.Config):
    assert where[field.name] == [titles[field.metadata["group"]]], (field.name, where[field.name])
  for flag in ("preset", "set", "compare"):
    assert where[flag] == [titles[config.RUN]]
  # Every topic has flags; the topics of the issue are all there, in this order; argparse's own
  # groups hold only --help.
  builtin = ("positional arguments", "options")
  assert [a.dest for t in builtin for a in _group_actions()[t]] == ["help"]
  shown = [title for title in _group_actions() if title not in builtin]
  assert shown == ["data", "model", "attention / normalizer", "optimizer", "evaluation",
                   "checkpointing / run", "distribution", "logging / monitoring",
                   "testing hooks"]
  assert all(_group_actions()[title] for title in shown)


def test_every_flag_has_help_with_its_default(capsys):
  for title, actions in _group_actions().items():
    for action in actions:
      assert action.help and action.help.strip(), (title, action.dest)
      if action.dest != "help":
        assert "(default: " in action.help, action.dest
  with pytest.raises(SystemExit) as info:
    config.from_argv(["--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  # Each field's flag is printed in its topic's section (between its title and the next one).
  titles = [title for _, title, _ in config.GROUPS] + ["examples (from"]
  for (key, title, _), after in zip(config.GROUPS, titles[1:], strict=True):
    section = out.split(f"\n{title}:\n", 1)[1].split(f"\n{after}", 1)[0]
    for field in dataclasses.fields(config.Config):
      assert (f"--{field.name} " in section) == (field.metadata["group"] == key), (key, field.name)
  words = " ".join(out.split())
  for field in dataclasses.fields(config.Config):
    help_ = " ".join(field.metadata["help"].split())
    assert help_[:30] in words, field.name
    assert f"(default: {field.default!r})" in words, field.name
