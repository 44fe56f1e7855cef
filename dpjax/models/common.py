"""What the model modules share: config basics, the one-example loss and the
attention core."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax._src.interpreters import batching  # BatchTracer; jax is pinned
import jax.numpy as jnp

from dpjax.models import lora
from dpjax.privacy import clipping

PyTree = Any
# (params, batch, dropout rngs or None) -> [b] per-example losses.
BatchLoss = Callable[[PyTree, Mapping[str, jax.Array], dict | None], jax.Array]


COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# While a step is traced for a mesh (`batch_layout`): shape -> the sharding of
# an activation of that shape split along its leading (example) axis only.
_BATCH_LAYOUT: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "batch_layout", default=None)


@contextlib.contextmanager
def batch_layout(sharding_for: Callable[[tuple[int, ...]], Any]):
  """Within: `along_batch` lays activations out by `sharding_for(shape)`
  (`partitioning.batch_laid_out` sets it while a step is traced)."""
  token = _BATCH_LAYOUT.set(sharding_for)
  try:
    yield
  finally:
    _BATCH_LAYOUT.reset(token)


def along_batch(x: jax.Array) -> jax.Array:
  """`x` (an activation, examples on its leading axis) split over the
  step's data-parallel devices along that axis and whole along the others,
  where a step is being traced for a mesh (`batch_layout`); `x` itself
  elsewhere.

  Why: with FSDP the weights are split along 'embed', and XLA's
  partitioner, left to itself, may follow them, splitting the activations
  along their hidden axis and computing the whole batch on every device,
  with an all-reduce after each matmul. T5-Large's layer over 32 v4 chips
  did so, moving 14 GB a device for 32 examples (docs/benchmarks.md).

  Under vmap (per-example gradients: `clipping.vmap_examples`, clipping's
  and ghost's, inside their loops and rematerialised layers too; any other
  vmap seen directly) `x` is one example, its leading axis a position: it
  is kept whole along all its axes, and the vmapped one is split as the
  batch is (`vmap_examples`) or left to the partitioner. (Split like a
  batch, the positions would take the data-parallel devices from the
  examples: a reshard at every layer.)"""
  sharding_for = _BATCH_LAYOUT.get()
  if sharding_for is None:
    return x
  sharding = sharding_for(x.shape)
  if clipping.one_example_traced() or isinstance(x, batching.BatchTracer):
    sharding = sharding.update(spec=jax.sharding.PartitionSpec())
  return jax.lax.with_sharding_constraint(x, sharding)


class ModelConfig:
  """Mixin for frozen model-config dataclasses with a `dtype` field: the
  compute dtype, and a JSON round trip (used to detect a checkpoint of a
  different model on resume)."""

  def check_dtype(self) -> None:
    """Raises ValueError unless `dtype` names one of `COMPUTE_DTYPES`."""
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"dtype must be one of {tuple(COMPUTE_DTYPES)}, "
                       f"got {self.dtype!r}")

  @property
  def compute_dtype(self):
    """Matmul/activation dtype; params stay float32."""
    return COMPUTE_DTYPES[self.dtype]

  def to_json(self) -> dict:
    """A plain dict of the fields (JSON-serializable)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]):
    """Inverse of `to_json`. Unknown keys are an error; missing keys default."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"Unknown {cls.__name__} fields: {sorted(unknown)}")
    if isinstance(d.get("lora"), Mapping):
      d = {**d, "lora": lora.LoRAConfig(**d["lora"])}
    return cls(**d)


def config_parts(model_config):
  """The model config and every config nested in its fields (e.g.
  GPT2DiscConfig.lm, DualEncoderConfig.encoder), outermost first."""
  if dataclasses.is_dataclass(model_config) and not isinstance(model_config,
                                                               type):
    yield model_config
    for f in dataclasses.fields(model_config):
      yield from config_parts(getattr(model_config, f.name))


def map_parts(model_config, fn: Callable):
  """`model_config` rebuilt with `fn` applied to it and to every config
  nested in its fields, innermost first."""
  if not dataclasses.is_dataclass(model_config) or isinstance(model_config,
                                                              type):
    return model_config
  changes = {f.name: map_parts(getattr(model_config, f.name), fn)
             for f in dataclasses.fields(model_config)
             if dataclasses.is_dataclass(getattr(model_config, f.name))}
  return fn(dataclasses.replace(model_config, **changes) if changes
            else model_config)


def scanned_layers(model_config) -> dict[str, int]:
  """The layer counts (`num_*_layers` fields) of the model config's scanned
  part (`scan_layers`, its own or a nested config's, its loop not unrolled);
  {} if none."""
  for part in config_parts(model_config):
    if (getattr(part, "scan_layers", False)
        and not getattr(part, "scan_unrolled", False)):
      return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)
              if f.name.startswith("num_") and f.name.endswith("_layers")}
  return {}


def loop_unrolled(model_config, layers: Mapping[str, int]):
  """`model_config` with its scanned parts at `layers` counts, their loops
  unrolled (`scan_unrolled`: the same clipping, e.g. ghost's book-keeping,
  in straight-line code)."""
  return map_parts(model_config, lambda c: (
      dataclasses.replace(c, scan_unrolled=True, **layers)
      if getattr(c, "scan_layers", False) else c))


def one_example_loss(batch_loss: BatchLoss
                     ) -> Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]:
  """`fn(params, example) -> scalar`: the loss of ONE example (no batch dim).

  Meant for `jax.vmap(jax.value_and_grad(fn), in_axes=(None, 0))` in
  per-example clipping. If the example has a 'dropout_rng' key (a PRNG key),
  dropout is enabled with it; otherwise the forward pass is deterministic.
  """

  def example_loss(params, example):
    batch = {k: v[None] for k, v in example.items() if k != "dropout_rng"}
    rngs = ({"dropout": example["dropout_rng"]} if "dropout_rng" in example
            else None)
    return batch_loss(params, batch, rngs)[0]

  return example_loss


def scaled_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     bias: jax.Array, dtype, *, scale: float | None = None,
                     dropout_rate: float = 0.0,
                     dropout_rng: jax.Array | None = None,
                     remat: bool = True) -> jax.Array:
  """softmax(scale * q k^T + bias) v, heads joined: [b, q, h * d_head].

  q, k, v: [b, len, heads, d_head]; bias broadcasts to [b, heads, q, k];
  `scale` defaults to 1/sqrt(d_head) (T5 passes 1.0). Logits and softmax in
  float32 (f32 accumulation of bf16 inputs; scaling the f32 logits rather
  than a bf16 query keeps full precision), the weighted sum of values in
  `dtype`. With a `dropout_rng`, the attention weights are dropped at
  `dropout_rate` as `flax.linen.Dropout` drops them (kept weights scaled by
  1 / (1 - rate)).

  Memory (`remat`, the default): the backward pass keeps no `[b, heads, q,
  k]` array. Autodiff of the expression as written keeps the softmax twice
  (float32 for its own derivative, `dtype` for the weighted sum's) and the
  dropout mask: for T5-Base at 384 tokens, 6 bytes x 12 heads x 384^2 =
  10.6 MB an example a layer, its largest residual. Here the backward pass
  recomputes the logits from q, k and the bias, which it keeps, and the
  mask from its key, as FlashAttention does. Cost: one more `q k^T`
  product and softmax (and the mask's random bits) a layer in the backward
  pass; the values and gradients are the same. Pass `remat=False` inside a
  layer that is rematerialised as a whole: its backward pass already
  recomputes the attention, and holds one layer's attention weights at a
  time.
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  if dropout_rng is None or dropout_rate == 0.0:
    dropout_rng, dropout_rate = None, 0.0
  attend = _attend_remat if remat else _attend
  out = attend(q, k, v, bias, dropout_rng, scale, dropout_rate)
  return out.reshape(*out.shape[:-2], -1)


def _attend(q, k, v, bias, dropout_rng, scale, rate):
  """[b, q, heads, d_head]."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                      preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits * scale + bias, axis=-1)
  if dropout_rng is not None:
    if rate == 1.0:
      probs = jnp.zeros_like(probs)
    else:
      keep = jax.random.bernoulli(dropout_rng, 1.0 - rate, probs.shape)
      probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


# Its residuals are its inputs.
_attend_remat = jax.checkpoint(_attend, static_argnums=(5, 6),
                               policy=jax.checkpoint_policies.nothing_saveable)
