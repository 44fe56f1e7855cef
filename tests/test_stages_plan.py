"""`plan.stages_plan`: one σ for a pipeline of runs on the same data (the
two-stage semantic-parse pipeline, the post-hoc discriminator head), checked
against dp-accounting called directly."""
import dp_accounting
import gin
import pytest

from dpjax.training import plan as plan_lib, run_config

N, BATCH = 1000, 50


@pytest.fixture(autouse=True)
def _no_gin_bindings():
  """RunConfig is gin-configurable: another test's bindings must not leak
  into the one built here."""
  gin.clear_config()
  yield
  gin.clear_config()


def _config(**kw):
  return run_config.RunConfig(
      model_dir="unused", model_config=None, mixture_or_task_name="unused",
      task_feature_lengths={}, batch_size=BATCH, **{
          "sampling_method": "poisson", "accountant": "pld", **kw})


def _epsilon(sigma: float, steps: int, delta: float) -> float:
  """T Poisson-sampled Gaussians at q = BATCH / N, dp-accounting's PLD."""
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          BATCH / N, dp_accounting.GaussianDpEvent(sigma)), steps)
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-3)
  return accountant.compose(event).get_epsilon(delta)


def test_one_sigma_for_both_stages_is_the_least_that_meets_the_target():
  delta, sigma = plan_lib.stages_plan(_config(), N, (30, 90), 2.0)
  assert delta == 1 / (2 * N)
  assert _epsilon(sigma, 120, delta) <= 2.0 * (1 + 1e-6)
  assert _epsilon(0.99 * sigma, 120, delta) > 2.0


def test_delta_given_or_configured_and_no_noise_at_infinity():
  assert plan_lib.stages_plan(_config(delta="1/n"), N, (5, 5), 3.0)[0] == 1 / N
  assert plan_lib.stages_plan(_config(), N, (5, 5), 3.0, 1e-6)[0] == 1e-6
  assert plan_lib.stages_plan(_config(), N, (5, 5), float("inf"))[1] == 0.0
