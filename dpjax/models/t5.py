"""T5 encoder-decoder Transformer (v1.0 and v1.1) in Flax linen.

The math follows the original Mesh-TensorFlow T5 (and so the Hugging Face
port) exactly:

* no 1/sqrt(d_kv) scaling of attention logits (it is folded into the query
  initializer instead);
* RMS layer norm (no mean subtraction, no bias, eps 1e-6) before every
  sub-block, plus a final norm on each stack;
* relative position biases, computed once per stack (owned by the stack, used
  by every self-attention layer), bidirectional buckets in the encoder and
  causal buckets in the decoder; cross-attention has none;
* v1.0: ReLU MLP, logits tied to the input embedding and scaled by
  d_model**-0.5; v1.1: gated-GELU (tanh approximation) MLP, separate
  `logits_dense`.

Parameter names and logical axis names follow t5x
(`t5x/examples/t5/network.py`). Kernels are stored 2-D, e.g. attention
`query/kernel` is `[embed, joined_kv]` (the transpose of a PyTorch
`nn.Linear.weight`); with `scan_layers` each stack's layer params are
stacked as `layers/...` with a leading `layers` axis (`run_layers`,
`scan_params`). Parameters are always float32; `T5Config.dtype` only sets
the compute dtype.
`dpjax.models.hf_t5` maps Hugging Face checkpoints onto these params.

No TensorFlow anywhere in here: only jax, flax and numpy.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.models import common, losses
from dpjax.models import lora as lora_lib
from dpjax.privacy import layers

Array = jax.Array
PyTree = Any

# Additive attention bias for masked positions. Finite (not -inf) so that a
# fully masked row gives a uniform softmax instead of NaN; relative position
# biases are far below float32 resolution at this magnitude.
_MASK_VALUE = -1e10
_FEED_FORWARDS = ("relu", "gated-gelu")
REMATS = ("none", "layer")
# A config may say 'auto': the trainer picks one of REMATS (dpjax.training.sizing).
CONFIG_REMATS = REMATS + ("auto",)


@dataclasses.dataclass(frozen=True)
class T5Config(common.ModelConfig):
  """Hyperparameters of a T5 model. Frozen, so it can be a static jit arg."""
  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 2048
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  feed_forward: str = "relu"  # "relu" (T5 v1.0) | "gated-gelu" (T5.1.1)
  tie_embeddings: bool = True  # v1.0 True, v1.1 False
  dtype: str = "float32"  # compute dtype; params are always float32
  # "layer": recompute each layer's activations in the backward pass
  # (`remat_layer`); same params and results, less memory, ~1/3 more flops.
  remat: str = "none"
  # One layer's program, looped over stacked params (`scanned_layers`): the
  # compiler sees one layer per stack instead of all of them. Params are
  # `encoder/layers/...` with a leading `layers` axis instead of `layers_i`
  # (`scan_params` / `unscan_params` convert).
  scan_layers: bool = False
  # The scan fully unrolled (straight-line code over the same stacked
  # params): the loop-free programs a dry run costs a scanned model by.
  scan_unrolled: bool = False
  # LoRA adapters on the projections it targets (`dpjax.models.lora`); None: none.
  lora: lora_lib.LoRAConfig | None = None

  def __post_init__(self):
    if self.feed_forward not in _FEED_FORWARDS:
      raise ValueError(f"feed_forward must be one of {_FEED_FORWARDS}, got {self.feed_forward!r}")
    if self.remat not in CONFIG_REMATS:
      raise ValueError(f"remat must be one of {CONFIG_REMATS}, got {self.remat!r}")
    self.check_dtype()


# ----------------------------------------------------------------------------
# Building blocks.
# ----------------------------------------------------------------------------


def _param(module: nn.Module, name: str, stddev: float, shape, axes):
  """A float32 normal(stddev) parameter annotated with logical axis names."""
  init = nn.with_logical_partitioning(nn.initializers.normal(stddev=stddev), axes)
  return module.param(name, init, shape, jnp.float32)


class LayerNorm(nn.Module):
  """T5 RMS norm: statistics in float32, no mean subtraction, no bias."""
  dtype: Any = jnp.float32
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        (x.shape[-1],), jnp.float32)
    return _rms_norm(x, scale, self.epsilon, self.dtype)


# Rematerialised: the backward pass keeps `x` in the compute dtype rather than
# the float32 copy its statistics are taken in (twice the bytes, a stack of
# them per norm in a layer loop); recomputing the statistics is elementwise.
@functools.partial(jax.checkpoint, static_argnums=(2, 3),
                   policy=jax.checkpoint_policies.nothing_saveable)
def _rms_norm(x: Array, scale: Array, epsilon: float, dtype) -> Array:
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + epsilon)
  return x.astype(dtype) * scale.astype(dtype)


def shared_embedding(cfg: T5Config) -> layers.Embed:
  """T5's token embedding (stddev 1, looked up in the compute dtype), shared
  by the encoder, the decoder and, if tied, the output projection."""
  return layers.Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), 1.0,
                      cfg.compute_dtype)


def relative_position_bucket(relative_position: np.ndarray, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> np.ndarray:
  """T5's bucketing of `relative_position = key_position - query_position`.

  Half the buckets (per direction, if bidirectional) are exact distances; the
  rest grow logarithmically up to `max_distance`, beyond which everything
  shares the last bucket. Computed in float32 numpy exactly as Mesh-TF/HF do
  (truncation of `log(n / max_exact) / log(max_distance / max_exact) * ...`).
  """
  rel = np.asarray(relative_position, dtype=np.int64)
  buckets = np.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets += (rel > 0).astype(np.int64) * num_buckets  # keys to the right
    n = np.abs(rel)
  else:
    n = np.maximum(-rel, 0)  # only keys at or before the query are distinct
  max_exact = num_buckets // 2
  with np.errstate(divide="ignore"):  # log(0) in the unused branch
    scaled = (np.log(n.astype(np.float32) / np.float32(max_exact))
              / np.float32(np.log(max_distance / max_exact))
              * np.float32(num_buckets - max_exact))
  large = max_exact + np.where(n < max_exact, 0, scaled).astype(np.int64)
  large = np.minimum(large, num_buckets - 1)
  return buckets + np.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
  """Learned per-head scalar bias for each relative-position bucket."""
  num_heads: int
  num_buckets: int
  max_distance: int
  bidirectional: bool
  stddev: float

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    """Returns the `[1, heads, q, k]` float32 bias (positions may be traced)."""
    table = _param(self, "rel_embedding", self.stddev, (self.num_heads, self.num_buckets),
                   ("heads", "relpos_buckets"))
    # Buckets are constant beyond +-max_distance, so a static table over that
    # range, indexed by the clipped relative position, is exact. It also lets
    # the decode step use a traced query position.
    d = self.max_distance
    bucket_of = jnp.asarray(relative_position_bucket(
        np.arange(-d, d + 1), bidirectional=self.bidirectional,
        num_buckets=self.num_buckets, max_distance=d), jnp.int32)
    rel = jnp.clip(key_positions[None, :] - query_positions[:, None], -d, d)
    # A product with the one-hot buckets, not a gather: a gather's gradient
    # is a scatter, which a TPU runs row by row, and per-example gradients
    # (ghost clipping's small parameters) first copy each example's
    # [q, k, heads] gradient into a layout to scatter from. The product is
    # one contraction each way, and exact: each bias is one table entry
    # times 1, at full float32 precision.
    onehot = (bucket_of[rel + d][..., None]
              == jnp.arange(self.num_buckets)).astype(table.dtype)
    return jnp.einsum("hb,qkb->hqk", table, onehot,
                      precision=jax.lax.Precision.HIGHEST)[None]


class MultiHeadAttention(nn.Module):
  """Multi-head dot-product attention without logit scaling.

  With `decode=True` it keeps a key/value cache (`cached_key`,
  `cached_value`) in the 'cache' collection. Self-attention
  (`static_kv=False`): `[b, max_length, heads, d_kv]`; the first call (cache
  absent) only creates the zero cache and otherwise runs normally; later calls
  take one query token and write its key/value at `cache_index`.
  Cross-attention (`static_kv=True`): the encoder's keys/values do not change
  while decoding, so the first call projects and stores them
  (`[b, input_length, heads, d_kv]`) and later calls reuse them.
  """
  config: T5Config
  static_kv: bool = False

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, bias: Array, *,
               deterministic: bool, decode: bool = False,
               cache_index: Array | None = None) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    h, dk = cfg.num_heads, cfg.d_kv
    joined = h * dk

    def project(x, name, stddev):
      y = lora_lib.dense(cfg.lora, x, joined, ("embed", "joined_kv"), stddev, dtype,
                     name=name, deterministic=deterministic)
      return y.reshape(*y.shape[:-1], h, dk)

    # The query init absorbs the 1/sqrt(d_kv) that T5 never applies to logits.
    q = project(inputs_q, "query", (cfg.d_model * dk) ** -0.5)
    if decode and self.static_kv and self.has_variable("cache", "cached_key"):
      k = self.get_variable("cache", "cached_key")
      v = self.get_variable("cache", "cached_value")
    else:
      k = project(inputs_kv, "key", cfg.d_model ** -0.5)
      v = project(inputs_kv, "value", cfg.d_model ** -0.5)
      if decode and self.static_kv:
        self.put_variable("cache", "cached_key", k)
        self.put_variable("cache", "cached_value", v)
    if decode and not self.static_kv:
      initialized = self.has_variable("cache", "cached_key")
      cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
      cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
      if initialized:
        if q.shape[1] != 1:
          raise ValueError(f"Cached decoding takes one token at a time, got {q.shape[1]}.")
        start = (0, cache_index, 0, 0)
        cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, start)
        cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, start)
        k, v = cached_k.value, cached_v.value

    # No logit scaling (scale 1).
    drop = not deterministic and cfg.dropout_rate > 0
    out = common.scaled_attention(
        q, k, v, bias, dtype, scale=1.0, dropout_rate=cfg.dropout_rate,
        dropout_rng=self.make_rng("dropout") if drop else None,
        remat=cfg.remat != "layer")
    return lora_lib.dense(cfg.lora, out, cfg.d_model, ("joined_kv", "embed"), joined ** -0.5,
                      dtype, name="out", deterministic=deterministic)


class MlpBlock(nn.Module):
  """Feed-forward block: ReLU (v1.0) or gated GELU (v1.1)."""
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    dense_in = functools.partial(lora_lib.dense, cfg.lora, x, cfg.d_ff, ("embed", "mlp"),
                                 cfg.d_model ** -0.5, dtype, deterministic=deterministic)
    if cfg.feed_forward == "relu":
      hidden = jax.nn.relu(dense_in(name="wi"))
    else:  # gated-gelu; HF's "gelu_new" is the tanh approximation
      hidden = jax.nn.gelu(dense_in(name="wi_0"), approximate=True) * dense_in(name="wi_1")
    hidden = nn.Dropout(cfg.dropout_rate)(hidden, deterministic=deterministic)
    return lora_lib.dense(cfg.lora, hidden, cfg.d_model, ("mlp", "embed"), cfg.d_ff ** -0.5, dtype,
                      name="wo", deterministic=deterministic)


class EncoderLayer(nn.Module):
  """Pre-norm self-attention + MLP, each with dropout on the residual branch.

  Flags are positional (not keyword-only): `remat_layer` marks them static.
  """
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, bias: Array, deterministic: bool) -> Array:
    cfg = self.config
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = LayerNorm(cfg.compute_dtype, name="pre_attention_layer_norm")(x)
    x = x + dropout(MultiHeadAttention(cfg, name="attention")(
        y, y, bias, deterministic=deterministic))
    y = LayerNorm(cfg.compute_dtype, name="pre_mlp_layer_norm")(x)
    return x + dropout(MlpBlock(cfg, name="mlp")(y, deterministic=deterministic))


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention, cross-attention and MLP (flags
  positional, as in `EncoderLayer`)."""
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, encoded: Array, self_bias: Array, cross_bias: Array,
               deterministic: bool, decode: bool, cache_index: Array | None) -> Array:
    cfg = self.config
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = LayerNorm(cfg.compute_dtype, name="pre_self_attention_layer_norm")(x)
    x = x + dropout(MultiHeadAttention(cfg, name="self_attention")(
        y, y, self_bias, deterministic=deterministic, decode=decode, cache_index=cache_index))
    y = LayerNorm(cfg.compute_dtype, name="pre_cross_attention_layer_norm")(x)
    x = x + dropout(MultiHeadAttention(cfg, static_kv=True,
                                       name="encoder_decoder_attention")(
        y, encoded, cross_bias, deterministic=deterministic, decode=decode))
    y = LayerNorm(cfg.compute_dtype, name="pre_mlp_layer_norm")(x)
    return x + dropout(MlpBlock(cfg, name="mlp")(y, deterministic=deterministic))


@functools.cache  # one lifted class per layer type, not one per trace
def remat_layer(layer: type[nn.Module], remat: str, static_argnums: tuple[int, ...]
                ) -> type[nn.Module]:
  """`layer`, or for `remat='layer'` the same layer under `nn.remat`.

  Rematerialised, the backward pass keeps only the layer's inputs and
  recomputes everything inside it (`nothing_saveable`): activation memory
  per layer drops from the attention and MLP intermediates to one
  `[b, L, d_model]` input, for about one extra forward pass. Saving the
  matmul outputs instead (`dots_with_no_batch_dims_saveable`) would keep the
  `d_ff`-wide MLP activations, the largest ones. Module names, and so the
  params tree, are unchanged. `static_argnums` (counting `self` as 0) name
  the Python-bool flags, which must stay static under `jax.checkpoint`.
  """
  if remat == "none":
    return layer
  if remat != "layer":  # 'auto' is resolved before a model is built
    raise ValueError(f"remat {remat!r}: build the model with one of {REMATS}")
  return nn.remat(layer, static_argnums=static_argnums,
                  policy=jax.checkpoint_policies.nothing_saveable)


LAYERS = "layers"  # the scanned stack's module name
LAYERS_AXIS = "layers"  # its params' leading logical axis (t5x's name)
_LAYER_KEY = re.compile(r"layers_(\d+)")


def _scan_body(layer: nn.Module, x: Array, *args) -> tuple[Array, None]:
  return common.along_batch(layer(x, *args)), None


def run_layers(layer: type[nn.Module], cfg: T5Config, count: int,
               static_argnums: tuple[int, ...], x: Array, *args) -> Array:
  """`x` through `count` layers of type `layer` (built from `cfg`, called
  with `*args` each), named `layers_i`, or with `cfg.scan_layers` one
  `layers` module looped over params stacked on a leading `layers` axis.

  The scan gives each layer its own params, dropout and init keys and (for
  decoding) its own cache slice, as the unrolled loop does; a layer
  rematerialised (`remat_layer`) is rematerialised inside the loop body.
  Each layer's output is split along the batch (`common.along_batch`).
  """
  module = remat_layer(layer, cfg.remat, static_argnums)
  if not cfg.scan_layers:
    for i in range(count):
      x = common.along_batch(module(cfg, name=f"layers_{i}")(x, *args))
    return x
  scan = nn.scan(_scan_body, variable_axes={"params": 0, "cache": 0},
                 split_rngs={"params": True, "dropout": True},
                 in_axes=(nn.broadcast,) * len(args), length=count,
                 unroll=count if cfg.scan_unrolled else 1,
                 metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
  return scan(module(cfg, name=LAYERS), x, *args)[0]


def scan_params(params: PyTree) -> PyTree:
  """Unrolled T5 params (`{encoder,decoder}/layers_i/...`) -> the scanned
  model's (`.../layers/...`, each leaf stacked on a new leading axis).
  Any tree of that layout converts (a LoRA model's adapters too)."""
  def stack(stack_name, tree):
    del stack_name
    keys = sorted((k for k in tree if _LAYER_KEY.fullmatch(k)),
                  key=lambda k: int(_LAYER_KEY.fullmatch(k).group(1)))
    if not keys:
      return tree
    rest = {k: v for k, v in tree.items() if k not in keys}
    return {**rest, LAYERS: jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *[tree[k] for k in keys])}
  return _per_stack(params, stack)


def unscan_params(params: PyTree, *, layers: Mapping[str, int] | None = None,
                  take: Callable[[Any, int], Any] = lambda x, i: x[i]) -> PyTree:
  """The inverse of `scan_params`: `.../layers/...` -> `.../layers_i/...`.

  Layer `i` gets `take(leaf, i)` of each stacked leaf, and each stack as
  many layers as its leaves' leading axis has, or as `layers` (stack name
  -> count) says: with both, any tree of the layout converts (e.g. the
  stacked params' shardings to each layer's)."""
  def split(stack, tree):
    if LAYERS not in tree:
      return tree
    stacked = tree[LAYERS]
    rest = {k: v for k, v in tree.items() if k != LAYERS}
    count = (layers[stack] if layers is not None
             else jax.tree.leaves(stacked)[0].shape[0])
    return {**rest, **{f"layers_{i}": jax.tree.map(lambda x: take(x, i), stacked)
                       for i in range(count)}}
  return _per_stack(params, split)


def unrolled(params: PyTree, config: T5Config) -> tuple[PyTree, T5Config]:
  """`params` and `config` of a scanned model as the same model unrolled
  (the layout checkpoints and exports use); others unchanged."""
  if not getattr(config, "scan_layers", False):
    return params, config
  return unscan_params(params), dataclasses.replace(config, scan_layers=False)


def _per_stack(params: PyTree, convert: Callable) -> PyTree:
  return {k: convert(k, v) if k in ("encoder", "decoder") and isinstance(v, Mapping)
          else v for k, v in params.items()}


def _relpos(cfg: T5Config, bidirectional: bool) -> RelativePositionBias:
  return RelativePositionBias(
      num_heads=cfg.num_heads, num_buckets=cfg.relative_attention_num_buckets,
      max_distance=cfg.relative_attention_max_distance, bidirectional=bidirectional,
      stddev=cfg.d_model ** -0.5, name="relpos_bias")


def _padding_bias(tokens: Array) -> Array:
  """`[b, 1, 1, L]` additive bias hiding key positions holding token 0."""
  return jnp.where(tokens > 0, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None, :]


class Encoder(nn.Module):
  """Embedding, encoder layers, final norm. Token 0 is padding."""
  config: T5Config
  shared_embedding: layers.Embed

  @nn.compact
  def __call__(self, tokens: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    x = dropout(common.along_batch(self.shared_embedding(tokens)))
    positions = jnp.arange(tokens.shape[-1])
    bias = _relpos(cfg, bidirectional=True)(positions, positions) + _padding_bias(tokens)
    x = run_layers(EncoderLayer, cfg, cfg.num_encoder_layers, (3,), x, bias,
                   deterministic)
    return dropout(LayerNorm(cfg.compute_dtype, name="encoder_norm")(x))


class Decoder(nn.Module):
  """Embedding, decoder layers, final norm and float32 output logits.

  In decode mode the stack keeps the current position in the 'cache'
  collection (`cache_index`) and builds the causal mask and relative position
  bias for that single query row against all `max_decode_length` cache slots.
  """
  config: T5Config
  shared_embedding: layers.Embed

  @nn.compact
  def __call__(self, encoded: Array, encoder_tokens: Array, tokens: Array, *,
               deterministic: bool, decode: bool = False,
               max_decode_length: int | None = None) -> Array:
    cfg = self.config
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    relpos = _relpos(cfg, bidirectional=False)

    cache_index = None
    stepping = decode and self.has_variable("cache", "cache_index")
    if decode:
      index_var = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
      cache_index = index_var.value
    if stepping:
      if max_decode_length is None:  # the cache length is the number of key slots
        layer, axis = (LAYERS, 2) if cfg.scan_layers else ("layers_0", 1)
        max_decode_length = self.variables["cache"][layer]["self_attention"][
            "cached_key"].shape[axis]
      query_positions = cache_index[None]
      index_var.value = cache_index + 1
    else:
      query_positions = jnp.arange(tokens.shape[-1])
    key_positions = jnp.arange(max_decode_length if stepping else tokens.shape[-1])
    causal = key_positions[None, :] <= query_positions[:, None]
    self_bias = relpos(query_positions, key_positions) + jnp.where(causal, 0.0, _MASK_VALUE)
    cross_bias = _padding_bias(encoder_tokens)

    x = dropout(common.along_batch(self.shared_embedding(tokens)))
    x = run_layers(DecoderLayer, cfg, cfg.num_decoder_layers, (5, 6), x,
                   encoded, self_bias, cross_bias, deterministic, decode,
                   cache_index)
    x = dropout(LayerNorm(cfg.compute_dtype, name="decoder_norm")(x))

    if cfg.tie_embeddings:
      # Rescale because the embedding (stddev 1) doubles as output projection.
      return self.shared_embedding.attend(x.astype(jnp.float32) * cfg.d_model ** -0.5)
    return layers.Dense(cfg.vocab_size, ("embed", "vocab"), cfg.d_model ** -0.5,
                        jnp.float32, name="logits_dense")(x)


class T5Transformer(nn.Module):
  """T5 encoder-decoder. Token 0 is both padding and the decoder start token."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = shared_embedding(cfg)
    self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens: Array, *, enable_dropout: bool = False) -> Array:
    """`[b, Li]` tokens -> `[b, Li, d_model]` encodings (compute dtype)."""
    return self.encoder(encoder_input_tokens, deterministic=not enable_dropout)

  def decode(self, encoded: Array, encoder_input_tokens: Array, decoder_input_tokens: Array,
             *, enable_dropout: bool = False, decode: bool = False,
             max_decode_length: int | None = None) -> Array:
    """Decoder logits `[b, Lt, vocab]` (float32).

    `decode=True` uses the 'cache' collection (apply with `mutable=['cache']`):
    the first call, with full-length `decoder_input_tokens`, creates the cache;
    subsequent calls feed one token `[b, 1]` per step. `max_decode_length`
    defaults to the cache length.
    """
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        deterministic=not enable_dropout, decode=decode,
                        max_decode_length=max_decode_length)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array, *,
               enable_dropout: bool = False) -> Array:
    encoded = self.encode(encoder_input_tokens, enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       enable_dropout=enable_dropout)


# ----------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------


def _boxed_init(config: T5Config, rng: Array, input_length: int, target_length: int):
  model = T5Transformer(config)
  return model.init({"params": rng}, jnp.ones((1, input_length), jnp.int32),
                    jnp.ones((1, target_length), jnp.int32))["params"]


# Module level, so repeated calls with the same config reuse the compilation.
_jitted_boxed_init = jax.jit(_boxed_init, static_argnums=(0, 2, 3))


def init_params(config: T5Config, rng: Array, *, input_length: int,
                target_length: int) -> tuple[PyTree, PyTree]:
  """Randomly initialized float32 params and their logical axes.

  Returns `(params, logical_axes)`: a plain (unboxed) pytree of arrays and a
  tree of the same structure whose leaves are `PartitionSpec`s of t5x logical
  axis names.
  """
  boxed = _jitted_boxed_init(config, rng, input_length, target_length)
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config: T5Config, *, input_length: int,
                    target_length: int) -> tuple[PyTree, PyTree]:
  """Like `init_params` but `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  boxed = jax.eval_shape(
      functools.partial(_boxed_init, config, input_length=input_length,
                        target_length=target_length),
      jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def param_count(params: PyTree) -> int:
  """Total number of scalars (works on arrays and ShapeDtypeStructs)."""
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------
# Losses for the trainer. Batches use seqio EncDecFeatureConverter names.
# ----------------------------------------------------------------------------



def _seq2seq_loss(model: T5Transformer, params, batch, rngs=None) -> Array:
  """`[b]` mean cross entropy over each example's weighted target tokens."""
  logits = model.apply({"params": params}, batch["encoder_input_tokens"],
                       batch["decoder_input_tokens"], enable_dropout=bool(rngs),
                       rngs=rngs or {})
  return losses.per_example_loss(logits, batch["decoder_target_tokens"],
                                 batch["decoder_loss_weights"])


def make_batch_loss(config: T5Config) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """`fn(params, batch) -> [b]` per-example losses, dropout off (eval)."""
  model = T5Transformer(config)
  return lambda params, batch: _seq2seq_loss(model, params, batch)


def make_example_loss(config: T5Config) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """The loss of ONE example, for per-example clipping (`common.one_example_loss`)."""
  return common.one_example_loss(functools.partial(_seq2seq_loss, T5Transformer(config)))
