"""BERT-style Transformer encoder and sequence classifier in Flax linen.

For downstream classifiers (e.g. redaction-policy classifiers) trained with
DP. The math is Hugging Face's `BertModel` / `BertForSequenceClassification`:

* word + learned absolute position + token type embeddings, summed, then
  LayerNorm (eps `layer_norm_epsilon`, 1e-12) and dropout;
* post-LayerNorm layers: self-attention (no causal mask; padding keys hidden
  by `attention_mask`) with logits scaled by 1/sqrt(d_head), dropout, add &
  norm; then `wo(gelu(wi(x)))` with the exact (erf) GELU, dropout, add &
  norm. Every projection has a bias;
* the classifier head: `pooling="cls"` is HF's BertPooler (tanh of a dense
  layer on the [CLS] = first position) ; `pooling="mean"` instead averages
  the final states over the real tokens (no pooler params). Then dropout and
  a linear classifier to `num_labels` float32 logits;
* one dropout rate for the embeddings, attention probabilities, residual
  branches and the classifier input, where HF has hidden_dropout_prob,
  attention_probs_dropout_prob and classifier_dropout.

Position ids are always `0..L-1` (as in HF), so pad on the right; padded
positions never influence the real ones (their keys are masked and neither
the [CLS] state nor the masked mean reads them).

Params are plain float32 with t5x-style names and logical axes, as in
`dpjax.models.gpt2` (whose Dense/LayerNorm/Embed building blocks are reused):

    encoder/{token_embedder, position_embedder, token_type_embedder}/embedding
        [vocab|abspos|token_types, embed]
    encoder/embedding_norm/{scale, bias}
    encoder/layers_i/attention/{query, key, value, out}/{kernel, bias}
    encoder/layers_i/post_attention_layer_norm/{scale, bias}
    encoder/layers_i/mlp/{wi, wo}/{kernel, bias}
    encoder/layers_i/post_mlp_layer_norm/{scale, bias}
    pooler/{kernel [embed, mlp], bias}            (pooling="cls" only)
    classifier/{kernel [embed, labels], bias}

`BertConfig.dtype` only sets the compute dtype (norms, softmax, the mean
pooling and the logits are float32). `dpjax.models.hf_bert` maps Hugging Face
checkpoints onto these params and back. The token embedding row of [PAD] is an
ordinary trainable row here (HF's `padding_idx` only freezes it in torch);
with padding masked it gets no gradient from padded positions anyway.

No TensorFlow anywhere in here: only jax, flax and numpy.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax.models import common, losses
from dpjax.models.gpt2 import Dense, Embed, LayerNorm, param_count  # noqa: F401 (re-exported)

Array = jax.Array
PyTree = Any

# Additive attention bias for masked keys (finite: an all-masked row gives a
# uniform softmax, not NaN).
_MASK_VALUE = -1e10
_POOLINGS = ("cls", "mean")
_INIT_STDDEV = 0.02  # BERT's initializer_range


@dataclasses.dataclass(frozen=True)
class BertConfig(common.ModelConfig):
  """Hyperparameters of a BERT classifier. Frozen, so it can be a static jit arg."""
  vocab_size: int = 30522
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  d_ff: int = 3072
  dropout_rate: float = 0.1
  layer_norm_epsilon: float = 1e-12
  num_labels: int = 2
  dtype: str = "float32"  # compute dtype; params are always float32
  pooling: str = "cls"  # "cls": HF BertPooler on [CLS]; "mean": masked mean, no pooler

  def __post_init__(self):
    self.check_dtype()
    if self.pooling not in _POOLINGS:
      raise ValueError(f"pooling must be one of {_POOLINGS}, got {self.pooling!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model {self.d_model} is not a multiple of num_heads "
                       f"{self.num_heads}")
    if self.num_labels < 1:
      raise ValueError(f"num_labels must be positive, got {self.num_labels}")

  @property
  def head_dim(self) -> int:
    """The per-head width: `d_model // num_heads`."""
    return self.d_model // self.num_heads


# ----------------------------------------------------------------------------
# Building blocks.
# ----------------------------------------------------------------------------


class SelfAttention(nn.Module):
  """Bidirectional multi-head self-attention, logits scaled by 1/sqrt(d_head)."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array, bias: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    h, dh = cfg.num_heads, cfg.head_dim

    def project(name):
      y = Dense(cfg.d_model, ("embed", "joined_kv"), _INIT_STDDEV, dtype, name=name)(x)
      return y.reshape(*y.shape[:-1], h, dh)

    q, k, v = project("query"), project("key"), project("value")
    drop = not deterministic and cfg.dropout_rate > 0
    out = common.scaled_attention(
        q, k, v, bias, dtype, dropout_rate=cfg.dropout_rate,
        dropout_rng=self.make_rng("dropout") if drop else None)
    return Dense(cfg.d_model, ("joined_kv", "embed"), _INIT_STDDEV, dtype, name="out")(out)


class MlpBlock(nn.Module):
  """`wo(gelu(wi(x)))` with the exact (erf) GELU, HF's "gelu"."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    hidden = jax.nn.gelu(Dense(cfg.d_ff, ("embed", "mlp"), _INIT_STDDEV, dtype, name="wi")(x),
                         approximate=False)
    return Dense(cfg.d_model, ("mlp", "embed"), _INIT_STDDEV, dtype, name="wo")(hidden)


class EncoderLayer(nn.Module):
  """Post-norm: `x = norm(x + drop(attn(x)))`, `x = norm(x + drop(mlp(x)))`."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array, bias: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    norm = functools.partial(LayerNorm, cfg.layer_norm_epsilon, cfg.compute_dtype)
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = SelfAttention(cfg, name="attention")(x, bias, deterministic=deterministic)
    x = norm(name="post_attention_layer_norm")(x + dropout(y))
    y = MlpBlock(cfg, name="mlp")(x)
    return norm(name="post_mlp_layer_norm")(x + dropout(y))


class BertEncoder(nn.Module):
  """BERT encoder (HF `BertModel` without the pooler): `tokens -> hidden states`."""
  config: BertConfig

  @nn.compact
  def __call__(self, tokens: Array, *, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, enable_dropout: bool = False) -> Array:
    """Final hidden states `[b, L, d_model]` in the compute dtype.

    Args:
      tokens: `[b, L]` int token ids.
      attention_mask: optional `[b, L]`, 1 = real token; keys where it is 0
        are not attended to. Default: all real.
      token_type_ids: optional `[b, L]` segment ids (default 0).
      enable_dropout: dropout on (needs a 'dropout' rng).
    """
    cfg = self.config
    deterministic = not enable_dropout
    length = tokens.shape[-1]
    if length > cfg.max_position_embeddings:
      raise ValueError(f"Sequence length {length} exceeds max_position_embeddings "
                       f"{cfg.max_position_embeddings}.")
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(tokens)
    if attention_mask is None:
      bias = jnp.zeros((1, 1, 1, length), jnp.float32)
    else:  # [b, 1, 1, k]: hides masked keys from every query
      bias = jnp.where(attention_mask > 0, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None]

    wte = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), name="token_embedder")
    wpe = Embed(cfg.max_position_embeddings, cfg.d_model, ("abspos", "embed"),
                name="position_embedder")
    tte = Embed(cfg.type_vocab_size, cfg.d_model, ("token_types", "embed"),
                name="token_type_embedder")
    x = wte(tokens) + tte(token_type_ids) + wpe(jnp.arange(length))[None]  # float32
    x = LayerNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="embedding_norm")(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    for i in range(cfg.num_layers):
      x = EncoderLayer(cfg, name=f"layers_{i}")(x, bias, deterministic=deterministic)
    return x


class BertClassifier(nn.Module):
  """Encoder + pooling + dropout + linear classifier (HF
  `BertForSequenceClassification`): `tokens [b, L] -> logits [b, num_labels]`."""
  config: BertConfig

  @nn.compact
  def __call__(self, tokens: Array, *, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, enable_dropout: bool = False) -> Array:
    """Float32 logits `[b, num_labels]`; arguments as `BertEncoder`."""
    cfg = self.config
    hidden = BertEncoder(cfg, name="encoder")(
        tokens, attention_mask=attention_mask, token_type_ids=token_type_ids,
        enable_dropout=enable_dropout)
    if cfg.pooling == "cls":
      pooled = jnp.tanh(Dense(cfg.d_model, ("embed", "mlp"), _INIT_STDDEV, cfg.compute_dtype,
                              name="pooler")(hidden[:, 0]))
    else:
      mask = (jnp.ones(tokens.shape, jnp.float32) if attention_mask is None
              else (attention_mask > 0).astype(jnp.float32))
      total = jnp.einsum("bld,bl->bd", hidden.astype(jnp.float32), mask)
      pooled = total / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    pooled = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=not enable_dropout)
    return Dense(cfg.num_labels, ("embed", "labels"), _INIT_STDDEV, jnp.float32,
                 name="classifier")(pooled)


# ----------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------


def _boxed_init(config: BertConfig, rng: Array, max_length: int):
  if max_length > config.max_position_embeddings:
    raise ValueError(f"max_length {max_length} exceeds max_position_embeddings "
                     f"{config.max_position_embeddings}.")
  return BertClassifier(config).init({"params": rng},
                                     jnp.ones((1, max_length), jnp.int32))["params"]


# Module level, so repeated calls with the same config reuse the compilation.
_jitted_boxed_init = jax.jit(_boxed_init, static_argnums=(0, 2))


def init_params(config: BertConfig, rng: Array, *, max_length: int) -> tuple[PyTree, PyTree]:
  """Randomly initialized float32 `BertClassifier` params and their logical axes.

  Returns `(params, logical_axes)`: a plain pytree of arrays and a tree of
  the same structure with `PartitionSpec`s of logical axis names. Shapes do
  not depend on `max_length` (the position table always has
  `max_position_embeddings` rows). `params['encoder']` are the params of a
  standalone `BertEncoder`.
  """
  boxed = _jitted_boxed_init(config, rng, max_length)
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config: BertConfig, *, max_length: int) -> tuple[PyTree, PyTree]:
  """Like `init_params` but `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  boxed = jax.eval_shape(functools.partial(_boxed_init, config, max_length=max_length),
                         jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


# ----------------------------------------------------------------------------
# Losses and prediction.
# ----------------------------------------------------------------------------

# 'tokens' [L] int, 'attention_mask' [L] (1 = real token), 'label' [] int;
# optional 'token_type_ids' [L].


def _logits(model: BertClassifier, params, batch, rngs=None) -> Array:
  return model.apply({"params": params}, batch["tokens"],
                     attention_mask=batch.get("attention_mask"),
                     token_type_ids=batch.get("token_type_ids"),
                     enable_dropout=bool(rngs), rngs=rngs or {})


def _classification_loss(model: BertClassifier, params, batch, rngs=None) -> Array:
  """`[b]` softmax cross entropy of `batch['label']`."""
  return losses.token_cross_entropy(_logits(model, params, batch, rngs), batch["label"])


def make_batch_loss(config: BertConfig) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """`fn(params, batch) -> [b]` per-example losses, dropout off (eval)."""
  model = BertClassifier(config)
  return lambda params, batch: _classification_loss(model, params, batch)


def make_example_loss(config: BertConfig) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """The loss of ONE example, for per-example clipping (`common.one_example_loss`)."""
  return common.one_example_loss(functools.partial(_classification_loss,
                                                   BertClassifier(config)))


def make_predict(config: BertConfig) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """`fn(params, batch) -> [b, num_labels]` float32 logits, dropout off.

  Reads 'tokens' and, if present, 'attention_mask' and 'token_type_ids'.
  """
  model = BertClassifier(config)
  return lambda params, batch: _logits(model, params, batch)
