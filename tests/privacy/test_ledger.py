"""Privacy ledger: recording, budget checks, atomic persistence."""

import json
import math
import os

import pytest

from dpjax.privacy import accounting
from dpjax.privacy import ledger as ledger_lib
from dpjax.privacy import sampling


def make_ledger(target=3.0):
  sampler = sampling.PoissonSampler(10_000, 100, seed=0)
  return ledger_lib.PrivacyLedger(
      accountant="rdp", sampling=sampler.describe(), noise_multiplier=1.0,
      clip_norm=1.0, dataset_size=10_000, delta=1e-5, target_epsilon=target)


def test_record_dp_steps_merges_identical_parameters():
  ledger = make_ledger()
  ledger.record_dp_steps()
  ledger.record_dp_steps(4, noise_multipliers=[1.0])
  ledger.record_dp_steps(2, noise_multipliers=(1.5,))
  ledger.record(accounting.Gaussian(5.0, 1))
  ledger.record(accounting.Gaussian(5.0, 2))
  assert ledger.steps == 7
  assert ledger.events == [accounting.PoissonGaussian(0.01, (1.0,), 5),
                           accounting.PoissonGaussian(0.01, (1.5,), 2),
                           accounting.Gaussian(5.0, 3)]
  assert ledger.epsilon_spent() == accounting.epsilon(ledger.events, 1e-5,
                                                      "rdp")


def test_shuffled_steps_count_each_epoch_once():
  sampler = sampling.ShuffleSampler(1000, 100, seed=0)  # 10 steps per epoch
  ledger = ledger_lib.PrivacyLedger(
      accountant="rdp", sampling=sampler.describe(), noise_multiplier=2.0,
      clip_norm=1.0, dataset_size=1000, delta=1e-5, target_epsilon=10.0)
  for _ in range(25):  # step by step: 2.5 epochs
    ledger.record_dp_steps()
  assert ledger.steps == 25
  assert ledger.events == [accounting.Gaussian(1.0, 3)]
  assert ledger.planned_events(30) == []  # epoch 3 already counted
  assert ledger.planned_events(31) == [accounting.Gaussian(1.0, 1)]


def test_check_budget():
  ledger = make_ledger(target=2.0)
  ledger.record_dp_steps(100, noise_multipliers=(1.0,))
  ledger.check_budget([accounting.PoissonGaussian(0.01, (1.0,), 10)])
  planned = [accounting.PoissonGaussian(0.01, (1.0,), 5000)]
  total = accounting.epsilon(ledger.events + planned, 1e-5, "rdp")
  with pytest.raises(ledger_lib.BudgetExceededError) as info:
    ledger.check_budget(planned)
  assert isinstance(info.value, ValueError)
  message = str(info.value)
  assert f"{total:.6g}" in message and "target 2 " in message
  assert f"{total - 2.0:.4g}" in message
  assert f"{100 * (total - 2.0) / 2.0:.2f}%" in message
  make_ledger(target=math.inf).check_budget(planned)


def test_save_load_round_trip(tmp_path):
  ledger = make_ledger(target=math.inf)
  ledger.record_dp_steps(3, noise_multipliers=(1.0, 2.0))
  ledger.record(accounting.Gaussian(4.0, 2))
  path = tmp_path / ledger_lib.LEDGER_FILENAME
  ledger.save(path)
  raw = json.loads(path.read_text())  # Strict JSON: no Infinity literal.
  assert raw["target_epsilon"] == "inf"
  assert raw["epsilon_spent"] == pytest.approx(ledger.epsilon_spent())
  loaded = ledger_lib.PrivacyLedger.load(path)
  assert loaded == ledger
  assert os.listdir(tmp_path) == [ledger_lib.LEDGER_FILENAME]


@pytest.mark.parametrize("fail", ["os.replace", "os.fsync"])
def test_interrupted_save_keeps_previous_ledger(tmp_path, monkeypatch, fail):
  path = tmp_path / ledger_lib.LEDGER_FILENAME
  ledger = make_ledger()
  ledger.record_dp_steps(10, noise_multipliers=(1.0,))
  ledger.save(path)
  before = path.read_text()

  def crash(*args, **kwargs):
    raise OSError("simulated crash")

  ledger.record_dp_steps(10, noise_multipliers=(1.0,))
  monkeypatch.setattr(ledger_lib.os, fail.split(".")[1], crash)
  with pytest.raises(OSError, match="simulated"):
    ledger.save(path)
  monkeypatch.undo()
  assert path.read_text() == before
  assert ledger_lib.PrivacyLedger.load(path).steps == 10
  assert os.listdir(tmp_path) == [ledger_lib.LEDGER_FILENAME]


def test_two_stage_ledger_equals_one_accountant_run(tmp_path):
  """Stage 2 composed after stage 1 (same σ, same q) spends exactly what one
  dp-accounting run over T1 + T2 steps spends, and survives a round trip."""
  stage1, stage2 = make_ledger(target=8.0), make_ledger(target=8.0)
  stage1.record_dp_steps(30)
  stage2.compose_after(stage1)
  stage2.record_dp_steps(70)
  direct = accounting.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, "rdp")
  assert stage2.epsilon_spent() == pytest.approx(direct, rel=1e-9)
  assert stage2.epsilon_spent() > stage1.epsilon_spent()
  stage2.save(tmp_path / "l.json")
  loaded = ledger_lib.PrivacyLedger.load(tmp_path / "l.json")
  assert loaded.epsilon_spent() == stage2.epsilon_spent()
  # The budget check counts the prior stage: with a budget of exactly
  # T1 + T2 steps, one more step is refused, though T2 + 1 alone would fit.
  exact = make_ledger(target=direct)
  exact.compose_after(stage1)
  exact.record_dp_steps(70)
  exact.check_budget([])
  with pytest.raises(ledger_lib.BudgetExceededError):
    exact.check_budget(exact.planned_events(71))
  alone = make_ledger(target=direct)
  alone.record_dp_steps(70)
  alone.check_budget(alone.planned_events(71))
  with pytest.raises(ValueError, match="another dataset"):
    ledger_lib.PrivacyLedger(
        accountant="rdp", sampling={}, noise_multiplier=1.0, clip_norm=1.0,
        dataset_size=5, delta=1e-5, target_epsilon=1.0).compose_after(stage1)
