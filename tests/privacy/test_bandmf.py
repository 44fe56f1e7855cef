"""BandMF: correlated noise whose covariance is the strategy's, cyclic
Poisson sampling, the ledger against jax-privacy's accountant, the band
choice, and a run from gin that resumes bit-identically."""
from __future__ import annotations

import json
import math
import os

import gin
import jax
import jax.numpy as jnp
from jax_privacy.accounting import accountants, analysis
import numpy as np
import pytest

from dpjax.training import checkpoints, plan as plan_lib, run_config
from dpjax import configurables
from dpjax import errors, gin_cli
from dpjax.privacy import accounting, ledger as ledger_lib, noise
from dpjax.privacy.mechanisms import bandmf
from dpjax.privacy import sampling, secret
from tests import test_trainer
from tests.audit import audits

SECRET = secret.RunSecret.pinned(3).noise_key()


def dense_inverse(coefs, steps) -> np.ndarray:
  """C⁻¹ of the column-normalised banded Toeplitz C, by numpy (float64)."""
  c = np.zeros((steps, steps))
  for k, a in enumerate(coefs):
    c += a * np.eye(steps, k=-k)
  return np.linalg.inv(c / np.linalg.norm(c, axis=0))


def test_noise_has_the_strategys_covariance():
  """Zero sums released 12 times: across 40,000 coordinates the noise of
  steps s and t has covariance σ²C² (C⁻¹ C⁻ᵀ)[s, t]; the correlation is
  real (far from the identity of DP-SGD)."""
  steps, d = 12, 40_000
  strategy = bandmf.optimized_strategy(steps, 4)
  init, privatize = bandmf.correlated_privatizer(
      strategy, noise_multiplier=1.5, sensitivity=2.0, normalizer=1.0)
  params = {"w": jnp.zeros((d // 4, 3)), "b": jnp.zeros(d // 4)}
  release = jax.jit(privatize)
  state, rows = init(params), []
  for t in range(steps):
    update, state = release({"loss": params}, t, SECRET, state)
    rows.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(update)]))
  empirical = np.cov(np.stack(rows), bias=True)
  inverse = dense_inverse(strategy.coefs, steps)
  want = 9.0 * inverse @ inverse.T
  tolerance = 5 * math.sqrt(2 / d) * np.sqrt(np.outer(np.diag(want),
                                                      np.diag(want)))
  assert np.all(np.abs(empirical - want) < tolerance)
  off = want - np.diag(np.diag(want))
  assert np.abs(off).max() > 5 * tolerance.max()


def test_noise_is_keyed_by_the_secret_and_release():
  strategy = bandmf.optimized_strategy(4, 2)
  init, privatize = bandmf.correlated_privatizer(
      strategy, noise_multiplier=1.0, sensitivity=1.0, normalizer=1.0)
  zeros = {"w": jnp.zeros(5)}
  first, _ = privatize({"loss": zeros}, 0, SECRET, init(zeros))
  # Release 0 is z_0 / c_0 scaled by its row: the DP-SGD draw of release 0.
  fresh = noise.add_gaussian_noise(zeros, noise.noise_key(SECRET, 0), 1.0)
  inverse = dense_inverse(strategy.coefs, 4)
  np.testing.assert_allclose(first["w"], inverse[0, 0] * fresh["w"],
                             rtol=1e-6)
  other, _ = privatize({"loss": zeros}, 0,
                       secret.RunSecret.pinned(4).noise_key(), init(zeros))
  assert not np.allclose(other["w"], first["w"])


def test_frozen_leaves_get_no_noise():
  strategy = bandmf.optimized_strategy(3, 2)
  init, privatize = bandmf.correlated_privatizer(
      strategy, noise_multiplier=1.0, sensitivity=1.0, normalizer=2.0,
      trainable={"w": True, "frozen": False})
  sums = {"w": jnp.ones(4), "frozen": jnp.zeros(3)}
  state = init(sums)
  # The frozen leaf keeps b - 1 numbers, not a buffer of its size (LoRA's
  # base would cost b - 1 copies of the model otherwise).
  assert [x.shape for x in jax.tree.leaves(state)] == [(), (), (1,), (1, 4)]
  whole_init, whole = bandmf.correlated_privatizer(
      strategy, noise_multiplier=1.0, sensitivity=1.0, normalizer=2.0)
  whole_state = whole_init(sums)
  for t in range(3):
    update, state = privatize({"loss": sums}, t, SECRET, state)
    assert np.all(np.asarray(update["frozen"]) == 0)
    assert np.all(np.asarray(update["w"]) != 0.5)
    # The trained leaf's noise is the one it gets with nothing frozen.
    unmasked, whole_state = whole({"loss": sums}, t, SECRET, whole_state)
    np.testing.assert_array_equal(update["w"], unmasked["w"])


# --- Cyclic Poisson sampling and its accounting. --------------------------

def test_each_example_is_sampled_only_in_its_groups_steps_at_rate_q():
  n, b, steps = 600, 4, 4000
  s = sampling.CyclicPoissonSampler(n, 30, cycle_length=b, steps=steps,
                                    seed=2)
  counts = np.zeros((b, n))
  for t in range(steps):
    counts[t % b, s.indices(t)] += 1
  # Each example appears in exactly one residue class of steps mod b.
  assert np.all((counts > 0).sum(0) <= 1)
  q, rounds = 30 / (n // b), steps // b
  assert s.sampling_rate == pytest.approx(q)
  seen = counts.max(0)
  z = (seen - rounds * q) / math.sqrt(rounds * q * (1 - q))
  assert np.abs(z).max() < 5  # all 600: Binomial(1000, q) each


def test_cyclic_sampler_resumes_at_any_step():
  a = sampling.CyclicPoissonSampler(300, 20, cycle_length=3, steps=20,
                                    seed=5)
  forward = [a.indices(t) for t in range(20)]
  b = sampling.CyclicPoissonSampler(300, 20, cycle_length=3, steps=20,
                                    seed=5)
  for t in (13, 14, 2, 19):
    np.testing.assert_array_equal(b.indices(t), forward[t])
  other = sampling.CyclicPoissonSampler(300, 20, cycle_length=3, steps=20,
                                        seed=6)
  assert not np.array_equal(other.indices(0), forward[0])


def test_rounds_are_counted_once_whatever_the_pieces():
  scheme = sampling.PoissonScheme(0.1, cycle_length=4)
  whole = scheme.events((1.0,), 10)
  assert whole == [accounting.PoissonGaussian(0.1, (1.0,), 3)]
  pieces = scheme.events((1.0,), 5) + scheme.events((1.0,), 10, start=5)
  assert sum(e.count for e in pieces) == 3


def config(**overrides):
  """A run's settings, none from gin bindings an earlier test left."""
  gin.clear_config()
  fields = dict(model_dir="/tmp/unused", model_config=None,
                mixture_or_task_name="x", task_feature_lengths={},
                batch_size=20, train_steps=64, mechanism="bandmf",
                target_epsilon=3.0)
  return run_config.RunConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def planned():
  return plan_lib.make_plan(config(), n=1000, sampling_seed=1,
                            secret_source="os_entropy")


def test_ledger_epsilon_is_jax_privacys_accountant(planned):
  """ε of the plan, and of the ledger after all steps, equals jax-privacy's
  DpsgdTrainingAccountant at cycle length b (PLD, same discretisation)."""
  bands = planned.mechanism.bands
  ledger = planned.ledger
  ledger.record_dp_steps(64, noise_multipliers=planned.noise_multipliers)
  theirs = analysis.DpsgdTrainingAccountant(
      dp_accountant_config=accountants.PldAccountantConfig(
          value_discretization_interval=1e-3)).compute_epsilon(
              num_updates=64, dp_params=analysis.DpParams(
                  noise_multipliers=planned.noise_multiplier,
                  num_samples=1000, delta=planned.delta, batch_size=20,
                  cycle_length=bands))
  assert ledger.epsilon_spent() == pytest.approx(theirs, rel=1e-9)
  assert planned.planned_epsilon == pytest.approx(theirs, rel=1e-9)
  assert 0.99 * 3 <= theirs <= 3
  again = ledger_lib.PrivacyLedger.from_json(
      json.loads(json.dumps(ledger.to_json())))
  assert again.mechanism == {"name": "bandmf", "bands": bands}
  assert again.epsilon_spent() == pytest.approx(theirs, rel=1e-9)


def test_bands_are_those_of_least_error(planned):
  """Each candidate's σ is calibrated for the target at its cycle length,
  and the plan takes the smallest σ x prefix error."""
  rows = planned.mechanism.candidates
  assert [r["bands"] for r in rows] == [1, 2, 4, 8, 16, 32]  # n // B = 50
  best = min(rows, key=lambda r: r["error"])
  assert planned.mechanism.bands == best["bands"]
  assert planned.noise_multiplier == pytest.approx(best["noise_multiplier"])
  for r in rows:
    scheme = sampling.PoissonScheme(20 / (1000 // r["bands"]),
                                    cycle_length=r["bands"])
    eps = accounting.epsilon(scheme.events((r["noise_multiplier"],), 64),
                             planned.delta, "pld")
    assert 0.99 * 3 <= eps <= 3
    strategy = bandmf.optimized_strategy(64, r["bands"])
    assert r["error"] == pytest.approx(
        r["noise_multiplier"] * bandmf.prefix_error(strategy), rel=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (dict(sampling_method="shuffle"), "does not combine"),
    (dict(clip_norm="adaptive"), "does not combine"),
    (dict(bands=51), "bands <= min"),
    (dict(target_epsilon="inf"), "set train.bands"),
    (dict(mechanism="dpftrl"), "train.mechanism must be one of"),
])
def test_bad_bandmf_settings_are_refused(overrides, message):
  with pytest.raises(errors.UsageError, match=message):
    plan_lib.make_plan(config(**overrides), n=1000, sampling_seed=1,
                       secret_source="os_entropy")


# --- A run from gin, killed and resumed. ----------------------------------

EXTRA = ["TRAIN_STEPS = 8", "train.bands = 2", "BATCH_SIZE = 16"]


def run(model_dir, *extra):
  gin.clear_config()
  gin_cli.configure(["quickstart_bandmf.gin"],
                    [f"MODEL_DIR = '{model_dir}'", *test_trainer.TINY,
                     *EXTRA, *extra])
  try:
    return configurables.train()
  finally:
    gin.clear_config()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("bandmf")
  return model_dir, run(model_dir)


@pytest.fixture(scope="module")
def resumed(uninterrupted, tmp_path_factory):
  """The run killed as it samples step 6 (checkpoint at 4), resumed."""
  model_dir = tmp_path_factory.mktemp("bandmf_killed")
  test_trainer.same_secret(uninterrupted[0], model_dir)
  original = sampling.CyclicPoissonSampler.microbatches

  def dies(self, index, m):
    if index == 6:
      raise KeyboardInterrupt("killed")
    return original(self, index, m)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sampling.CyclicPoissonSampler, "microbatches", dies)
    with pytest.raises(KeyboardInterrupt):
      run(model_dir)
  assert checkpoints.manager(str(model_dir)).latest_step() == 4
  return model_dir, run(model_dir)


def test_run_records_bandmf_and_its_epsilon(uninterrupted):
  model_dir, result = uninterrupted
  with open(os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)) as f:
    ledger = json.load(f)
  assert ledger["mechanism"] == {"name": "bandmf", "bands": 2}
  assert ledger["sampling"]["method"] == "cyclic_poisson"
  assert ledger["sampling"]["cycle_length"] == 2
  theirs = analysis.DpsgdTrainingAccountant(
      dp_accountant_config=accountants.PldAccountantConfig(
          value_discretization_interval=1e-3)).compute_epsilon(
              num_updates=8, dp_params=analysis.DpParams(
                  noise_multipliers=ledger["noise_multiplier"],
                  num_samples=test_trainer.N, delta=ledger["delta"],
                  batch_size=16, cycle_length=2))
  assert result["epsilon_spent"] == pytest.approx(theirs, rel=1e-9)


def test_resumed_run_is_bit_identical(uninterrupted, resumed):
  for a, b in zip(jax.tree.leaves(test_trainer.restored_params(
      uninterrupted[0])), jax.tree.leaves(test_trainer.restored_params(
          resumed[0]))):
    np.testing.assert_array_equal(a, b)
  assert resumed[1]["epsilon_spent"] == uninterrupted[1]["epsilon_spent"]


def test_export_releases_params_and_names_bandmf(uninterrupted, tmp_path):
  """The release holds the params and the statement, never the noise state
  the checkpoint keeps."""
  from dpjax import export
  out = tmp_path / "release"
  export.main([f"--model_dir={uninterrupted[0]}", f"--output_dir={out}"])
  with open(out / export.STATEMENT_FILE) as f:
    statement = json.load(f)
  assert statement["mechanism"] == {"name": "bandmf", "bands": 2}
  assert "BandMF (2-banded" in (out / "PRIVACY.md").read_text()
  for name in os.listdir(out):
    assert b"noise_state" not in (out / name).read_bytes()


def test_dry_run_names_the_mechanism(tmp_path, capsys):
  from dpjax import train
  try:
    train.main(["--gin_file=quickstart_bandmf.gin",
                f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                *(f"--gin.{e.replace(' ', '')}" for e in EXTRA),
                "--gin.TASK_FEATURE_LENGTHS={'inputs':64,'targets':16}",
                "--dry_run"])
  finally:
    gin.clear_config()
  record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert record["mechanism"] == {"name": "bandmf", "bands": 2}
  assert record["sampling"] == "cyclic_poisson"
  assert not os.path.exists(tmp_path / "run")


def test_lora_run_checkpoints_noise_for_the_adapters_only(tmp_path):
  """BandMF with LoRA: the frozen base keeps no noise buffer of its size,
  and the state (scalars for frozen leaves) checkpoints and restores."""
  model_dir = tmp_path / "lora"
  # One layer each: the claim is per leaf, and this model compiles anew.
  lora = ["TRAIN_STEPS = 2", "train.checkpoint_period = 2",
          "T5Config.lora = @LoRAConfig()", "LoRAConfig.rank = 4",
          "T5Config.num_encoder_layers = 1", "T5Config.num_decoder_layers = 1"]
  first = run(model_dir, *lora)
  assert checkpoints.manager(str(model_dir)).latest_step() == 2
  again = run(model_dir, *lora)  # restores the state, trains no more
  assert again["epsilon_spent"] == first["epsilon_spent"]


def test_an_audit_of_this_run_stays_at_or_below_its_epsilon(tmp_path):
  """`audits.AUDITS` audits (`python -m dpjax.audit`, fresh secrets) of
  this file's run at ε = 3, two steps: canaries sampled as cyclic Poisson
  samples an example, the releases decorrelated by the strategy
  (tests/audit)."""
  bindings = [b.replace(" = ", "=", 1) for b in [*test_trainer.TINY, *EXTRA]]
  audits.assert_honest(audits.honest_audits(
      tmp_path, "quickstart_bandmf.gin", *bindings, *audits.SMALL_T5,
      "TRAIN_STEPS=2"), "bandmf")
