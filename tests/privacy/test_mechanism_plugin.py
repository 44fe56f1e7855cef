"""A mechanism defined in this file alone trains end to end.

`NoisyCount` is DP-SGD that divides the noisy gradient sum by a noisy count
of the sampled examples (a second Gaussian release of sensitivity 1 on the
same sample) instead of the expected batch size. It subclasses
`mechanisms.DPSGD`, overrides what differs and registers itself: nothing
else in dpjax knows of it, yet the plan calibrates σ with its count, the
step releases both, the ledger records both, and a checkpoint of it is
verified and resumed by the plan it recorded.
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import dp_accounting
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import pld

from dpjax import configurables, errors, gin_cli, verify
from dpjax.privacy import ledger as ledger_lib, mechanisms, noise
from dpjax.privacy import optimizers
from dpjax.privacy.mechanisms import multi_loss
from dpjax.models import t5
from dpjax.training import run_config
from tests import test_trainer

COUNT = "sampled_count"
COUNT_STREAM = 0x6E637431  # apart from the gradient noise


@mechanisms.register
@dataclasses.dataclass(frozen=True)
class NoisyCount(mechanisms.DPSGD):
  """DP-SGD normalised by a noisy count of the sample (sensitivity 1)."""
  name: ClassVar[str] = "noisy_count"
  record_key: ClassVar[str] = "noisy_count"
  setting: ClassVar[str] = "train.mechanism = 'noisy_count'"

  count_stddev: float = 4.0

  @classmethod
  def from_config(cls, config):
    if config.sampling_method != "poisson":
      raise errors.UsageError("noisy_count counts a Poisson sample")
    return cls("poisson")

  @classmethod
  def from_plan(cls, plan):
    return cls(plan["sampling"], **plan["noisy_count"])

  def record(self):
    return {"count_stddev": self.count_stddev}

  def step_multipliers(self, sigma, releases):
    return (float(sigma),) * releases + (self.count_stddev,)

  def accumulate(self, accumulate):
    def counting(params, sums, batch, mask, step, call, clip_norms):
      sums = dict(sums)
      count = sums.pop(COUNT)
      sums, metrics = accumulate(params, sums, batch, mask, step, call,
                                 clip_norms)
      sums[COUNT] = count + metrics[multi_loss.LOSS]["num_examples"].astype(
          jnp.float32)
      return sums, metrics
    return counting

  def extra_sums(self, names):
    return {COUNT: jnp.zeros((), jnp.float32)}

  def privatizer(self, *, sensitivities, noise_multiplier, normalizer,
                 trainable=None, layouts=None):
    noisy_sum = noise.privatizer(
        noise_multipliers={k: noise_multiplier for k in sensitivities},
        sensitivities=sensitivities, normalizer=1.0, trainable=trainable,
        layouts=layouts)

    def update(sums, clip_norms, noise_state, count, noise_secret):
      sums = dict(sums)
      sampled = sums.pop(COUNT) + self.count_stddev * noise.standard_normal(
          noise.stream_keys(noise_secret, COUNT_STREAM, count), ())
      release = noisy_sum(sums, count, noise_secret)
      return (jax.tree.map(lambda x: x / jnp.maximum(sampled, 1.0), release),
              clip_norms, noise_state)

    return optimizers.Privatizer(lambda params: (None, None), update)


STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("noisy_count")
  gin.clear_config()
  gin_cli.configure(["quickstart.gin"], [
      f"MODEL_DIR = '{model_dir}'", *test_trainer.TINY,
      f"TRAIN_STEPS = {STEPS}", "train.mechanism = 'noisy_count'"])
  try:
    return model_dir, configurables.train()
  finally:
    gin.clear_config()


def test_it_is_selectable_by_name():
  assert "noisy_count" in mechanisms.names()
  config = _config(mechanism="noisy_count")
  assert isinstance(mechanisms.from_config(config), NoisyCount)
  with pytest.raises(errors.UsageError, match="does not combine"):
    mechanisms.from_config(_config(mechanism="noisy_count",
                                               privacy_unit="user"))


def test_the_ledger_composes_both_releases_as_dp_accounting(run):
  """ε is dp-accounting's PLD accountant over T Poisson-sampled pairs of
  Gaussians (the sum's σ and the count's: on the same sample, one Gaussian
  of multiplier (σ⁻² + 4⁻²)^-1/2), and σ was calibrated with the count in
  the composition."""
  model_dir, result = run
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))
  assert [e.to_json()["noise_multipliers"] for e in ledger.events] == [
      [ledger.noise_multiplier, 4.0]]
  pair = dp_accounting.GaussianDpEvent(
      (ledger.noise_multiplier ** -2 + 4.0 ** -2) ** -0.5)
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          test_trainer.Q, pair), STEPS)).get_epsilon(ledger.delta)
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 3.0 <= result["epsilon_spent"] <= 3.0


def test_the_checkpoint_is_verified_by_the_plan_it_recorded(run):
  model_dir, _ = run
  step, meta = verify.run_meta(str(model_dir))
  assert step == STEPS and meta.plan["noisy_count"] == {"count_stddev": 4.0}
  assert verify.run_ledger(str(model_dir)).steps == STEPS


def test_the_update_is_divided_by_the_noisy_count():
  """One release against an independent computation of the same draws."""
  secret = jnp.arange(4, dtype=jnp.uint32)
  sums = {multi_loss.LOSS: {"w": jnp.full(3, 6.0)}, COUNT: jnp.float32(5.0)}
  update, _, _ = NoisyCount("poisson", 2.0).privatizer(
      sensitivities={multi_loss.LOSS: 0.5}, noise_multiplier=1.5,
      normalizer=99.0).update(sums, None, None, 7, secret)
  noisy = noise.add_gaussian_noise({"w": jnp.full(3, 6.0)},
                                   noise.noise_key(secret, 7), 0.75)["w"]
  count = 5.0 + 2.0 * float(noise.standard_normal(
      noise.stream_keys(secret, COUNT_STREAM, 7), ()))
  np.testing.assert_allclose(update["w"], noisy / max(count, 1.0), rtol=1e-6)


def _config(**overrides):
  """A RunConfig with the given settings (nothing is read)."""
  return run_config.RunConfig(
      model_dir="unused", model_config=t5.T5Config(),
      mixture_or_task_name="unused",
      task_feature_lengths={"inputs": 8, "targets": 8}, batch_size=4,
      **overrides)
