"""Dual encoder for dense retrieval: one T5 encoder shared by queries and
documents, trained with the in-batch softmax loss (Carranza et al., NAACL 2024,
arXiv 2305.05973, Eq. 1).

* embedding: the T5 encoder's final states, mean-pooled over the real
  (non-zero) tokens (`pooling="first"`: the first position), then L2
  normalised, so the dot product of two embeddings is their cosine;
* loss of a group of pairs `(q_i, d_i)`: `-log softmax_j(cos(q_i, d_j) / τ)[i]`
  over the documents of the same group, averaged over its queries. The paper
  gives no temperature (Eq. 1 has none, i.e. τ = 1); with cosines in
  [-1, 1] the logits would then span at most 2 nats and the softmax could
  never become confident, so τ is a config field (default 0.01).

Params are the T5 encoder's, under the names `t5.T5Transformer` gives them
(`token_embedder/embedding`, `encoder/...`), so a pretrained T5's encoder
subtree is this model's params as is (`params_from_t5`).

The trainer's unit (its "row", the thing sampled, clipped and counted as n) is
a GROUP of `group_size` pairs (`PairGroups`): the loss of a row is the
in-batch softmax within the group, whose other documents are its negatives.
Non-private training uses one group per batch (`group_size` = the batch),
which is exactly the in-batch softmax loss of the batch.

Formal guarantees
-----------------
The in-batch softmax loss is not a sum of per-example terms: pair j's
document is a negative in every other query's loss of its batch, so clipping
each ∇loss_i to C does NOT bound pair j's influence on the clipped sum (it
can change all B clipped terms; tests/privacy/test_dual_encoder_dp.py has a
batch where replacing one pair moves the naively clipped sum by ~(B-2)C).
Here the clipped unit is the group instead:

* Rows: `PairGroups.indices(n)` is a seeded permutation of the pair
  POSITIONS `0..n-1` cut into consecutive groups of `group_size` (the last
  one padded, `pair_mask` 0). It depends on n and the seed only, never on
  pair contents.
* A row's loss reads only the pairs of that row (padding masked out of both
  the queries and the negatives), so the trainer's per-row clipping bounds a
  row's contribution to the clipped sum by C, whatever the other rows hold.
* Protected unit: one (query, document) pair, under REPLACE-ONE adjacency
  (datasets of the same size n differing in the pair at one position; a
  pair's query, document or both may differ). Both datasets have the same
  rows except the one holding that position, so for every batch the clipped
  sum changes by at most 2C (both versions of that row clipped to C), and
  not at all for batches without that row.
* With `train.sampling_method = 'shuffle'` over rows (each row in at most one
  batch per epoch) an epoch is therefore one Gaussian mechanism of
  sensitivity 2C and noise σC, i.e. noise multiplier σ/2: exactly the
  trainer's own ledger event (`accounting.shuffle_epochs_event`, replace-one).
  The ledger's (ε, δ) is then the pair-level replace-one guarantee, provided
  δ is chosen per PAIR (δ = 1/(2 n_pairs), `tasks.msmarco
  .msmarco_dual_encoder_delta`), not per row.
* NOT covered: add/remove-one of a pair (it shifts the positions after it and
  so changes many groups), and Poisson sampling over rows, whose ledger
  (add/remove of a whole row) states a group-level guarantee only. The
  pair-level bound under Poisson sampling is the replace-one analysis of the
  Poisson-subsampled Gaussian (dp_accounting's PLD accountant with
  `NeighboringRelation.REPLACE_ONE`), which the trainer's ledger does not do.
* Trade-off of `group_size` g for a batch of B pairs: g - 1 negatives per
  query, against B/g independently clipped rows per batch (the clipped sum is
  at most (B/g)·C against the same noise σC).

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

from dpjax.models import common, t5

Array = jax.Array
PyTree = Any

POOLINGS = ("mean", "first")
# Logit of a padding document: far below any cosine / τ, finite so that a
# row without real pairs gives 0 and no NaN gradient.
_MASKED_LOGIT = -1e9
_GROUP_STREAM = 0x67727073  # "grps": the grouping's own random stream


@dataclasses.dataclass(frozen=True)
class DualEncoderConfig:
  """A shared T5 encoder, its pooling, the softmax temperature and the
  grouping of pairs into training rows. Frozen: a static jit argument."""
  encoder: t5.T5Config = t5.T5Config()
  pooling: str = "mean"  # "mean" | "first"
  temperature: float = 0.01
  group_size: int = 32  # pairs per training row (see `PairGroups`)
  group_seed: int = 0

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    if self.group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {self.group_size}")

  @property
  def dropout_rate(self) -> float:
    """The encoder's dropout rate."""
    return self.encoder.dropout_rate

  def to_json(self) -> dict:
    """A plain dict of the fields, the encoder as its own JSON."""
    return dict(dataclasses.asdict(self), encoder=self.encoder.to_json())

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "DualEncoderConfig":
    """Inverse of `to_json`. Unknown keys are an error; missing keys default."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"Unknown {cls.__name__} fields: {sorted(unknown)}")
    fields = dict(d)
    if "encoder" in fields:
      fields["encoder"] = t5.T5Config.from_json(fields["encoder"])
    return cls(**fields)


@dataclasses.dataclass(frozen=True)
class PairGroups:
  """The dual encoder's feature converter: pairs -> training rows of
  `group_size` pairs (`dpjax.data.arrays.load_task_arrays(converter=...)`)."""
  group_size: int
  seed: int

  def indices(self, num_pairs: int) -> np.ndarray:
    """`int64[ceil(n / g), g]` pair positions, -1 for padding.

    A permutation of `0..n-1` drawn from `np.random.default_rng([seed,
    _GROUP_STREAM])`, cut into consecutive groups; only the last group can be
    short. A function of (n, g, seed) alone.
    """
    if num_pairs < 1:
      raise ValueError(f"no pairs to group (num_pairs={num_pairs})")
    order = np.random.default_rng([self.seed, _GROUP_STREAM]).permutation(
        num_pairs)
    groups = -(-num_pairs // self.group_size)
    padded = np.full(groups * self.group_size, -1, np.int64)
    padded[:num_pairs] = order
    return padded.reshape(groups, self.group_size)

  def rows(self, queries: np.ndarray, documents: np.ndarray
           ) -> dict[str, np.ndarray]:
    """Per-pair tokens `[n, Lq]`, `[n, Ld]` -> the rows the trainer samples:
    int32 `query_tokens [G, g, Lq]`, `document_tokens [G, g, Ld]` (zeros at
    padding) and float32 `pair_mask [G, g]` (1 on real pairs)."""
    if len(queries) != len(documents):
      raise ValueError(f"{len(queries)} queries but {len(documents)} documents")
    idx = self.indices(len(queries))
    real = idx >= 0
    take = lambda x: np.where(real[..., None], x[np.maximum(idx, 0)], 0)
    return {"query_tokens": take(queries).astype(np.int32),
            "document_tokens": take(documents).astype(np.int32),
            "pair_mask": real.astype(np.float32)}


def _pool(encoded: Array, tokens: Array, pooling: str) -> Array:
  """`[b, L, d]` states -> `[b, d]` float32 (mean over tokens != 0, or first)."""
  encoded = encoded.astype(jnp.float32)
  if pooling == "first":
    return encoded[:, 0]
  real = (tokens > 0).astype(jnp.float32)[..., None]
  return (encoded * real).sum(1) / jnp.maximum(real.sum(1), 1.0)


def _l2_normalize(x: Array) -> Array:
  """x / ||x||; a zero vector (an all-padding input) stays zero, no NaN."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-24))


class DualEncoder(nn.Module):
  """The shared encoder; `embed` maps tokens to unit-norm embeddings."""
  config: DualEncoderConfig

  def setup(self):
    cfg = self.config.encoder
    self.token_embedder = t5.shared_embedding(cfg)
    self.encoder = t5.Encoder(cfg, self.token_embedder)

  def embed(self, tokens: Array, *, enable_dropout: bool = False) -> Array:
    """`[..., L]` int tokens (0 = padding) -> `[..., d_model]` float32."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    encoded = self.encoder(flat, deterministic=not enable_dropout)
    pooled = _l2_normalize(_pool(encoded, flat, self.config.pooling))
    return pooled.reshape(*tokens.shape[:-1], -1)

  def __call__(self, query_tokens: Array, document_tokens: Array, *,
               enable_dropout: bool = False) -> tuple[Array, Array]:
    # One apply for both, so dropout draws different masks for each.
    return (self.embed(query_tokens, enable_dropout=enable_dropout),
            self.embed(document_tokens, enable_dropout=enable_dropout))


@functools.partial(jax.jit, static_argnums=0)
def encode(config: DualEncoderConfig, params: PyTree, tokens: Array) -> Array:
  """`int32[n, L]` tokens -> `float32[n, d_model]` L2-normalised embeddings
  (dropout off; pad id 0 is left out of the mean pooling)."""
  return DualEncoder(config).apply({"params": params}, tokens,
                                   method=DualEncoder.embed)


def in_batch_softmax_loss(queries: Array, documents: Array, pair_mask: Array,
                          temperature: float) -> Array:
  """`[..., g]` per-query losses of Eq. 1 within each group; 0 at padding.

  `queries`, `documents`: `[..., g, d]` unit vectors (pair i is `(q_i,
  d_i)`); `pair_mask`: `[..., g]`, > 0 on real pairs. Padding documents are
  no negatives and padding queries have no loss.
  """
  real = pair_mask > 0
  logits = jnp.einsum("...id,...jd->...ij", queries, documents) / temperature
  logits = jnp.where(real[..., None, :], logits, _MASKED_LOGIT)
  positive = jnp.diagonal(logits, axis1=-2, axis2=-1)
  return jnp.where(real, jax.nn.logsumexp(logits, axis=-1) - positive, 0.0)


# ----------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------


def _boxed_init(config: DualEncoderConfig, rng: Array):
  tokens = jnp.ones((1, 1, 1), jnp.int32)  # shapes do not depend on lengths
  return DualEncoder(config).init({"params": rng}, tokens, tokens)["params"]


_jitted_boxed_init = jax.jit(_boxed_init, static_argnums=0)


def init_params(config: DualEncoderConfig, rng: Array) -> tuple[PyTree, PyTree]:
  """Randomly initialized float32 params and their logical axes (as
  `t5.init_params`: `token_embedder` and `encoder` subtrees of a T5)."""
  boxed = _jitted_boxed_init(config, rng)
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config: DualEncoderConfig) -> tuple[PyTree, PyTree]:
  """Like `init_params` but `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  boxed = jax.eval_shape(functools.partial(_boxed_init, config),
                         jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def params_from_t5(t5_params: PyTree) -> PyTree:
  """A T5's params (e.g. a pretrained checkpoint) -> the dual encoder's: its
  shared embedding and encoder; the decoder is dropped."""
  return {k: t5_params[k] for k in ("token_embedder", "encoder")}


# ----------------------------------------------------------------------------
# Losses for the trainer: a row is a group, batches are [b, g, ...].
# ----------------------------------------------------------------------------


def _group_losses(model: DualEncoder, params, batch, rngs=None) -> Array:
  """`[b]` in-batch softmax loss of each group, averaged over its real pairs."""
  q, d = model.apply({"params": params}, batch["query_tokens"],
                     batch["document_tokens"], enable_dropout=bool(rngs),
                     rngs=rngs or {})
  mask = batch["pair_mask"]
  per_query = in_batch_softmax_loss(q, d, mask, model.config.temperature)
  return per_query.sum(-1) / jnp.maximum((mask > 0).sum(-1), 1)


def make_batch_loss(config: DualEncoderConfig
                    ) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """`fn(params, batch) -> [b]` per-group losses, dropout off (eval)."""
  model = DualEncoder(config)
  return lambda params, batch: _group_losses(model, params, batch)


def make_example_loss(config: DualEncoderConfig
                      ) -> Callable[[PyTree, Mapping[str, Array]], Array]:
  """The loss of ONE row (a group of pairs), for per-row clipping."""
  return common.one_example_loss(functools.partial(_group_losses,
                                                   DualEncoder(config)))
