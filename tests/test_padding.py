"""`train.trim_padding`: microbatches of like-length rows cut to bucket
widths. Each example's loss against its full-width loss (T5 and GPT-2), the
reordering against the sample it reorders, and a run whose clipped sums
equal the untrimmed run's."""
from __future__ import annotations

import os

import gin
import jax
import numpy as np
import pytest

from dpjax import configurables
from dpjax import errors
from dpjax.training import padding, run_config
from dpjax.models import gpt2, t5
from dpjax.privacy import ledger as ledger_lib

from tests import numerics, test_trainer


def _last_real(row) -> int:
  """One past the last nonzero entry, by a loop."""
  return max((i + 1 for i, x in enumerate(row) if x != 0), default=0)


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
  """As `data.arrays.decoder_only_features`: bos, prompt, target, then bos
  padding outside the attention mask."""
  real = rng.integers(2, length + 1, n)
  prompt = rng.integers(0, real - 1)
  pos = np.arange(length)[None, :]
  tokens = rng.integers(2, vocab - 1, (n, length)).astype(np.int32)
  tokens[:, 0] = bos
  tokens[pos >= real[:, None]] = bos
  return {"tokens": tokens,
          "loss_weights": ((pos > prompt[:, None]) & (pos < real[:, None])
                           ).astype(np.float32),
          "attention_mask": (pos < real[:, None]).astype(np.int32)}


def test_bucket_widths_are_multiples_of_8_up_to_the_length():
  assert padding.bucket_widths(176, 4) == (48, 88, 136, 176)
  assert padding.bucket_widths(48, 4) == (16, 24, 40, 48)
  assert padding.bucket_widths(20, 8) == (8, 16, 20)
  with pytest.raises(ValueError):
    padding.bucket_widths(20, 0)


@pytest.mark.parametrize("model", ["t5", "gpt2"])
def test_cut_rows_give_each_example_its_full_width_loss(model):
  rng = np.random.default_rng(0)
  # One layer per stack: each layer masks a cut position as the first does.
  if model == "t5":
    cfg = t5.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64,
                      num_heads=4, num_encoder_layers=1,
                      num_decoder_layers=1, dropout_rate=0.0)
    params, _ = t5.init_params(cfg, jax.random.PRNGKey(0),
                               input_length=32, target_length=40)
    loss, arrays = jax.jit(t5.make_batch_loss(cfg)), _t5_arrays(rng)
    mark = "decoder_target_tokens"
  else:
    cfg = gpt2.GPT2Config(vocab_size=61, n_positions=48, d_model=32,
                          num_layers=1, num_heads=4, dropout_rate=0.0)
    params, _ = gpt2.init_params(cfg, jax.random.PRNGKey(0), max_length=48)
    loss, arrays = jax.jit(gpt2.make_batch_loss(cfg)), _gpt2_arrays(rng)
    mark = "attention_mask"
  trim = padding.Trimmer(arrays, buckets=4)
  order = np.argsort([_last_real(row) for row in arrays[mark]])
  full = np.asarray(loss(params, arrays))
  widths = set()
  for rows in (order[:6], order[6:12], order[-6:], order):
    batch = {k: v[rows] for k, v in trim(rows).items()}
    widths.add(batch[mark].shape[1])
    np.testing.assert_allclose(loss(params, batch), full[rows], rtol=2e-5,
                               atol=2e-6)
  assert len(widths) > 1  # some microbatch was cut


def test_each_axis_is_cut_to_the_smallest_bucket_holding_the_rows():
  arrays = _t5_arrays(np.random.default_rng(1), n=50)
  trim = padding.Trimmer(arrays, buckets=4)
  marks = {"encoder": "encoder_input_tokens",
           "decoder": "decoder_target_tokens"}
  for rows in np.array_split(np.random.default_rng(2).permutation(50), 7):
    cut = trim(rows)
    for axis, mark in marks.items():
      longest = max(_last_real(row) for row in arrays[mark][rows])
      ladder = padding.bucket_widths(arrays[mark].shape[1], 4)
      width = min(w for w in ladder if w >= longest)
      for key in cut:
        if key.startswith(axis):
          assert cut[key].shape == (50, width)
          np.testing.assert_array_equal(cut[key], arrays[key][:, :width])


def test_rows_without_token_axes_are_refused():
  with pytest.raises(ValueError, match="token axes"):
    padding.Trimmer({"query_tokens": np.ones((4, 2, 8))}, 4)


def test_by_length_reorders_the_same_examples_and_weights():
  rng = np.random.default_rng(3)
  lengths = rng.integers(1, 100, 40)
  idx = rng.choice(40, size=(3, 8), replace=False)
  mask = np.ones((3, 8), np.float32)
  mask[2, 5:] = 0.0  # a padded Poisson sample
  mask[0, 1] = 0.5  # a user-level weight
  idx[2, 5:] = 0
  got_idx, got_mask = padding.by_length(idx, mask, lengths)
  assert got_idx.shape == idx.shape and got_mask.shape == mask.shape
  real = got_mask.ravel() > 0
  assert sorted(zip(got_idx.ravel()[real], got_mask.ravel()[real])) == sorted(
      zip(idx.ravel()[mask.ravel() > 0], mask.ravel()[mask.ravel() > 0]))
  assert not real[real.sum():].any()  # padding rows last
  ordered = lengths[got_idx.ravel()[real]]
  assert all(a >= b for a, b in zip(ordered, ordered[1:]))


def test_length_buckets_must_be_positive():
  with pytest.raises(errors.UsageError, match="length_buckets"):
    test_trainer.configure("/tmp/unused", "train.length_buckets = 0")
    run_config.check(configurables.run_config())
  gin.clear_config()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same 2-step DP run (one secret: the same samples and noise), its
  16-example batch in microbatches of 4, with and without trim_padding."""
  out = {}
  for name, extra in (("full", []), ("trimmed", ["train.trim_padding = True"])):
    model_dir = tmp_path_factory.mktemp(name)
    if out:
      test_trainer.same_secret(out["full"][0], model_dir)
    out[name] = (model_dir, test_trainer.run(
        model_dir, "TRAIN_STEPS = 2", "MICROBATCH_SIZE = 4",
        "train.checkpoint_period = 2", *extra))
  gin.clear_config()
  return out


def test_trimmed_run_ends_with_the_untrimmed_params(runs):
  """The same update up to float32 sums in another order, per leaf
  (`numerics.update_differences`; measured: at most 6.7e-7 of the
  update; elementwise at rtol 1e-4 this failed on 1 of 8,192 params)."""
  differences = numerics.update_differences(
      *(test_trainer.restored_params(runs[name][0])
        for name in ("full", "trimmed")), test_trainer.initial_params())
  assert max(differences) < 1e-4, differences


def test_trimmed_run_spends_the_same_epsilon(runs):
  full, trimmed = runs["full"], runs["trimmed"]
  assert trimmed[1]["epsilon_spent"] == full[1]["epsilon_spent"]
  ledgers = [ledger_lib.PrivacyLedger.load(
      os.path.join(d, ledger_lib.LEDGER_FILENAME)) for d, _ in (full, trimmed)]
  assert ledgers[0].events == ledgers[1].events
