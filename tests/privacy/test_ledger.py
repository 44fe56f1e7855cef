"""Privacy ledger: recording, budget checks, atomic persistence."""

import json
import math
import os

import dp_accounting
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


OVERSPENDING = [accounting.PoissonGaussian(0.01, (1.0,), 5000)]


def spent_100_steps():
  ledger = make_ledger(target=2.0)
  ledger.record_dp_steps(100, noise_multipliers=(1.0,))
  return ledger


def _dp_accounting_epsilon(steps: int) -> float:
  """ε of `steps` Poisson-subsampled Gaussian releases (q = 0.01, σ = 1),
  by dp-accounting's RDP accountant called directly."""
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          0.01, dp_accounting.GaussianDpEvent(1.0)), steps)
  accountant = dp_accounting.rdp.RdpAccountant(orders=accounting.RDP_ORDERS)
  return accountant.compose(event).get_epsilon(1e-5)


def test_check_budget_accepts_up_to_the_last_step_that_fits():
  """After 100 steps at target 2, the plan of k more is accepted exactly
  while dp-accounting says 100 + k steps stay within ε = 2."""
  fits = lambda k: _dp_accounting_epsilon(100 + k) <= 2.0
  lo, hi = 0, 100_000  # fits(lo), not fits(hi)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  ledger = spent_100_steps()
  ledger.check_budget([accounting.PoissonGaussian(0.01, (1.0,), lo)])
  with pytest.raises(ledger_lib.BudgetExceededError):
    ledger.check_budget([accounting.PoissonGaussian(0.01, (1.0,), hi)])


@pytest.fixture(scope="module")
def overspent():
  """The refusal of 5000 more steps after 100 at target 2, and the total ε
  they would spend."""
  ledger = spent_100_steps()
  total = accounting.epsilon(ledger.events + OVERSPENDING, 1e-5, "rdp")
  with pytest.raises(ledger_lib.BudgetExceededError) as info:
    ledger.check_budget(OVERSPENDING)
  return info.value, total


def test_budget_refusal_names_the_total_and_the_target(overspent):
  error, total = overspent
  assert f"{total:.6g}" in str(error) and "target 2 " in str(error)


def test_budget_refusal_names_the_excess(overspent):
  error, total = overspent
  assert f"{total - 2.0:.4g}" in str(error)


def test_budget_refusal_names_the_excess_in_percent(overspent):
  error, total = overspent
  assert f"{100 * (total - 2.0) / 2.0:.2f}%" in str(error)


def test_infinite_target_accepts_any_plan():
  make_ledger(target=math.inf).check_budget(OVERSPENDING)


@pytest.fixture
def saved(tmp_path):
  """A ledger of mixed events at target ∞, saved in an empty dir."""
  ledger = make_ledger(target=math.inf)
  ledger.record_dp_steps(3, noise_multipliers=(1.0, 2.0))
  ledger.record(accounting.Gaussian(4.0, 2))
  path = tmp_path / ledger_lib.LEDGER_FILENAME
  ledger.save(path)
  return ledger, path


def test_saved_ledger_is_strict_json_without_infinity(saved):
  _, path = saved
  assert json.loads(path.read_text())["target_epsilon"] == "inf"


def test_saved_ledger_records_the_epsilon_spent(saved):
  ledger, path = saved
  assert json.loads(path.read_text())["epsilon_spent"] == pytest.approx(
      ledger.epsilon_spent())


def test_save_load_round_trip(saved):
  ledger, path = saved
  assert ledger_lib.PrivacyLedger.load(path) == ledger


def test_save_leaves_no_temporary_file(saved):
  _, path = saved
  assert os.listdir(path.parent) == [ledger_lib.LEDGER_FILENAME]


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


def stage1():
  """30 steps at σ = 1, q = 0.01."""
  ledger = make_ledger(target=8.0)
  ledger.record_dp_steps(30)
  return ledger


def stage2():
  """70 steps at the same σ and q, composed after stage 1."""
  ledger = make_ledger(target=8.0)
  ledger.compose_after(stage1())
  ledger.record_dp_steps(70)
  return ledger


DIRECT_100 = accounting.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, "rdp")


def test_two_stage_ledger_equals_one_accountant_run():
  """Stage 2 spends exactly what one dp-accounting run over T1 + T2 steps
  spends."""
  assert stage2().epsilon_spent() == pytest.approx(DIRECT_100, rel=1e-9)


def test_second_stage_spends_more_than_the_first():
  assert stage2().epsilon_spent() > stage1().epsilon_spent()


def test_two_stage_ledger_survives_a_round_trip(tmp_path):
  ledger = stage2()
  ledger.save(tmp_path / "l.json")
  loaded = ledger_lib.PrivacyLedger.load(tmp_path / "l.json")
  assert loaded.epsilon_spent() == ledger.epsilon_spent()


def exact_budget_after_stage1():
  """Stage 2 with a budget of exactly T1 + T2 steps."""
  exact = make_ledger(target=DIRECT_100)
  exact.compose_after(stage1())
  exact.record_dp_steps(70)
  return exact


def test_budget_of_exactly_both_stages_accepts_them():
  exact_budget_after_stage1().check_budget([])


def test_budget_check_counts_the_prior_stage():
  """One more step than T1 + T2 is refused."""
  exact = exact_budget_after_stage1()
  with pytest.raises(ledger_lib.BudgetExceededError):
    exact.check_budget(exact.planned_events(71))


def test_without_the_prior_stage_one_more_step_fits():
  alone = make_ledger(target=DIRECT_100)
  alone.record_dp_steps(70)
  alone.check_budget(alone.planned_events(71))


def test_prior_stage_on_another_dataset_is_refused():
  with pytest.raises(ValueError, match="another dataset"):
    ledger_lib.PrivacyLedger(
        accountant="rdp", sampling={}, noise_multiplier=1.0, clip_norm=1.0,
        dataset_size=5, delta=1e-5, target_epsilon=1.0).compose_after(stage1())
