"""The dual encoder (dpjax.models.dual_encoder), its pairs task and a trainer
run, each checked against an independent computation: the T5 encoder with a
numpy masked mean, explicit loops over queries and groups, direct
SentencePiece encoding of the files."""
from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
import seqio

from dpjax import configurables
from dpjax import gin_cli
from dpjax.generation import inference
from dpjax.data import arrays as data_arrays
from dpjax.data.readers import msmarco
from dpjax.models import dual_encoder, t5, trainable
from tasks import msmarco as msmarco_tasks

ENCODER = t5.T5Config(vocab_size=61, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                      num_encoder_layers=1, num_decoder_layers=1,
                      dropout_rate=0.0)
CONFIG = dual_encoder.DualEncoderConfig(encoder=ENCODER, temperature=0.1,
                                        group_size=4)
LQ, LD = 6, 9


@pytest.fixture(scope="module")
def params():
  return dual_encoder.init_params(CONFIG, jax.random.PRNGKey(0))[0]


def _tokens(rng, shape, min_len=1):
  """Random right-padded ids: each row a random length >= min_len."""
  ids = rng.integers(2, ENCODER.vocab_size, shape)
  lengths = rng.integers(min_len, shape[-1] + 1, shape[:-1])
  return np.where(np.arange(shape[-1]) < lengths[..., None], ids, 0).astype(
      np.int32)


@jax.jit
def _t5_encoded(params, tokens):
  """The T5 encoder's states, computed by t5.T5Transformer itself."""
  return t5.T5Transformer(ENCODER).apply({"params": params}, tokens,
                                         method=t5.T5Transformer.encode)


def _reference_embeddings(params, tokens, pooling="mean"):
  states = np.asarray(_t5_encoded(params, tokens), np.float64)
  if pooling == "first":
    pooled = states[:, 0]
  else:
    real = (tokens > 0)[..., None]
    pooled = (states * real).sum(1) / np.maximum(real.sum(1), 1)
  norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
  return pooled / np.where(norm > 0, norm, 1.0)


def test_params_are_the_t5_encoder_subtrees():
  ours, our_axes = dual_encoder.abstract_params(CONFIG)
  full, full_axes = t5.abstract_params(ENCODER, input_length=1, target_length=1)
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(ours) == shapes(dual_encoder.params_from_t5(full))
  assert our_axes == dual_encoder.params_from_t5(full_axes)


def test_encode_is_the_masked_mean_of_the_t5_encoder(params):
  rng = np.random.default_rng(0)
  tokens = _tokens(rng, (4, LD))
  tokens[3] = 0  # an all-padding row embeds to zero, not NaN
  got = np.asarray(dual_encoder.encode(CONFIG, params, tokens))
  assert got.dtype == np.float32 and got.shape == (4, ENCODER.d_model)
  np.testing.assert_allclose(got, _reference_embeddings(params, tokens),
                             atol=2e-6)
  np.testing.assert_allclose(np.linalg.norm(got[:3], axis=-1), 1.0, rtol=1e-6)
  assert not got[3].any()
  # Padding is invisible: the same texts padded further embed the same.
  longer = np.pad(tokens, ((0, 0), (0, 5)))
  np.testing.assert_allclose(dual_encoder.encode(CONFIG, params, longer), got,
                             atol=2e-6)
  first = dual_encoder.DualEncoderConfig(encoder=ENCODER, pooling="first")
  np.testing.assert_allclose(dual_encoder.encode(first, params, tokens),
                             _reference_embeddings(params, tokens, "first"),
                             atol=2e-6)


def _softmax_loss_loop(q, d, mask, temperature):
  """Eq. 1 by hand: for each real query, -log of its document's softmax
  weight among the real documents; then the mean over real queries."""
  losses = []
  for i in range(len(q)):
    if not mask[i]:
      continue
    logits = [q[i] @ d[j] / temperature for j in range(len(d)) if mask[j]]
    positive = q[i] @ d[i] / temperature
    losses.append(np.log(np.sum(np.exp(logits))) - positive)
  return np.mean(losses)


@pytest.fixture(scope="module")
def groups():
  """Three groups of four pairs; the last has one padding pair."""
  rng = np.random.default_rng(1)
  batch = {"query_tokens": _tokens(rng, (3, 4, LQ)),
           "document_tokens": _tokens(rng, (3, 4, LD)),
           "pair_mask": np.ones((3, 4), np.float32)}
  batch["pair_mask"][2, 3] = 0
  batch["query_tokens"][2, 3] = batch["document_tokens"][2, 3] = 0
  return batch


@pytest.fixture(scope="module")
def per_row(params, groups):
  """What the trainer differentiates: the loss and gradient of each row."""
  model = trainable.trainable(CONFIG, {"queries": LQ, "documents": LD})
  return jax.jit(jax.vmap(jax.value_and_grad(model.example_loss),
                          in_axes=(None, 0)))(params, groups)


def test_row_losses_are_the_in_batch_softmax_per_group(params, groups, per_row):
  losses, _ = per_row
  for k in range(3):
    q = _reference_embeddings(params, groups["query_tokens"][k])
    d = _reference_embeddings(params, groups["document_tokens"][k])
    want = _softmax_loss_loop(q, d, groups["pair_mask"][k], CONFIG.temperature)
    np.testing.assert_allclose(losses[k], want, rtol=2e-5)


def test_row_gradient_is_the_gradient_of_its_own_group_loss(params, groups,
                                                            per_row):
  """The per-row gradient the trainer clips equals the gradient of a loss
  written here from the T5 encoder: the group's real queries against the
  group's real documents only, mean over its queries."""

  @jax.jit
  @jax.grad
  def own_loss(p, queries, documents):  # the real pairs of one group
    def embed(tokens):
      states = _t5_encoded(p, tokens)
      real = (tokens > 0)[..., None]
      pooled = (states * real).sum(1) / jnp.maximum(real.sum(1), 1)
      return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    q, d = embed(queries), embed(documents)
    total = 0.0
    for i in range(len(q)):
      logits = jnp.stack([q[i] @ d[j] for j in range(len(d))])
      total += jax.nn.logsumexp(logits / CONFIG.temperature) - logits[i] / (
          CONFIG.temperature)
    return total / len(q)

  k = 2  # the group with a padding pair, which must play no part
  want = own_loss(params, groups["query_tokens"][k][:3],
                  groups["document_tokens"][k][:3])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a[k], b, atol=2e-5),
               per_row[1], want)


def test_pair_groups_partition_the_positions():
  grouping = dual_encoder.PairGroups(group_size=4, seed=3)
  idx = grouping.indices(10)
  assert idx.shape == (3, 4)
  assert sorted(idx[idx >= 0].tolist()) == list(range(10))
  assert (idx[:2] >= 0).all() and (idx[2] == -1).sum() == 2
  np.testing.assert_array_equal(idx, grouping.indices(10))  # deterministic
  assert not np.array_equal(idx, dual_encoder.PairGroups(4, 4).indices(10))
  queries = np.arange(10)[:, None] * np.ones((1, 3), np.int32)
  rows = grouping.rows(queries, queries + 100)
  for k in range(3):
    for j in range(4):
      if idx[k, j] < 0:
        assert rows["pair_mask"][k, j] == 0 and not rows["query_tokens"][k, j].any()
      else:
        assert rows["pair_mask"][k, j] == 1
        assert (rows["query_tokens"][k, j] == idx[k, j]).all()
        assert (rows["document_tokens"][k, j] == idx[k, j] + 100).all()


def _sp_row(sp, text, length):
  ids = sp.encode(text)[:length - 1] + [1]
  return ids + [0] * (length - len(ids))


def test_task_rows_from_original_and_synthetic_pairs(tmp_path):
  sp = spm.SentencePieceProcessor(model_file=msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  lengths = {"queries": 16, "documents": 48}
  grouping = dual_encoder.PairGroups(group_size=8, seed=0)
  msmarco_tasks.register_msmarco_dual_encoder(task_name="test_de_original")
  rows = data_arrays.load_task_arrays("test_de_original", "train", lengths,
                                      converter=grouping)
  pairs = msmarco.load_query_passage_pairs(msmarco.DEFAULT_SAMPLE_DIR, "train")
  idx = grouping.indices(len(pairs))
  assert rows["query_tokens"].shape == (len(idx), 8, 16)
  assert rows["pair_mask"].sum() == len(pairs)
  for k, j in [(0, 0), (5, 3), (len(idx) - 1, 0)]:
    _, _, query, passage = pairs[idx[k, j]]
    assert rows["query_tokens"][k, j].tolist() == _sp_row(sp, query, 16)
    assert rows["document_tokens"][k, j].tolist() == _sp_row(sp, passage, 48)
  np.testing.assert_array_equal(
      data_arrays.real_token_counts(rows),
      (rows["query_tokens"] > 0).sum((1, 2)) + (rows["document_tokens"] > 0
                                                ).sum((1, 2)))

  # A dpjax.infer output directory: its qrels point into the collection.
  out = tmp_path / "synthetic"
  out.mkdir()
  chosen = [pairs[0], pairs[7]]
  (out / "queries.synthetic.tsv").write_text(
      "".join(f"{i}\tsynthetic query {i}\n" for i in range(2)))
  (out / "qrels.synthetic.tsv").write_text(
      "".join(f"{i}\t0\t{pid}\t1\n" for i, (_, pid, _, _) in enumerate(chosen)))
  msmarco_tasks.register_msmarco_dual_encoder(
      train_pairs_dir=str(out), train_pairs_split="synthetic",
      task_name="test_de_synthetic")
  pairs = data_arrays.dual_encoder_features(
      seqio.get_mixture_or_task("test_de_synthetic").get_dataset(
          lengths, split="train", shuffle=False), lengths)
  for i, (_, _, _, passage) in enumerate(chosen):
    assert pairs["queries"][i].tolist() == _sp_row(sp, f"synthetic query {i}", 16)
    assert pairs["documents"][i].tolist() == _sp_row(sp, passage, 48)
  assert msmarco_tasks.msmarco_dual_encoder_delta(
      train_pairs_dir=str(out), train_pairs_split="synthetic") == 1 / 4
  with pytest.raises(FileNotFoundError, match="qrels.nope.tsv"):
    msmarco_tasks.register_msmarco_dual_encoder(
        train_pairs_dir=str(out), train_pairs_split="nope", task_name="x")


def test_config_json_round_trip():
  back = trainable.config_from_json("DualEncoderConfig", CONFIG.to_json())
  assert back == CONFIG and hash(back) == hash(CONFIG)
  with pytest.raises(ValueError, match="pooling"):
    dual_encoder.DualEncoderConfig(pooling="max")
  with pytest.raises(KeyError, match="documents"):
    trainable.trainable(CONFIG, {"queries": 8})


def test_train_command_runs_and_the_run_encodes(tmp_path):
  """`python -m dpjax.train --gin_file=gin/dual_encoder_msmarco.gin` with the
  sample sizes and a tinier model, in process."""
  gin.clear_config()
  gin_cli.configure(
      ["dual_encoder_msmarco.gin", "dual_encoder_msmarco_sample.gin"],
      [f"MODEL_DIR = '{tmp_path}'", "TRAIN_STEPS = 3",
       "TASK_FEATURE_LENGTHS = {'queries': 8, 'documents': 24}",
       "GROUP_SIZE = 6", "INITIAL_CHECKPOINT_PATH = None",
       "T5Config.vocab_size = 2000", "T5Config.num_encoder_layers = 1",
       "T5Config.d_model = 16", "T5Config.d_ff = 32",
       "T5Config.num_heads = 2", "T5Config.d_kv = 8",
       "train.log_period = 1", "train.eval_period = 3",
       "train.eval_examples = 8", "train.checkpoint_period = 3"])
  try:
    result = configurables.train()
  finally:
    gin.clear_config()
  assert result["steps_done"] == 3 and np.isfinite(result["loss"])
  assert np.isfinite(result["eval_loss"])  # make_batch_loss on dev groups
  assert result["examples_per_step"] == 1  # one group of 6 pairs per batch
  config, params, meta = inference.load_trained(str(tmp_path))
  assert isinstance(config, dual_encoder.DualEncoderConfig)
  assert config.group_size == 6 and config.encoder.d_model == 16
  assert meta.plan["dataset_size"] == -(-2998 // 6)
  tokens = np.array([[5, 6, 7, 1, 0, 0], [9, 1, 0, 0, 0, 0]], np.int32)
  emb = np.asarray(dual_encoder.encode(config, params, tokens))
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)


def test_pretrained_t5_checkpoint_loads_into_the_encoder(tmp_path):
  from dpjax import pretrained
  t5_params = t5.init_params(ENCODER, jax.random.PRNGKey(3), input_length=LQ,
                             target_length=LQ)[0]
  pretrained.export_hf(t5_params, ENCODER, tmp_path)
  loaded = pretrained.load_pretrained(tmp_path, CONFIG)
  want = {k: t5_params[k] for k in ("token_embedder", "encoder")}
  assert jax.tree.structure(loaded) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
