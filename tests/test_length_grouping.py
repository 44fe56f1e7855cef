"""Length-grouped batches (ε = ∞ runs): the sampler, the trim's exactness
against full-width losses, the ledger's ε = ∞, and the plan's refusals."""
from __future__ import annotations

import os

import gin
import jax
import numpy as np
import pytest

from dpjax import gin_cli, length_grouping, plan as plan_lib, run_config, trainer
from dpjax.models import gpt2, t5
from dpjax.privacy import accounting, ledger as ledger_lib, sampling

from tests.test_trainer import TINY


def _lengths(n=700, seed=0):
  return np.random.default_rng(seed).integers(1, 60, n)


def test_each_epoch_is_disjoint_batches_of_distinct_examples():
  sampler = length_grouping.LengthGroupedSampler(_lengths(), 32, seed=5)
  epoch = [sampler.indices(t) for t in range(sampler.steps_per_epoch)]
  used = np.concatenate(epoch)
  assert all(len(b) == 32 for b in epoch)
  assert len(np.unique(used)) == used.size == sampler.steps_per_epoch * 32
  later = np.concatenate([sampler.indices(t) for t in range(
      sampler.steps_per_epoch, 2 * sampler.steps_per_epoch)])
  assert len(np.unique(later)) == later.size
  assert not np.array_equal(np.sort(used), np.sort(later))  # 700 % 32 left


def test_a_window_of_the_whole_epoch_sorts_batches_by_length():
  lengths = _lengths()
  sampler = length_grouping.LengthGroupedSampler(lengths, 32, seed=5,
                                                 window=1000)
  batches = sorted((lengths[sampler.indices(t)] for t in range(
      sampler.steps_per_epoch)), key=np.max)
  for shorter, longer in zip(batches, batches[1:]):
    assert shorter.max() <= longer.min()


def test_grouping_leaves_less_padding_than_shuffling_and_is_reproducible():
  lengths = _lengths()
  grouped = length_grouping.LengthGroupedSampler(lengths, 32, seed=5)
  shuffled = sampling.ShuffleSampler(len(lengths), 32, seed=5)
  steps = range(3 * grouped.steps_per_epoch)
  padded = lambda s: np.mean([lengths[s.indices(t)].max() for t in steps])
  assert padded(grouped) < 0.8 * padded(shuffled)
  again = length_grouping.LengthGroupedSampler(lengths, 32, seed=5)
  assert all(np.array_equal(grouped.indices(t), again.indices(t))
             for t in reversed(steps))  # any order: no state across epochs


def test_bucket_widths_are_multiples_of_8_up_to_the_length():
  assert length_grouping.bucket_widths(176, 4) == (48, 88, 136, 176)
  assert length_grouping.bucket_widths(48, 4) == (16, 24, 40, 48)
  assert length_grouping.bucket_widths(20, 8) == (8, 16, 20)
  with pytest.raises(ValueError):
    length_grouping.bucket_widths(20, 0)


def _padded_rows(rng, n, length, vocab, low=1):
  """[n, length] tokens in [2, vocab) ending in EOS (1), then zeros."""
  real = rng.integers(low, length + 1, n)
  rows = rng.integers(2, vocab, (n, length)).astype(np.int32)
  rows[np.arange(n), real - 1] = 1
  rows[np.arange(length)[None, :] >= real[:, None]] = 0
  return rows


def _t5_arrays(rng, n=24, vocab=97):
  targets = _padded_rows(rng, n, 40, vocab)
  inputs = np.zeros_like(targets)
  inputs[:, 1:] = targets[:, :-1]
  return {"encoder_input_tokens": _padded_rows(rng, n, 32, vocab),
          "decoder_input_tokens": inputs, "decoder_target_tokens": targets,
          "decoder_loss_weights": (targets > 0).astype(np.float32)}


def _gpt2_arrays(rng, n=24, vocab=61, length=48, bos=60):
  real = rng.integers(2, length + 1, n)
  prompt = rng.integers(0, real - 1)
  pos = np.arange(length)[None, :]
  tokens = rng.integers(2, vocab - 1, (n, length)).astype(np.int32)
  tokens[:, 0] = bos
  tokens[pos >= real[:, None]] = bos  # decoder_only_features' padding
  return {"tokens": tokens,
          "loss_weights": ((pos > prompt[:, None]) & (pos < real[:, None])
                           ).astype(np.float32),
          "attention_mask": (pos < real[:, None]).astype(np.int32)}


@pytest.mark.parametrize("model", ["t5", "gpt2"])
def test_trimmed_batches_give_each_example_its_full_width_loss(model):
  rng = np.random.default_rng(0)
  if model == "t5":
    cfg = t5.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64,
                      num_heads=4, num_encoder_layers=2,
                      num_decoder_layers=2, dropout_rate=0.0)
    params, _ = t5.init_params(cfg, jax.random.PRNGKey(0),
                               input_length=32, target_length=40)
    loss, arrays = jax.jit(t5.make_batch_loss(cfg)), _t5_arrays(rng)
  else:
    cfg = gpt2.GPT2Config(vocab_size=61, n_positions=48, d_model=32,
                          num_layers=2, num_heads=4, dropout_rate=0.0)
    params, _ = gpt2.init_params(cfg, jax.random.PRNGKey(0), max_length=48)
    loss, arrays = jax.jit(gpt2.make_batch_loss(cfg)), _gpt2_arrays(rng)
  trim = length_grouping.Trimmer(arrays, buckets=4)
  mark = ("attention_mask" if model == "gpt2" else "decoder_target_tokens")
  order = np.argsort([_last_real(row) for row in arrays[mark]])
  full = np.asarray(loss(params, arrays))
  widths = set()
  for idx in (order[:6], order[6:12], order[-6:], order):
    cut = trim(idx)
    batch = {k: v[idx] for k, v in cut.items()}
    widths.add(tuple(v.shape[1] for v in batch.values()))
    np.testing.assert_allclose(loss(params, batch), full[idx], rtol=2e-5,
                               atol=2e-6)
  assert len(widths) > 1  # some batch was cut


def _last_real(row) -> int:
  """One past the last nonzero entry, by a loop."""
  return max((i + 1 for i, x in enumerate(row) if x != 0), default=0)


def test_each_axis_is_cut_to_the_smallest_bucket_holding_the_batch():
  arrays = _t5_arrays(np.random.default_rng(1), n=50)
  trim = length_grouping.Trimmer(arrays, buckets=4)
  marks = {"encoder": "encoder_input_tokens",
           "decoder": "decoder_target_tokens"}
  for idx in np.array_split(np.random.default_rng(2).permutation(50), 7):
    cut = trim(idx)
    for axis, mark in marks.items():
      longest = max(_last_real(row) for row in arrays[mark][idx])
      ladder = length_grouping.bucket_widths(arrays[mark].shape[1], 4)
      width = min(w for w in ladder if w >= longest)
      for key in cut:
        if key.startswith(axis):
          assert cut[key].shape == (50, width)
          np.testing.assert_array_equal(cut[key], arrays[key][:, :width])


def test_rows_without_token_axes_are_refused():
  with pytest.raises(ValueError, match="token axes"):
    length_grouping.Trimmer({"query_tokens": np.ones((4, 2, 8))}, 4)


def test_the_ledger_of_length_grouped_steps_says_infinite_epsilon():
  sampler = length_grouping.LengthGroupedSampler(_lengths(), 32, seed=5)
  description = sampler.describe()
  assert isinstance(sampling.scheme_from_description(description),
                    sampling.NonPrivateScheme)
  # Whatever σ a ledger claims, grouped steps release without a bound.
  ledger = ledger_lib.PrivacyLedger(
      noise_multiplier=5.0, clip_norm=1.0, delta=1e-5, target_epsilon=3.0,
      sampling=description, dataset_size=700, accountant="pld")
  ledger.record_dp_steps(3)
  assert ledger.events == [accounting.Gaussian(0.0, 3)]
  assert ledger.epsilon_spent() == float("inf")


def _config(**overrides):
  """A run's settings, none from gin bindings an earlier test left."""
  gin.clear_config()
  fields = dict(model_dir="/tmp/unused", model_config=None,
                mixture_or_task_name="x", task_feature_lengths={},
                batch_size=8, train_steps=50, target_epsilon="inf",
                sampling_method="length_grouped")
  return run_config.RunConfig(**{**fields, **overrides})


@pytest.mark.parametrize("fields, message", [
    ({"target_epsilon": 8.0}, "TARGET_EPSILON = 'inf'"),
    ({"privacy_unit": "user"}, "privacy_unit"),
    ({"mechanism": "bandmf"}, "bandmf"),
    ({"length_buckets": 0}, "length_buckets"),
])
def test_plan_refuses_length_grouping_where_it_cannot_hold(fields, message):
  with pytest.raises(gin_cli.UsageError, match=message):
    plan_lib.check_run_inputs(_config(**fields))


def test_unknown_sampling_method_names_the_choices():
  with pytest.raises(gin_cli.UsageError, match="length_grouped"):
    plan_lib.check_run_inputs(_config(sampling_method="sorted"))


def test_a_length_grouped_run_trains_at_infinite_epsilon(tmp_path):
  gin.clear_config()
  gin_cli.configure(["quickstart.gin"], [
      f"MODEL_DIR = '{tmp_path}'", *TINY, "TRAIN_STEPS = 3",
      "TARGET_EPSILON = 'inf'", "train.sampling_method = 'length_grouped'"])
  result = trainer.train()
  assert result["steps_done"] == 3 and result["epsilon_spent"] == float("inf")
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(tmp_path, ledger_lib.LEDGER_FILENAME))
  assert ledger.sampling["method"] == "length_grouped"
  assert ledger.events == [accounting.Gaussian(0.0, 3)]
