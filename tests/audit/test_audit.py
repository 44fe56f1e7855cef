"""`python -m dpjax.audit`: gradient canaries, their scores and the ε lower
bound, against explicit loops, jax-privacy's estimator called directly,
runs without noise, and planted bugs the audit must catch."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_privacy import auditing

from dpjax import errors, export, gin_cli
from dpjax.audit import __main__ as audit_cli, canaries as canaries_lib
from dpjax.audit import inputs as inputs_lib, scores as scores_lib
from dpjax.models import t5, trainable
from dpjax.privacy import mechanisms, sampling
from dpjax.privacy.mechanisms import dpsgd
from dpjax.privacy import ledger as ledger_lib, secret
from tests.audit.audits import (CANARIES, CONFIDENCE, RUN, SHORT,
                                  assert_honest, audit, honest_audits)
from tests.audit.conftest import EXAMPLES

# --- Canaries: insertion, sampling and observation. -------------------------

def _tiny_model():
  return trainable.trainable(t5.T5Config(
      vocab_size=64, d_model=8, d_kv=4, d_ff=8, num_heads=2,
      num_encoder_layers=1, num_decoder_layers=1), {"inputs": 4, "targets": 4})


def test_canaries_and_controls_are_distinct_coordinates_of_trained_leaves():
  model = _tiny_model()
  c = canaries_lib.choose(model, 100, canaries_lib.Participation(rate=0.5), 3)
  leaves = jax.tree_util.tree_leaves(model.abstract_params()[0])
  seen = {(j, int(i)) for j, flat in c.leaves.items() for i in flat}
  assert len(seen) == 200
  assert all(0 <= i < np.prod(leaves[j].shape) for j, i in seen)
  assert sorted(np.concatenate(list(c.which.values()))) == list(range(200))
  assert c is canaries_lib.choose(model, 100,
                                  canaries_lib.Participation(rate=0.5), 3)
  with pytest.raises(errors.UsageError, match="needs 2 × "):
    canaries_lib.choose(model, 10**9, canaries_lib.Participation(rate=0.5), 3)


def test_lora_canaries_are_in_the_adapters_only():
  from dpjax.models import lora
  model = trainable.trainable(dataclasses.replace(
      _tiny_model().config, lora=lora.LoRAConfig(rank=2)),
                              {"inputs": 4, "targets": 4})
  mask = jax.tree_util.tree_leaves(model.trainable_mask(
      model.abstract_params()[0]))
  leaves = jax.tree_util.tree_leaves(model.abstract_params()[0])
  adapters = sum(int(np.prod(x.shape)) for x, t in zip(leaves, mask) if t)
  assert canaries_lib.trained_coordinates(model) == adapters < sum(
      int(np.prod(x.shape)) for x in leaves)
  c = canaries_lib.choose(model, adapters // 2,
                          canaries_lib.Participation(rate=0.5), 0)
  assert all(mask[j] for j in c.leaves)


def test_included_sampled_canaries_add_the_bound_at_their_coordinate():
  """Against a loop over the canaries: each included canary the step
  samples adds min(4 C, C) = C at its coordinate, nothing else changes, and
  `observe` reads the canaries' then the controls' coordinates."""
  model = _tiny_model()
  c = canaries_lib.choose(model, 50, canaries_lib.Participation(rate=0.3), 0)
  params = model.init_params(jax.random.PRNGKey(0))[0]
  secret = jnp.asarray(np.arange(4, dtype=np.uint32))
  bound = 0.25
  got = c.insert({"loss": params}, {"loss": bound}, 7, secret)["loss"]
  present = np.asarray(c.coins(secret) & c.sampled(secret, 7))
  expected = [np.array(x, np.float32).ravel()
              for x in jax.tree_util.tree_leaves(params)]
  coordinates = {}
  for j, flat in c.leaves.items():
    for i, w in zip(flat, c.which[j]):
      coordinates[int(w)] = (j, int(i))
  for k in range(c.count):
    j, i = coordinates[k]
    expected[j][i] += bound * present[k]
  for g, e in zip(jax.tree_util.tree_leaves(got), expected):
    np.testing.assert_array_equal(np.asarray(g).ravel(), e)
  observed = np.asarray(c.observe(got))
  assert [observed[w] for w in range(2 * c.count)] == [
      expected[coordinates[w][0]][coordinates[w][1]]
      for w in range(2 * c.count)]
  assert 0 < present.sum() < c.count


def test_coins_are_fair_and_poisson_canaries_are_sampled_at_the_rate():
  c = dataclasses.replace(
      canaries_lib.choose(_tiny_model(), 100,
                          canaries_lib.Participation(rate=0.2), 0),
      count=20_000)
  secret = jnp.asarray(np.array([9, 8, 7, 6], np.uint32))
  coins = np.asarray(c.coins(secret))
  assert abs(coins.mean() - 0.5) < 4 * math.sqrt(0.25 / 20_000)
  steps = np.stack([np.asarray(c.sampled(secret, t)) for t in range(5)])
  assert abs(steps.mean() - 0.2) < 4 * math.sqrt(0.16 / 100_000)
  assert not (steps[0] == steps[1]).all()  # each step its own draw
  other = jnp.asarray(np.array([9, 8, 7, 5], np.uint32))
  assert not (np.asarray(c.coins(other)) == coins).all()


def test_shuffled_canaries_are_sampled_once_per_epoch():
  c = canaries_lib.choose(_tiny_model(), 100,
                          canaries_lib.Participation(steps_per_epoch=4), 0)
  secret = jnp.asarray(np.array([1, 2, 3, 4], np.uint32))
  steps = np.stack([np.asarray(c.sampled(secret, t)) for t in range(8)])
  assert (steps[:4].sum(0) == 1).all() and (steps[4:].sum(0) == 1).all()
  assert not (steps[:4] == steps[4:]).all()  # each epoch its own slot


def test_samplers_give_the_canaries_their_true_rate():
  poisson = sampling.PoissonSampler(100, 25, seed=0)
  assert canaries_lib.participation(poisson).rate == 0.25
  shuffle = sampling.ShuffleSampler(100, 25, seed=0)
  assert canaries_lib.participation(shuffle).steps_per_epoch == 4
  cyclic = canaries_lib.participation(sampling.CyclicPoissonSampler(
      100, 10, cycle_length=2, steps=4, seed=0))
  assert (cyclic.rate, cyclic.cycle_length) == (10 / 50, 2)
  with pytest.raises(errors.UsageError, match="not modelled"):
    canaries_lib.participation(object())


# --- Scores. ------------------------------------------------------------------

def test_scores_are_the_poisson_likelihood_ratio_of_standardized_releases():
  """Against a float64 loop: per step, the release over the robust scale of
  the controls of the canary's leaf, then log(1 - q + q e^{x/σ - 1/2σ²})."""
  rng = np.random.default_rng(0)
  steps, count, sigma, q = 6, 40, 0.8, 0.3
  obs = rng.normal(size=(steps, 2 * count)) * np.arange(1, steps + 1)[:, None]
  groups = np.array([0] * 30 + [1] * 10 + [0] * 25 + [1] * 15)
  got = scores_lib.scores(obs, groups, sigma,
                          canaries_lib.Participation(rate=q))
  for i in range(count):
    total = 0.0
    for t in range(steps):
      mine = [count + k for k in range(count) if groups[count + k] == groups[i]]
      controls = obs[t, mine] if len(mine) >= scores_lib.MIN_CONTROLS else (
          obs[t, count:])
      center = np.median(controls)
      scale = 1.4826 * np.median(np.abs(controls - center))
      x = (obs[t, i] - center) / scale
      total += math.log(1 - q + q * math.exp(x / sigma - 1 / (2 * sigma**2)))
    assert got[i] == pytest.approx(total, rel=1e-9)


def test_shuffled_scores_average_the_ratio_over_each_epochs_steps():
  rng = np.random.default_rng(1)
  count, sigma, s = 30, 1.5, 4
  obs = rng.normal(size=(6, 2 * count))  # one epoch and a half
  groups = np.zeros(2 * count, int)
  got = scores_lib.scores(obs, groups, sigma,
                          canaries_lib.Participation(steps_per_epoch=s))
  w = scores_lib.standardized(obs, groups)
  ratio = np.exp(w / sigma - 1 / (2 * sigma**2))
  expected = (np.log(ratio[:4].sum(0) / s)
              + np.log((ratio[4:].sum(0) + (s - 2)) / s))
  np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_without_noise_the_score_is_the_sum_of_the_releases():
  obs = np.arange(24.0).reshape(3, 8)
  np.testing.assert_array_equal(
      scores_lib.scores(obs, np.zeros(8, int), 0.0,
                        canaries_lib.Participation(rate=0.5)),
      obs[:, :4].sum(0))


def test_the_strategy_inverts_bandmfs_noising_matrix():
  """`Strategy.matrix()` times jax-privacy's streaming C⁻¹ (materialized
  by feeding it the unit vectors) is the identity."""
  from dpjax.privacy.mechanisms import bandmf
  strategy = bandmf.optimized_strategy(9, 3)
  matrix = strategy.noising_matrix()
  state = matrix.init_multiply(jnp.zeros(9))
  rows = []
  for t in range(9):
    row, state = matrix.multiply_next(jnp.eye(9)[t], state)
    rows.append(np.asarray(row, np.float64))
  np.testing.assert_allclose(
      strategy.matrix() @ np.stack(rows),
      np.eye(9), atol=1e-5)


def test_cyclic_scores_decorrelate_then_average_the_groups():
  """Against a loop: C times the releases, standardized, read along C's
  column s; the Poisson step terms of each group summed; the log of the
  groups' mean."""
  rng = np.random.default_rng(2)
  steps, count, sigma, q, b = 6, 25, 1.2, 0.4, 2
  from dpjax.privacy.mechanisms import bandmf
  strategy = bandmf.Strategy((0.8, 0.6), steps).matrix()
  obs = rng.normal(size=(steps, 2 * count))
  groups = np.zeros(2 * count, int)
  got = scores_lib.scores(obs, groups, sigma, canaries_lib.Participation(
      rate=q, cycle_length=b), strategy)
  w = scores_lib.standardized(strategy @ obs, groups)
  for i in range(count):
    per_group = []
    for g in range(b):
      total = 0.0
      for s in range(g, steps, b):
        x = float(strategy[:, s] @ w[:, i])
        total += math.log(1 - q + q * math.exp(x / sigma - 1 / (2 * sigma**2)))
      per_group.append(math.exp(total))
    assert got[i] == pytest.approx(math.log(sum(per_group) / b), rel=1e-9)


def test_cyclic_canaries_are_sampled_in_their_groups_steps_only():
  c = canaries_lib.choose(_tiny_model(), 100, canaries_lib.Participation(
      rate=1.0, cycle_length=3), 0)
  secret = jnp.asarray(np.array([5, 6, 7, 8], np.uint32))
  group = np.asarray(c.groups_of_cycle(secret))
  steps = np.stack([np.asarray(c.sampled(secret, t)) for t in range(6)])
  np.testing.assert_array_equal(
      steps, np.arange(6)[:, None] % 3 == group[None, :])
  assert set(group) == {0, 1, 2}


# --- Audits of training runs. ---------------------------------------------------

@pytest.fixture(scope="module")
def noiseless(tmp_path_factory, data_dir):
  out = tmp_path_factory.mktemp("noiseless") / "audit"
  return out, audit(out, data_dir, "TARGET_EPSILON='inf'")


def test_without_noise_the_bound_is_far_above_1(noiseless):
  """ε = ∞: 10,000 canaries, 10 steps at q = 1/2 (measured: 11.3)."""
  _, line = noiseless
  assert line["epsilon"] == math.inf
  assert line["epsilon_lower_bound"] > 8


def test_the_bound_is_jax_privacys_estimator_on_the_written_scores(noiseless):
  out, line = noiseless
  with open(out / "scores.csv") as f:
    rows = list(csv.DictReader(f))
  s = np.array([float(r["score"]) for r in rows])
  coins = np.array([r["in"] == "1" for r in rows])
  auditor = auditing.CanaryScoreAuditor(s[coins], s[~coins])
  # The same up to the root finder's last bits (its search order).
  assert line["epsilon_lower_bound"] == pytest.approx(
      auditor.epsilon_one_run_fdp(0.05, line["delta"]), rel=1e-9)
  assert line["epsilon_one_run"] == pytest.approx(
      auditor.epsilon_one_run(0.05, line["delta"]), rel=1e-9)
  assert json.loads((out / "audit.json").read_text()) == line
  assert (out / "scores.png").read_bytes()[:4] == b"\x89PNG"
  assert np.load(out / "observations.npy").shape == (10, 2 * CANARIES)
  assert line["canaries_in"] == coins.sum()


@pytest.fixture(scope="module")
def honest(tmp_path_factory, data_dir):
  """`audits.AUDITS` audits of DP-SGD runs at ε = 3: (directory, line) each."""
  out = tmp_path_factory.mktemp("honest")
  lines = honest_audits(out, "quickstart.gin", *RUN,
                        f"register_msmarco_query_generation.data_dir='{data_dir}'",
                        *SHORT)
  return [(out / f"audit{i}", line) for i, line in enumerate(lines)]


def test_dpsgd_audits_at_eps_3_stay_at_or_below_it(honest):
  """With fresh secrets, at 99.99% (`audits.assert_honest` says why the
  test is not a coin toss). BandMF's, adaptive clipping's and user-level
  runs' audits are in their mechanisms' test files; shuffling's canary
  sampling and scores are checked above."""
  assert_honest([line for _, line in honest], "dpsgd")


# --- Input canaries (black box). ----------------------------------------------

def _split(n=6, layout="encoder_decoder"):
  """A split of `n` rows, targets of 2..5 tokens then padding."""
  rng = np.random.default_rng(0)
  lengths = 2 + np.arange(n) % 4
  weights = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
  targets = (rng.integers(3, 64, (n, 6)) * weights).astype(np.int32)
  if layout == "decoder_only":
    return {"tokens": targets, "loss_weights": weights,
            "attention_mask": (weights > 0).astype(np.int32)}
  shifted = np.zeros_like(targets)
  shifted[:, 1:] = targets[:, :-1]
  return {"encoder_input_tokens": rng.integers(3, 64, (n, 4), np.int32),
          "decoder_input_tokens": shifted, "decoder_target_tokens": targets,
          "decoder_loss_weights": weights}


@pytest.mark.parametrize("layout, weights, targets", [
    ("encoder_decoder", "decoder_loss_weights", "decoder_target_tokens"),
    ("decoder_only", "loss_weights", "tokens")])
def test_input_canaries_are_real_rows_with_random_targets(layout, weights,
                                                          targets):
  train = _split(layout=layout)
  c = inputs_lib.choose(train, 50, seed=3)
  vocabulary = set(train[targets][train[weights] > 0].tolist())
  kept = []
  for i in range(50):
    # Some real row, its weights and other features kept.
    source = [j for j in range(6) if all(
        np.array_equal(c.rows[k][i], train[k][j]) for k in train
        if k not in (targets, "decoder_input_tokens"))]
    assert source, i
    marked = c.rows[weights][i] > 0
    assert np.array_equal(c.rows[targets][i][~marked],
                          train[targets][source[0]][~marked])
    assert set(c.rows[targets][i][marked].tolist()) <= vocabulary
    kept.append(max(np.mean(c.rows[targets][i][marked]
                            == train[targets][j][marked]) for j in source))
    if layout == "encoder_decoder":  # the decoder reads the targets shifted
      assert np.array_equal(c.rows["decoder_input_tokens"][i],
                            np.concatenate([[0], c.rows[targets][i][:-1]]))
  # Drawn, not the source's: a token stays by chance (1 in ~20).
  assert np.mean(kept) < 0.25, np.mean(kept)
  secret = jnp.arange(4, dtype=jnp.uint32)
  added, coins = c.added(secret), np.asarray(canaries_lib.coins(secret, 50))
  for i in range(50):  # an excluded canary has no loss, hence no gradient
    want = c.rows[weights][i] if coins[i] else 0 * c.rows[weights][i]
    assert np.array_equal(added[weights][i], want)
    assert all(np.array_equal(added[k][i], c.rows[k][i]) for k in train
               if k != weights)


def test_packed_rows_are_refused_by_the_input_audit():
  packed = {**_split(), "decoder_segment_ids": np.ones((6, 6), np.int32)}
  with pytest.raises(errors.UsageError, match="unpacked encoder-decoder"):
    inputs_lib.choose(packed, 4, seed=0)


def test_input_scores_are_minus_each_canarys_loss():
  model = _tiny_model()
  params, _ = model.init_params(jax.random.PRNGKey(1))
  c = inputs_lib.choose(_split(), 70, seed=1)  # two batches, one padded
  got = inputs_lib.scores(model.batch_loss, params, c)
  one = jax.jit(model.batch_loss)
  want = [-float(one(params, {k: v[i:i + 1] for k, v in c.rows.items()})[0])
          for i in range(70)]
  np.testing.assert_allclose(got, want, rtol=1e-5)


INPUT = ["--kind=input", "--canaries=200"]


@pytest.fixture(scope="module")
def noiseless_input(tmp_path_factory, data_dir):
  """ε = ∞, 200 input canaries beside the 64 rows, q = 1/2 over 10 steps."""
  out = tmp_path_factory.mktemp("noiseless_input") / "audit"
  return out, audit(out, data_dir, "TARGET_EPSILON='inf'", "BATCH_SIZE=132",
                    flags=INPUT)


def test_without_noise_the_input_bound_is_above_1(noiseless_input):
  """Measured: 4.2 (95%)."""
  out, line = noiseless_input
  assert (line["kind"], line["epsilon"]) == ("input", math.inf)
  assert line["epsilon_lower_bound"] > 2
  # The canaries are rows of the split, in or out: its size is n + m.
  ledger = ledger_lib.PrivacyLedger.load(
      out / "run" / ledger_lib.LEDGER_FILENAME)
  assert ledger.dataset_size == EXAMPLES + 200
  with open(out / "scores.csv") as f:
    listed = [r["in"] == "1" for r in csv.DictReader(f)]
  assert listed == np.asarray(canaries_lib.coins(
      secret.RunSecret.load(out / "run").noise_key(), 200)).tolist()


def test_an_input_audit_at_eps_3_stays_at_or_below_it(data_dir, tmp_path):
  assert_honest([audit(tmp_path / "audit", data_dir, *SHORT,
                       flags=[*INPUT, f"--confidence={CONFIDENCE}"])],
                "dpsgd")


# --- The audit in a release (`python -m dpjax.export --audit`). ------------

def export_with_audit(run_dir, audit_dir, output_dir) -> dict:
  return gin_cli.exit_on_user_error(lambda: export.main([
      f"--model_dir={run_dir}", f"--output_dir={output_dir}",
      f"--audit={audit_dir}"]))


def test_a_release_states_its_audits_bound_recomputed_from_the_scores(
    honest, tmp_path):
  (audit_dir, line), (_, other) = honest[:2]
  with open(audit_dir / "scores.csv") as f:
    rows = list(csv.DictReader(f))
  s = np.array([float(r["score"]) for r in rows])
  coins = np.array([r["in"] == "1" for r in rows])
  want = auditing.CanaryScoreAuditor(s[coins], s[~coins]).epsilon_one_run_fdp(
      1 - line["confidence"], line["delta"])
  for run_dir, audited_run in ((line["run_dir"], "this run"),
                               (other["run_dir"], "another run")):
    out = tmp_path / audited_run.replace(" ", "_")
    result = export_with_audit(run_dir, audit_dir, out)
    entry = json.loads((out / "privacy_statement.json").read_text())["audit"]
    assert entry == result["statement"]["audit"]
    assert entry["epsilon_lower_bound"] == pytest.approx(want, rel=1e-9)
    assert entry["audited_run"].startswith(audited_run)
    assert (entry["kind"], entry["confidence"], entry["canaries"],
            entry["canaries_in"]) == ("gradient", line["confidence"],
                                      line["canaries"], coins.sum())
    assert entry["threat_model"] == audit_cli.THREAT_MODELS["gradient"]
    text = (out / "PRIVACY.md").read_text()
    assert (f"ε ≥ {want:.3g} at {100 * CONFIDENCE:.4g}% confidence" in text
            and audited_run in text.split("## Audit")[1])


def refused(run_dir, audit_dir, output_dir, capsys) -> str:
  with pytest.raises(SystemExit) as exit_:
    export_with_audit(run_dir, audit_dir, output_dir)
  assert exit_.value.code == 2 and not os.path.exists(output_dir)
  return capsys.readouterr().err.strip()


def test_an_audit_of_another_mechanism_or_with_other_coins_is_refused(
    honest, noiseless, tmp_path, capsys):
  (audit_dir, line), = honest[:1]
  err = refused(line["run_dir"], noiseless[0], tmp_path / "r", capsys)
  assert "audited another mechanism than this release" in err
  assert "noise_multiplier 0.0 (audit)" in err and len(err.splitlines()) == 1
  # Coins flipped after the scores were seen: not the run's secret's draw.
  forged = tmp_path / "forged"
  shutil.copytree(audit_dir, forged, symlinks=True)
  scores_csv = (forged / "scores.csv").read_text().splitlines()
  head, first, *rest = scores_csv
  first = first[:-1] + ("0" if first.endswith("1") else "1")
  (forged / "scores.csv").write_text("\n".join([head, first, *rest]) + "\n")
  err = refused(line["run_dir"], forged, tmp_path / "r", capsys)
  assert "are not the ones its run's secret drew" in err


# Planted bugs: test-only mechanisms that break the guarantee they claim.

@dataclasses.dataclass(frozen=True)
class QuietNoise(dpsgd.DPSGD):
  """Claims σ, adds 0.3 σ."""
  name: ClassVar[str] = "planted_quiet_noise"
  setting: ClassVar[str] = "train.mechanism = 'planted_quiet_noise'"

  def privatizer(self, *, noise_multiplier, **kwargs):
    return super().privatizer(noise_multiplier=0.3 * noise_multiplier,
                              **kwargs)


class TenthRateSampler(sampling.PoissonSampler):
  """Samples at q; its accounting (and the ledger) says q / 10."""

  @property
  def scheme(self):
    return sampling.PoissonScheme(self.sampling_rate / 10)

  def describe(self):
    return {**super().describe(), "sampling_rate": self.sampling_rate / 10}


@dataclasses.dataclass(frozen=True)
class TenthRate(dpsgd.DPSGD):
  """DP-SGD with `TenthRateSampler`."""
  name: ClassVar[str] = "planted_tenth_rate"
  setting: ClassVar[str] = "train.mechanism = 'planted_tenth_rate'"

  def sampler(self, inputs, *, seed, unit_ids=None):
    return TenthRateSampler(inputs.n, inputs.batch_size, seed=seed)


@pytest.fixture
def planted():
  for m in (QuietNoise, TenthRate):
    mechanisms.register(m)
  yield
  for m in (QuietNoise, TenthRate):
    mechanisms._REGISTRY.pop(m.name)


@pytest.mark.parametrize("bug", ["quiet_noise", "tenth_rate",
                                 "unclipped_canaries"])
def test_a_planted_bug_is_caught(bug, planted, data_dir, tmp_path,
                                 monkeypatch, capsys):
  flags = ()
  if bug == "unclipped_canaries":
    monkeypatch.setattr(canaries_lib, "clipped_norm", lambda raw, bound: raw)
    # Canaries of their own (one fewer): the release that inserts them is
    # traced afresh with the bug, and no other test's run finds it.
    flags = [f"--canaries={CANARIES - 1}"]
    bindings = []
  else:
    bindings = [f"train.mechanism='planted_{bug}'"]
  line = audit(tmp_path / "audit", data_dir, *bindings, flags=flags)
  assert line["epsilon"] == pytest.approx(3.0, abs=0.01)
  assert line["epsilon_lower_bound"] > line["epsilon"], line
  # Its release is refused: the audit refutes the ε it would state. (The
  # tenth rate's ledger already fails verification: its plan samples at q.)
  err = refused(line["run_dir"], tmp_path / "audit", tmp_path / "r", capsys)
  assert ("does not account for its releases" if bug == "tenth_rate" else
          "the guarantee is refuted; nothing was released") in err, err


# --- Bad input. ----------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--canaries=1"], "--canaries must be at least 2, got 1"),
    (["--kind=membership"], "--kind must be one of ('gradient', 'input')"),
    (["--confidence=1.5"], "--confidence must be in (0, 1)"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, message, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    gin_cli.exit_on_user_error(lambda: audit_cli.main(
        ["--gin_file=quickstart.gin", f"--output_dir={tmp_path / 'a'}",
         *flags]))
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err
  assert not (tmp_path / "a").exists()


def test_an_existing_output_dir_is_refused_and_left_as_it_is(tmp_path,
                                                             capsys):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "mine.txt").write_text("keep")
  with pytest.raises(SystemExit) as exit_:
    gin_cli.exit_on_user_error(lambda: audit_cli.main(
        ["--gin_file=quickstart.gin", f"--output_dir={tmp_path / 'a'}"]))
  assert exit_.value.code == 2
  assert "exists: an audit trains a fresh run" in capsys.readouterr().err
  assert os.listdir(tmp_path / "a") == ["mine.txt"]
