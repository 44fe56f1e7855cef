"""GPT-2 checkpoints under a larger gin vocabulary (tokens appended to the
BPE), and GPT-2 + discriminator head from a plain GPT-2 checkpoint.

A random tiny `transformers` GPT-2 (vocab 101) is saved as a Hugging Face
directory and loaded with vocab_size 101 + 4. References: the checkpoint's
own tensors (safetensors), the rows' mean and covariance in numpy (float64),
the logits of the same checkpoint loaded without growth, and transformers
loading the export.
"""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from dpjax.training import partitioning
from dpjax.models import gpt2, gpt2_disc, hf_gpt2, hf_t5, t5, trainable
from dpjax.pretrained import hf
import dpjax.pretrained as pretrained
from tests.pretrained.test_hf_t5_gpt2 import (MASK, TOKENS, VOCAB, CountingReader,
                                              assert_trees_equal, gpt2_pair, save,
                                              torch_logits, transformers)

NEW = 4  # appended tokens
WTE = ("token_embedder", "embedding")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, torch model, config at the checkpoint's vocab, grown config)."""
  model, cfg = gpt2_pair()
  directory = save(model, tmp_path_factory.mktemp("gpt2"), "safetensors")
  grown = gpt2.GPT2Config(**{**cfg.to_json(), "vocab_size": VOCAB + NEW})
  return directory, model, cfg, grown


@pytest.fixture(scope="module")
def loaded(checkpoint):
  """(plain params, grown params)."""
  directory, _, cfg, grown = checkpoint
  return hf.load_hf(directory, cfg), hf.load_hf(directory, grown)


def _logits(cfg, params):
  return np.asarray(jax.jit(lambda p: gpt2.GPT2(cfg).apply(
      {"params": p}, TOKENS, attention_mask=MASK))(params))


def test_grown_import_keeps_checkpoint_rows_and_appends_distinct_rows(checkpoint, loaded,
                                                                      capsys):
  directory, _, cfg, grown = checkpoint
  plain, params = loaded
  again = hf.load_hf(directory, grown)
  assert "4 embedding rows added" in capsys.readouterr().out
  wte = load_file(directory / "model.safetensors")["transformer.wte.weight"]
  table = np.asarray(params["token_embedder"]["embedding"])
  assert table.shape == (VOCAB + NEW, cfg.d_model)
  np.testing.assert_array_equal(table[:VOCAB], wte)
  # Reproducible, and the new tokens are as far apart as pretrained ones.
  np.testing.assert_array_equal(np.asarray(again["token_embedder"]["embedding"]), table)
  distances = lambda x: [np.linalg.norm(x[i] - x[j]) for i in range(len(x))
                         for j in range(i)]
  assert min(distances(table[VOCAB:])) > 0.3 * np.median(distances(wte[:20]))
  # Everything but the embedding is the ungrown import's.
  flat = lambda p: {k: v for k, v in jax.tree_util.tree_leaves_with_path(p)
                    if hf._keystr(k) != "/".join(WTE)}
  for (k, a), (_, b) in zip(flat(plain).items(), flat(params).items()):
    np.testing.assert_array_equal(a, b, err_msg=hf._keystr(k))


def test_grown_rows_have_the_tables_mean_and_covariance():
  """20,000 new rows against numpy's float64 mean and covariance of a
  correlated, off-centre table (sampling error ~ 1/√20,000)."""
  rng = np.random.default_rng(0)
  table = (rng.standard_normal((50, 6)) @ rng.standard_normal((6, 6)) + 2.0).astype(np.float32)
  new = hf.grow_rows(table, 50 + 20_000)[50:].astype(np.float64)
  old = table.astype(np.float64)
  scale = np.sqrt(np.diag(np.cov(old.T, bias=True)))
  np.testing.assert_allclose(new.mean(0), old.mean(0), atol=0.03 * scale.max())
  np.testing.assert_allclose(np.cov(new.T, bias=True) / np.outer(scale, scale),
                             np.cov(old.T, bias=True) / np.outer(scale, scale), atol=0.05)
  np.testing.assert_array_equal(hf.grow_rows(table, 52)[:50], table)


def test_grown_logits(checkpoint, loaded):
  """Old tokens keep their logits; a new token's logit at each position is
  Gaussian with the mean and variance of the old tokens' (tied head: h . x,
  x ~ N(μ, Σ)), so it starts as likely as a typical token: z-scores of 400
  new tokens over all positions are N(0, 1)."""
  directory, _, cfg, grown = checkpoint
  plain, params = loaded
  before, after = _logits(cfg, plain), _logits(grown, params)
  assert after.shape == (*TOKENS.shape, VOCAB + NEW)
  np.testing.assert_allclose(after[..., :VOCAB], before, rtol=1e-5, atol=1e-5)
  many = gpt2.GPT2Config(**{**cfg.to_json(), "vocab_size": VOCAB + 400})
  new = _logits(many, hf.load_hf(directory, many))[..., VOCAB:].astype(np.float64)
  old = before.astype(np.float64)
  z = (new - old.mean(-1, keepdims=True)) / old.std(-1, keepdims=True)
  assert abs(z.mean()) < 0.15 and 0.85 < z.std() < 1.15, (z.mean(), z.std())


def test_smaller_gin_vocabulary_is_refused_before_reading(checkpoint):
  directory, _, cfg, _ = checkpoint
  hf_config, reader = hf.open_hf_checkpoint(directory)
  counting = CountingReader(reader)
  small = gpt2.GPT2Config(**{**cfg.to_json(), "vocab_size": VOCAB - 1})
  with pytest.raises(hf.CheckpointError, match=r"vocab_size: checkpoint 101, gin 100 \(a smaller "
                     r"gin vocabulary would drop the pretrained embedding rows 100\.\.100"):
    hf.load_from_reader(hf_config, counting, small)
  # Growing does not excuse another mismatch.
  other = gpt2.GPT2Config(**{**cfg.to_json(), "vocab_size": VOCAB + NEW, "num_layers": 3})
  with pytest.raises(hf.CheckpointError) as e:
    hf.load_from_reader(hf_config, counting, other)
  assert "num_layers (config.json 'n_layer'): checkpoint 2, gin 3" in str(e.value)
  assert "vocab_size" not in str(e.value)
  assert counting.reads == 0
  # A mapping without VOCAB_PARAMS (T5) does not grow.
  small_t5 = t5.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_heads=2,
                         num_encoder_layers=1, num_decoder_layers=1)
  big_t5 = t5.T5Config(**{**small_t5.to_json(), "vocab_size": VOCAB + NEW})
  with pytest.raises(hf.CheckpointError, match=r"vocab_size: checkpoint 101, gin 105$"):
    hf.check_config(hf_t5.config_to_hf(small_t5), big_t5)


def test_export_of_grown_model_round_trips(checkpoint, loaded, tmp_path):
  _, _, _, grown = checkpoint
  _, params = loaded
  hf.export_hf(params, grown, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["vocab_size"] == VOCAB + NEW
  assert_trees_equal(hf.load_hf(tmp_path, grown), params)
  theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
  assert np.max(np.abs(_logits(grown, params) - torch_logits(theirs))) < 1e-4
  # <|endoftext|> stays GPT-2's 50256 when tokens are appended after it.
  for vocab in (50257, 50264):
    written = hf_gpt2.config_to_hf(gpt2.GPT2Config(vocab_size=vocab))
    assert written["eos_token_id"] == written["bos_token_id"] == 50256


def _disc_config(lm):
  return gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=(VOCAB, VOCAB + 1))


def test_gpt2_disc_from_a_gpt2_checkpoint(checkpoint, loaded, capsys):
  directory, _, _, grown = checkpoint
  _, lm = loaded
  cfg = _disc_config(grown)
  key = jax.random.PRNGKey(3)
  mesh = partitioning.make_mesh()
  abstract, axes = gpt2_disc.abstract_params(cfg, max_length=1)
  shardings = partitioning.param_shardings(mesh, axes)
  params = pretrained.load_pretrained(directory, cfg, shardings=shardings, rng=key)
  assert "disc_head: not in the checkpoint, freshly initialised" in capsys.readouterr().out
  assert_trees_equal(gpt2_disc.lm_params(params), lm)
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda x: x.shape, abstract)
  assert np.shape(params["disc_head"]["out"]["kernel"]) == (grown.d_model, 2)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert x.sharding == s
  # The head a run seeded like this gets without a checkpoint (the trainer's
  # init: jitted, its feature lengths), up to XLA's float rounding.
  model = trainable.trainable(cfg, {"inputs": 3, "targets": 8})
  scratch = jax.jit(lambda: model.init_params(key)[0]["disc_head"])()
  for x, y in zip(jax.tree.leaves(params["disc_head"]), jax.tree.leaves(scratch)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)
  with pytest.raises(ValueError, match="needs rng= to initialise its discriminator head"):
    pretrained.load_pretrained(directory, cfg)
