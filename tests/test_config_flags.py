"""The command line's config flags, generated from `EARConfig` / `HParams`: every field is one."""
import dataclasses

from absl import flags
import pytest

from ear_jax.core import config as config_lib
from experiments import config_flags


def _flag_values():
  fv = flags.FlagValues()
  return fv, config_flags.define_config_flags(fv), config_flags.define_hparam_flags(fv)


def test_every_config_field_but_the_data_fixed_ones_and_every_hparam_is_a_flag_with_its_help():
  fv, cfg, hp = _flag_values()
  fields = {f.name for f in dataclasses.fields(config_lib.EARConfig)}
  assert set(cfg) == fields - set(config_flags.SET_BY_DATA)
  assert set(hp) == set(config_lib.HPARAM_DEFAULTS)
  assert "Plackett-Luce" in fv["loss_form"].help  # the docstring's Attributes entry
  assert "Eq. (7) relevance weight" in fv["lambda_rel"].help  # the field's comment
  assert all(len(fv[name].help) > len(f"EARConfig.{name}: ") + 25 for name in cfg)


def test_flags_set_the_fields_they_name():
  fv, cfg, hp = _flag_values()
  fv(["prog", "--train_slate=gumbel", "--nouse_replay", "--test_rounds=2", "--guard_z=0.1",
      "--guard_holdout=5", "--tau=0.25"])
  over = config_flags.overrides(cfg)
  assert over == {"train_slate": "gumbel", "use_replay": False, "test_rounds": 2,
                  "guard_z": 0.1, "guard_holdout": 5}
  c = config_lib.EARConfig.for_method("ear", **over)
  assert (c.train_slate, c.use_replay, c.eval_rounds) == ("gumbel", False, 2)
  assert config_flags.overrides(hp) == {"tau": 0.25}


@pytest.mark.parametrize("arg", ["--replay_size=0", "--guard_holdout=-1", "--tau=0",
                                 "--guard_z=-1", "--loss_form=pl", "--optimizer=rmsprop"])
def test_out_of_bounds_values_are_refused_naming_the_flag(arg):
  fv, _, _ = _flag_values()
  with pytest.raises(flags.Error, match=arg.split("=")[0].lstrip("-")):
    fv(["prog", arg])
