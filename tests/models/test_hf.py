"""Hugging Face compatibility: checkpoint conversion and (optionally) logits.

The logits comparison needs `transformers<5` (the last versions with Flax
T5); it is skipped where that is not installed, as in CI.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.models import hf_t5, t5


def _hf_state_dict(cfg, params):
  """dpjax params -> a PyTorch-style HF state dict (names and [out, in] weights)."""
  sd = {"shared.weight": params["token_embedder"]["embedding"]}
  attn = {"query": "q", "key": "k", "value": "v", "out": "o"}
  blocks = {
      "encoder": [("pre_attention_layer_norm", "attention", "SelfAttention"),
                  ("pre_mlp_layer_norm", "mlp", "DenseReluDense")],
      "decoder": [("pre_self_attention_layer_norm", "self_attention", "SelfAttention"),
                  ("pre_cross_attention_layer_norm", "encoder_decoder_attention",
                   "EncDecAttention"),
                  ("pre_mlp_layer_norm", "mlp", "DenseReluDense")],
  }
  for kind, sublayers in blocks.items():
    stack = params[kind]
    n = cfg.num_encoder_layers if kind == "encoder" else cfg.num_decoder_layers
    for i in range(n):
      layer = stack[f"layers_{i}"]
      for j, (norm, block, hf_block) in enumerate(sublayers):
        prefix = f"{kind}.block.{i}.layer.{j}"
        sd[f"{prefix}.layer_norm.weight"] = layer[norm]["scale"]
        for ours, dense in layer[block].items():
          sd[f"{prefix}.{hf_block}.{attn.get(ours, ours)}.weight"] = dense["kernel"].T
    sd[f"{kind}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
        stack["relpos_bias"]["rel_embedding"].T)
    sd[f"{kind}.final_layer_norm.weight"] = stack[f"{kind}_norm"]["scale"]
    sd[f"{kind}.embed_tokens.weight"] = sd["shared.weight"]
  sd["lm_head.weight"] = (params["decoder"]["logits_dense"]["kernel"].T
                          if "logits_dense" in params["decoder"] else sd["shared.weight"])
  return {k: np.asarray(v) for k, v in sd.items()}


@pytest.mark.parametrize("variant", ["tiny", "tiny_v11"])
def test_state_dict_roundtrip(variant, request):
  cfg, params, _ = request.getfixturevalue(variant)
  sd = _hf_state_dict(cfg, params)
  converted = hf_t5.params_from_hf_state_dict(cfg, sd)
  assert jax.tree.structure(converted) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="Unused"):
    hf_t5.params_from_hf_state_dict(cfg, dict(sd, extra=np.zeros(2)))
  with pytest.raises(KeyError):
    hf_t5.params_from_hf_state_dict(cfg, {k: v for k, v in sd.items() if ".wo." not in k})
  wrong = dict(sd)
  wrong["shared.weight"] = wrong["shared.weight"][:-1]
  with pytest.raises(ValueError, match="does not fit"):
    hf_t5.params_from_hf_state_dict(cfg, wrong)


@pytest.mark.parametrize("variant", ["tiny", "tiny_v11"])
def test_logits_match_hugging_face_flax(variant, request, monkeypatch):
  transformers = pytest.importorskip("transformers")
  if not hasattr(transformers, "FlaxT5ForConditionalGeneration"):
    pytest.skip("this transformers has no Flax T5")
  from flax.traverse_util import flatten_dict
  # transformers' Flax T5 still calls jnp.clip(a_max=...), gone from new jax.
  clip = jnp.clip
  monkeypatch.setattr(jnp, "clip", lambda x, a_min=None, a_max=None, **kw: clip(
      x, kw.get("min", a_min), kw.get("max", a_max)))
  cfg, _, _ = request.getfixturevalue(variant)
  hf = transformers.FlaxT5ForConditionalGeneration(transformers.T5Config(
      vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
      num_heads=cfg.num_heads, num_layers=cfg.num_encoder_layers,
      num_decoder_layers=cfg.num_decoder_layers, dropout_rate=0.0,
      feed_forward_proj=cfg.feed_forward, tie_word_embeddings=cfg.tie_embeddings), seed=3)
  sd = {}
  for path, x in flatten_dict(hf.params).items():  # Flax names -> PyTorch names
    name = ".".join(path[:-1] + ("weight",))
    sd[name] = np.asarray(x).T if path[-1] == "kernel" else np.asarray(x)
  params = hf_t5.params_from_hf_state_dict(cfg, sd)
  rng = np.random.default_rng(0)
  enc = rng.integers(2, cfg.vocab_size, (2, 150)).astype(np.int32)
  enc[1, 60:] = 0
  dec = rng.integers(2, cfg.vocab_size, (2, 140)).astype(np.int32)
  dec[:, 0] = 0
  ours = t5.T5Transformer(cfg).apply({"params": params}, enc, dec)
  theirs = hf(input_ids=enc, attention_mask=(enc > 0).astype(np.int32),
              decoder_input_ids=dec).logits
  scale = float(jnp.max(jnp.abs(theirs)))
  np.testing.assert_allclose(ours, theirs, atol=1e-5 * max(scale, 1.0))
