"""The direct-DP dual encoder's privacy argument (dpjax.models.dual_encoder,
"Formal guarantees"): one pair moves the trainer's clipped sum by at most 2C
when rows are groups; naive per-example clipping of the in-batch loss does
not bound it; the DP run's ledger is a direct dp-accounting computation."""
from __future__ import annotations

import math
import os

import dp_accounting
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import pld

from dpjax import configurables
from dpjax import gin_cli
from dpjax.models import dual_encoder, t5, trainable
from dpjax.privacy import clipping, clipping_method
from dpjax.privacy import ledger as ledger_lib

ENCODER = t5.T5Config(vocab_size=61, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                      num_encoder_layers=1, num_decoder_layers=1,
                      dropout_rate=0.0)
CONFIG = dual_encoder.DualEncoderConfig(encoder=ENCODER, temperature=0.1,
                                        group_size=4)
LQ, LD = 5, 7
C = 0.05  # below every row's gradient norm here: each row is clipped


def _norm(tree):
  return float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree))))


def _diff(a, b):
  return jax.tree.map(jnp.subtract, a, b)


@pytest.fixture(scope="module")
def params():
  return dual_encoder.init_params(CONFIG, jax.random.PRNGKey(0))[0]


@pytest.fixture(scope="module")
def trainer_clipped_sum():
  """The clipped sum exactly as the trainer builds it (per-row vmap)."""
  model = trainable.trainable(CONFIG, {"queries": LQ, "documents": LD})
  return jax.jit(clipping_method.make_clipped_grad(model.example_loss, clip_norm=C,
                                            method="vmap"))


def _random_pair(rng):
  return (rng.integers(2, ENCODER.vocab_size, LQ).astype(np.int32),
          rng.integers(2, ENCODER.vocab_size, LD).astype(np.int32))


def test_one_pair_moves_the_grouped_clipped_sum_by_at_most_2c(
    params, trainer_clipped_sum):
  rng = np.random.default_rng(0)
  queries = rng.integers(2, ENCODER.vocab_size, (40, LQ)).astype(np.int32)
  documents = rng.integers(2, ENCODER.vocab_size, (40, LD)).astype(np.int32)
  grouping = dual_encoder.PairGroups(CONFIG.group_size, seed=0)
  rows = grouping.rows(queries[:16], documents[:16])  # 4 groups of 4
  everyone = np.ones(4, np.float32)
  total, stats = trainer_clipped_sum(params, rows, everyone)
  assert int(stats.num_clipped) == 4  # the bound is active in every row
  where = {int(p): divmod(i, 4) for i, p in
           enumerate(grouping.indices(16).reshape(-1))}
  moved = []
  for trial, position in enumerate([3, 10, 12]):
    k, j = where[position]
    # Replace-one: the pair at `position` becomes another (query, document);
    # the grouping, a function of positions only, is unchanged.
    q2, d2 = queries.copy()[:16], documents.copy()[:16]
    q2[position], d2[position] = queries[20 + trial], documents[20 + trial]
    neighbour = grouping.rows(q2, d2)
    changed = [g for g in range(4) if any(
        (neighbour[f][g] != rows[f][g]).any() for f in rows)]
    assert changed == [k]
    other, _ = trainer_clipped_sum(params, neighbour, everyone)
    delta = _diff(total, other)
    moved.append(_norm(delta))
    assert moved[-1] <= 2 * C * (1 + 1e-5)
    # All of the change is row k's: its two clipped versions.
    only_k = np.eye(4, dtype=np.float32)[k]
    mine, _ = trainer_clipped_sum(params, rows, only_k)
    theirs, _ = trainer_clipped_sum(params, neighbour, only_k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7),
                 delta, _diff(mine, theirs))
    # Dropping the pair from its group (pair_mask 0) is a row change too.
    dropped = {f: v.copy() for f, v in rows.items()}
    dropped["pair_mask"][k, j] = 0
    without, _ = trainer_clipped_sum(params, dropped, everyone)
    assert _norm(_diff(total, without)) <= 2 * C * (1 + 1e-5)
  assert max(moved) > C  # replace-one needs the 2C, not C


def _naive_clipped_sum():
  """Per-example clipping of the FULL in-batch loss: example i carries its
  query, its position and the whole batch's documents (the paper's
  "duplicated" batch), so each gradient is clipped on its own."""
  model = dual_encoder.DualEncoder(CONFIG)

  def example_loss(params, example):
    q, docs = model.apply({"params": params}, example["query_tokens"],
                          example["batch_documents"])
    logits = docs @ q / CONFIG.temperature
    return jax.nn.logsumexp(logits) - logits[example["index"]]

  return jax.jit(clipping.clipped_grad(example_loss, clip_norm=C))


def test_naive_per_example_clipping_of_in_batch_loss_exceeds_the_bound(
    params, trainer_clipped_sum):
  """B identical pairs: every in-batch loss is log B with zero gradient.
  Replacing ONE pair's document gives every other query a distinct negative:
  B - 1 equal nonzero gradients, each clipped to C, so the naive sum moves by
  about (B - 2) C, far beyond the 2C a per-example guarantee assumes."""
  b = 8
  q, d = _random_pair(np.random.default_rng(1))
  _, d_other = _random_pair(np.random.default_rng(2))
  docs = np.tile(d, (b, 1))
  swapped = docs.copy()
  swapped[0] = d_other

  def batch(documents):
    return {"query_tokens": np.tile(q, (b, 1)), "batch_documents":
            np.broadcast_to(documents, (b, b, LD)).copy(),
            "index": np.arange(b, dtype=np.int32)}

  naive = _naive_clipped_sum()
  before, _ = naive(params, batch(docs), np.ones(b, np.float32))
  after, stats = naive(params, batch(swapped), np.ones(b, np.float32))
  assert _norm(before) < 1e-3 * C
  assert int(stats.num_clipped) >= b - 1
  assert _norm(_diff(before, after)) > (b - 3) * C > 2 * C
  # The same change to a group (a row) of the trainer: within 2C.
  rows = {"query_tokens": np.tile(q, (4, 4, 1)),
          "document_tokens": np.stack([docs[:4], swapped[:4]] * 2),
          "pair_mask": np.ones((4, 4), np.float32)}
  one, _ = trainer_clipped_sum(params, rows, np.eye(4, dtype=np.float32)[0])
  two, _ = trainer_clipped_sum(params, rows, np.eye(4, dtype=np.float32)[1])
  assert _norm(_diff(one, two)) <= 2 * C * (1 + 1e-5)


def test_ghost_clipping_gives_the_same_clipped_sum(params, trainer_clipped_sum):
  """clipping_method 'ghost' (and so 'auto') works for the dual encoder: the
  shared encoder is called twice per row, each call its own set of sites."""
  rng = np.random.default_rng(3)
  rows = dual_encoder.PairGroups(4, seed=1).rows(  # the last group short
      rng.integers(2, ENCODER.vocab_size, (15, LQ)).astype(np.int32),
      rng.integers(2, ENCODER.vocab_size, (15, LD)).astype(np.int32))
  model = trainable.trainable(CONFIG, {"queries": LQ, "documents": LD})
  ghost = clipping_method.make_clipped_grad(model.example_loss, clip_norm=C,
                                     method="ghost")
  mask = np.array([1, 1, 0, 1], np.float32)
  want, want_stats = trainer_clipped_sum(params, rows, mask)
  got, got_stats = jax.jit(ghost)(params, rows, mask)
  np.testing.assert_allclose(got_stats.norms, want_stats.norms, rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               got, want)


def test_dp_run_ledger_is_the_pair_level_replace_one_guarantee(tmp_path):
  """The DP gin (sample sizes, tiny model, 2 steps): rows are groups of 8,
  shuffle sampling, δ = 1/(2 n_pairs); ε is a Gaussian of noise multiplier
  σ/2 per (started) epoch, computed here with dp-accounting directly."""
  gin.clear_config()
  gin_cli.configure(
      ["dual_encoder_msmarco_dp.gin", "dual_encoder_msmarco_sample.gin"],
      [f"MODEL_DIR = '{tmp_path}'", "TRAIN_STEPS = 2", "TARGET_EPSILON = 8.0",
       "TASK_FEATURE_LENGTHS = {'queries': 8, 'documents': 24}",
       "INITIAL_CHECKPOINT_PATH = None", "T5Config.vocab_size = 2000",
       "T5Config.num_encoder_layers = 1", "T5Config.d_model = 16",
       "T5Config.d_ff = 32", "T5Config.num_heads = 2", "T5Config.d_kv = 8",
       "train.log_period = 1", "train.eval_period = 0",
       "train.checkpoint_period = 2"])
  try:
    result = configurables.train()
  finally:
    gin.clear_config()
  pairs = 2998  # tasks/data/msmarco_sample/README.md
  groups = math.ceil(pairs / 8)
  ledger = ledger_lib.PrivacyLedger.load(
      os.path.join(tmp_path, ledger_lib.LEDGER_FILENAME))
  assert ledger.dataset_size == groups and ledger.steps == 2
  assert ledger.sampling["method"] == "shuffle"
  assert ledger.sampling["steps_per_epoch"] == groups // 4
  assert ledger.delta == pytest.approx(1 / (2 * pairs))
  assert ledger.clip_norm == 0.1 and result["examples_per_step"] == 4
  sigma = ledger.noise_multiplier
  assert ledger.accountant == "pld"
  direct = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(
          sigma / 2), 1)).get_epsilon(1 / (2 * pairs))
  assert result["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
  assert 0.99 * 8.0 <= result["epsilon_spent"] <= 8.0
