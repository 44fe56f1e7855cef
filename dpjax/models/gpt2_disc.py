"""GPT-2 with a discriminator head: the multitask model of "DP Conditional
Text Generation for Synthetic Data" (an ICLR 2023 submission, OpenReview
LUql3ZOFwFD, Sec. 5.1.3, Alg. 1).

One GPT-2 (`dpjax.models.gpt2`) and a small MLP head on its final hidden
states (after the final norm), trained on two per-example losses:

* "lm": the causal LM loss of the conditioned row `BOS label SEP text EOS`
  (`tasks.textcls`), prompt masked out by `loss_weights` as in
  `gpt2.make_example_loss`;
* "disc": the same row with the label slot (`label_position`) replaced by a
  random token; the head classifies the mean of the hidden states of
  positions `0..e` (as PPLM's discriminator averages hidden states) at the
  end `e` of every text prefix of `prefix_step`, `2 * prefix_step`, ...
  tokens, the whole text always being the last prefix; prefix k of K gets
  weight k / (1 + ... + K) (linearly rising, summing to 1), and the loss is
  the weighted sum of the prefixes' cross entropies against the class whose
  token is in the label slot (`label_token_ids`).

The random label-slot token is uniform over `[0, vocab_size)` and is drawn
from the example's key: `slot, lm_dropout, disc_dropout =
jax.random.split(example["dropout_rng"], 3)`, token
`jax.random.randint(slot, (), 0, vocab_size)`. With the trainer's
`step.dropout_keys(seed, step, call)` it is thus a pure function of
the run seed and the example's place in the sampled batch, never of the data.

Params: GPT-2's params plus a `disc_head` subtree,

    disc_head/hidden/{kernel [embed, mlp], bias [mlp]}   (GELU after it)
    disc_head/out/{kernel [mlp, labels], bias [labels]}

Frozen layers (`frozen_layers`, `head_only`) are a boolean mask over the
params (`trainable_mask`); the trainer differentiates, clips and noises only
the True leaves.

Formal guarantees: none by themselves. Each loss is a function of one
example (and its key), so the per-example gradient of each, w.r.t. all
params, clipped to its own norm C_lm or C_disc and summed over a Poisson
sample, has sensitivity C_lm or C_disc; adding N(0, σ_lm² C_lm²) and
N(0, σ_disc² C_disc²) separately is two Gaussian releases per step on the
same sample, which `privacy.accounting.PoissonGaussian(q, (σ_lm, σ_disc), T)`
composes. With `head_only` only the disc release is made (the post-hoc
discriminator of the paper's Baseline 2, on a frozen fine-tuned LM).

No TensorFlow anywhere in here: only jax, flax and numpy.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.models import common, gpt2, lora, losses

Array = jax.Array
PyTree = Any

HEAD = "disc_head"
_INIT_STDDEV = 0.02
_LAYER = re.compile(r"layers_(\d+)")


@dataclasses.dataclass(frozen=True)
class GPT2DiscConfig(common.ModelConfig):
  """The GPT-2, the head and the layout of a conditioned row. Frozen and
  hashable, so it can be a static jit argument."""
  lm: gpt2.GPT2Config
  label_token_ids: tuple[int, ...]  # token of class c in the label slot
  prefix_step: int = 2
  head_hidden: int | None = None  # None: the GPT-2's d_model
  label_position: int = 1
  text_start: int = 3
  frozen_layers: tuple[int, ...] = ()  # GPT-2 blocks that get no gradient
  head_only: bool = False  # train the head alone (a post-hoc discriminator)

  def __post_init__(self):
    ids = tuple(int(i) for i in self.label_token_ids)
    frozen = tuple(int(i) for i in self.frozen_layers)
    object.__setattr__(self, "label_token_ids", ids)
    object.__setattr__(self, "frozen_layers", frozen)
    problems = []
    if len(ids) < 2 or len(set(ids)) != len(ids):
      problems.append(f"label_token_ids must be >= 2 distinct ids, got {ids}")
    if any(not 0 <= i < self.lm.vocab_size for i in ids):
      problems.append(f"label_token_ids {ids} outside the vocabulary ({self.lm.vocab_size})")
    if self.prefix_step < 1:
      problems.append(f"prefix_step must be >= 1, got {self.prefix_step}")
    if not 0 <= self.label_position < self.text_start:
      problems.append(f"need 0 <= label_position {self.label_position} < text_start "
                      f"{self.text_start}")
    if any(not 0 <= i < self.lm.num_layers for i in frozen):
      problems.append(f"frozen_layers {frozen} outside 0..{self.lm.num_layers - 1}")
    if problems:
      raise ValueError("GPT2DiscConfig: " + "; ".join(problems))

  @property
  def num_classes(self) -> int:
    """The number of classes: one per label token."""
    return len(self.label_token_ids)

  @property
  def dtype(self) -> str:
    """The compute dtype: the LM's."""
    return self.lm.dtype

  @classmethod
  def from_json(cls, d: Mapping[str, Any]):
    d = dict(d)
    lm = d.pop("lm", None)
    if not isinstance(lm, Mapping):
      raise ValueError(f"GPT2DiscConfig JSON needs an 'lm' object, got {lm!r}")
    return super().from_json({**d, "lm": gpt2.GPT2Config.from_json(lm)})


class DiscriminatorHead(nn.Module):
  """`[..., d_model] -> [..., num_classes]` float32 logits: Dense, GELU, Dense."""
  num_classes: int
  hidden: int

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = gpt2.Dense(self.hidden, ("embed", "mlp"), _INIT_STDDEV, name="hidden")(x)
    x = jax.nn.gelu(x, approximate=True)
    return gpt2.Dense(self.num_classes, ("mlp", "labels"), _INIT_STDDEV, name="out")(x)


def _head(config: GPT2DiscConfig) -> DiscriminatorHead:
  return DiscriminatorHead(config.num_classes, config.head_hidden or config.lm.d_model)


def lm_params(params: PyTree) -> PyTree:
  """The GPT-2's params (everything but the head), for `gpt2.GPT2.apply`."""
  return {k: v for k, v in params.items() if k != HEAD}


def head_logits(config: GPT2DiscConfig, params: PyTree, mean_hidden: Array) -> Array:
  """Class logits of mean hidden states `[..., d_model]`."""
  return _head(config).apply({"params": params[HEAD]}, mean_hidden.astype(jnp.float32))


# ----------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------


def _boxed_head(config: GPT2DiscConfig, rng: Array):
  return _head(config).init(rng, jnp.zeros((1, config.lm.d_model), jnp.float32))["params"]


def init_params(config: GPT2DiscConfig, rng: Array, *, max_length: int
                ) -> tuple[PyTree, PyTree]:
  """`(params, logical_axes)`: `gpt2.init_params` plus the `disc_head` subtree."""
  lm_rng, head_rng = jax.random.split(rng)
  params, axes = gpt2.init_params(config.lm, lm_rng, max_length=max_length)
  boxed = _boxed_head(config, head_rng)
  return ({**params, HEAD: nn.meta.unbox(boxed)},
          {**axes, HEAD: nn.get_partition_spec(boxed)})


def abstract_params(config: GPT2DiscConfig, *, max_length: int) -> tuple[PyTree, PyTree]:
  """Like `init_params` but `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  params, axes = gpt2.abstract_params(config.lm, max_length=max_length)
  boxed = jax.eval_shape(functools.partial(_boxed_head, config), jax.random.key(0))
  return ({**params, HEAD: nn.meta.unbox(boxed)},
          {**axes, HEAD: nn.get_partition_spec(boxed)})


def trainable_mask(config: GPT2DiscConfig, params: PyTree) -> PyTree:
  """Bools shaped like `params`: True where a leaf receives gradient.

  The head always trains; with `head_only` nothing else does; otherwise
  every GPT-2 param but those of the `frozen_layers` blocks (the paper's
  "last N frozen layers" is `range(num_layers - N, num_layers)`), and of
  those, with LoRA on the GPT-2 (`config.lm.lora`), only what
  `lora.trainable_mask` trains.
  """
  def trains(name: str) -> bool:
    if name == HEAD:
      return True
    match = _LAYER.fullmatch(name)
    return not config.head_only and not (match and int(match[1]) in config.frozen_layers)

  mask = {k: jax.tree.map(lambda _, t=trains(k): t, v) for k, v in params.items()}
  if config.lm.lora is None:
    return mask
  adapted = lora.trainable_mask(config.lm.lora, params)
  return {k: v if k == HEAD else jax.tree.map(lambda a, b: a and b, v, adapted[k])
          for k, v in mask.items()}


# ----------------------------------------------------------------------------
# The two losses.
# ----------------------------------------------------------------------------

# 'tokens' [L] int, 'loss_weights' [L], 'attention_mask' [L] (1 = real
# token), as `dpjax.data.arrays.decoder_only_features` makes them.


def prefixes(config: GPT2DiscConfig, text_lengths: Array, length: int
             ) -> tuple[Array, Array]:
  """`(ends, weights)`, both `[b, K]` with `K = ceil((length - text_start) /
  prefix_step)`: the last position of each text prefix and its loss weight.

  A text of n tokens has prefixes of `min(k * prefix_step, n)` tokens for
  k = 1..ceil(n / prefix_step), weighted k / sum(1..that); the other slots
  have weight 0 (all weights are 0 when n = 0).
  """
  step = config.prefix_step
  k = jnp.arange(1, max(math.ceil((length - config.text_start) / step), 1) + 1)
  n = jnp.clip(text_lengths, 0, length - config.text_start)[:, None]
  ends = config.text_start + jnp.minimum(k * step, n) - 1
  used = (k - 1) * step < n
  weights = jnp.where(used, k, 0).astype(jnp.float32)
  return ends, weights / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)


def prefix_means(hidden: Array, ends: Array) -> Array:
  """`[b, K, d]` means of `hidden [b, L, d]` over positions `0..ends[b, k]`."""
  sums = jnp.take_along_axis(jnp.cumsum(hidden.astype(jnp.float32), axis=1),
                             ends[..., None], axis=1)
  return sums / (ends + 1)[..., None].astype(jnp.float32)


def class_targets(config: GPT2DiscConfig, tokens: Array) -> Array:
  """`[b, C]` one-hot of the class whose token is in the label slot (all
  zeros when the slot holds no label token: such a row has no disc loss)."""
  slot = tokens[:, config.label_position, None]
  return (slot == jnp.asarray(config.label_token_ids)).astype(jnp.float32)


def replace_label_slot(config: GPT2DiscConfig, tokens: Array, slot_keys: Array) -> Array:
  """`tokens [b, L]` with the label slot of row i set to a token drawn
  uniformly from the vocabulary with `slot_keys[i]`."""
  random = jax.vmap(lambda key: jax.random.randint(key, (), 0, config.lm.vocab_size))
  return tokens.at[:, config.label_position].set(random(slot_keys).astype(tokens.dtype))


def _lm_loss(model: gpt2.GPT2, params, batch, rngs) -> Array:
  tokens = batch["tokens"]
  logits = model.apply({"params": lm_params(params)}, tokens,
                       attention_mask=batch["attention_mask"], enable_dropout=bool(rngs),
                       rngs=rngs or {})
  return losses.next_token_loss(logits, tokens, batch["loss_weights"])


def _disc_loss(config: GPT2DiscConfig, params, batch, slot_keys, rngs) -> Array:
  tokens, mask = batch["tokens"], batch["attention_mask"]
  hidden = gpt2.GPT2(config.lm).apply(
      {"params": lm_params(params)}, replace_label_slot(config, tokens, slot_keys),
      attention_mask=mask, return_hidden=True, enable_dropout=bool(rngs), rngs=rngs or {})
  ends, weights = prefixes(config, mask.sum(-1) - config.text_start, tokens.shape[1])
  log_probs = jax.nn.log_softmax(head_logits(config, params, prefix_means(hidden, ends)))
  xent = -jnp.sum(log_probs * class_targets(config, tokens)[:, None, :], axis=-1)
  return jnp.sum(weights * xent, axis=-1)


def make_example_losses(config: GPT2DiscConfig
                        ) -> Callable[[PyTree, Mapping[str, Array]], dict[str, Array]]:
  """`fn(params, example) -> {"lm": scalar, "disc": scalar}` for ONE example
  (no batch dim), for per-example clipping of each loss's gradient.

  The example must carry a PRNG key `dropout_rng` (the label-slot token;
  dropout too when `lm.dropout_rate > 0`, with independent keys per loss).
  """
  model = gpt2.GPT2(config.lm)
  dropout = config.lm.dropout_rate > 0

  def example_losses(params, example):
    if "dropout_rng" not in example:
      raise KeyError("the discriminator loss needs a per-example key 'dropout_rng' to "
                     "draw the label-slot token (dpjax.training.step.dropout_keys)")
    slot_key, lm_key, disc_key = jax.random.split(example["dropout_rng"], 3)
    batch = {k: v[None] for k, v in example.items() if k != "dropout_rng"}
    rngs = lambda key: {"dropout": key} if dropout else None
    return {"lm": _lm_loss(model, params, batch, rngs(lm_key))[0],
            "disc": _disc_loss(config, params, batch, slot_key[None], rngs(disc_key))[0]}

  return example_losses


def make_batch_losses(config: GPT2DiscConfig
                      ) -> Callable[[PyTree, Mapping[str, Array], Array], dict[str, Array]]:
  """`fn(params, batch, rng) -> {"lm": [b], "disc": [b]}`, dropout off (eval);
  row i's label-slot token is drawn with `jax.random.split(rng, b)[i]`."""
  model = gpt2.GPT2(config.lm)

  def batch_losses(params, batch, rng):
    keys = jax.random.split(rng, batch["tokens"].shape[0])
    return {"lm": _lm_loss(model, params, batch, None),
            "disc": _disc_loss(config, params, batch, keys, None)}

  return batch_losses


def make_predict(config: GPT2DiscConfig) -> Callable[[PyTree, Mapping[str, Array], Array], Array]:
  """`fn(params, batch, rng) -> [b, C]` class probabilities of each whole row
  (the mean hidden state over its real tokens), the label slot replaced as
  in training (keys `jax.random.split(rng, b)`), dropout off: the
  discriminator as a classifier of generated text."""
  model = gpt2.GPT2(config.lm)

  def predict(params, batch, rng):
    tokens, mask = batch["tokens"], batch["attention_mask"]
    keys = jax.random.split(rng, tokens.shape[0])
    hidden = model.apply({"params": lm_params(params)}, replace_label_slot(config, tokens, keys),
                         attention_mask=mask, return_hidden=True)
    ends = jnp.maximum(mask.sum(-1) - 1, 0)[:, None]
    return jax.nn.softmax(head_logits(config, params, prefix_means(hidden, ends))[:, 0])

  return predict


def check_label_slots(config: GPT2DiscConfig, tokens: np.ndarray) -> None:
  """Raises ValueError naming the first rows whose label slot holds no label
  token (host-side check of the training arrays; in-graph such rows only
  get a zero disc loss)."""
  slot = np.asarray(tokens)[:, config.label_position]
  bad = np.flatnonzero(~np.isin(slot, config.label_token_ids))
  if bad.size:
    raise ValueError(f"{bad.size} rows have no label token at position "
                     f"{config.label_position} (rows {bad[:5].tolist()}: tokens "
                     f"{slot[bad[:5]].tolist()}; label tokens {config.label_token_ids})")
