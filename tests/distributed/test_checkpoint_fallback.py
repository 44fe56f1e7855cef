"""Resuming past unreadable checkpoints (`checkpoints.restore_newest`)."""
from __future__ import annotations

import gc
import glob
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.training import checkpoints, state as state_lib
from dpjax import verify
from dpjax.privacy import ledger as ledger_lib, sampling, secret as secret_lib

STEPS = (2, 4, 6)


def state_at(step: int) -> state_lib.TrainState:
  return state_lib.TrainState(
      jnp.int32(step), {"w": jnp.full((3, 4), step, jnp.float32)},
      {"mu": jnp.arange(5, dtype=jnp.float32) * step}, jnp.int32(step))


def ledger_at(step: int) -> ledger_lib.PrivacyLedger:
  ledger = ledger_lib.PrivacyLedger(
      accountant="rdp",
      sampling=sampling.PoissonSampler(1000, 10, seed=0).describe(),
      noise_multiplier=1.0, clip_norm=1.0, dataset_size=1000, delta=1e-5,
      target_epsilon=10.0)
  ledger.record_dp_steps(step)
  return ledger


PLAN = {"dataset_size": 1000, "batch_size": 10, "steps": 8,
        "sampling": "poisson", "clip_norm": 1.0, "delta": 1e-5,
        "target_epsilon": 10.0, "noise_multiplier": 1.0, "accountant": "rdp",
        "seed": 0, "noise_multiplier_given": True}
SECRET = secret_lib.RunSecret.pinned(5)
KEY = SECRET.meta_key()


def meta_at(step: int) -> checkpoints.RunMeta:
  ledger = ledger_at(step).to_json()
  return checkpoints.RunMeta(
      ledger=ledger, plan=PLAN, model_class="T5Config",
      model_config={}, sampler=ledger["sampling"],
      mixture_or_task_name="task",
      data_position=checkpoints.DataPosition(step=step, seed=0, dp_steps=step),
      task_feature_lengths={})


@pytest.fixture
def model_dir(tmp_path):
  SECRET.save(str(tmp_path))
  mngr = checkpoints.manager(str(tmp_path))
  for step in STEPS:
    checkpoints.save(mngr, step, state_at(step),
                     meta_at(step), str(tmp_path), KEY)
  mngr.close()
  return tmp_path


def truncate_arrays(d):
  for f in glob.glob(os.path.join(d, "state", "d", "*")):
    open(f, "w").close()


def halve_arrays(d):
  for f in glob.glob(os.path.join(d, "state", "d", "*")):
    with open(f, "rb") as fh:
      data = fh.read()
    with open(f, "wb") as fh:
      fh.write(data[:len(data) // 2])


def drop_meta(d):
  shutil.rmtree(os.path.join(d, "meta"))


# orbax's failed reads leave a callback on an event loop it has closed; each
# such test collects it before it ends, so that the warning is its own.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", [truncate_arrays, halve_arrays, drop_meta])
def test_unreadable_newest_falls_back_to_the_previous(model_dir, corrupt,
                                                      capsys):
  corrupt(str(model_dir / "checkpoints" / "6"))
  mngr = checkpoints.manager(str(model_dir))
  step, state, meta = checkpoints.restore_newest(mngr, state_at(0),
                                                 str(model_dir), KEY)
  assert step == 4
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(state_at(4))):
    np.testing.assert_array_equal(got, want)
  assert meta.ledger == ledger_at(4).to_json()
  out = capsys.readouterr().out
  assert "checkpoint at step 6 is unreadable" in out
  assert "resuming from the previous checkpoint, step 4 (not 6)" in out
  # Moved aside, so the replayed step 6 is saved again.
  assert os.listdir(model_dir / checkpoints.CORRUPT_DIRNAME) == ["6"]
  assert mngr.all_steps() == [2, 4]
  checkpoints.save(mngr, 6, state_at(6), meta_at(6),
                   str(model_dir), KEY)
  assert verify.newest(mngr, KEY)[0] == 6
  assert ledger_lib.PrivacyLedger.load(
      model_dir / ledger_lib.LEDGER_FILENAME).steps == 6
  mngr.close()
  gc.collect()


def test_missing_meta_is_skipped_when_planning(model_dir):
  drop_meta(str(model_dir / "checkpoints" / "6"))
  step, meta = verify.run_meta(str(model_dir))
  assert step == 4 and meta.ledger["steps"] == 4


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_nothing_readable_raises_and_moves_nothing(model_dir):
  for step in STEPS:
    truncate_arrays(str(model_dir / "checkpoints" / str(step)))
  mngr = checkpoints.manager(str(model_dir))
  with pytest.raises(checkpoints.UnreadableCheckpointError,
                     match="step 6: .*step 4: .*step 2: "):
    checkpoints.restore_newest(mngr, state_at(0), str(model_dir), KEY)
  assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4", "6"]
  assert not (model_dir / checkpoints.CORRUPT_DIRNAME).exists()
  mngr.close()
  gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_all_metas_unreadable_refuses_instead_of_starting_over(model_dir):
  for step in STEPS:
    drop_meta(str(model_dir / "checkpoints" / str(step)))
  mngr = checkpoints.manager(str(model_dir))
  with pytest.raises(checkpoints.UnreadableCheckpointError,
                     match="no checkpoint in .* reads back .*step 6 .*"
                           "Move that directory aside"):
    verify.newest(mngr, KEY)
  mngr.close()


def test_a_save_orbax_declines_is_an_error(model_dir):
  """Orbax does not save over a step directory that exists (here: one whose
  meta was lost); before, the run went on as if it had saved."""
  drop_meta(str(model_dir / "checkpoints" / "6"))
  mngr = checkpoints.manager(str(model_dir))
  with pytest.raises(checkpoints.CheckpointSaveError, match="step 6"):
    checkpoints.save(mngr, 6, state_at(6), meta_at(6),
                     str(model_dir), KEY)
  assert ledger_lib.PrivacyLedger.load(
      model_dir / ledger_lib.LEDGER_FILENAME).steps == 6  # not rewritten
  mngr.close()


def test_a_full_disk_fails_the_save_in_one_line_and_leaves_no_temporary(
    model_dir, monkeypatch):
  mngr = checkpoints.manager(str(model_dir))

  def disk_full(self, step, *args, **kwargs):
    os.makedirs(os.path.join(str(self.directory),
                             f"{step}.orbax-checkpoint-tmp-1234", "state"))
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(type(mngr), "save", disk_full)
  with pytest.raises(checkpoints.CheckpointSaveError) as e:
    checkpoints.save(mngr, 8, state_at(8), meta_at(8),
                     str(model_dir), KEY)
  assert "step 8" in str(e.value) and "No space left" in str(e.value)
  assert "\n" not in str(e.value)
  assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4", "6"]
  mngr.close()


class _LegacyNoiseState(NamedTuple):
  count: jax.Array


class _LegacyState(NamedTuple):
  step: jax.Array
  params: dict
  opt_state: tuple


def test_a_checkpoint_with_the_counter_in_the_optimizer_state_resumes(tmp_path):
  """Checkpoints written before `TrainState.noise_count` kept the noise
  counter as the first part of an optax chain state (`opt_state =
  (PrivatizeState(count), base state)`). They restore into the current
  layout with the counter and the base state as saved."""
  mngr = checkpoints.manager(str(tmp_path))
  want = state_at(6)._replace(noise_count=jnp.int32(5))
  legacy = _LegacyState(want.step, want.params,
                        (_LegacyNoiseState(want.noise_count), want.opt_state))
  checkpoints.save(mngr, 6, legacy, meta_at(6), str(tmp_path), KEY)
  step, state, _ = checkpoints.restore_newest(mngr, state_at(0), str(tmp_path),
                                              KEY)
  mngr.close()
  assert step == 6 and isinstance(state, state_lib.TrainState)
  jax.tree.map(np.testing.assert_array_equal, state, want)
  assert int(state.noise_count) == 5 != int(state.step)
