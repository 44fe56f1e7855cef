"""Tests of GPT-2: forward math, masking, losses, caching, generation, params.

The Hugging Face name mapping is checked here against an independent
state-dict construction; logits against PyTorch transformers are compared
in tests/pretrained/test_hf_t5_gpt2.py.
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
from dpjax.generation import decoding
from dpjax.models import gpt2, hf_gpt2
from dpjax.pretrained import hf

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin" / "models"
VOCAB = 97
TOKENS = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]], np.int32)


def tiny_config(**overrides) -> gpt2.GPT2Config:
  """The shapes of gin/models/gpt2_tiny.gin, with a short position table."""
  fields = dict(vocab_size=VOCAB, n_positions=64, d_model=64, num_layers=2, num_heads=4)
  return gpt2.GPT2Config(**{**fields, **overrides})


@functools.partial(jax.jit, static_argnums=0)
def forward(cfg, params, tokens, attention_mask=None, positions=None):
  return gpt2.GPT2(cfg).apply({"params": params}, tokens, attention_mask=attention_mask,
                              positions=positions)


@pytest.fixture(scope="module")
def tiny():
  """(config, params, logical_axes); biases and norms randomized (init zeros/ones
  would hide mistakes in them)."""
  cfg = tiny_config()
  params, axes = gpt2.init_params(cfg, jax.random.PRNGKey(0), max_length=8)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else x
            for x, k in zip(leaves, keys)]
  return cfg, jax.tree.unflatten(treedef, leaves), axes


# ----------------------------------------------------------------------------
# Forward pass.
# ----------------------------------------------------------------------------


def test_forward_shapes_and_dtypes(tiny):
  cfg, params, _ = tiny
  logits = forward(cfg, params, TOKENS)
  assert logits.shape == (2, 8, VOCAB) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_bfloat16_close_to_float32(tiny):
  cfg, params, _ = tiny
  f32 = forward(cfg, params, TOKENS)
  bf16 = forward(dataclasses.replace(cfg, dtype="bfloat16"), params, TOKENS)
  assert bf16.dtype == jnp.float32  # logits stay float32
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.1 * max(1.0, float(jnp.max(jnp.abs(f32))))
  assert float(jnp.mean(jnp.abs(bf16 - f32))) < 0.02


def test_is_causal(tiny):
  cfg, params, _ = tiny
  base = forward(cfg, params, TOKENS)
  for t in (0, 3, 6):
    changed = TOKENS.copy()
    changed[:, t + 1:] = 50 + np.arange(7 - t)
    out = forward(cfg, params, changed)
    np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-5)
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-3)


def test_tied_logits_and_final_norm(tiny):
  """logits = layer_norm(final state) @ wte.T, with no rescaling."""
  cfg, params, _ = tiny

  @jax.jit
  def logits_and_final_state(params):
    logits, state = gpt2.GPT2(cfg).apply({"params": params}, TOKENS,
                                         capture_intermediates=True, mutable=["intermediates"])
    return logits, state["intermediates"]["layers_1"]["__call__"][0]

  logits, x = logits_and_final_state(params)
  x = np.asarray(x, np.float64)
  norm = params["decoder_norm"]
  x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
  expected = (x * norm["scale"] + norm["bias"]) @ np.asarray(
      params["token_embedder"]["embedding"], np.float64).T
  np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_attention_mask_hides_padding(tiny):
  """Masked (left) padding changes no real position's logits: with positions
  continuing from 0 at the first real token, it equals the unpadded row."""
  cfg, params, _ = tiny
  short = TOKENS[:1, :5]
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  expected = forward(cfg, params, short)
  for pad in ([1, 2, 3], [90, 80, 70]):
    padded = np.concatenate([np.array([pad], np.int32), short], axis=1)
    got = forward(cfg, params, padded, mask, positions)
    np.testing.assert_allclose(got[:, 3:], expected, atol=1e-5)
  # Right padding needs no mask at all (causality), but a mask is harmless.
  right = np.concatenate([short, np.array([[1, 2, 3]], np.int32)], axis=1)
  got = forward(cfg, params, right, mask[:, ::-1].copy())
  np.testing.assert_allclose(got[:, :5], expected, atol=1e-5)


# ----------------------------------------------------------------------------
# Losses.
# ----------------------------------------------------------------------------

# Row 0: prompt of 3 tokens, 4 targets, 1 padding; row 1: 2 + 6, no padding.
WEIGHTS = np.array([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1]], np.float32)


def _numpy_loss(logits, tokens, weights):
  logits = np.asarray(logits, np.float64)[:, :-1]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return (nll * weights[:, 1:]).sum(-1) / weights[:, 1:].sum(-1)


def test_batch_loss_matches_numpy(tiny):
  cfg, params, _ = tiny
  batch_loss = jax.jit(gpt2.make_batch_loss(cfg))
  got = batch_loss(params, {"tokens": TOKENS, "loss_weights": WEIGHTS})
  np.testing.assert_allclose(got, _numpy_loss(forward(cfg, params, TOKENS), TOKENS, WEIGHTS),
                             rtol=1e-5)
  # Padding (weight 0, after the targets) does not change the loss.
  padded = TOKENS.copy()
  padded[0, 7] = 60
  np.testing.assert_allclose(
      batch_loss(params, {"tokens": padded, "loss_weights": WEIGHTS}), got, rtol=1e-6)
  # Prompt tokens are not predicted: raising a prompt weight changes the loss.
  w = WEIGHTS.copy()
  w[0, 1] = 1
  assert not np.isclose(batch_loss(params, {"tokens": TOKENS, "loss_weights": w})[0], got[0])


def test_the_loss_reads_the_logits_unsliced(tiny):
  """The logsumexp reads the output projection's logits as they are, every
  position's (the last one's at weight 0; `test_batch_loss_matches_numpy`
  checks the value). A slice between them keeps a TPU from fusing the max
  into the projection: ghost's GPT-2 small step on a v4 read the float32
  logits once more an example, and nodp's peak held a sliced copy of them
  (whole step 3% more cycles, nodp's peak 10% higher)."""
  cfg, params, _ = tiny

  def sliced_logits(jaxpr):
    yield from (e for e in jaxpr.eqns if e.primitive.name == "slice"
                and e.invars[0].aval.shape[-1] == VOCAB)
    for sub in jax.extend.core.subjaxprs(jaxpr):
      yield from sliced_logits(sub)

  batch = {"tokens": TOKENS, "loss_weights": WEIGHTS}
  for loss in (gpt2.make_batch_loss(cfg),
               jax.vmap(gpt2.make_example_loss(cfg), in_axes=(None, 0))):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda p: loss(p, batch).sum()))(
        params).jaxpr
    assert not list(sliced_logits(jaxpr))


def test_nll_sums_and_perplexity_match_numpy_over_padded_batches(tiny):
  """Three rows in batches of two (the last padded with row 0, which must
  not count): per-row sums and the perplexity of a float64 loop."""
  cfg, params, _ = tiny
  tokens = np.concatenate([TOKENS, TOKENS[:1] + 7])
  weights = np.concatenate([WEIGHTS, WEIGHTS[1:]])
  sums, counts = gpt2.nll_sums(cfg, params, tokens, weights, batch_size=2)
  means = _numpy_loss(forward(cfg, params, tokens), tokens, weights)
  np.testing.assert_allclose(counts, weights[:, 1:].sum(-1))
  np.testing.assert_allclose(sums, means * counts, rtol=1e-5)
  expected = np.exp((means * counts).sum() / counts.sum())
  assert gpt2.perplexity(cfg, params, tokens, weights,
                         batch_size=2) == pytest.approx(expected, rel=1e-5)


def test_example_loss_under_vmap_grad(tiny):
  cfg, params, _ = tiny
  example_loss = gpt2.make_example_loss(cfg)
  per_example = jax.jit(jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0)))
  batch = {"tokens": TOKENS, "loss_weights": WEIGHTS, "attention_mask": np.ones_like(TOKENS)}
  values, grads = per_example(params, batch)
  np.testing.assert_allclose(values, _numpy_loss(forward(cfg, params, TOKENS), TOKENS, WEIGHTS),
                             rtol=1e-5)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(g.shape == (2,) + p.shape and np.all(np.isfinite(g))
             for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)))
  # 'dropout_rng' turns dropout on, deterministically per key.
  batch["dropout_rng"] = jax.random.split(jax.random.PRNGKey(0), 2)
  dropped, _ = per_example(params, batch)
  again, _ = per_example(params, batch)
  np.testing.assert_array_equal(dropped, again)
  assert not np.allclose(dropped, values, atol=1e-4)


# ----------------------------------------------------------------------------
# Cache and generation.
# ----------------------------------------------------------------------------


def test_cached_decoding_matches_full_forward(tiny):
  cfg, params, _ = tiny
  length = 20
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, length)).astype(np.int32)
  model = gpt2.GPT2(cfg)
  cache = jax.eval_shape(lambda: model.apply({"params": params}, tokens, decode=True,
                                             mutable=["cache"])[1]["cache"])
  assert cache["layers_1"]["attention"]["cached_key"].shape == (2, length, 4, 16)
  assert cache["cache_index"].shape == ()
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)

  @jax.jit
  def step(cache, token):
    logits, state = model.apply({"params": params, "cache": cache}, token, decode=True,
                                mutable=["cache"])
    return logits, state["cache"]

  cached = []
  for t in range(length):
    logits, cache = step(cache, tokens[:, t:t + 1])
    cached.append(logits)
  assert int(cache["cache_index"]) == length
  np.testing.assert_allclose(jnp.concatenate(cached, axis=1), forward(cfg, params, tokens),
                             atol=1e-5, rtol=1e-5)


PROMPTS = np.array([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0], [10, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([5, 2, 1], np.int32)
NEW = 6


def _greedy_reference(cfg, params, eos_id=-1, banned=()):
  """Greedy continuation by re-running the full (uncached) model each step."""
  buf = np.zeros((3, PROMPTS.shape[1] + NEW), np.int32)
  buf[:, :PROMPTS.shape[1]] = PROMPTS
  out = np.full((3, NEW), eos_id, np.int32)
  done = np.zeros(3, bool)
  for k in range(NEW):
    logits = np.array(forward(cfg, params, buf))
    logits[..., list(banned)] = -np.inf
    token = logits[np.arange(3), LENGTHS + k - 1].argmax(-1)
    out[~done, k] = token[~done]
    done |= token == eos_id
    buf[np.arange(3), LENGTHS + k] = token
  return out


def test_greedy_generation_matches_uncached_loop(tiny):
  cfg, params, _ = tiny
  gen = functools.partial(decoding.generate_causal, cfg, params, PROMPTS, LENGTHS,
                          max_new_tokens=NEW, rng=None, greedy=True)
  got = gen(eos_id=-1)
  assert got.shape == (3, NEW) and got.dtype == jnp.int32
  ref = _greedy_reference(cfg, params)
  np.testing.assert_array_equal(got, ref)
  # A token row 0 emits at step 2 becomes EOS: rows stop at its first
  # occurrence and are padded with it afterwards.
  eos = int(ref[0, 2])
  got = gen(eos_id=eos)
  np.testing.assert_array_equal(got, _greedy_reference(cfg, params, eos_id=eos))
  first = int(np.argmax(ref[0] == eos))
  assert np.all(got[0, first:] == eos)
  # It also traces under an outer jit (lowering only; compiling is slow).
  fn = jax.jit(functools.partial(decoding.generate_causal, cfg, max_new_tokens=NEW, top_k=5,
                                 top_p=0.9, banned_ids=(1, 2)))
  assert fn.lower(params, PROMPTS, LENGTHS, rng=jax.random.PRNGKey(0)).out_info.shape == (3, NEW)


def test_banned_ids_and_top_k_1(tiny):
  cfg, params, _ = tiny
  common = dict(max_new_tokens=NEW, eos_id=-1)
  # Ban the two tokens greedy decoding emits most.
  values, counts = np.unique(_greedy_reference(cfg, params), return_counts=True)
  banned = tuple(int(v) for v in values[np.argsort(-counts)[:2]])
  greedy = decoding.generate_causal(cfg, params, PROMPTS, LENGTHS, rng=None, greedy=True,
                                    banned_ids=banned, **common)
  np.testing.assert_array_equal(greedy, _greedy_reference(cfg, params, banned=banned))
  assert not np.isin(greedy, banned).any()
  top1 = decoding.generate_causal(cfg, params, PROMPTS, LENGTHS, rng=jax.random.PRNGKey(7),
                                  top_k=1, top_p=0.95, temperature=2.0, banned_ids=banned,
                                  **common)
  np.testing.assert_array_equal(top1, greedy)
  # Near-uniform sampling (same compilation): varied, seeded, never banned.
  sample = functools.partial(decoding.generate_causal, cfg, params, PROMPTS, LENGTHS,
                             top_k=VOCAB, top_p=0.999, temperature=50.0, banned_ids=banned,
                             **common)
  a, b = sample(rng=jax.random.PRNGKey(1)), sample(rng=jax.random.PRNGKey(1))
  np.testing.assert_array_equal(a, b)
  assert not np.isin(a, banned).any() and len(np.unique(a)) > 8
  with pytest.raises(ValueError, match="outside"):
    decoding.generate_causal(cfg, params, PROMPTS, LENGTHS, rng=None, greedy=True,
                             banned_ids=(VOCAB,), **common)
  with pytest.raises(ValueError, match="n_positions"):
    decoding.generate_causal(cfg, params, PROMPTS, LENGTHS, rng=None, greedy=True,
                             max_new_tokens=61)


# ----------------------------------------------------------------------------
# Params, axes, configs.
# ----------------------------------------------------------------------------


def test_every_param_has_logical_axes(tiny):
  cfg, params, axes = tiny
  names = {"vocab", "embed", "mlp", "heads", "kv", "joined_kv", "abspos"}
  is_spec = lambda x: isinstance(x, PartitionSpec)
  assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_spec)
  for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_spec)):
    assert isinstance(spec, PartitionSpec) and len(spec) == x.ndim
    assert set(spec) <= names
  shapes, abstract_axes = gpt2.abstract_params(cfg, max_length=8)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
      lambda x: (x.shape, x.dtype), params)
  assert abstract_axes == axes
  assert axes["position_embedder"]["embedding"] == PartitionSpec("abspos", "embed")
  assert axes["layers_0"]["attention"]["query"]["kernel"] == PartitionSpec("embed", "joined_kv")


# Exact parameter counts of Hugging Face's distilgpt2, gpt2, gpt2-medium,
# gpt2-large and gpt2-xl (tied lm_head counted once).
EXPECTED = {"gpt2_distil": 81_912_576, "gpt2_small": 124_439_808,
            "gpt2_medium": 354_823_168, "gpt2_large": 774_030_080,
            "gpt2_xl": 1_557_611_200}


def _gin_config(name, bindings=()):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([str(GIN_DIR / f"{name}.gin")], list(bindings))
    return configurables.GPT2Config()
  finally:
    gin.clear_config()


def test_gin_sizes_param_counts():
  for name, expected in EXPECTED.items():
    shapes, _ = gpt2.abstract_params(_gin_config(name), max_length=4)
    assert gpt2.param_count(shapes) == expected, name
  cfg = _gin_config("gpt2_tiny", ["GPT2Config.vocab_size = 1000"])
  assert (cfg.vocab_size, cfg.n_positions, cfg.d_model, cfg.num_layers, cfg.num_heads,
          cfg.mlp_dim) == (1000, 256, 64, 2, 4, 256)
  assert "vocab_size" not in (GIN_DIR / "gpt2_tiny.gin").read_text()
  assert {p.stem for p in GIN_DIR.glob("gpt2*.gin")} == set(EXPECTED) | {"gpt2_tiny"}


def test_config_json_roundtrip():
  cfg = gpt2.GPT2Config(d_model=128, num_heads=2, d_ff=300, dtype="bfloat16")
  assert gpt2.GPT2Config.from_json(cfg.to_json()) == cfg
  assert gpt2.GPT2Config().mlp_dim == 3072 and cfg.mlp_dim == 300
  with pytest.raises(ValueError):
    gpt2.GPT2Config.from_json({"d_modle": 128})
  with pytest.raises(ValueError):
    gpt2.GPT2Config(d_model=100, num_heads=3)
  with pytest.raises(ValueError):
    gpt2.GPT2Config(dtype="float16")
  hash(cfg)  # usable as a static jit argument


# ----------------------------------------------------------------------------
# Hugging Face.
# ----------------------------------------------------------------------------


def _hf_state_dict(cfg, params):
  """dpjax params -> a PyTorch-style HF GPT2LMHeadModel state dict."""
  sd = {"transformer.wte.weight": params["token_embedder"]["embedding"],
        "transformer.wpe.weight": params["position_embedder"]["embedding"],
        "transformer.ln_f.weight": params["decoder_norm"]["scale"],
        "transformer.ln_f.bias": params["decoder_norm"]["bias"]}
  for i in range(cfg.num_layers):
    layer, p = params[f"layers_{i}"], f"transformer.h.{i}"
    attn = layer["attention"]
    for hf, ours in (("ln_1", "pre_attention_layer_norm"), ("ln_2", "pre_mlp_layer_norm")):
      sd[f"{p}.{hf}.weight"], sd[f"{p}.{hf}.bias"] = layer[ours]["scale"], layer[ours]["bias"]
    for part in ("kernel", "bias"):
      suffix = "weight" if part == "kernel" else "bias"
      sd[f"{p}.attn.c_attn.{suffix}"] = np.concatenate(
          [attn[n][part] for n in ("query", "key", "value")], axis=-1)
      sd[f"{p}.attn.c_proj.{suffix}"] = attn["out"][part]
      sd[f"{p}.mlp.c_fc.{suffix}"] = layer["mlp"]["wi"][part]
      sd[f"{p}.mlp.c_proj.{suffix}"] = layer["mlp"]["wo"][part]
  sd["lm_head.weight"] = sd["transformer.wte.weight"]
  return {k: np.asarray(v) for k, v in sd.items()}


def _load(cfg, state_dict):
  return hf.load_from_reader(hf_gpt2.config_to_hf(cfg), hf.DictReader(state_dict), cfg)


def test_state_dict_layout_and_roundtrip(tiny):
  cfg, params, _ = tiny
  sd = _hf_state_dict(cfg, params)
  exported = hf_gpt2.to_hf_state_dict(cfg, params)
  assert set(exported) == set(sd) - {"lm_head.weight"}
  for k, v in exported.items():
    np.testing.assert_array_equal(v, sd[k], err_msg=k)
  converted = _load(cfg, sd)
  assert jax.tree.structure(converted) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # GPT2Model checkpoints: no prefix, no lm_head, old causal-mask buffers.
  bare = {k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
  bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), bool))
  jax.tree.map(np.testing.assert_array_equal, _load(cfg, bare), converted)
  with pytest.raises(hf.CheckpointError, match="unused tensor 'extra'"):
    _load(cfg, dict(sd, extra=np.zeros(2)))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor 'transformer.h.0.mlp.c_fc"):
    _load(cfg, {k: v for k, v in sd.items() if "c_fc" not in k})
  with pytest.raises(hf.CheckpointError, match=r"h\.1\.attn\.c_attn\.weight' of shape "
                     r"\(64, 191\) does not fit param layers_1/attention/query/kernel"):
    _load(cfg, dict(sd, **{
        "transformer.h.1.attn.c_attn.weight": sd["transformer.h.1.attn.c_attn.weight"][:, 1:]}))


def test_hf_config_roundtrip():
  for cfg in (tiny_config(), tiny_config(d_ff=200, layer_norm_epsilon=1e-6)):
    assert hf_gpt2.config_from_hf(hf_gpt2.config_to_hf(cfg)) == cfg
  with pytest.raises(ValueError, match="tie_word_embeddings"):
    hf_gpt2.config_from_hf(dict(hf_gpt2.config_to_hf(tiny_config()), tie_word_embeddings=False))
  with pytest.raises(ValueError, match="activation_function"):
    hf_gpt2.config_from_hf(dict(hf_gpt2.config_to_hf(tiny_config()), activation_function="relu"))
