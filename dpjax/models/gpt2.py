"""GPT-2 decoder-only Transformer in Flax linen.

The math follows OpenAI's GPT-2 (and so Hugging Face's `GPT2LMHeadModel`):

* learned absolute position embeddings added to the token embeddings;
* pre-LayerNorm blocks (mean/variance norm with scale and bias, eps 1e-5)
  and a final norm (`decoder_norm`, HF's `ln_f`);
* causal multi-head self-attention with logits scaled by 1/sqrt(d_head);
  every projection has a bias;
* MLP `gelu_new` (GELU, tanh approximation), width `d_ff` (4 * d_model);
* output logits tied to the token embedding (`x @ wte.T`, no rescaling);
* dropout (one rate) on the embeddings, the attention probabilities and both
  residual branches, where HF has embd_pdrop, attn_pdrop and resid_pdrop.

Parameter and logical axis names follow t5x (`token_embedder`, `layers_i`,
`attention/{query,key,value,out}`, `mlp/{wi,wo}`), so the partitioning rules
of T5 apply; the position table's first axis is 'abspos'. Kernels are 2-D
`[in, out]` (HF's Conv1D layout; the fused `c_attn` is stored as three
kernels). Parameters are always float32; `GPT2Config.dtype` only sets the
compute dtype, with norms, softmax and logits in float32.
`dpjax.models.hf_gpt2` maps Hugging Face checkpoints onto these params.

No TensorFlow anywhere in here: only jax, flax and numpy.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.models import common, losses, t5
from dpjax.models import lora as lora_lib
from dpjax.privacy import layers

Array = jax.Array
PyTree = Any

# Additive attention bias for masked keys. Finite (not -inf) so that a fully
# masked row gives a uniform softmax instead of NaN.
_MASK_VALUE = -1e10
_INIT_STDDEV = 0.02  # GPT-2's initializer_range


@dataclasses.dataclass(frozen=True)
class GPT2Config(common.ModelConfig):
  """Hyperparameters of a GPT-2 model. Frozen, so it can be a static jit arg."""
  vocab_size: int = 50257
  n_positions: int = 1024
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  d_ff: int | None = None  # None: 4 * d_model
  dropout_rate: float = 0.1
  layer_norm_epsilon: float = 1e-5
  dtype: str = "float32"  # compute dtype; params are always float32
  # "layer": recompute each block's activations in the backward pass
  # (`t5.remat_layer`); same params and results, less memory.
  remat: str = "none"
  # LoRA adapters on the projections it targets (`dpjax.models.lora`); None: none.
  lora: lora_lib.LoRAConfig | None = None

  def __post_init__(self):
    self.check_dtype()
    if self.remat not in t5.CONFIG_REMATS:
      raise ValueError(f"remat must be one of {t5.CONFIG_REMATS}, got {self.remat!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model {self.d_model} is not a multiple of num_heads "
                       f"{self.num_heads}")

  @property
  def head_dim(self) -> int:
    """The per-head width: `d_model // num_heads`."""
    return self.d_model // self.num_heads

  @property
  def mlp_dim(self) -> int:
    """The MLP's hidden width: `d_ff`, by default 4 x `d_model`."""
    return self.d_ff if self.d_ff is not None else 4 * self.d_model


# ----------------------------------------------------------------------------
# Building blocks.
# ----------------------------------------------------------------------------


def _param(module: nn.Module, name: str, init, shape, axes):
  """A float32 parameter annotated with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


# GPT-2's linear layers have a bias; its embeddings GPT-2's initialiser.
Dense = functools.partial(layers.Dense, use_bias=True)
Embed = functools.partial(layers.Embed, stddev=_INIT_STDDEV)


class LayerNorm(nn.Module):
  """Standard layer norm (mean and variance, scale and bias) in float32."""
  epsilon: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",))
    bias = _param(self, "bias", nn.initializers.zeros, (x.shape[-1],), ("embed",))
    x = x.astype(jnp.float32)
    centered = x - jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return (centered * jax.lax.rsqrt(var + self.epsilon) * scale + bias).astype(self.dtype)


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention, logits scaled by 1/sqrt(d_head).

  With `decode=True` it keeps a key/value cache (`cached_key`,
  `cached_value`: `[b, max_length, heads, d_head]`, compute dtype) in the
  'cache' collection. The first such call (cache absent) only creates the
  zero cache and otherwise runs normally; later calls take one query token
  and write its key/value at `cache_index`.
  """
  config: GPT2Config

  @nn.compact
  def __call__(self, x: Array, bias: Array, *, deterministic: bool, decode: bool,
               cache_index: Array | None) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    h, dh = cfg.num_heads, cfg.head_dim

    def project(name):
      y = lora_lib.dense(cfg.lora, x, cfg.d_model, ("embed", "joined_kv"), _INIT_STDDEV,
                         dtype, name=name, deterministic=deterministic, use_bias=True)
      return y.reshape(*y.shape[:-1], h, dh)

    q, k, v = project("query"), project("key"), project("value")
    if decode:
      initialized = self.has_variable("cache", "cached_key")
      cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
      cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
      if initialized:
        start = (0, cache_index, 0, 0)
        cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, start)
        cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, start)
        k, v = cached_k.value, cached_v.value

    drop = not deterministic and cfg.dropout_rate > 0
    out = common.scaled_attention(
        q, k, v, bias, dtype, dropout_rate=cfg.dropout_rate,
        dropout_rng=self.make_rng("dropout") if drop else None,
        remat=cfg.remat != "layer")
    # GPT-2 scales the init of residual-branch outputs by 1/sqrt(2 * layers).
    out_stddev = _INIT_STDDEV / np.sqrt(2 * cfg.num_layers)
    return lora_lib.dense(cfg.lora, out, cfg.d_model, ("joined_kv", "embed"), out_stddev,
                          dtype, name="out", deterministic=deterministic, use_bias=True)


class MlpBlock(nn.Module):
  """`wo(gelu_new(wi(x)))`; gelu_new is the tanh approximation."""
  config: GPT2Config

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    dense = functools.partial(lora_lib.dense, cfg.lora, deterministic=deterministic,
                              use_bias=True)
    hidden = jax.nn.gelu(dense(x, cfg.mlp_dim, ("embed", "mlp"), _INIT_STDDEV, dtype,
                               name="wi"), approximate=True)
    out_stddev = _INIT_STDDEV / np.sqrt(2 * cfg.num_layers)
    return dense(hidden, cfg.d_model, ("mlp", "embed"), out_stddev, dtype, name="wo")


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention + MLP, dropout on each residual branch.

  Flags are positional (not keyword-only): `t5.remat_layer` marks them static.
  """
  config: GPT2Config

  @nn.compact
  def __call__(self, x: Array, bias: Array, deterministic: bool, decode: bool,
               cache_index: Array | None) -> Array:
    cfg = self.config
    norm = functools.partial(LayerNorm, cfg.layer_norm_epsilon, cfg.compute_dtype)
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = norm(name="pre_attention_layer_norm")(x)
    x = x + dropout(CausalSelfAttention(cfg, name="attention")(
        y, bias, deterministic=deterministic, decode=decode, cache_index=cache_index))
    y = norm(name="pre_mlp_layer_norm")(x)
    return x + dropout(MlpBlock(cfg, name="mlp")(y, deterministic=deterministic))


class GPT2(nn.Module):
  """GPT-2 language model: `tokens [b, L] -> logits [b, L, vocab]` (float32).

  GPT-2 has no padding id. Right padding needs no mask (attention is causal,
  so later positions never affect earlier ones); other layouts pass
  `attention_mask` (`[b, L]`, 1 = real token), which hides the masked keys,
  and, for left padding, `positions`.
  """
  config: GPT2Config

  @nn.compact
  def __call__(self, tokens: Array, *, attention_mask: Array | None = None,
               positions: Array | None = None, enable_dropout: bool = False,
               decode: bool = False, return_hidden: bool = False) -> Array:
    """Logits `[b, L, vocab]` (float32).

    Args:
      tokens: `[b, L]` int token ids.
      attention_mask: optional `[b, L]`; keys where it is 0 are not attended
        to. Not supported in cached decoding steps.
      positions: optional `[b, L]` position ids (default `0..L-1`, or the
        cache index when decoding).
      enable_dropout: dropout on (needs a 'dropout' rng).
      decode: use the 'cache' collection (apply with `mutable=['cache']`):
        the first call, with `[b, max_length]` tokens, creates the zero cache
        (keys/values and `cache_index`) and returns ordinary logits; later
        calls feed one token `[b, 1]` each at position `cache_index`.
      return_hidden: return the final hidden states `[b, L, d_model]`
        (float32, after the final norm: HF's `hidden_states[-1]`) instead of
        the logits, e.g. as text features.
    """
    cfg = self.config
    deterministic = not enable_dropout
    length = tokens.shape[-1]

    cache_index = None
    stepping = decode and self.has_variable("cache", "cache_index")
    if decode:
      index_var = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
      cache_index = index_var.value
    if stepping:
      if length != 1:
        raise ValueError(f"Cached decoding takes one token at a time, got {length}.")
      if attention_mask is not None:
        raise ValueError("attention_mask is not supported in cached decoding steps.")
      num_keys = self.variables["cache"]["layers_0"]["attention"]["cached_key"].shape[1]
      query_positions = cache_index[None]
      index_var.value = cache_index + 1
    else:
      num_keys = length
      query_positions = jnp.arange(length)
    if num_keys > cfg.n_positions:
      raise ValueError(f"Sequence length {num_keys} exceeds n_positions {cfg.n_positions}.")

    # [b or 1, 1, q, k] additive bias: causal, and hides masked keys.
    visible = (jnp.arange(num_keys)[None, :] <= query_positions[:, None])[None, None]
    if attention_mask is not None:
      visible = visible & (attention_mask > 0)[:, None, None, :]
    bias = jnp.where(visible, 0.0, _MASK_VALUE).astype(jnp.float32)

    if positions is None:
      positions = query_positions[None]
    # Looked up in the compute dtype (t5x's convention), so the lookups'
    # output gradients are, and ghost clipping keeps the tied projection's
    # logits gradient in it too (`ghost.Site.dtype`); the logits are float32.
    wte = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"),
                dtype=cfg.compute_dtype, name="token_embedder")
    wpe = Embed(cfg.n_positions, cfg.d_model, ("abspos", "embed"),
                dtype=cfg.compute_dtype, name="position_embedder")
    x = common.along_batch(wte(tokens) + wpe(positions))
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    layer = t5.remat_layer(DecoderLayer, cfg.remat, static_argnums=(3, 4))
    for i in range(cfg.num_layers):
      x = common.along_batch(
          layer(cfg, name=f"layers_{i}")(x, bias, deterministic, decode, cache_index))
    x = LayerNorm(cfg.layer_norm_epsilon, jnp.float32, name="decoder_norm")(x)
    return x if return_hidden else wte.attend(x)


# ----------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------


def _boxed_init(config: GPT2Config, rng: Array, max_length: int):
  if max_length > config.n_positions:
    raise ValueError(f"max_length {max_length} exceeds n_positions {config.n_positions}.")
  return GPT2(config).init({"params": rng}, jnp.ones((1, max_length), jnp.int32))["params"]


# Module level, so repeated calls with the same config reuse the compilation.
_jitted_boxed_init = jax.jit(_boxed_init, static_argnums=(0, 2))


def init_params(config: GPT2Config, rng: Array, *, max_length: int) -> tuple[PyTree, PyTree]:
  """Randomly initialized float32 params and their logical axes.

  Returns `(params, logical_axes)`: a plain (unboxed) pytree of arrays and a
  tree of the same structure whose leaves are `PartitionSpec`s of t5x logical
  axis names. The shapes do not depend on `max_length` (the position table
  always has `n_positions` rows); it only sets the length initialized with.
  """
  boxed = _jitted_boxed_init(config, rng, max_length)
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config: GPT2Config, *, max_length: int) -> tuple[PyTree, PyTree]:
  """Like `init_params` but `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  boxed = jax.eval_shape(functools.partial(_boxed_init, config, max_length=max_length),
                         jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def param_count(params: PyTree) -> int:
  """Total number of scalars (works on arrays and ShapeDtypeStructs)."""
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------
# Losses for the trainer: causal LM loss with prompt and padding masked out.
# ----------------------------------------------------------------------------

# 'tokens' [L] int, 'loss_weights' [L] (1 on target tokens, 0 on prompt and
# padding); optional 'attention_mask' [L] (1 = real token).


def _lm_loss(model: GPT2, params, batch, rngs=None) -> Array:
  """`[b]` mean cross entropy of predicting tokens[t+1] from tokens[:t+1],
  over the positions t+1 with nonzero `loss_weights`."""
  tokens = batch["tokens"]
  logits = model.apply({"params": params}, tokens, attention_mask=batch.get("attention_mask"),
                       enable_dropout=bool(rngs), rngs=rngs or {})
  return losses.next_token_loss(logits, tokens, batch["loss_weights"])


def make_batch_loss(config: GPT2Config) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """`fn(params, batch) -> [b]` per-example losses, dropout off (eval)."""
  model = GPT2(config)
  return lambda params, batch: _lm_loss(model, params, batch)


def make_example_loss(config: GPT2Config) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """The loss of ONE example, for per-example clipping (`common.one_example_loss`)."""
  return common.one_example_loss(functools.partial(_lm_loss, GPT2(config)))


# Scoring ---------------------------------------------------------------------


def fixed_size_batches(n: int, batch_size: int):
  """(row indices, number of real rows) of `batch_size`-row batches over n
  rows, the last padded with row 0: one compiled shape for every batch."""
  for start in range(0, n, batch_size):
    rows = np.arange(start, min(start + batch_size, n))
    yield (np.concatenate([rows, np.zeros(batch_size - len(rows), int)]),
           len(rows))


@functools.partial(jax.jit, static_argnames=("config",))
def _nll_sums(config: GPT2Config, params, tokens: Array, weights: Array):
  """Per row: Σ_p weights[p] · -log P(tokens[p] | tokens[:p]), and Σ weights
  over p ≥ 1 (position 0 has no prediction). Right padding needs no mask:
  attention is causal."""
  logits = GPT2(config).apply({"params": params}, tokens)[:, :-1]
  w = weights[:, 1:].astype(jnp.float32)
  return (jnp.sum(losses.token_cross_entropy(logits, tokens[:, 1:]) * w,
                  axis=-1), jnp.sum(w, axis=-1))


def nll_sums(config: GPT2Config, params, tokens: np.ndarray,
             weights: np.ndarray, *, batch_size: int = 64
             ) -> tuple[np.ndarray, np.ndarray]:
  """float64 `[n]` summed token NLL and summed weight of each of the `[n, L]`
  rows, `batch_size` rows a call."""
  sums, counts = np.zeros(len(tokens)), np.zeros(len(tokens))
  for idx, real in fixed_size_batches(len(tokens), batch_size):
    s, c = _nll_sums(config, params, jnp.asarray(tokens[idx], jnp.int32),
                     jnp.asarray(weights[idx], jnp.float32))
    sums[idx[:real]] = np.asarray(s)[:real]
    counts[idx[:real]] = np.asarray(c)[:real]
  return sums, counts


def perplexity(config: GPT2Config, params, tokens: np.ndarray,
               weights: np.ndarray, *, batch_size: int = 64) -> float:
  """exp(Σ weighted token NLL / Σ weights) over all rows: the perplexity of
  the tokens with nonzero `weights` (`nll_sums`)."""
  sums, counts = nll_sums(config, params, tokens, weights,
                          batch_size=batch_size)
  return float(np.exp(sums.sum() / counts.sum()))
