"""Ghost-norm clipping: clipped gradient sums without per-example gradients of
the large weight matrices.

`clipping.clipped_grad` differentiates every example separately (`vmap` of
`grad`), which materialises an `[n, rows, cols]` gradient per weight matrix.
Here every call where a large parameter meets the activations (a *site*:
`Dense.__call__`, the embedding lookup `Embed.__call__` and the tied output
projection `Embed.attend` of `dpjax.models.t5` and `dpjax.models.gpt2`, so
BERT too) is intercepted with `flax.linen.intercept_methods`; no model code
changes. One vmapped forward and backward pass records, per example, each
site's input and the gradient of the loss w.r.t. its output (a zero added to
the output and differentiated). A parameter's gradient through a site is
`A^T B`, `A: [T, rows]`, `B: [T, cols]`:

    dense   x @ kernel         A = x                  B = d loss / d output
    lookup  embedding[ids]     A = onehot(ids)        B = d loss / d output
    attend  x @ embedding.T    A = d loss / d output  B = x

and over a parameter's sites k (a tied embedding has several):

    ||sum_k A_k^T B_k||^2 = sum_{k,l} sum_{t,s} (A_k[t].A_l[s]) (B_k[t].B_l[s])

the ghost-norm identity: `[T, T]` Gram matrices instead of `[rows, cols]`;
for one-hot rows `A.A` is an id comparison and `onehot . A` a gather. Where
that costs more, a site's `A^T B` is formed per example instead (the direct
path). Parameters used anywhere else (norm scales, biases, relative position
tables) are small and get per-example gradients by `vmap(grad)`, the large
ones being constants there. Given the clip weights `w_i`, the clipped sum of
a large parameter is `sum_i w_i A_i^T B_i` over its sites, one einsum (a
`segment_sum` for lookups) over batch and positions: no second backward pass
("book-keeping").

Formal guarantees
-----------------
Those of `clipping.clipped_grad`, for the same call contract: for ANY
`params`, `batch` and `mask`,

* every example with `mask[i] == 0` contributes exactly zero to the sum;
* every example with `mask[i] == 1` contributes `w_i g_i` with
  `w_i = min(1, C / ||g_i||)`, of L2 norm `<= C`, or zero if its loss or
  squared norm is non-finite; `g_i` is its gradient, whose large blocks are
  `sum_k A_k^T B_k` from the very factors the norm is computed from. Up to
  float32 rounding, which for the identity is relative to its (possibly
  cancelling) terms rather than to the norm; a sum rounded below zero is
  taken as zero;
* factors and gradients of dropped examples are selected away with
  `jnp.where`, so NaN/inf cannot leak through `0 * NaN`;
* `example_loss` sees one example at a time (it is `vmap`ped).

So `f.sensitivity == C` bounds the L2 change of the sum when one example is
added or removed (`2 * C` for replacing one). `ClipStats` are not private.

Cost
----
Per example and site, ghost: `T^2 (rows + cols)` flops (`T^2 (1 + cols)`
for a lookup) and two `[T, T]` Grams per pair of a parameter's sites;
direct: `T rows cols` flops and a `[rows, cols]` array. `norm='auto'` takes
the direct path where `rows cols <= 2 T^2`, which then costs no more flops
either, and the ghost path elsewhere (long sequences against small matrices
go direct; embeddings and wide layers stay ghost). The book-keeping keeps
every site's input and output gradient for the whole batch: the activations
backprop keeps anyway plus, for the tied projection, the `[T, vocab]` logits
gradient. Norms and sums run in float32 at HIGHEST matmul precision,
whatever the compute dtype: the clip bound rests on them.

Rematerialisation (`jax.checkpoint`, e.g. `T5Config.remat = 'layer'`) is
refused: the factors are recorded from outside the calls, and inside a
rematerialised layer the parameters are no longer the leaves of `params`,
so its weight matrices would silently fall back to per-example gradients.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.extend import core as jax_core
from jax.extend.core import primitives
import jax.numpy as jnp
import numpy as np

from dpjax.models import gpt2, t5
from dpjax.privacy import clipping

PyTree = Any
Factors = tuple[jax.Array, jax.Array]

# The intercepted methods: (module class, method) -> kind of site.
_KINDS = {
    (t5.Dense, "__call__"): "dense",
    (gpt2.Dense, "__call__"): "dense",
    (t5.Embed, "__call__"): "lookup",
    (gpt2.Embed, "__call__"): "lookup",
    (t5.Embed, "attend"): "attend",
    (gpt2.Embed, "attend"): "attend",
}
_PARAM_NAMES = {"dense": "kernel", "lookup": "embedding", "attend": "embedding"}
_NORMS = ("auto", "ghost", "direct")
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Site:
  """One call where a large parameter `[rows, cols]` meets the activations."""

  key: tuple[tuple[str, ...], str, int]  # (module path, method, call index)
  kind: str  # 'dense' | 'lookup' | 'attend'
  param: str  # the parameter's key path (`jax.tree_util.keystr`)
  leaf: int  # its index in `jax.tree.leaves(params)`
  shape: tuple[int, int]  # (rows, cols) of the parameter
  length: int  # T: positions one example sends through the call
  output: jax.ShapeDtypeStruct  # the call's output for one example
  norm: str  # 'ghost' (Gram identity) or 'direct' (A^T B, then its norm)


def find_sites(example_loss: clipping.LossFn, params: PyTree, example: PyTree,
               *, norm: str = "auto") -> tuple[Site, ...]:
  """The sites of `example_loss`, in call order, each with its norm path.

  A call of an intercepted method is a site when its parameter is a leaf of
  `params` used by the loss ONLY through such calls (checked on the traced
  program, with the sites' outputs cut off); otherwise it is left alone and
  the parameter is small. Traces `example_loss` twice, runs nothing; so
  `example_loss` must not be `jax.jit`-wrapped itself (a cached trace would
  hide its flax calls, and a jitted call reads every parameter).

  Args:
    example_loss: As in `clipping.clipped_grad`.
    params: Arrays or `jax.ShapeDtypeStruct`s.
    example: ONE example (no batch dim), arrays or `jax.ShapeDtypeStruct`s.
    norm: 'ghost' or 'direct' forces every site's norm path; 'auto' picks
      per site (see "Cost" in the module docstring).

  Returns:
    The sites; empty if the loss makes no intercepted call.

  Raises:
    ValueError: if the loss rematerialises (see the module docstring).
  """
  if norm not in _NORMS:
    raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}.")
  params, example = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), (params, example))
  calls = {}  # key -> (kind, leaf, input shape, output)

  def discover(params, example):
    leaves = jax.tree.leaves(params)

    def record(key, kind, module, call, x):
      out = call()
      value = module.get_variable("params", _PARAM_NAMES[kind])
      # Identity: a parameter transformed on its way in (cast, sliced) is no
      # leaf, so its calls stay ordinary.
      leaf = next((i for i, p in enumerate(leaves) if p is value), None)
      if leaf is not None:
        calls[key] = (kind, leaf, x.shape,
                      jax.ShapeDtypeStruct(out.shape, out.dtype))
      return out

    return _run(example_loss, params, example, record)

  jax.eval_shape(discover, params, example)
  if not calls:
    return ()

  def cut(key, kind, module, call, x):
    if key not in calls:
      return call()
    out = calls[key][-1]
    return jnp.zeros(out.shape, out.dtype)

  jaxpr = jax.make_jaxpr(
      lambda p, e: _run(example_loss, p, e, cut))(params, example).jaxpr
  if _rematerialises(jaxpr):
    raise ValueError(
        "ghost clipping cannot see inside rematerialised layers "
        "(jax.checkpoint / nn.remat, e.g. T5Config.remat or GPT2Config.remat "
        "= 'layer'): their weight matrices would get per-example gradients. "
        "Use remat = 'none' with ghost clipping, or vmap clipping with remat.")
  used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  used |= {id(v) for v in jaxpr.outvars}
  leaves_with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  only_in_sites = {i for i, v in enumerate(jaxpr.invars[:len(leaves_with_path)])
                   if id(v) not in used}

  sites = []
  for key, (kind, leaf, in_shape, out) in calls.items():
    if leaf not in only_in_sites:
      continue
    path, value = leaves_with_path[leaf]
    if len(value.shape) != 2:
      raise ValueError(f"{kind} site {key} uses {jax.tree_util.keystr(path)} "
                       f"of shape {value.shape}; expected 2-D.")
    length = math.prod(in_shape if kind == "lookup" else in_shape[:-1])
    sites.append(Site(
        key=key, kind=kind, param=jax.tree_util.keystr(path), leaf=leaf,
        shape=tuple(value.shape), length=length, output=out,
        norm=_cheaper(length, *value.shape) if norm == "auto" else norm))
  return tuple(sites)


def ghost_clipped_grad(example_loss: clipping.LossFn, *, clip_norm: float,
                       microbatch_size: int | None = None,
                       norm: str = "auto") -> clipping.ClippedGradFn:
  """`clipping.clipped_grad`, computed with ghost norms and book-keeping.

  Same call contract, result (up to float rounding), `ClipStats` and formal
  guarantees as `clipping.clipped_grad` (see the module docstring), without
  per-example gradients of the parameters used only through sites.

  Args:
    example_loss: As in `clipping.clipped_grad`.
    clip_norm: The L2 bound `C > 0` on each example's gradient.
    microbatch_size: As in `clipping.clipped_grad`.
    norm: Per-site norm path, as in `find_sites`.

  Returns:
    A `ClippedGradFn` with `sensitivity == clip_norm`. Calling it on a loss
    with no sites raises `ValueError` (use `clipping.clipped_grad`).

  Example:
    >>> import jax.numpy as jnp
    >>> from dpjax.models import gpt2
    >>> from dpjax.privacy import clipping
    >>> layer = gpt2.Dense(2, ("embed", "mlp"), stddev=1.0)
    >>> loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x))
    >>> params = {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}
    >>> xs = jnp.array([[3.0, 0.0], [0.1, 0.0], [jnp.nan, 1.0]])
    >>> mask = jnp.array([1.0, 1.0, 0.0])
    >>> f = ghost_clipped_grad(loss, clip_norm=2.0)
    >>> g, stats = f(params, xs, mask)
    >>> print(stats.norms, stats.num_clipped)  # sqrt(2 |x|^2 + 2)
    [4.472136 1.421267 0.      ] 1
    >>> [(s.param, s.kind) for s in find_sites(loss, params, xs[0])]
    [("['kernel']", 'dense')]
    >>> v, _ = clipping.clipped_grad(loss, clip_norm=2.0)(params, xs, mask)
    >>> all(jnp.allclose(g[k], v[k]) for k in params)
    True
  """
  clipping.check_bound("clip_norm", clip_norm)
  if norm not in _NORMS:
    raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}.")
  bounds = np.asarray([clip_norm], np.float32)

  def clip_chunk(params, batch, mask):
    example = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[0], b), batch)
    sites = find_sites(example_loss, params, example, norm=norm)
    if not sites:
      raise ValueError("ghost clipping found no intercepted site in the loss "
                       "(no Dense/Embed of dpjax.models.t5 or gpt2 fed by a "
                       "params leaf); use clipping.clipped_grad.")
    leaves, treedef = jax.tree.flatten(params)
    large = {s.leaf for s in sites}
    small = [None if i in large else p for i, p in enumerate(leaves)]
    per_example = _per_example(example_loss, sites, leaves, treedef)
    losses, small_grads, large_sq, factors = jax.vmap(
        per_example, in_axes=(None, 0))(small, batch)
    sq_norms = large_sq + sum(clipping.sum_squares(g)
                              for g in small_grads if g is not None)
    scales, keep, stats = clipping.clip_scales(
        losses, sq_norms[:, None], mask, bounds)
    weights = scales[:, 0]

    summed = [None if g is None else clipping.weighted_sum(g, weights, keep)
              for g in small_grads]
    for site, (a, b) in zip(sites, factors):
      term = _book_keeping(site, a, b, weights, keep)
      summed[site.leaf] = term if summed[site.leaf] is None else (
          summed[site.leaf] + term)
    return jax.tree.unflatten(treedef, summed), stats

  return clipping.ClippedGrad(
      fn=clipping.scan_chunks(clip_chunk, microbatch_size),
      sensitivity=float(clip_norm))


def _interceptor(on_site: Callable) -> Callable:
  """A flax method interceptor calling `on_site(key, kind, module, call, x)`
  at each call of an intercepted method (`call()` runs it; `x` its input)."""
  counts = collections.Counter()

  def intercept(next_fun, args, kwargs, context):
    kind = _KINDS.get((type(context.module), context.method_name))
    if kind is None or len(args) != 1 or kwargs:
      return next_fun(*args, **kwargs)
    where = (context.module.path, context.method_name)
    key = (*where, counts[where])  # a shared module is called more than once
    counts[where] += 1
    return on_site(key, kind, context.module, lambda: next_fun(*args), args[0])

  return intercept


def _run(example_loss, params, example, on_site):
  with nn.intercept_methods(_interceptor(on_site)):
    return example_loss(params, example)


def _rematerialises(jaxpr) -> bool:
  """Whether the program (or any program nested in it) has a jax.checkpoint."""
  return (any(e.primitive is primitives.remat_p for e in jaxpr.eqns)
          or any(map(_rematerialises, jax_core.subjaxprs(jaxpr))))


def _cheaper(length: int, rows: int, cols: int) -> str:
  """'direct' if A^T B is no bigger than the identity's two [T, T] Grams.

  Then it also takes no more flops: `rows cols <= 2 T^2` implies
  `T rows cols <= T^2 (rows + cols)` (and `rows cols <= T^2 (1 + cols)`
  for a lookup). Memory decides, as it bounds the microbatch.
  """
  return "direct" if rows * cols <= 2 * length * length else "ghost"


def _per_example(example_loss, sites, leaves, treedef):
  """`(small, example) -> (loss, small grads, large squared norm, factors)`.

  Differentiates only w.r.t. the small leaves (`None` at large ones) and
  zeros added to the site outputs; the large leaves are constants.
  """
  index = {s.key: i for i, s in enumerate(sites)}

  def loss_and_inputs(small, deltas, example):
    inputs = [None] * len(sites)

    def perturb(key, kind, module, call, x):
      i = index.get(key)
      if i is None:
        return call()
      inputs[i] = x
      return call() + deltas[i]

    full = [p if q is None else q for p, q in zip(leaves, small)]
    loss = _run(example_loss, jax.tree.unflatten(treedef, full), example,
                perturb)
    return loss, inputs

  grad_fn = jax.value_and_grad(loss_and_inputs, argnums=(0, 1), has_aux=True)

  def per_example(small, example):
    zeros = [jnp.zeros(s.output.shape, s.output.dtype) for s in sites]
    (loss, inputs), (small_grads, out_grads) = grad_fn(small, zeros, example)
    factors = [_factors(s, x, g) for s, x, g in zip(sites, inputs, out_grads)]
    return loss, small_grads, _large_sq_norm(sites, factors), factors

  return per_example


def _factors(site: Site, x: jax.Array, g: jax.Array) -> Factors:
  """(A [T, rows], B [T, cols]) of one example; int ids [T] as A of a lookup.

  Kept in the compute dtype (the batch's factors are what ghost clipping
  stores); every product of them accumulates in float32.
  """
  rows, cols = site.shape
  if site.kind == "dense":
    return x.reshape(-1, rows), g.reshape(-1, cols)
  if site.kind == "attend":
    return g.reshape(-1, rows), x.reshape(-1, cols)
  # Negative ids wrap, as in jnp.take; a row of an id still out of range
  # reaches no parameter row, so its B row is zeroed (and the id made safe).
  ids = x.reshape(-1)
  ids = jnp.where(ids < 0, ids + rows, ids)
  valid = (ids >= 0) & (ids < rows)
  return (jnp.where(valid, ids, 0),
          jnp.where(valid[:, None], g.reshape(-1, cols), 0))


def _large_sq_norm(sites, factors) -> jax.Array:
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
      grad = sum(_site_grad(s, f) for s, f in direct)
      total += jnp.sum(jnp.square(grad))
      for s, f in ghost:
        total += 2 * _inner(grad, s, f)
    for i, (s, f) in enumerate(ghost):
      for j, (r, h) in enumerate(ghost[i:]):
        total += (1 if j == 0 else 2) * _ghost_inner(s, f, r, h)
  # Cancelling cross terms can round below zero; NaN stays NaN.
  return jnp.maximum(total, 0.0)


def _site_grad(site: Site, factors: Factors) -> jax.Array:
  """A^T B, `[rows, cols]`."""
  a, b = factors
  if site.kind == "lookup":
    return jnp.zeros(site.shape, jnp.float32).at[a].add(
        b.astype(jnp.float32))
  return _dot(a.T, b)


def _inner(grad: jax.Array, site: Site, factors: Factors) -> jax.Array:
  """<grad, A^T B> without forming A^T B."""
  a, b = factors
  rows_of_grad = grad[a] if site.kind == "lookup" else _dot(a, grad)
  return jnp.sum(rows_of_grad * b.astype(jnp.float32))


def _ghost_inner(s: Site, f: Factors, r: Site, h: Factors) -> jax.Array:
  """<A_s^T B_s, A_r^T B_r> = sum((A_s A_r^T) * (B_s B_r^T))."""
  (a1, b1), (a2, b2) = f, h
  if s.kind == "lookup" and r.kind == "lookup":
    gram_a = (a1[:, None] == a2[None, :]).astype(jnp.float32)
  elif s.kind == "lookup":
    gram_a = a2[:, a1].T.astype(jnp.float32)  # onehot(a1) @ A_r^T
  elif r.kind == "lookup":
    gram_a = a1[:, a2].astype(jnp.float32)
  else:
    gram_a = _dot(a1, a2.T)
  return jnp.sum(gram_a * _dot(b1, b2.T))


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b with float32 accumulation at full precision (not TF32/bf16
  passes): the clip bound rests on these products."""
  return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _book_keeping(site: Site, a: jax.Array, b: jax.Array, weights: jax.Array,
                  keep: jax.Array) -> jax.Array:
  """sum_i weights[i] A_i^T B_i over kept examples (a: [m, T, rows] or ids
  [m, T]; b: [m, T, cols])."""
  keep = keep[:, None, None]
  # Weighted in float32: a bf16 weight could round above min(1, C/norm).
  b = jnp.where(keep, b, 0).astype(jnp.float32) * weights[:, None, None]
  if site.kind == "lookup":
    return jax.ops.segment_sum(b.reshape(-1, b.shape[-1]), a.reshape(-1),
                               num_segments=site.shape[0])
  a = jnp.where(keep, a, 0)
  return jnp.einsum("mta,mtb->ab", a, b, precision=_HIGHEST,
                    preferred_element_type=jnp.float32)
