"""The per-site algebra of ghost clipping (`dpjax.privacy.ghost`).

A site (a dense layer, an embedding lookup or its tied `attend`) of one
example has the gradient `A^T B`, with `A` its input (or one-hot ids) and
`B` its output gradient over the example's T positions. Its squared norm is
`sum((A A^T) * (B B^T))` without forming `A^T B` (the Gram identity), and
so are the cross terms of sites that share a parameter; the clipped sum
over a batch is book-kept from the same factors. A site here is anything
with `kind`, `shape` (rows, cols), `leaf` and `norm` ('ghost' | 'direct'),
as `ghost.Site`.

Every product accumulates in float32 and is exact but for that
accumulation, whatever the compute dtype: the clip bound rests on these
numbers. Under bf16 compute a product of two factors is one exact bf16
pass; `book_keeping` rounds the clip weights down to bf16, so a weighted
factor has 16 significant bits: two exact bf16 parts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Factors = tuple[jax.Array, jax.Array]
HIGHEST = jax.lax.Precision.HIGHEST
BF16_PASS = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
# A float32 operand as two bf16 parts (a bf16 operand's low part is zero):
# exact where that operand has at most 16 significant bits.
BF16_TWO_PARTS = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def factors(site, x: jax.Array, g: jax.Array) -> Factors:
  """(A [T, rows], B [T, cols]) of one example; int ids [T] as A of a lookup.

  Kept in the compute dtype (the batch's factors are what ghost clipping
  stores); every product of them accumulates in float32.
  """
  rows, cols = site.shape
  if site.kind == "dense":
    return x.reshape(-1, rows), g.reshape(-1, cols)
  if site.kind == "attend":
    # The logits are float32 (`Embed.attend`); their gradient and the input
    # are rounded to the compute dtype, as the model's backward pass rounds
    # the rest (and a TPU's default-precision product rounds them anyway):
    # the gradient is the largest factor kept, and bf16 factors make the
    # norm's and the sum's products bf16 passes. Both are of the rounded
    # factors.
    return (g.reshape(-1, rows).astype(site.dtype),
            x.reshape(-1, cols).astype(site.dtype))
  # Negative ids wrap, as in jnp.take; a row of an id still out of range
  # reaches no parameter row, so its B row is zeroed (and the id made safe).
  ids = x.reshape(-1)
  ids = jnp.where(ids < 0, ids + rows, ids)
  valid = (ids >= 0) & (ids < rows)
  return (jnp.where(valid, ids, 0),
          jnp.where(valid[:, None], g.reshape(-1, cols), 0))


def pinned(x: jax.Array) -> jax.Array:
  """`x`, a bf16 array, as exactly its bf16 values, whatever fused it.

  XLA (`xla_allow_excess_precision`, on by default) may drop a float32 ->
  bf16 -> float32 round trip, so a fused consumer of a bf16 factor can see
  the float32 value it was rounded from. The norm's products take bf16
  operands (`exact_precision`: the algorithm rounds them to nearest, ties
  to even); a book-kept sum takes a float32 weighted factor, so its
  operands are rounded here alike, by integer ops, which no compiler
  drops (NaN kept NaN), and so is any bf16 factor that meets float32
  arithmetic (`as_stored`, `exact_operands`). Fused into the sum's
  operands, it moves no bytes.
  """
  wide = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(wide, jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(
      0xFFFF0000)
  rounded = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jnp.where(jnp.isnan(wide), wide, rounded).astype(x.dtype)


def large_sq_norm(sites, factors) -> jax.Array:
  """Sum over large params of ||sum over their sites of A^T B||^2 (one example).

  Direct sites are summed into one `[rows, cols]` gradient G; its cross term
  with a ghost site is <G, A^T B> = sum_t A[t] G B[t]^T; ghost site pairs
  use the Gram identity.
  """
  total = jnp.zeros((), jnp.float32)
  for leaf in dict.fromkeys(s.leaf for s in sites):
    mine = [(s, f) for s, f in zip(sites, factors) if s.leaf == leaf]
    direct = [(s, f) for s, f in mine if s.norm == "direct"]
    ghost = [(s, f) for s, f in mine if s.norm == "ghost"]
    if direct:
      grad = sum(site_grad(s, f) for s, f in direct)
      total += jnp.sum(jnp.square(grad))
      for s, f in ghost:
        total += 2 * inner(grad, s, f)
    for i, (s, f) in enumerate(ghost):
      # Both of a site's own Grams are symmetric, but computing only the
      # blocks on and above their diagonals (3/4 of the flops) costs more
      # than it saves on an accelerator: for T5-Base's stacked factors
      # (12 layers x 8 examples x 384 positions), 3.2x the v5e's cycles
      # (the TPU copies the factors into a block-major layout) and 2x the
      # H100's bytes.
      total += ghost_inner(s, f, s, f)
      for r, h in ghost[i + 1:]:
        total += 2 * ghost_inner(s, f, r, h)
  # Cancelling cross terms can round below zero; NaN stays NaN.
  return jnp.maximum(total, 0.0)


def site_grad(site, factors: Factors) -> jax.Array:
  """A^T B, `[rows, cols]`."""
  a, b = factors
  if site.kind == "lookup":
    return jnp.zeros(site.shape, jnp.float32).at[a].add(
        as_stored(b).astype(jnp.float32))
  return dot(a.T, b)


def inner(grad: jax.Array, site, factors: Factors) -> jax.Array:
  """<grad, A^T B> without forming A^T B."""
  a, b = factors
  rows_of_grad = grad[a] if site.kind == "lookup" else dot(a, grad)
  return jnp.sum(rows_of_grad * as_stored(b).astype(jnp.float32))


def ghost_inner(s, f: Factors, r, h: Factors) -> jax.Array:
  """<A_s^T B_s, A_r^T B_r> = sum((A_s A_r^T) * (B_s B_r^T))."""
  (a1, b1), (a2, b2) = f, h
  if s.kind == "lookup" and r.kind == "lookup":
    gram_a = (a1[:, None] == a2[None, :]).astype(jnp.float32)
  elif s.kind == "lookup":
    gram_a = dot(onehot(a1, a2), a2.T)
  elif r.kind == "lookup":
    gram_a = dot(a1, onehot(a2, a1).T)
  else:
    gram_a = dot(a1, a2.T)
  return jnp.sum(gram_a * dot(b1, b2.T))


def onehot(ids: jax.Array, like: jax.Array) -> jax.Array:
  """onehot(ids) [T, rows] in `like`'s dtype: a product with it picks
  columns of `like` [T', rows] without a gather, which on a TPU would copy
  the `[T, vocab]` logits gradient into a layout it can gather from."""
  return (ids[:, None] == jnp.arange(like.shape[-1])).astype(like.dtype)


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b with float32 accumulation, exact products: the clip bound rests
  on these products."""
  a, b = exact_operands(a, b)
  return jnp.dot(a, b, precision=exact_precision(a, b),
                 preferred_element_type=jnp.float32)


def as_stored(x: jax.Array) -> jax.Array:
  """A factor as the values it holds: a bf16 one `pinned` (a fused float32
  consumer may otherwise see the float32 value it was rounded from, where
  the book-kept sum sees the bf16 one); any other unchanged."""
  return pinned(x) if x.dtype == jnp.bfloat16 else x


def exact_operands(a: jax.Array, b: jax.Array) -> Factors:
  """A product's operands as the values they hold: a bf16 operand beside a
  wider one is widened for a float32 product, so it is `as_stored`. Two
  bf16 operands need nothing: their algorithm (`exact_precision`) takes
  bf16 operands."""
  if a.dtype == b.dtype:
    return a, b
  return as_stored(a), as_stored(b)


def exact_precision(a: jax.Array, b: jax.Array):
  """A precision whose products of `a` and `b` are exact: one bf16 pass
  where both are bf16 (the algorithm takes bf16 operands: where a
  compiler fused in the float32 value a factor was rounded from, HIGHEST
  would take it and split it into up to six bf16 passes), full float32
  (not TF32 or bf16 passes) otherwise."""
  if a.dtype == b.dtype == jnp.bfloat16:
    return BF16_PASS
  return HIGHEST


def book_keeping(site, a: jax.Array, b: jax.Array, weights: jax.Array,
                  keep: jax.Array) -> jax.Array:
  """sum_i weights[i] A_i^T B_i over kept examples (a: [m, T, rows] or ids
  [m, T]; b: [m, T, cols]), with bf16 factors at the weights `truncated`
  to bf16 (never above them, so never above min(1, C / norm); at most 2^-7
  below; 1 stays 1)."""
  keep = keep[:, None, None]
  narrow = b.dtype == jnp.bfloat16
  if narrow:
    weights, b = truncated(weights), pinned(b)
  b = jnp.where(keep, b, 0).astype(jnp.float32) * weights[:, None, None]
  if site.kind == "lookup":
    return jax.ops.segment_sum(b.reshape(-1, b.shape[-1]), a.reshape(-1),
                               num_segments=site.shape[0])
  if not (narrow and a.dtype == jnp.bfloat16):
    return float32_sum(jnp.where(keep, a, 0), b)
  a = jnp.where(keep, pinned(a), 0)
  # b = w B is a product of two bf16 values: 16 significant bits, so two
  # bf16 parts hold it exactly. A TPU takes them as the X3 algorithm (two
  # bf16 passes, fused; HIGHEST would take three). An NVIDIA GPU would run
  # that algorithm's third product too, or a float32 operand on its CUDA
  # cores (1/15 of an H100's bf16 rate): the parts are written out there.
  return jax.lax.platform_dependent(a, b, cuda=bfloat16_parts_sum,
                                    tpu=two_part_sum, default=float32_sum)


def truncated(x: jax.Array) -> jax.Array:
  """float32 `x` cut toward zero to its leading 8 significant bits (kept
  float32), by a bit mask: a compiler that allows excess precision may
  drop a float32 -> bf16 -> float32 round trip; it cannot drop a mask."""
  return jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000),
      jnp.float32)


def float32_sum(a: jax.Array, b: jax.Array) -> jax.Array:
  """sum over m, t of a[m, t]^T b[m, t], float32 at HIGHEST precision."""
  a, b = exact_operands(a, b)
  return jnp.einsum("mta,mtb->ab", a, b, precision=HIGHEST,
                    preferred_element_type=jnp.float32)


def two_part_sum(a: jax.Array, b: jax.Array) -> jax.Array:
  """`float32_sum` of bf16 `a` and float32 `b` of at most 16 significant
  bits, by the X3 algorithm: exact, a bf16 product per part of b."""
  return jnp.einsum("mta,mtb->ab", a, b, precision=BF16_TWO_PARTS,
                    preferred_element_type=jnp.float32)


def bfloat16_parts_sum(a: jax.Array, b: jax.Array) -> jax.Array:
  """`two_part_sum` from written-out bf16 products: b split exactly into
  two bf16 parts (`bfloat16_parts`), A^T [hi | lo] one bf16 product with
  float32 accumulation (a bf16 x bf16 product is exact in float32), its two
  blocks summed."""
  cols = b.shape[-1]
  parts = float32_sum(a, bfloat16_parts(b))
  return parts.reshape(parts.shape[0], 2, cols).sum(axis=1)


def bfloat16_parts(x: jax.Array) -> jax.Array:
  """float32 `x [..., n]` of at most 16 significant bits (a product of two
  bf16 values) as bf16 `[..., 2n]`: [hi | lo] with hi + lo == x exactly
  (subnormals aside).

  hi is x's leading 8 significant bits (`truncated`), so lo = x - hi is
  exact in float32 and holds the other 8 bits. The conversions to bf16 are
  then exact too."""
  hi = truncated(x)
  return jnp.concatenate([hi.astype(jnp.bfloat16),
                          (x - hi).astype(jnp.bfloat16)], axis=-1)
