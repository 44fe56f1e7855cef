"""Tests of the T5 model: shapes, masking, caching, axes, configs."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dpjax.models import t5

ENC = np.array([[5, 6, 7, 8, 9, 10, 1, 0], [11, 12, 13, 1, 0, 0, 0, 0]], np.int32)
DEC = np.array([[0, 20, 21, 22, 23, 1], [0, 30, 31, 1, 0, 0]], np.int32)


def test_forward_shapes(tiny, forward):
  cfg, params, _ = tiny
  model = t5.T5Transformer(cfg)

  @jax.jit
  def encode_then_decode(params):
    encoded = model.apply({"params": params}, ENC, method=model.encode)
    return encoded, model.apply({"params": params}, encoded, ENC, DEC, method=model.decode)

  encoded, logits = encode_then_decode(params)
  assert encoded.shape == (2, 8, cfg.d_model)
  assert logits.shape == (2, 6, cfg.vocab_size) and logits.dtype == jnp.float32
  full = forward(cfg, params, ENC, DEC)
  np.testing.assert_allclose(full, logits, atol=1e-5)
  assert np.all(np.isfinite(full))


def test_params_are_float32(tiny):
  _, params, _ = tiny
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_bfloat16_close_to_float32(tiny, forward):
  cfg, params, _ = tiny
  f32 = forward(cfg, params, ENC, DEC)
  bf16 = forward(dataclasses.replace(cfg, dtype="bfloat16"), params, ENC, DEC)
  assert bf16.dtype == jnp.float32  # logits stay float32
  # bf16 has ~3 significant digits; logits here are O(1).
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.15
  assert float(jnp.mean(jnp.abs(bf16 - f32))) < 0.03
  np.testing.assert_array_equal(jnp.argmax(bf16, -1)[:, :3], jnp.argmax(f32, -1)[:, :3])


def test_encoder_padding_is_masked(tiny, forward):
  """Trailing padding (token 0) in the encoder input changes no logit."""
  cfg, params, _ = tiny
  padded = ENC[1:]  # [11, 12, 13, 1, 0, 0, 0, 0]
  short = padded[:, :4]
  assert np.all(padded[:, 4:] == 0) and np.all(short > 0)
  np.testing.assert_allclose(forward(cfg, params, padded, DEC[1:]),
                             forward(cfg, params, short, DEC[1:]), atol=1e-5)


def test_decoder_is_causal(tiny, forward):
  cfg, params, _ = tiny
  base = forward(cfg, params, ENC, DEC)
  for t in range(DEC.shape[1] - 1):
    changed = DEC.copy()
    changed[:, t + 1:] = 50 + np.arange(DEC.shape[1] - t - 1)
    out = forward(cfg, params, ENC, changed)
    np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-5)
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-3)


def test_cached_decoding_matches_full_forward(tiny, forward):
  """Teacher-forced decoding one token at a time through the KV cache equals
  the full forward pass, over more than max_distance (128) positions."""
  cfg, params, _ = tiny
  rng = np.random.default_rng(0)
  length = 140
  enc = rng.integers(2, cfg.vocab_size, (2, 12)).astype(np.int32)
  enc[1, 7:] = 0
  dec = rng.integers(0, cfg.vocab_size, (2, length)).astype(np.int32)
  dec[:, 0] = 0
  model = t5.T5Transformer(cfg)
  encoded = model.apply({"params": params}, enc, method=model.encode)

  # The cache-creating call (decode=True, full length): check its layout.
  cache = model.apply({"params": params}, encoded, enc, jnp.zeros_like(dec),
                      decode=True, mutable=["cache"], method=model.decode)[1]["cache"]
  layer = cache["decoder"]["layers_1"]
  assert layer["self_attention"]["cached_key"].shape == (
      2, length, cfg.num_heads, cfg.d_kv)
  assert not np.any(layer["self_attention"]["cached_key"])  # filled per step
  assert int(cache["decoder"]["cache_index"]) == 0
  # Cross-attention keys of the encodings, projected once at creation.
  assert layer["encoder_decoder_attention"]["cached_key"].shape == (
      2, enc.shape[1], cfg.num_heads, cfg.d_kv)

  @jax.jit
  def step(cache, tokens):
    logits, state = model.apply({"params": params, "cache": cache}, encoded, enc, tokens,
                                decode=True, mutable=["cache"], method=model.decode)
    return logits, state["cache"]

  cached = []
  for t in range(length):
    logits, cache = step(cache, dec[:, t:t + 1])
    cached.append(logits)
  assert int(cache["decoder"]["cache_index"]) == length
  np.testing.assert_allclose(jnp.concatenate(cached, axis=1), forward(cfg, params, enc, dec),
                             atol=1e-5, rtol=1e-5)


def test_every_param_has_logical_axes(tiny, tiny_v11):
  names = {"vocab", "embed", "mlp", "heads", "kv", "joined_kv", "relpos_buckets"}
  for _, params, axes in (tiny, tiny_v11):
    is_spec = lambda x: isinstance(x, PartitionSpec)
    assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_spec)
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_spec)):
      assert isinstance(spec, PartitionSpec) and len(spec) == x.ndim
      assert set(spec) <= names


def test_abstract_params_match_init(tiny):
  cfg, params, axes = tiny
  shapes, abstract_axes = t5.abstract_params(cfg, input_length=8, target_length=8)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
      lambda x: (x.shape, x.dtype), shapes)
  assert abstract_axes == axes
  assert t5.param_count(shapes) == t5.param_count(params)


def test_param_names_follow_t5x(tiny, tiny_v11):
  _, p10, _ = tiny
  _, p11, _ = tiny_v11
  assert p10["token_embedder"]["embedding"].shape == (97, 64)
  assert set(p10["decoder"]["layers_0"]) == {
      "pre_self_attention_layer_norm", "self_attention", "pre_cross_attention_layer_norm",
      "encoder_decoder_attention", "pre_mlp_layer_norm", "mlp"}
  assert set(p10["encoder"]["layers_1"]) == {
      "pre_attention_layer_norm", "attention", "pre_mlp_layer_norm", "mlp"}
  # Relative position bias: one table per stack, none in the layers.
  assert p10["encoder"]["relpos_bias"]["rel_embedding"].shape == (4, 32)
  assert "relpos_bias" not in p10["decoder"]["layers_1"]["self_attention"]
  assert set(p10["decoder"]["layers_0"]["mlp"]) == {"wi", "wo"}
  assert "logits_dense" not in p10["decoder"]
  # T5.1.1: gated MLP and a separate output projection.
  assert set(p11["decoder"]["layers_0"]["mlp"]) == {"wi_0", "wi_1", "wo"}
  assert p11["decoder"]["logits_dense"]["kernel"].shape == (64, 97)


def test_v11_runs(tiny_v11, forward):
  cfg, params, _ = tiny_v11
  logits = forward(cfg, params, ENC, DEC)
  assert logits.shape == (2, 6, cfg.vocab_size) and np.all(np.isfinite(logits))


def test_tied_logits_scaled(tiny):
  """v1.0 logits = (d_model**-0.5 * final decoder state) @ embedding.T."""
  cfg, params, _ = tiny

  @jax.jit
  def logits_and_hidden(params):
    logits, state = t5.T5Transformer(cfg).apply(
        {"params": params}, ENC, DEC, capture_intermediates=True, mutable=["intermediates"])
    return logits, state["intermediates"]["decoder"]["decoder_norm"]["__call__"][0]

  logits, hidden = logits_and_hidden(params)
  expected = (hidden * cfg.d_model ** -0.5) @ params["token_embedder"]["embedding"].T
  np.testing.assert_allclose(logits, expected, atol=1e-5)


def test_relative_position_buckets():
  bucket = lambda rel, bidi, nb=32, md=128: int(t5.relative_position_bucket(
      np.array(rel), bidirectional=bidi, num_buckets=nb, max_distance=md))
  # Bidirectional: keys left of the query in [0, 16), right in [16, 32).
  expected_bidi = {0: 0, -1: 1, -7: 7, -8: 8, -15: 9, -16: 10, -31: 11, -32: 12, -64: 14,
                   -127: 15, -128: 15, -1000: 15, 1: 17, 8: 24, 16: 26, 1000: 31}
  for rel, b in expected_bidi.items():
    assert bucket(rel, True) == b, rel
  # Causal: keys to the right all share bucket 0.
  expected_causal = {5: 0, 0: 0, -1: 1, -15: 15, -16: 16, -32: 21, -127: 31, -1000: 31}
  for rel, b in expected_causal.items():
    assert bucket(rel, False) == b, rel


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_is_the_table_entry_and_its_gradient_a_bucket_sum(
    bidirectional):
  """The bias is exactly the table entry of each (query, key) bucket, and its
  gradient the sum over the positions of each bucket (numpy, float64); the
  gradient is a product, not a scatter, so per-example gradients need no
  scatter's copy either."""
  heads, buckets, distance, q, k = 3, 8, 16, 24, 24
  module = t5.RelativePositionBias(num_heads=heads, num_buckets=buckets,
                                   max_distance=distance,
                                   bidirectional=bidirectional, stddev=1.0)
  positions = jnp.arange(q)
  params = nn.meta.unbox(module.init(jax.random.key(0), positions, positions))
  table = np.asarray(params["params"]["rel_embedding"])
  rel = np.clip(np.arange(k)[None, :] - np.arange(q)[:, None], -distance, distance)
  bucket = t5.relative_position_bucket(rel, bidirectional=bidirectional,
                                       num_buckets=buckets, max_distance=distance)
  bias = module.apply(params, positions, positions)
  np.testing.assert_array_equal(np.asarray(bias)[0], table[:, bucket])
  cotangent = np.random.RandomState(0).standard_normal((1, heads, q, k))

  def loss(p):
    return jnp.sum(module.apply(p, positions, positions) * cotangent)

  grad = jax.jit(jax.grad(loss))(params)["params"]["rel_embedding"]
  want = np.stack([[cotangent[0, h][bucket == b].sum() for b in range(buckets)]
                   for h in range(heads)])
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
  per_example = jax.vmap(jax.grad(lambda p, c: jnp.sum(
      module.apply(p, positions, positions) * c)), in_axes=(None, 0))
  lowered = jax.jit(per_example).lower(params, jnp.stack([cotangent[0]] * 2)[:, None])
  assert "scatter" not in lowered.as_text()


def test_config_json_roundtrip():
  cfg = t5.T5Config(d_model=128, feed_forward="gated-gelu", tie_embeddings=False,
                    dtype="bfloat16")
  assert t5.T5Config.from_json(cfg.to_json()) == cfg
  assert t5.T5Config.from_json({"d_model": 128}) == t5.T5Config(d_model=128)
  with pytest.raises(ValueError):
    t5.T5Config.from_json({"d_modle": 128})
  with pytest.raises(ValueError):
    t5.T5Config(feed_forward="swish")
  hash(cfg)  # usable as a static jit argument


def test_scanned_layers_are_the_unrolled_model(tiny, forward):
  """`scan_layers`: the params are the unrolled ones stacked on a leading
  `layers` axis (and back), the logits and the greedy decode (through the
  stacked KV cache) are the unrolled model's, and a scanned init gives each
  layer its own values."""
  from dpjax.generation import decoding
  cfg, params, axes = tiny
  scfg = dataclasses.replace(cfg, scan_layers=True)
  init, saxes = t5.init_params(scfg, jax.random.PRNGKey(0), input_length=8,
                               target_length=8)
  stacked = t5.scan_params(params)
  assert jax.tree.structure(stacked) == jax.tree.structure(init)
  query = stacked["encoder"]["layers"]["attention"]["query"]["kernel"]
  assert query.shape == (cfg.num_encoder_layers, cfg.d_model,
                         cfg.num_heads * cfg.d_kv)
  np.testing.assert_array_equal(
      query[1], params["encoder"]["layers_1"]["attention"]["query"]["kernel"])
  assert saxes["encoder"]["layers"]["attention"]["query"]["kernel"] == (
      PartitionSpec("layers", *axes["encoder"]["layers_0"]["attention"]
                    ["query"]["kernel"]))
  fresh = init["decoder"]["layers"]["mlp"]["wi"]["kernel"]
  assert not np.allclose(fresh[0], fresh[1])
  assert jax.tree.all(jax.tree.map(np.array_equal,
                                   t5.unscan_params(stacked), params))
  assert t5.unrolled(stacked, scfg)[1] == cfg

  np.testing.assert_allclose(forward(scfg, stacked, ENC, DEC),
                             forward(cfg, params, ENC, DEC), atol=1e-5, rtol=1e-5)
  want = decoding.generate(cfg, params, ENC, max_length=6, rng=None, greedy=True)
  got = decoding.generate(scfg, stacked, ENC, max_length=6, rng=None, greedy=True)
  np.testing.assert_array_equal(got, want)


def test_a_checkpoint_from_before_scan_layers_is_an_unrolled_model(make_config):
  """A run's model JSON written before `scan_layers` existed resumes and
  initialises the unrolled model (the field's default) and is refused by a
  scanned one, whose params are laid out otherwise."""
  import types
  from dpjax.training import checkpoints
  cfg = make_config()
  before = {k: v for k, v in checkpoints.config_json(cfg).items()
            if k not in ("scan_layers", "scan_unrolled")}
  meta = types.SimpleNamespace(model_config=before, model_class="T5Config")
  checkpoints.check_model(meta, cfg)
  checkpoints.check_initialises(meta, cfg)
  scanned = dataclasses.replace(cfg, scan_layers=True)
  for check in (checkpoints.check_model, checkpoints.check_initialises):
    with pytest.raises(checkpoints.CheckpointMismatchError, match="scan_layers"):
      check(meta, scanned)
