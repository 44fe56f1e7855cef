"""Accounting against direct dp_accounting computations."""

import math

import dp_accounting as dpa
from dp_accounting import pld
from dp_accounting import rdp
import pytest

from dpjax.privacy import accounting, sampling

DELTA = 1e-5


def direct_epsilon(event, acc):
  if acc == "rdp":
    accountant = rdp.RdpAccountant(orders=accounting.RDP_ORDERS)
  else:
    accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
  return accountant.compose(event).get_epsilon(DELTA)


def poisson_event(q, sigma, steps):
  return dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_dpsgd_epsilon_matches_dp_accounting(acc):
  got = accounting.dpsgd_epsilon(1.1, 0.01, 500, DELTA, acc)
  assert got == pytest.approx(direct_epsilon(poisson_event(0.01, 1.1, 500),
                                             acc), rel=1e-9)
  assert 0 < got < 10


def test_multiple_noise_multipliers_rdp_is_composed_event():
  event = accounting.PoissonGaussian(0.02, (1.0, 2.0), 300)
  direct = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
      0.02, dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.0),
                                 dpa.GaussianDpEvent(2.0)])), 300)
  assert event.to_dp_event() == direct
  assert accounting.epsilon([event], DELTA, "rdp") == pytest.approx(
      direct_epsilon(direct, "rdp"), rel=1e-9)


def test_multiple_noise_multipliers_pld_equals_composed_gaussians():
  # Without subsampling PLD accepts the composed Gaussians directly, which
  # checks the effective-noise reduction used under Poisson sampling.
  sigmas = (1.5, 3.0, 4.0)
  got = accounting.epsilon([accounting.PoissonGaussian(1.0, sigmas, 4)],
                           DELTA, "pld")
  direct = dpa.SelfComposedDpEvent(
      dpa.ComposedDpEvent([dpa.GaussianDpEvent(s) for s in sigmas]), 4)
  assert got == pytest.approx(direct_epsilon(direct, "pld"), rel=1e-2)
  assert accounting.effective_noise_multiplier(sigmas) == pytest.approx(
      sum(s ** -2 for s in sigmas) ** -0.5)


def test_gaussian_event_matches_analytic_gaussian():
  event = accounting.Gaussian(3.0, 4)  # == one Gaussian with sigma 1.5.
  exact = dpa.get_epsilon_gaussian(1.5, DELTA)
  assert accounting.epsilon([event], DELTA, "pld") == pytest.approx(
      exact, rel=1e-2)
  assert accounting.epsilon([event], DELTA, "rdp") >= exact


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_composition_of_unlike_events(acc):
  events = [accounting.PoissonGaussian(0.01, (1.0,), 200),
            accounting.Gaussian(20.0, 5),
            accounting.PoissonGaussian(0.05, (2.0,), 50)]
  direct = dpa.ComposedDpEvent([
      poisson_event(0.01, 1.0, 200),
      dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(20.0), 5),
      poisson_event(0.05, 2.0, 50)])
  got = accounting.epsilon(events, DELTA, acc)
  assert got == pytest.approx(direct_epsilon(direct, acc), rel=1e-9)
  assert got > accounting.epsilon(events[:1], DELTA, acc)


@pytest.mark.parametrize("acc,target", [("rdp", 2.0), ("pld", 1.0)])
def test_calibration_is_tight_and_matches_dp_accounting(acc, target):
  q, steps = 0.02, 200
  sigma = accounting.dpsgd_noise_multiplier(target, DELTA, q, steps, acc)
  eps = direct_epsilon(poisson_event(q, sigma, steps), acc)
  assert 0.99 * target <= eps <= target
  direct_sigma = dpa.calibrate_dp_mechanism(
      lambda: (rdp.RdpAccountant(accounting.RDP_ORDERS) if acc == "rdp"
               else pld.PLDAccountant(value_discretization_interval=1e-3)),
      lambda s: poisson_event(q, s, steps), target, DELTA)
  assert sigma == pytest.approx(direct_sigma, rel=1e-3)


def test_calibrate_general_events():
  def make_events(s):
    return [accounting.PoissonGaussian(0.01, (s, 2 * s), 100),
            accounting.Gaussian(10 * s, 2)]
  sigma = accounting.calibrate_noise_multiplier(1.5, DELTA, make_events)
  eps = accounting.epsilon(make_events(sigma), DELTA)
  assert 0.99 * 1.5 <= eps <= 1.5


def test_infinite_target_means_no_noise():
  assert accounting.dpsgd_noise_multiplier(math.inf, DELTA, 0.1, 10) == 0.0


def test_no_event_is_free():
  assert accounting.epsilon([], DELTA) == 0.0


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_no_noise_spends_infinite_epsilon(acc):
  assert accounting.dpsgd_epsilon(0.0, 0.1, 10, DELTA, acc) == math.inf


@pytest.mark.parametrize("call", [
    lambda: accounting.dpsgd_noise_multiplier(0.0, DELTA, 0.1, 10),
    lambda: accounting.dpsgd_noise_multiplier(-1.0, DELTA, 0.1, 10),
    lambda: accounting.dpsgd_noise_multiplier(1.0, 0.0, 0.1, 10),
    lambda: accounting.dpsgd_noise_multiplier(1.0, 1.0, 0.1, 10),
    lambda: accounting.dpsgd_noise_multiplier(1.0, DELTA, 0.0, 10),
    lambda: accounting.dpsgd_noise_multiplier(1.0, DELTA, 1.5, 10),
    lambda: accounting.dpsgd_noise_multiplier(1.0, DELTA, 0.1, 0),
    lambda: accounting.dpsgd_epsilon(-0.5, 0.1, 10, DELTA),
    lambda: accounting.dpsgd_epsilon(1.0, 0.1, 10, DELTA, "moments"),
    lambda: accounting.PoissonGaussian(0.1, (), 1),
    lambda: accounting.Gaussian(1.0, 0),
])
def test_invalid_inputs_raise_one_line_value_errors(call):
  with pytest.raises(ValueError) as info:
    call()
  assert "\n" not in str(info.value)


EVENTS = [accounting.PoissonGaussian(0.01, [1.0, 2.0], 3),
          accounting.Gaussian(2.0, 4)]


@pytest.mark.parametrize("event", EVENTS, ids=["poisson_gaussian",
                                               "gaussian"])
def test_events_round_trip_through_json(event):
  assert accounting.event_from_json(event.to_json()) == event


def test_noise_multipliers_given_as_a_list_are_kept_as_a_tuple():
  assert EVENTS[0].noise_multipliers == (1.0, 2.0)


def test_like_events_merge_into_one_of_the_summed_count():
  merged = accounting.merge(EVENTS[0],
                            accounting.PoissonGaussian(0.01, (1.0, 2.0), 5))
  assert merged == accounting.PoissonGaussian(0.01, (1.0, 2.0), 8)


def test_unlike_events_do_not_merge():
  assert accounting.merge(EVENTS[0], EVENTS[1]) is None


def test_unknown_event_type_is_refused():
  with pytest.raises(ValueError):
    accounting.event_from_json({"type": "exponential"})


def test_an_epoch_of_shuffled_sigma_is_one_gaussian_of_sigma_over_2():
  assert accounting.shuffle_epochs_event(2.0, 3) == accounting.Gaussian(1.0, 3)


SHUFFLE = sampling.scheme_from_description(
    {"method": "shuffle", "steps_per_epoch": 10})
POISSON = sampling.scheme_from_description(
    {"method": "poisson", "sampling_rate": 0.1})


def test_shuffle_scheme_is_rebuilt_from_its_description():
  assert SHUFFLE == sampling.ShuffleSampler(105, 10, seed=0).scheme


def test_shuffle_scheme_neighbours_replace_one():
  assert SHUFFLE.neighbouring is sampling.Neighbouring.REPLACE_ONE


def test_shuffle_scheme_counts_a_started_epoch_as_whole():
  assert SHUFFLE.events((2.0,), 25) == [
      accounting.Gaussian(1.0, 3)]  # 2.5 epochs count as 3.


def test_shuffle_scheme_from_an_epoch_start_counts_that_epoch():
  assert SHUFFLE.events((2.0,), 25, start=20) == [
      accounting.Gaussian(1.0, 1)]  # epoch 3 starts at step 20


def test_shuffle_scheme_within_a_counted_epoch_counts_nothing():
  assert SHUFFLE.events((2.0,), 25, start=21) == []


def test_poisson_scheme_is_rebuilt_from_its_description():
  assert POISSON == sampling.PoissonSampler(1000, 100, seed=0).scheme


def test_poisson_scheme_neighbours_add_or_remove_one():
  assert POISSON.neighbouring is sampling.Neighbouring.ADD_OR_REMOVE_ONE


def test_poisson_scheme_counts_every_step():
  assert POISSON.events((1.0, 2.0), 7) == [
      accounting.PoissonGaussian(0.1, (1.0, 2.0), 7)]


@pytest.mark.parametrize("sampler", [
    sampling.PoissonSampler(1000, 100, seed=0),
    sampling.ShuffleSampler(105, 10, seed=0)], ids=["poisson", "shuffle"])
def test_sampler_description_names_its_schemes_adjacency(sampler):
  assert sampler.describe()["adjacency"] == sampler.scheme.neighbouring.value


def test_unknown_sampling_method_is_refused():
  with pytest.raises(ValueError, match="method"):
    sampling.scheme_from_description({"method": "cyclic"})


@pytest.mark.parametrize("acc", ["rdp", "pld"])
@pytest.mark.parametrize("sigmas", [(0.0, 0.0), (1.0, 0.0)])
def test_a_noiseless_release_makes_the_step_non_private(acc, sigmas):
  event = accounting.PoissonGaussian(0.1, sigmas, 3)
  assert accounting.epsilon([event], 1e-5, acc) == math.inf


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_the_noisy_release_alone_is_private(acc):
  """The 0 is what makes the mixed step's ε infinite."""
  assert accounting.epsilon(
      [accounting.PoissonGaussian(0.1, (1.0,), 3)], 1e-5, acc) < 10


LAPLACE = accounting.Laplace(20.0, 300)


def test_laplace_event_is_dp_accountings_self_composed_laplace():
  assert LAPLACE.to_dp_event() == dpa.SelfComposedDpEvent(
      dpa.LaplaceDpEvent(20.0), 300)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_laplace_epsilon_matches_dp_accounting(acc):
  assert accounting.epsilon([LAPLACE], DELTA, acc) == pytest.approx(
      direct_epsilon(LAPLACE.to_dp_event(), acc), rel=1e-9)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_one_laplace_of_multiplier_s_is_pure_1_over_s_dp(acc):
  """At delta > 0 its epsilon is at most 1/s (RDP's conversion adds up to
  log(1/delta) / (largest order - 1)), and close to it at a small delta."""
  one = accounting.epsilon([accounting.Laplace(4.0)], 1e-9, acc)
  slack = (math.log(1e9) / (max(accounting.RDP_ORDERS) - 1) if acc == "rdp"
           else 1e-3 / 4.0)
  assert 0.9 / 4.0 <= one <= 1 / 4.0 + slack


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_noiseless_laplace_spends_infinite_epsilon(acc):
  no_noise = accounting.Laplace(0.0, 2)
  assert accounting.epsilon([no_noise], DELTA, acc) == math.inf


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_laplace_composes_with_other_kinds(acc):
  mixed = [LAPLACE, accounting.Gaussian(3.0, 4)]
  assert accounting.epsilon(mixed, DELTA, acc) == pytest.approx(
      direct_epsilon(dpa.ComposedDpEvent(
          [e.to_dp_event() for e in mixed]), acc), rel=1e-9)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_laplace_is_calibrated_like_any_event(acc):
  s = accounting.calibrate_noise_multiplier(
      3.0, DELTA, lambda s: [accounting.Laplace(s, 300)], acc)
  assert 0.99 * 3.0 <= accounting.epsilon(
      [accounting.Laplace(s, 300)], DELTA, acc) <= 3.0


def test_laplace_event_round_trips_through_json():
  event = accounting.Laplace(2.5, 3)
  assert accounting.event_from_json(event.to_json()) == event


def test_like_laplace_events_merge():
  assert accounting.merge(accounting.Laplace(2.5, 3),
                          accounting.Laplace(2.5, 4)) == \
      accounting.Laplace(2.5, 7)


def test_laplace_does_not_merge_with_a_gaussian():
  assert accounting.merge(accounting.Laplace(2.5, 3),
                          accounting.Gaussian(2.5, 4)) is None


def test_negative_laplace_multiplier_is_refused():
  with pytest.raises(ValueError):
    accounting.Laplace(-1.0)


MIXES = {
    "one run": [accounting.PoissonGaussian(0.01, (1.1,), 300)],
    "two losses, two stages": [
        accounting.PoissonGaussian(0.01, (1.1, 2.0), 300),
        accounting.PoissonGaussian(0.02, (0.9,), 50)],
    "shuffled then Poisson": [accounting.Gaussian(3.0, 4),
                              accounting.PoissonGaussian(0.01, (1.1,), 10)],
    "laplace queries": [accounting.Laplace(2.0, 5)],
    "a noiseless step": [accounting.PoissonGaussian(0.01, (0.0,), 3)],
}


@pytest.mark.parametrize("acc", ["rdp", "pld"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_epsilon_equals_dp_accountings_float_for_float(mix, acc):
  # The cached unit mechanisms change nothing: the same float as the
  # accountant composing the events itself.
  events = MIXES[mix]
  expected = direct_epsilon(
      dpa.ComposedDpEvent([e.to_dp_event() if acc == "rdp" or not isinstance(
          e, accounting.PoissonGaussian) else accounting.PoissonGaussian(
              e.sampling_rate, (accounting.effective_noise_multiplier(
                  e.noise_multipliers),), e.count).to_dp_event()
                           for e in events]), acc)
  assert accounting.epsilon(events, DELTA, acc) == expected


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_epsilon_after_more_steps_is_recomputed_not_reused(acc):
  # The cache holds one step of a mechanism, never a count's result.
  short = accounting.epsilon([accounting.PoissonGaussian(0.01, (1.1,), 10)],
                             DELTA, acc)
  long = accounting.epsilon([accounting.PoissonGaussian(0.01, (1.1,), 400)],
                            DELTA, acc)
  assert long == direct_epsilon(poisson_event(0.01, 1.1, 400), acc) > short
