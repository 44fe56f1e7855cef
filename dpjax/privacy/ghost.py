"""Ghost-norm clipping: clipped gradient sums without per-example gradients of
the large weight matrices.

`clipping.clipped_grad` differentiates every example separately (`vmap` of
`grad`), which materialises an `[n, rows, cols]` gradient per weight matrix.
Here every call where a large parameter meets the activations (a *site*:
`Dense.__call__`, the embedding lookup `Embed.__call__` and the tied output
projection `Embed.attend` of `dpjax.privacy.layers`, whose docstring states
what each computes; the dpjax models build their large matrices from them)
is intercepted with `flax.linen.intercept_methods`; no model code changes.
One vmapped forward and backward pass sees, per example, each site's input
and the gradient of the loss w.r.t. its output (a zero added to the output
and differentiated, or a tap, below). A parameter's gradient through a site
is `A^T B`, `A: [T, rows]`, `B: [T, cols]`:

    dense   x @ kernel         A = x                  B = d loss / d output
    lookup  embedding[ids]     A = onehot(ids)        B = d loss / d output
    attend  x @ embedding.T    A = d loss / d output  B = x

and over a parameter's sites k (a tied embedding has several):

    ||sum_k A_k^T B_k||^2 = sum_{k,l} sum_{t,s} (A_k[t].A_l[s]) (B_k[t].B_l[s])

the ghost-norm identity: `[T, T]` Gram matrices instead of `[rows, cols]`;
for one-hot rows `A.A` is an id comparison and `onehot . A` picks columns
(as a product with the one-hot rows: a TPU gathers them by copying). Where
that costs more, a site's `A^T B` is formed per example instead (the direct
path). Parameters used anywhere else (norm scales, biases, relative position
tables) are small and get per-example gradients by `vmap(grad)`, the large
ones being constants there. Given the clip weights `w_i`, the clipped sum
is formed one of two ways (`summation`):

* book-keeping: `sum_i w_i A_i^T B_i` over a parameter's sites, one einsum
  (a `segment_sum` for lookups) over batch and positions from the recorded
  factors; no second backward pass, but every site's factors are kept for
  the whole batch;
* second pass: the norms come from *taps* (an identity on a site's output
  whose backward pass returns that example's `||A^T B||^2` as the cotangent
  of a per-example zero, so nothing is recorded), and the sum from one more
  backward pass of `sum_i w_i L_i` through the model as it is. One more
  backward pass, no stored factors: the default through rematerialised
  layers (`jax.checkpoint`, e.g. `T5Config.remat = 'layer'`), whose
  activations exist only while their backward pass runs. Book-keeping
  works there too (a tap returns the factors themselves, as the cotangent
  of a zero shaped like them), at the cost of keeping every site's factors,
  which is more than remat keeps and less than no remat (no attention
  weights).

Scanned layers (`jax.lax.scan` over a stack of identical layers, e.g.
`T5Config.scan_layers`) hold each large parameter once, stacked `[layers,
rows, cols]`, and the loop body sees one layer's slice, where a site's factors
cannot be kept: the body's values live for one iteration. So a zero stacked
like the factors, `[layers, T, rows]` and `[layers, T, cols]`, is placed
beside the parameter in the params tree (a flax scan loops over it as over the
parameter, `_with_sinks`), and the site returns its factors as that slice's
cotangent: the loop's backward pass stacks them per layer, and book-keeping
proceeds from them (from each layer's own, where the loop is unrolled into
straight-line code: `Site.unrolled`). A site whose module does not see the
stacked zero (a loss that rebuilds the params tree; a lookup, whose int ids
have no cotangent) can only be tapped, as is every scanned site when the
second pass sums, with the tap's per-example zero closed over by the loop: a
loop's backward pass sums the cotangents of what its body closes over, so the
tap returns `sum_l ||A_l^T B_l||^2`, which is the stacked parameter's squared
norm (the layers' gradients are disjoint blocks of it); the sum then comes
from the second pass.

A parameter with several sites (a tied embedding) needs the cross terms of
the identity, so its factors are always recorded, which the second pass
does not do inside remat or a loop: such a parameter must be used outside
`jax.checkpoint` and loops (the dpjax models' embeddings are); inside, it
is refused.

Formal guarantees
-----------------
Those of `clipping.clipped_grad`, for the same call contract: for ANY
`params`, `batch` and `mask`,

* every example with `mask[i] <= 0` contributes exactly zero to the sum;
* every example with `mask[i] > 0` contributes `w_i g_i` with
  `w_i = min(mask[i], 1) min(1, C / ||g_i||)`, of L2 norm `<= C`, or zero
  if its loss or squared norm is non-finite; `g_i` is its gradient, whose
  large blocks are `sum_k A_k^T B_k`. Book-keeping bf16 factors, `w_i` is
  rounded down to bf16's 8 significant bits (at most 2^-7 below, never
  above; 1 stays 1), which makes its products exact in two bf16 parts.
  Up to float rounding: the identity's is relative to its (possibly
  cancelling) terms rather than to the norm (a sum rounded below zero is
  taken as zero); book-keeping forms the sum from the very factors the
  norm is computed from, with exact products accumulated in float32
  (under bf16 compute, both of the factors' bf16 values, whatever a
  compiler fused: `ghost_algebra.pinned`); the second pass forms it in the
  model's backward pass, in its compute dtype (bfloat16 under mixed
  precision, as any mixed-precision backward pass rounds its weight
  gradients);
* factors and gradients of dropped examples are selected away with
  `jnp.where`, so NaN/inf cannot leak through `0 * NaN`; in the second pass
  a dropped example is replaced by a kept one at weight 0;
* `example_loss` sees one example at a time (it is `vmap`ped).

So `f.sensitivity == C` bounds the L2 change of the sum when one example is
added or removed (`2 * C` for replacing one). `ClipStats` are not private.

Cost
----
Per example and site, ghost: `T^2 (rows + cols)` flops (`T^2 (1 + cols)`
for a lookup) and two `[T, T]` Grams per pair of a parameter's sites;
direct: `T rows cols` flops and a `[rows, cols]` array. `norm='auto'` takes
the direct path where `rows cols <= 2 T^2`, which then costs no more memory
(nor flops), and the ghost path elsewhere (long sequences against small
matrices go direct; embeddings and wide layers stay ghost). The
book-keeping keeps every site's input and output gradient for the whole
batch: the activations backprop keeps anyway plus, for the tied
projection, the `[T, vocab]` logits gradient, rounded to the compute
dtype (`Site.dtype`; the logits themselves are float32) and shared with
the model's backward pass. The second pass keeps what the model's own
backward pass keeps (with remat, a layer's input), and costs one forward
and backward pass more.
Norms and book-kept sums take exact products accumulated in float32,
whatever the compute dtype: the clip bound rests on them. Under bf16
compute a Gram is one bf16 pass of the bf16 factors; the book-kept sum
multiplies a factor weighted by the rounded-down weight, 16 significant
bits, as two bf16 parts: the X3 algorithm on a TPU, written-out parts on a
GPU (`ghost_algebra.book_keeping`). Two bf16 products, then, in place of
the backward pass's one weight-gradient product (float32 at HIGHEST took
three).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
from jax._src.interpreters import partial_eval  # dce_jaxpr; jax is pinned
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core
from jax.extend.core import primitives
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import clipping, ghost_algebra as algebra, layers

PyTree = Any

# The intercepted methods: (module class, method) -> kind of site. Each
# computes exactly what `layers` says it does, which the norms rely on.
_KINDS = {
    (layers.Dense, "__call__"): "dense",
    (layers.Embed, "__call__"): "lookup",
    (layers.Embed, "attend"): "attend",
}
_PARAM_NAMES = {"dense": "kernel", "lookup": "embedding", "attend": "embedding"}
_NORMS = ("auto", "ghost", "direct")
SUMMATIONS = ("auto", "book_keeping", "second_pass")
# Calls whose body sees its operands unchanged, so a parameter passed in is
# still that parameter inside (a custom_vjp redefines the gradient: sites
# under one stay ordinary calls). A scan's body sees a slice of what it
# loops over (`_marked_leaves`).
_TRANSPARENT = (primitives.remat_p, primitives.jit_p, primitives.closed_call_p,
                primitives.call_p)
_MARK = "dpjax.ghost.site."
# The params-tree key, beside a scanned site's parameter, of the zero whose
# cotangent carries its factors out of the loop.
_SINK = "dpjax_ghost_factors"


@dataclasses.dataclass(frozen=True)
class Site:
  """One call where a large parameter `[rows, cols]` meets the activations."""

  key: tuple[tuple[str, ...], str, int]  # (module path, method, call index)
  kind: str  # 'dense' | 'lookup' | 'attend'
  param: str  # the parameter's key path (`jax.tree_util.keystr`)
  leaf: int  # its index in `jax.tree.leaves(params)`
  shape: tuple[int, int]  # (rows, cols) of the parameter (of one layer's slice)
  length: int  # T: positions one example sends through the call
  output: jax.ShapeDtypeStruct  # the call's output for one example
  norm: str  # 'ghost' (Gram identity) or 'direct' (A^T B, then its norm)
  remat: bool  # inside a jax.checkpoint: its factors only through a tap
  scanned: bool = False  # a slice of a leaf a scan loops over
  # Scanned, by a loop unrolled into straight-line code (`unroll` covering
  # its length: a cost program's `T5Config.scan_unrolled`). XLA then
  # stacks the layers' factors by copying them into one buffer, where the
  # loop writes each layer's in place: they are taken apart per layer
  # (`_per_layer`), which XLA forwards from each layer's own instead.
  unrolled: bool = False
  # The module's compute dtype: an `attend`'s output gradient (its float32
  # logits' gradient, `[T, vocab]`) is kept as a factor in it.
  dtype: Any = jnp.float32
  input: jax.ShapeDtypeStruct | None = None  # the call's input, one example
  # Scanned, and its module sees one layer's slice of a zero placed beside
  # its parameter (`_with_sinks`): its factors leave the loop as that
  # zero's cotangent.
  sink: bool = False

  @property
  def recordable(self) -> bool:
    """Whether the factors can leave the model: outside a loop always
    (inside remat as a tap's cotangent), out of a loop's body only through
    its sink."""
    return self.sink or not self.scanned

  def factor_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes and dtypes of one example's factors."""
    return jax.eval_shape(lambda x, g: algebra.factors(self, x, g),
                          self.input, self.output)

  def factor_zeros(self, layers: int | None = None) -> algebra.Factors:
    """Zeros shaped like the factors, stacked `layers` deep if given (to
    be traced: a constant of the program, not an allocation)."""
    stack = () if layers is None else (layers,)
    return tuple(jnp.zeros((*stack, *f.shape), f.dtype)
                 for f in self.factor_shapes())


def find_sites(example_loss: clipping.LossFn, params: PyTree, example: PyTree,
               *, norm: str = "auto") -> tuple[Site, ...]:
  """The sites of `example_loss`, in call order, each with its norm path.

  A call of an intercepted method is a site when its parameter is a leaf of
  `params`, passed to it unchanged (through `jax.checkpoint` and `jax.jit`
  too), and used by the loss ONLY through such calls (both checked on the
  traced program, the latter with the sites' outputs cut off); otherwise it
  is left alone and the parameter is small. A scanned site gets `sink`
  where its module sees the zero placed for its factors.
  Traces `example_loss` twice (three times with scanned sites), runs
  nothing; so `example_loss` must not be `jax.jit`-wrapped itself (a
  cached trace would hide its flax calls).

  Args:
    example_loss: As in `clipping.clipped_grad`.
    params: Arrays or `jax.ShapeDtypeStruct`s.
    example: ONE example (no batch dim), arrays or `jax.ShapeDtypeStruct`s.
    norm: 'ghost' or 'direct' forces every site's norm path; 'auto' picks
      per site (see "Cost" in the module docstring).

  Returns:
    The sites; empty if the loss makes no intercepted call.

  Raises:
    ValueError: if a parameter with several sites has one inside a
      `jax.checkpoint` or a scan (see the module docstring).
  """
  if norm not in _NORMS:
    raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}.")
  params, example = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), (params, example))
  calls = []  # (key, kind, input, output, compute dtype), in call order

  def mark(key, kind, module, call, x):
    out = call()
    # Names the parameter's value in the program, to find which leaf it is.
    checkpoint_name(module.get_variable("params", _PARAM_NAMES[kind]),
                    f"{_MARK}{len(calls)}")
    calls.append((key, kind, jax.ShapeDtypeStruct(x.shape, x.dtype),
                  jax.ShapeDtypeStruct(out.shape, out.dtype), module.dtype))
    return out

  jaxpr = jax.make_jaxpr(
      lambda p, e: _run(example_loss, p, e, mark))(params, example).jaxpr
  if not calls:
    return ()
  leaves_with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  leaf_vars = jaxpr.invars[:len(leaves_with_path)]
  origins = _marked_leaves(jaxpr, {v: i for i, v in enumerate(leaf_vars)})
  candidates = {calls[i][0] for i, origin in origins.items()
                if origin.leaf is not None}

  outputs = {key: out for key, _, _, out, _ in calls}

  def cut(key, kind, module, call, x):
    if key not in candidates:
      return call()
    return jnp.zeros(outputs[key].shape, outputs[key].dtype)

  cut_jaxpr = jax.make_jaxpr(
      lambda p, e: _run(example_loss, p, e, cut))(params, example).jaxpr
  _, used = partial_eval.dce_jaxpr(cut_jaxpr, [True] * len(cut_jaxpr.outvars))

  sites = []
  for i, (key, kind, x, out, dtype) in enumerate(calls):
    leaf, remat, scanned, unrolled = origins.get(
        i, _Origin(None, False, False, False))
    if leaf is None or used[leaf]:
      continue
    path, value = leaves_with_path[leaf]
    shape = value.shape[1:] if scanned else value.shape
    if len(shape) != 2:
      raise ValueError(f"{kind} site {key} uses {jax.tree_util.keystr(path)} "
                       f"of shape {value.shape}; expected 2-D"
                       f"{' slices' if scanned else ''}.")
    length = math.prod(x.shape if kind == "lookup" else x.shape[:-1])
    sites.append(Site(
        key=key, kind=kind, param=jax.tree_util.keystr(path), leaf=leaf,
        shape=tuple(shape), length=length, output=out,
        norm=_cheaper(length, *shape) if norm == "auto" else norm,
        remat=remat, scanned=scanned, unrolled=unrolled,
        dtype=jnp.dtype(dtype), input=x))
  per_param = collections.Counter(s.leaf for s in sites)
  for s in sites:
    if (s.remat or s.scanned) and per_param[s.leaf] > 1:
      where = ("a rematerialised function (jax.checkpoint / nn.remat)"
               if s.remat else "a scan's loop body")
      raise ValueError(
          f"{s.param} has {per_param[s.leaf]} ghost sites, one of them "
          f"({s.key}) inside {where}: its norm needs the factors of every "
          "site, which such a call cannot record. Call the module once per "
          "checkpointed function or loop body, move it out, or use vmap "
          "clipping.")
  sunk = _sinks_reach(example_loss, params, example, [
      s for s in sites if s.scanned and s.kind != "lookup"])
  return tuple(dataclasses.replace(s, sink=s.key in sunk) for s in sites)


def _sinks_reach(example_loss, params, example, scanned: list[Site]
                 ) -> frozenset:
  """Keys of the `scanned` sites whose module sees one layer's slice of
  the zeros shaped like its stacked factors placed beside its parameter
  (`_with_sinks`): shape and dtype unchanged, as a flax scan over the
  params passes them, and a loss that rebuilds the params tree may not.
  Traces `example_loss` once; runs nothing."""
  if not scanned:
    return frozenset()
  leaves = jax.tree.leaves(params)
  layers = {s.leaf: leaves[s.leaf].shape[0] for s in scanned}
  want = {s.key: _shapes(s.factor_shapes()) for s in scanned}
  seen = set()

  def probe(key, kind, module, call, x):
    del kind, x
    if key in want and _shapes(
        module.get_variable("params", _SINK, None)) == want[key]:
      seen.add(key)
    return call()

  sinks = lambda: {s.leaf: s.factor_zeros(layers[s.leaf]) for s in scanned}
  try:
    jax.make_jaxpr(lambda p, e: _run(
        example_loss, _with_sinks(p, sinks()), e, probe))(params, example)
  except (KeyError, TypeError, ValueError):  # a loss that rejects the key
    return frozenset()
  return frozenset(seen)


def _shapes(tree) -> Any:
  """The tree's structure with each leaf's (shape, dtype)."""
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _with_sinks(params, sinks: dict[int, Any]) -> PyTree:
  """`params` with `sinks[leaf]` under the key `_SINK` in the dict that
  holds each such leaf, where the leaf's path is all dict keys (flax's
  layout; elsewhere none is placed). The rest of the tree is shared."""
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

  def insert(tree, path, value):
    if not path:
      return {**tree, _SINK: value}
    return {**tree, path[0]: insert(tree[path[0]], path[1:], value)}

  for leaf, sink in sinks.items():
    if all(isinstance(k, jax.tree_util.DictKey) for k in paths[leaf]):
      params = insert(params, [k.key for k in paths[leaf][:-1]], sink)
  return params


def ghost_clipped_grad(example_loss: clipping.LossFn, *, clip_norm: float,
                       microbatch_size: int | None = None,
                       norm: str = "auto",
                       summation: str = "auto") -> clipping.ClippedGradFn:
  """`clipping.clipped_grad`, computed with ghost norms.

  Same call contract, result (up to float rounding), `ClipStats` and formal
  guarantees as `clipping.clipped_grad` (see the module docstring), without
  per-example gradients of the parameters used only through sites.

  Args:
    example_loss: As in `clipping.clipped_grad`.
    clip_norm: The L2 bound `C > 0` on each example's gradient.
    microbatch_size: As in `clipping.clipped_grad`.
    norm: Per-site norm path, as in `find_sites`.
    summation: 'book_keeping' (one pass, factors kept), 'second_pass' (taps
      and a second backward pass, nothing kept), or 'auto': the second pass
      where a site is rematerialised or its factors cannot be recorded
      (`Site.recordable`: in a loop without its sink), book-keeping
      otherwise.

  Returns:
    A `ClippedGradFn` with `sensitivity == clip_norm`. Calling it on a loss
    with no sites raises `ValueError` (use `clipping.clipped_grad`), and so
    does 'book_keeping' on a loss with a site it cannot record.

  Example:
    >>> import jax.numpy as jnp
    >>> from dpjax.privacy import clipping, ghost_algebra as algebra, layers
    >>> layer = layers.Dense(2, ("embed", "mlp"), stddev=1.0, use_bias=True)
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
    >>> g2, _ = ghost_clipped_grad(loss, clip_norm=2.0,
    ...                            summation="second_pass")(params, xs, mask)
    >>> all(jnp.allclose(g2[k], v[k]) for k in params)
    True
  """
  clipping.check_bound("clip_norm", clip_norm)
  if norm not in _NORMS:
    raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}.")
  if summation not in SUMMATIONS:
    raise ValueError(
        f"summation must be one of {SUMMATIONS}, got {summation!r}.")
  bounds = np.asarray([clip_norm], np.float32)

  def clip_chunk(params, batch, mask):
    example = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[0], b), batch)
    sites = find_sites(example_loss, params, example, norm=norm)
    if not sites:
      raise ValueError("ghost clipping found no intercepted site in the loss "
                       "(no Dense/Embed of dpjax.privacy.layers fed by "
                       "a params leaf); use clipping.clipped_grad.")
    second_pass = uses_second_pass(summation, sites)
    leaves, treedef = jax.tree.flatten(params)
    large = sorted({s.leaf for s in sites})
    small = [None if i in large else p for i, p in enumerate(leaves)]
    tapped = _tapped(sites) if second_pass else frozenset()
    per_example = _per_example(example_loss, sites, leaves, treedef, tapped)
    losses, small_grads, large_sq, factors = clipping.vmap_examples(
        per_example, in_axes=(None, 0))(small, batch)
    untapped = [s for s in sites if s.key not in tapped]
    sq_norms = large_sq + sum(clipping.sum_squares(g)
                              for g in small_grads if g is not None) + sum(
        _stacked_sq_norms(s, f) for s, f in zip(untapped, factors)
        if s.scanned)
    scales, keep, stats = clipping.clip_scales(
        losses, sq_norms[:, None], mask, bounds)
    weights = scales[:, 0]
    if not second_pass and any(s.factor_shapes()[1].dtype == jnp.bfloat16
                               for s in sites):
      # Book-kept bf16 sums take the weights rounded down to bf16
      # (`ghost_algebra.book_keeping`); so do the small leaves, so that
      # each example adds one multiple of its gradient.
      weights = algebra.truncated(weights)

    summed = [None if g is None else clipping.weighted_sum(g, weights, keep)
              for g in small_grads]
    if second_pass:
      grads = _weighted_grad(example_loss, leaves, treedef, large, batch,
                             weights, keep)
      summed = [grads.get(i, g) for i, g in enumerate(summed)]
    else:
      for site, f in zip(sites, factors):
        keep_sum = lambda f, site=site: algebra.book_keeping(
            site, *f, weights, keep)
        term = (_per_layer(site, keep_sum, f, axis=1) if site.scanned
                else keep_sum(f))
        summed[site.leaf] = term if summed[site.leaf] is None else (
            summed[site.leaf] + term)
    return jax.tree.unflatten(treedef, summed), stats

  return clipping.ClippedGrad(
      fn=clipping.scan_chunks(clip_chunk, microbatch_size),
      sensitivity=float(clip_norm))


def uses_second_pass(summation: str, sites: tuple[Site, ...]) -> bool:
  """Whether `ghost_clipped_grad(summation=summation)` forms the sum of
  `sites` (`find_sites`') by a second backward pass; a ValueError where
  'book_keeping' cannot record a site's factors."""
  hidden = [s for s in sites if not s.recordable]
  if summation == "book_keeping" and hidden:
    raise ValueError(
        f"summation='book_keeping' cannot record the factors of "
        f"{len(hidden)} site(s) inside loops that do not carry them out "
        f"(e.g. {hidden[0].param}); use summation='second_pass' or 'auto'.")
  # Under remat, 'auto' keeps the memory remat saves rather than the factors.
  return summation == "second_pass" or (summation == "auto" and any(
      s.remat or not s.recordable for s in sites))


def _tapped(sites: tuple[Site, ...]) -> frozenset:
  """Keys of the sites whose parameter has no other site: their norm needs
  no cross term, so a tap gives it (a scanned site's, summed over the
  layers by the loop's backward pass)."""
  per_param = collections.Counter(s.leaf for s in sites)
  return frozenset(s.key for s in sites if per_param[s.leaf] == 1)


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


class _Origin(NamedTuple):
  """Where a marked parameter value of `find_sites` comes from."""
  leaf: int | None  # the leaf it is (a slice of, if scanned); None: computed
  remat: bool  # inside a `jax.checkpoint`
  scanned: bool  # a scan's slice of the leaf
  unrolled: bool  # that scan unrolled into straight-line code


def _marked_leaves(jaxpr, leaf_of: dict, remat: bool = False,
                   scanned: bool = False, unrolled: bool = False
                   ) -> dict[int, _Origin]:
  """Call index -> its `_Origin`, for the marks of `find_sites` in `jaxpr`,
  whose variables `leaf_of` maps to leaves (or, `scanned`, to the leaves
  they are slices of)."""
  found = {}
  for eqn in jaxpr.eqns:
    if (eqn.primitive is primitives.name_p
        and eqn.params["name"].startswith(_MARK)):
      found[int(eqn.params["name"][len(_MARK):])] = _Origin(
          _leaf(leaf_of, eqn.invars[0]), remat, scanned, unrolled)
    elif eqn.primitive in _TRANSPARENT:
      body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      body = getattr(body, "jaxpr", body)  # a ClosedJaxpr under jit
      inner = {v: _leaf(leaf_of, x) for v, x in zip(body.invars, eqn.invars)}
      found.update(_marked_leaves(
          body, inner, remat or eqn.primitive is primitives.remat_p, scanned,
          unrolled))
    elif eqn.primitive is primitives.scan_p and not scanned:
      # The body's invars: consts, carry, then one slice of each looped-over
      # operand. Only those slices are a leaf's layers; a leaf the body
      # closes over is used whole in every iteration (not a site).
      body = eqn.params["jaxpr"].jaxpr
      first = eqn.params["num_consts"] + eqn.params["num_carry"]
      inner = {v: _leaf(leaf_of, x) for v, x in zip(body.invars[first:],
                                                   eqn.invars[first:])}
      # jax lowers a scan whose `unroll` is 0 or covers its length with no
      # loop (`_scan_impl`).
      unroll = eqn.params["unroll"]
      found.update(_marked_leaves(
          body, inner, remat, scanned=True,
          unrolled=unroll == 0 or unroll >= eqn.params["length"] > 1))
  return found


def _leaf(leaf_of: dict, atom) -> int | None:
  return leaf_of.get(atom) if isinstance(atom, jax_core.Var) else None


def _cheaper(length: int, rows: int, cols: int) -> str:
  """'direct' if A^T B is no bigger than the identity's two [T, T] Grams.

  Then it also takes no more flops than the full Grams: `rows cols <= 2 T^2`
  implies `T rows cols <= T^2 (rows + cols)` (and `rows cols <= T^2 (1 +
  cols)` for a lookup). Memory decides, as it bounds the microbatch.
  """
  return "direct" if rows * cols <= 2 * length * length else "ghost"


def _per_example(example_loss, sites, leaves, treedef, tapped):
  """`(small, example) -> (loss, small grads, large squared norm, factors)`.

  Differentiates only w.r.t. the small leaves (`None` at large ones), zeros
  added to the outputs of the recorded sites, zeros shaped like the factors
  of the carried ones (inside remat or a loop: a tap returns its factors as
  their cotangent; a scanned site's are stacked per layer beside its
  parameter, `_with_sinks`) and the sinks of the `tapped` ones; the large
  leaves are constants. The factors are those of the untapped sites, in
  site order (a scanned site's as `_by_layer` gives them). The squared
  norm leaves out the untapped scanned sites' (`_stacked_sq_norms`).
  """
  untapped = [s for s in sites if s.key not in tapped]
  recorded = [s for s in untapped if not (s.remat or s.scanned)]
  carried = [s for s in untapped if s.remat or s.scanned]
  index = {s.key: i for i, s in enumerate(recorded)}
  taps = {s.key: (j, s) for j, s in enumerate(
      s for s in sites if s.key in tapped)}
  carry = {s.key: (j, s) for j, s in enumerate(carried)}

  def loss_and_inputs(small, deltas, sinks, carries, example):
    inputs = [None] * len(recorded)

    def perturb(key, kind, module, call, x):
      if key in taps:
        j, site = taps[key]
        return _tap(site, False, call(), x, sinks[j])
      if key in carry:
        j, site = carry[key]
        return _tap(site, True, call(), x, (
            module.get_variable("params", _SINK) if site.scanned
            else carries[j]))
      i = index.get(key)
      if i is None:
        return call()
      inputs[i] = x
      out = call() + deltas[i]
      site = recorded[i]
      return (out if out.dtype == site.dtype else
              _round_cotangent(site.dtype, out))

    full = [p if q is None else q for p, q in zip(leaves, small)]
    params = _with_sinks(jax.tree.unflatten(treedef, full), {
        s.leaf: z for s, z in zip(carried, carries) if s.scanned})
    loss = _run(example_loss, params, example, perturb)
    return loss, inputs

  grad_fn = jax.value_and_grad(loss_and_inputs, argnums=(0, 1, 2, 3),
                               has_aux=True)

  def per_example(small, example):
    zeros = [jnp.zeros(s.output.shape, s.output.dtype) for s in recorded]
    sinks = [jnp.zeros((), jnp.float32) for _ in taps]
    carries = [s.factor_zeros(leaves[s.leaf].shape[0] if s.scanned else None)
               for s in carried]
    (loss, inputs), (small_grads, out_grads, tapped_sq, carried_factors) = (
        grad_fn(small, zeros, sinks, carries, example))
    factors = [algebra.factors(s, x, g)
               for s, x, g in zip(recorded, inputs, out_grads)]
    carried_factors = [_by_layer(s, f) if s.scanned else f
                       for s, f in zip(carried, carried_factors)]
    by_key = dict(zip([s.key for s in recorded + carried],
                      factors + carried_factors))
    # A scanned site's norm is left to `_stacked_sq_norms`, after the pass.
    own = [(s, f) for s, f in zip(carried, carried_factors) if not s.scanned]
    return (loss, small_grads,
            algebra.large_sq_norm(recorded, factors) + sum(tapped_sq)
            + sum(algebra.large_sq_norm((s,), (f,)) for s, f in own),
            [by_key[s.key] for s in untapped])

  return per_example


def _stacked_sq_norms(site: Site, factors) -> jax.Array:
  """`[examples]`: each example's ||A^T B||^2 of a scanned site (its
  parameter's only one) summed over the layers, whose gradients are
  disjoint blocks of the stacked parameter; from the batch's factors,
  `[examples, layers, ...]` as `_by_layer` gives them.

  Batched over the layers outside the examples: the products' batch
  dimensions then come in the order the loop stacks the factors in,
  layers outermost, so a TPU reads them where they are. Batched inside
  the per-example pass (examples outermost), every Gram read a copy of
  its stacked factors transposed to examples-outermost.
  """
  norm = clipping.vmap_examples(
      lambda f: algebra.large_sq_norm((site,), (f,)), in_axes=0)
  return jnp.sum(_per_layer(site, norm, factors, axis=1), axis=0)


def _by_layer(site: Site, factors: algebra.Factors):
  """A scanned site's factors, stacked by the loop `[layers, ...]`, as
  `_per_layer` takes them: as they are, or, where the loop is unrolled
  (`Site.unrolled`), a tuple of each layer's: XLA forwards each such slice
  of the stack from that layer's factors themselves, where an op over the
  whole stack would read a copy of them all."""
  if not site.unrolled:
    return factors
  return tuple(tuple(jax.lax.index_in_dim(f, i, 0, keepdims=False)
                     for f in factors) for i in range(factors[0].shape[0]))


def _per_layer(site: Site, fn: Callable, factors, axis: int = 0) -> jax.Array:
  """`fn` of each layer's factors of a scanned site (`_by_layer`'s:
  stacked along `axis`, or a tuple per layer), stacked on a leading axis."""
  if site.unrolled:
    return jnp.stack([fn(f) for f in factors])
  return jax.vmap(fn, in_axes=axis)(factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _round_cotangent(dtype, out: jax.Array) -> jax.Array:
  """`out`, unchanged; its cotangent is rounded to `dtype` (and back).

  For an `attend`, whose logits are float32 in a model computing in
  bfloat16: the logits' gradient is then one `[T, vocab]` buffer in the
  compute dtype, from which the model's backward pass and the site's
  factor (`ghost_algebra.factors`) both read, rather than a float32 one
  read by both (a TPU's default-precision product rounds it to bfloat16
  anyway)."""
  del dtype
  return out


def _round_cotangent_fwd(dtype, out):
  del dtype
  return out, None


def _round_cotangent_bwd(dtype, _, g):
  return (g.astype(dtype).astype(g.dtype),)


_round_cotangent.defvjp(_round_cotangent_fwd, _round_cotangent_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tap(site: Site, record: bool, out: jax.Array, x: jax.Array, sink: PyTree
         ) -> jax.Array:
  """`out`, unchanged. Its backward pass passes the cotangent through and
  returns, as the cotangent of `sink` (a zero nothing reads), this call's
  factors (`record`) or `||A^T B||^2` from them: from its input `x` and
  that cotangent, where the cotangent exists, inside a rematerialised layer
  or a loop's body too."""
  del site, record, x, sink
  return out


def _tap_fwd(site, record, out, x, sink):
  del site, record, sink
  return out, x


def _tap_bwd(site, record, x, g):
  factors = algebra.factors(site, x, g)
  return g, None, (factors if record else
                   algebra.large_sq_norm((site,), (factors,)))


_tap.defvjp(_tap_fwd, _tap_bwd)


def _weighted_grad(example_loss, leaves, treedef, large, batch, weights,
                   keep) -> dict[int, jax.Array]:
  """Leaf index -> `sum_i weights[i] * dL_i / d leaf` for the `large` leaves:
  one backward pass of the weighted batch loss through the model as it is.

  A dropped example (padding, non-finite) is replaced by a kept one at
  weight 0, since `0 * NaN` would leak through a backward pass; with no kept
  example the sum is zero.
  """
  n = keep.shape[0]
  stand_in = jnp.where(keep, jnp.arange(n), jnp.argmax(keep))
  batch = jax.tree.map(lambda x: x[stand_in], batch)
  weights = jnp.where(keep, weights, 0.0)

  def weighted_loss(large_leaves):
    full = dict(enumerate(leaves)) | dict(zip(large, large_leaves))
    losses = clipping.vmap_examples(example_loss, in_axes=(None, 0))(
        jax.tree.unflatten(treedef, [full[i] for i in range(len(leaves))]),
        batch)
    return jnp.sum(weights * losses.astype(jnp.float32))

  grads = jax.grad(weighted_loss)([leaves[i] for i in large])
  return {i: jnp.where(jnp.any(keep), g.astype(jnp.float32), 0.0)
          for i, g in zip(large, grads)}
