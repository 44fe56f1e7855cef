"""Hugging Face T5 name mapping, against an independent state-dict layout.

Logits against PyTorch transformers are compared in
tests/pretrained/test_hf_t5_gpt2.py.
"""
import jax
import numpy as np
import pytest

from dpjax.models import hf_t5
from dpjax.pretrained import hf


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


def _load(cfg, state_dict):
  return hf.load_from_reader(hf_t5.config_to_hf(cfg), hf.DictReader(state_dict), cfg)


@pytest.mark.parametrize("variant", ["tiny", "tiny_v11"])
def test_state_dict_layout_and_roundtrip(variant, request):
  cfg, params, _ = request.getfixturevalue(variant)
  sd = _hf_state_dict(cfg, params)
  exported = hf_t5.to_hf_state_dict(cfg, params)
  aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
  if cfg.tie_embeddings:
    aliases.add("lm_head.weight")
  assert set(exported) == set(sd) - aliases
  for k, v in exported.items():
    np.testing.assert_array_equal(v, sd[k], err_msg=k)
  converted = _load(cfg, sd)
  assert jax.tree.structure(converted) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(hf.CheckpointError, match="unused tensor 'extra' of shape \\(2,\\)"):
    _load(cfg, dict(sd, extra=np.zeros(2)))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor 'encoder\.block\.0\.layer\.1\."
                     r"DenseReluDense\.wo\.weight'"):
    _load(cfg, {k: v for k, v in sd.items() if ".wo." not in k})
  wrong = dict(sd)
  wrong["shared.weight"] = wrong["shared.weight"][:-1]
  with pytest.raises(hf.CheckpointError, match=r"tensor 'shared.weight' of shape \(96, 64\) "
                     r"gives \(96, 64\), but param token_embedder/embedding has shape "
                     r"\(97, 64\)"):
    _load(cfg, wrong)


def test_untied_model_without_lm_head_reads_shared(tiny_v11):
  """transformers 5 saves a T5.1.1-config model whose head is tied without
  lm_head.weight; its logits_dense is then the shared embedding."""
  cfg, params, _ = tiny_v11
  sd = {k: v for k, v in _hf_state_dict(cfg, params).items() if k != "lm_head.weight"}
  converted = _load(cfg, sd)
  np.testing.assert_array_equal(converted["decoder"]["logits_dense"]["kernel"],
                                params["token_embedder"]["embedding"].T)


def test_hf_config_roundtrip(make_config):
  for cfg in (make_config(), make_config(feed_forward="gated-gelu", tie_embeddings=False,
                                         num_decoder_layers=3)):
    assert hf_t5.config_from_hf(hf_t5.config_to_hf(cfg)) == cfg
  # transformers 4 wrote tie_word_embeddings=false for T5.1.1, 5 writes
  # scale_decoder_outputs=false (and tie_word_embeddings=true).
  v11 = {"model_type": "t5", "feed_forward_proj": "gated-gelu"}
  assert not hf_t5.config_from_hf(dict(v11, tie_word_embeddings=False)).tie_embeddings
  assert not hf_t5.config_from_hf(dict(v11, tie_word_embeddings=True,
                                       scale_decoder_outputs=False)).tie_embeddings
  assert hf_t5.config_from_hf({"model_type": "t5"}).tie_embeddings  # old t5-small configs
  with pytest.raises(ValueError, match="feed_forward_proj 'gated-silu'"):
    hf_t5.config_from_hf(dict(v11, feed_forward_proj="gated-silu"))
