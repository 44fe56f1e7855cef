"""Tests of the BERT encoder / classifier and its Hugging Face mapping.

The Hugging Face comparisons build tiny random `transformers` models in torch
(CPU); they are skipped where torch or transformers is not installed.
"""
import dataclasses
import functools
import pathlib

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dpjax import configurables
from dpjax.training import partitioning
from dpjax.models import bert, hf_bert, hf_common

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin" / "models"
VOCAB = 97
LABELS = 3
# Right-padded batch: lengths 10, 7 and 4, padding id 0.
LENGTHS = np.array([10, 7, 4])
MASK = (np.arange(10)[None] < LENGTHS[:, None]).astype(np.int32)
_rng = np.random.default_rng(0)
TOKENS = np.where(MASK, _rng.integers(1, VOCAB, (3, 10)), 0).astype(np.int32)
TYPES = np.where(MASK, _rng.integers(0, 2, (3, 10)), 0).astype(np.int32)
LABEL = np.array([0, 2, 1], np.int32)


def tiny_config(**overrides) -> bert.BertConfig:
  """The shapes of gin/models/bert_tiny.gin, with a short position table."""
  fields = dict(vocab_size=VOCAB, max_position_embeddings=64, d_model=64, num_layers=2,
                num_heads=4, d_ff=128, num_labels=LABELS)
  return bert.BertConfig(**{**fields, **overrides})


@functools.partial(jax.jit, static_argnums=0)
def classify(cfg, params, tokens, mask=None, types=None):
  return bert.BertClassifier(cfg).apply({"params": params}, tokens, attention_mask=mask,
                                        token_type_ids=types)


@functools.partial(jax.jit, static_argnums=0)
def encode(cfg, encoder_params, tokens, mask=None, types=None):
  return bert.BertEncoder(cfg).apply({"params": encoder_params}, tokens, attention_mask=mask,
                                     token_type_ids=types)


def _randomized_params(cfg, seed):
  """Params with biases and norms randomized (init zeros/ones would hide
  mistakes in them)."""
  params, axes = bert.init_params(cfg, jax.random.PRNGKey(seed), max_length=10)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 100), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else x
            for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, leaves), axes


@pytest.fixture(scope="module")
def tiny():
  cfg = tiny_config()
  params, axes = _randomized_params(cfg, 0)
  return cfg, params, axes


@pytest.fixture(scope="module")
def tiny_mean():
  cfg = tiny_config(pooling="mean")
  params, axes = _randomized_params(cfg, 1)
  return cfg, params, axes


# ----------------------------------------------------------------------------
# Forward pass.
# ----------------------------------------------------------------------------


def test_forward_shapes_and_dtypes(tiny):
  cfg, params, _ = tiny
  logits = classify(cfg, params, TOKENS, MASK, TYPES)
  assert logits.shape == (3, LABELS) and logits.dtype == jnp.float32
  hidden = encode(cfg, params["encoder"], TOKENS, MASK, TYPES)
  assert hidden.shape == (3, 10, 64) and hidden.dtype == jnp.float32
  assert np.all(np.isfinite(logits)) and np.all(np.isfinite(hidden))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert set(params) == {"encoder", "pooler", "classifier"}
  # Token types matter; no mask = all real.
  assert not np.allclose(classify(cfg, params, TOKENS, MASK), logits, atol=1e-4)
  full = np.ones_like(MASK)
  np.testing.assert_allclose(classify(cfg, params, TOKENS, None, TYPES),
                             classify(cfg, params, TOKENS, full, TYPES), atol=1e-6)


@pytest.mark.parametrize("variant", ["tiny", "tiny_mean"])
def test_padding_does_not_affect_real_outputs(variant, request):
  """Right padding: logits and real-position states equal the unpadded rows',
  whatever the padded tokens are."""
  cfg, params, _ = request.getfixturevalue(variant)
  logits = classify(cfg, params, TOKENS, MASK, TYPES)
  hidden = encode(cfg, params["encoder"], TOKENS, MASK, TYPES)
  garbage = np.where(MASK, TOKENS, 50 + np.arange(10)[None]).astype(np.int32)
  garbage_types = np.where(MASK, TYPES, 1).astype(np.int32)
  np.testing.assert_allclose(classify(cfg, params, garbage, MASK, garbage_types), logits,
                             atol=1e-5)
  other = encode(cfg, params["encoder"], garbage, MASK, garbage_types)
  for row, n in enumerate(LENGTHS):
    np.testing.assert_allclose(other[row, :n], hidden[row, :n], atol=1e-5)
  # The same as the unpadded row (one length only: each one compiles).
  row, n = 1, LENGTHS[1]
  short = (TOKENS[row:row + 1, :n], None, TYPES[row:row + 1, :n])
  np.testing.assert_allclose(classify(cfg, params, *short)[0], logits[row], atol=1e-5)
  np.testing.assert_allclose(encode(cfg, params["encoder"], *short)[0], hidden[row, :n],
                             atol=1e-5)
  # Without the mask the padding does leak in (the test can see a mistake).
  assert not np.allclose(classify(cfg, params, garbage, None, TYPES)[1:], logits[1:],
                         atol=1e-4)


def test_mean_pooling_has_no_pooler(tiny_mean):
  cfg, params, _ = tiny_mean
  assert set(params) == {"encoder", "classifier"}
  hidden = np.asarray(encode(cfg, params["encoder"], TOKENS, MASK, TYPES), np.float64)
  pooled = (hidden * MASK[..., None]).sum(1) / MASK.sum(1, keepdims=True)
  expected = pooled @ params["classifier"]["kernel"] + params["classifier"]["bias"]
  np.testing.assert_allclose(classify(cfg, params, TOKENS, MASK, TYPES), expected, atol=1e-5)


def test_bfloat16_close_to_float32(tiny):
  cfg, params, _ = tiny
  f32 = classify(cfg, params, TOKENS, MASK, TYPES)
  bf16 = classify(dataclasses.replace(cfg, dtype="bfloat16"), params, TOKENS, MASK, TYPES)
  assert bf16.dtype == jnp.float32  # logits stay float32
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05 * max(1.0, float(jnp.max(jnp.abs(f32))))


def test_too_long_raises(tiny):
  cfg, params, _ = tiny
  with pytest.raises(ValueError, match="max_position_embeddings"):
    classify(cfg, params, np.ones((1, 65), np.int32))


# ----------------------------------------------------------------------------
# Losses.
# ----------------------------------------------------------------------------


def _numpy_xent(logits, labels):
  logits = np.asarray(logits, np.float64)
  m = logits.max(-1, keepdims=True)
  logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  return -logp[np.arange(len(labels)), labels]


def test_losses_and_predict(tiny):
  cfg, params, _ = tiny
  batch = {"tokens": TOKENS, "attention_mask": MASK, "label": LABEL, "token_type_ids": TYPES}
  logits = jax.jit(bert.make_predict(cfg))(params, batch)
  np.testing.assert_allclose(logits, classify(cfg, params, TOKENS, MASK, TYPES), atol=1e-6)
  got = jax.jit(bert.make_batch_loss(cfg))(params, batch)
  assert got.shape == (3,)
  np.testing.assert_allclose(got, _numpy_xent(logits, LABEL), rtol=1e-5)

  per_example = jax.jit(jax.vmap(jax.value_and_grad(bert.make_example_loss(cfg)),
                                 in_axes=(None, 0)))
  values, grads = per_example(params, batch)
  np.testing.assert_allclose(values, got, rtol=1e-5)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(g.shape == (3,) + p.shape and np.all(np.isfinite(g))
             for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)))
  # Padded positions get no gradient through the position table.
  wpe_grad = grads["encoder"]["position_embedder"]["embedding"]
  assert np.all(wpe_grad[2, 4:] == 0) and np.any(wpe_grad[2, :4] != 0)
  # 'dropout_rng' turns dropout on, deterministically per key.
  batch["dropout_rng"] = jax.random.split(jax.random.PRNGKey(0), 3)
  dropped, _ = per_example(params, batch)
  again, _ = per_example(params, batch)
  np.testing.assert_array_equal(dropped, again)
  assert not np.allclose(dropped, values, atol=1e-4)


# ----------------------------------------------------------------------------
# Params, axes, configs, gin.
# ----------------------------------------------------------------------------


def test_every_param_has_logical_axes(tiny):
  cfg, params, axes = tiny
  names = {"vocab", "embed", "mlp", "joined_kv", "abspos", "token_types", "labels"}
  is_spec = lambda x: isinstance(x, PartitionSpec)
  assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_spec)
  for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_spec)):
    assert isinstance(spec, PartitionSpec) and len(spec) == x.ndim
    assert set(spec) <= names and len(set(spec)) == len(spec)
  shapes, abstract_axes = bert.abstract_params(cfg, max_length=8)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
      lambda x: (x.shape, x.dtype), params)
  assert abstract_axes == axes
  enc = axes["encoder"]
  assert enc["token_type_embedder"]["embedding"] == PartitionSpec("token_types", "embed")
  assert enc["position_embedder"]["embedding"] == PartitionSpec("abspos", "embed")
  assert enc["layers_0"]["attention"]["query"]["kernel"] == PartitionSpec("embed", "joined_kv")
  assert axes["classifier"]["kernel"] == PartitionSpec("embed", "labels")
  # The data-parallel rules accept every name (unknown ones are replicated).
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  shardings = partitioning.param_shardings(mesh, axes, partitioning.DATA_PARALLEL_RULES)
  assert all(s.spec == PartitionSpec(*[None] * len(s.spec)) for s in jax.tree.leaves(shardings))


def _gin_config(name, bindings=()):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([str(GIN_DIR / f"{name}.gin")], list(bindings))
    return configurables.BertConfig()
  finally:
    gin.clear_config()


# Exact parameter counts of Hugging Face's BertModel (encoder + pooler) for
# bert-base-uncased and bert-large-uncased.
EXPECTED = {"bert_base": 109_482_240, "bert_large": 335_141_888}


def test_gin_sizes_param_counts():
  for name, expected in EXPECTED.items():
    cfg = _gin_config(name)
    shapes, _ = bert.abstract_params(cfg, max_length=4)
    head = bert.param_count(shapes["classifier"])
    assert head == (cfg.d_model + 1) * cfg.num_labels
    assert bert.param_count(shapes) - head == expected, name
  cfg = _gin_config("bert_tiny", ["BertConfig.vocab_size = 1000"])
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.d_ff) == (
      1000, 64, 2, 4, 128)
  assert "BertConfig.vocab_size" not in (GIN_DIR / "bert_tiny.gin").read_text()
  assert {p.stem for p in GIN_DIR.glob("bert*.gin")} == set(EXPECTED) | {"bert_tiny"}


def test_config_json_roundtrip():
  cfg = bert.BertConfig(d_model=128, num_heads=2, num_labels=5, dtype="bfloat16",
                        pooling="mean")
  assert bert.BertConfig.from_json(cfg.to_json()) == cfg
  with pytest.raises(ValueError):
    bert.BertConfig.from_json({"d_modle": 128})
  for bad in (dict(d_model=100, num_heads=3), dict(dtype="float16"), dict(pooling="max"),
              dict(num_labels=0)):
    with pytest.raises(ValueError):
      bert.BertConfig(**bad)
  hash(cfg)  # usable as a static jit argument


# ----------------------------------------------------------------------------
# Hugging Face.
# ----------------------------------------------------------------------------


class DictReader:
  """A `hf_common.TensorReader` over an in-memory state dict."""

  def __init__(self, state_dict):
    self.tensors = {k: np.asarray(v) for k, v in state_dict.items()}

  def keys(self):
    return self.tensors.keys()

  def shape(self, name):
    return self.tensors[name].shape

  def get(self, name):
    return self.tensors[name].astype(np.float32)


def _is_source(x):
  return isinstance(x, hf_common.Source)


def _load(cfg, state_dict, **kwargs):
  """param_sources + materialise; also checks every tensor is used or ignorable."""
  sources, ignorable = hf_bert.param_sources(cfg, DictReader(state_dict), **kwargs)
  used = {n for s in jax.tree.leaves(sources, is_leaf=_is_source) for n in s.names}
  assert used | ignorable == set(state_dict) and not used & ignorable
  params = jax.tree.map(lambda s: s.load(), sources, is_leaf=_is_source)
  shapes, _ = bert.abstract_params(cfg, max_length=1)
  if kwargs.get("encoder_only"):
    shapes = {k: v for k, v in shapes.items() if k != "classifier"}
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
      lambda x: (x.shape, x.dtype), shapes)
  return params, ignorable


@pytest.fixture(scope="module")
def hf():
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  import torch
  import transformers
  return torch, transformers


def _hf_config(transformers, **overrides):
  fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=64, num_labels=LABELS)
  return transformers.BertConfig(**{**fields, **overrides})


def _randomize(torch, model, seed):
  """Seeded init, plus noise on biases and norms (zeros/ones by default)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def _state_dict(model):
  return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _torch_inputs(torch):
  return dict(input_ids=torch.from_numpy(TOKENS).long(),
              attention_mask=torch.from_numpy(MASK).long(),
              token_type_ids=torch.from_numpy(TYPES).long())


def _max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_matches_hugging_face_classifier(hf):
  torch, transformers = hf
  torch.manual_seed(0)
  model = _randomize(torch, transformers.BertForSequenceClassification(
      _hf_config(transformers)), 1)
  cfg = hf_bert.config_from_hf(model.config.to_dict())
  assert cfg == tiny_config()
  params, ignorable = _load(cfg, _state_dict(model))
  assert not ignorable
  with torch.no_grad():
    out = model(**_torch_inputs(torch), output_hidden_states=True)
  logits_diff = _max_diff(classify(cfg, params, TOKENS, MASK, TYPES), out.logits.numpy())
  hidden_diff = _max_diff(encode(cfg, params["encoder"], TOKENS, MASK, TYPES),
                          out.hidden_states[-1].numpy())
  print(f"\nHF BertForSequenceClassification: logits {logits_diff:.2e}, "
        f"last_hidden_state {hidden_diff:.2e}")
  assert logits_diff < 1e-4 and hidden_diff < 1e-4


def test_matches_hugging_face_bert_model_encoder_only(hf):
  torch, transformers = hf
  torch.manual_seed(2)
  model = _randomize(torch, transformers.BertModel(_hf_config(transformers)), 3)
  cfg = tiny_config()
  state_dict = _state_dict(model)
  # Older checkpoints also store the position/token type id buffers.
  state_dict["embeddings.position_ids"] = np.arange(64)[None]
  # Without encoder_only the classifier head is missing (named as expected).
  sources, _ = hf_bert.param_sources(cfg, DictReader(state_dict))
  assert sources["classifier"]["kernel"].names == ("classifier.weight",)
  with pytest.raises(KeyError, match="classifier.weight"):
    sources["classifier"]["kernel"].load()
  loaded, ignorable = _load(cfg, state_dict, encoder_only=True)
  assert set(loaded) == {"encoder", "pooler"}
  assert ignorable == {"embeddings.position_ids"}
  fresh, _ = bert.init_params(cfg, jax.random.PRNGKey(5), max_length=10)
  params = {**fresh, **loaded}
  with torch.no_grad():
    out = model(**_torch_inputs(torch))
  hidden = encode(cfg, params["encoder"], TOKENS, MASK, TYPES)
  hidden_diff = _max_diff(hidden, out.last_hidden_state.numpy())
  pooled = np.tanh(np.asarray(hidden[:, 0], np.float64) @ params["pooler"]["kernel"]
                   + params["pooler"]["bias"])
  pooler_diff = _max_diff(pooled, out.pooler_output.numpy())
  print(f"\nHF BertModel (encoder_only): last_hidden_state {hidden_diff:.2e}, "
        f"pooler_output {pooler_diff:.2e}")
  assert hidden_diff < 1e-4 and pooler_diff < 1e-4
  assert classify(cfg, params, TOKENS, MASK, TYPES).shape == (3, LABELS)
  # With legacy LayerNorm names (gamma/beta) the same params load.
  legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                     "LayerNorm.beta"): v
            for k, v in state_dict.items()}
  again, _ = _load(cfg, legacy, encoder_only=True)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b)
  # Mean pooling: the pooler is ignorable, the encoder the same.
  mean_cfg = tiny_config(pooling="mean")
  mean, ignorable = _load(mean_cfg, state_dict, encoder_only=True)
  assert set(mean) == {"encoder"}
  assert ignorable == {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
  with pytest.raises(ValueError, match="encoder_only"):
    hf_bert.param_sources(mean_cfg, DictReader(state_dict))


def test_pretraining_checkpoint_heads_are_ignorable(hf):
  torch, transformers = hf
  torch.manual_seed(4)
  model = transformers.BertForPreTraining(_hf_config(transformers)).eval()
  state_dict = _state_dict(model)
  loaded, ignorable = _load(tiny_config(), state_dict, encoder_only=True)
  assert ignorable and all(k.startswith("cls.") for k in ignorable)
  np.testing.assert_array_equal(loaded["encoder"]["token_embedder"]["embedding"],
                                state_dict["bert.embeddings.word_embeddings.weight"])


def test_export_roundtrip_and_torch_load(hf, tiny):
  torch, transformers = hf
  cfg, params, _ = tiny
  state_dict = hf_bert.to_hf_state_dict(cfg, params)
  assert all(v.dtype == np.float32 for v in state_dict.values())
  back, _ = _load(cfg, state_dict)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)

  hf_cfg = transformers.BertConfig(**hf_bert.config_to_hf(cfg))
  assert hf_bert.config_from_hf(hf_cfg.to_dict()) == cfg
  assert hf_bert.config_from_hf(hf_bert.config_to_hf(cfg)) == cfg
  model = transformers.BertForSequenceClassification(hf_cfg).eval()
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
  with torch.no_grad():
    out = model(**_torch_inputs(torch))
  diff = _max_diff(classify(cfg, params, TOKENS, MASK, TYPES), out.logits.numpy())
  print(f"\nexport -> torch BertForSequenceClassification: logits {diff:.2e}")
  assert diff < 1e-4

  # Encoder-only params export under BertModel names.
  encoder_sd = hf_bert.to_hf_state_dict(cfg, {k: params[k] for k in ("encoder", "pooler")})
  assert set(encoder_sd) == {k[len("bert."):] for k in state_dict if k.startswith("bert.")}
  transformers.BertModel(hf_cfg).load_state_dict(
      {k: torch.from_numpy(v) for k, v in encoder_sd.items()}, strict=True)


def test_mapping_errors(tiny):
  cfg, params, _ = tiny
  state_dict = hf_bert.to_hf_state_dict(cfg, params)
  # Lazy: a missing tensor is named by its Source and fails on load.
  missing = {k: v for k, v in state_dict.items() if "layer.1.output.dense" not in k}
  sources, _ = hf_bert.param_sources(cfg, DictReader(missing))
  wo = sources["encoder"]["layers_1"]["mlp"]["wo"]["kernel"]
  assert wo.names == ("bert.encoder.layer.1.output.dense.weight",)
  with pytest.raises(KeyError):
    wo.load()
  # An unknown tensor is neither used nor ignorable (the loader rejects it).
  _, ignorable = hf_bert.param_sources(cfg, DictReader(dict(state_dict, extra=np.zeros(2))))
  assert "extra" not in ignorable
  hf_json = hf_bert.config_to_hf(cfg)
  for key, value in (("hidden_act", "relu"), ("hidden_act", "gelu_new"),
                     ("position_embedding_type", "relative_key"), ("model_type", "roberta")):
    with pytest.raises(ValueError):
      hf_bert.config_from_hf(dict(hf_json, **{key: value}))
  no_labels = {k: v for k, v in hf_json.items() if k not in ("id2label", "label2id")}
  assert hf_bert.config_from_hf(no_labels).num_labels == 2
  with pytest.raises(ValueError, match="pooling"):
    hf_bert.config_to_hf(tiny_config(pooling="mean"))


def test_generic_hf_loader(tiny):
  """dpjax.pretrained.hf loads through this mapping and checks config and shapes."""
  hf_loader = pytest.importorskip("dpjax.pretrained.hf")
  cfg, params, _ = tiny
  hf_json = hf_bert.config_to_hf(cfg)
  state_dict = hf_bert.to_hf_state_dict(cfg, params)
  loaded = hf_loader.load_from_reader(hf_json, DictReader(state_dict), cfg)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  wrong = dict(state_dict)
  wrong["bert.embeddings.word_embeddings.weight"] = np.zeros((VOCAB + 1, 64), np.float32)
  with pytest.raises(hf_loader.CheckpointError, match="word_embeddings"):
    hf_loader.load_from_reader(hf_json, DictReader(wrong), cfg)
  with pytest.raises(hf_loader.CheckpointError, match="num_labels"):
    hf_loader.load_from_reader(hf_json, DictReader(state_dict),
                               dataclasses.replace(cfg, num_labels=2))


def test_load_hf_directory_of_a_plain_bert_model(hf, tmp_path):
  """The issue's path: a saved BertModel directory into a classifier's encoder."""
  torch, transformers = hf
  from dpjax.pretrained import hf as hf_loader
  torch.manual_seed(6)
  model = _randomize(torch, transformers.BertModel(
      _hf_config(transformers, num_labels=2)), 7)
  model.save_pretrained(tmp_path)
  cfg = tiny_config()  # LABELS labels: the head is ours, not the checkpoint's
  with pytest.raises(hf_loader.CheckpointError, match="num_labels"):
    hf_loader.load_hf(tmp_path, cfg)  # a whole classifier: the head differs
  loaded = hf_loader.load_hf(tmp_path, cfg, encoder_only=True)
  assert set(loaded) == {"encoder", "pooler"}
  with torch.no_grad():
    out = model(**_torch_inputs(torch))
  diff = _max_diff(encode(cfg, loaded["encoder"], TOKENS, MASK, TYPES),
                   out.last_hidden_state.numpy())
  assert diff < 1e-4, diff
