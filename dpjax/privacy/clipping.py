"""Per-example gradient clipping: the sensitivity-bounding half of DP-SGD.

A clipped-gradient function maps `(params, batch, mask)` to the SUM over real
examples of per-example gradients, each clipped to a bounded L2 norm, and
carries that bound as its `sensitivity`. Noise is added elsewhere
(`dpjax.privacy.noise.privatizer`), once per logical batch, scaled by this
`sensitivity`; keeping the bound on the callable means the two cannot drift.
Here the per-example gradients come from `vmap`; `dpjax.privacy.ghost`
computes the same sum without them, and
`dpjax.privacy.clipping_method.make_clipped_grad` picks one.

Formal guarantees
-----------------
Let `f = clipped_grad(loss_fn, clip_norm=C)` and `S = f(params, batch, mask)[0]`.
For ANY `params`, `batch` and `mask` (including NaN/inf losses or gradients and
arbitrary content in padding rows):

* every example `i` with `mask[i] <= 0` contributes exactly zero to `S`;
* every example with `mask[i] > 0` contributes its clipped gradient times
  its weight `w_i = min(mask[i], 1)`, a vector of L2 norm `<= w_i C <= C`
  (up to float32 rounding), or zero if its loss or gradient is non-finite;
* `loss_fn` sees one example at a time (it is `vmap`ped), so an example's
  gradient does not depend on the other examples in the batch.

Hence adding or removing one real example (or flipping its mask) changes `S`
by at most `f.sensitivity == C` in L2 norm; replacing one example changes it by
at most `2 * C`. Masks are 0/1 for example-level DP; user-level sampling
(`sampling.UserPoissonSampler`) gives each of a user's `c` sampled examples
the weight `1/c`, so one user's whole contribution is at most `C`. For
`per_group_clipped_grad` the same holds with `C = sqrt(sum_g C_g**2)`, since
each group's block is clipped to `C_g`.
`multi_loss_clipped_grad` returns one such sum per named loss (each the
sensitivity of its own loss's bound), meant to be noised separately.

`ClipStats` are computed from individual examples WITHOUT noise: they are for
monitoring and debugging only, and releasing them is not covered by any DP
guarantee.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
KeyPath = tuple[Any, ...]


class ClipStats(NamedTuple):
  """Per-example diagnostics of one clipped-gradient call (NOT private)."""

  norms: jax.Array  # [n] global L2 grad norm before clipping; 0 if dropped.
  losses: jax.Array  # [n] per-example loss; 0 if dropped.
  num_clipped: jax.Array  # Real examples with some norm above its bound.
  num_nonfinite: jax.Array  # Real examples zeroed for NaN/inf loss or grad.
  num_examples: jax.Array  # sum(mask).


class ClippedGradFn(Protocol):
  """`(params, batch, mask) -> (clipped grad sum, ClipStats)`.

  `sensitivity` bounds the L2 change of the returned sum when one example is
  added or removed.
  """

  sensitivity: float

  def __call__(
      self, params: PyTree, batch: PyTree, mask: jax.Array
  ) -> tuple[PyTree, ClipStats]:
    ...


@dataclasses.dataclass(frozen=True)
class ClippedGrad:
  """A clipped-gradient callable bundled with its L2 sensitivity."""

  fn: Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, ClipStats]]
  sensitivity: float

  def __call__(self, params, batch, mask):
    return self.fn(params, batch, mask)


def clipped_grad(
    loss_fn: LossFn, *, clip_norm: float, microbatch_size: int | None = None
) -> ClippedGradFn:
  """Returns a function computing the sum of per-example clipped gradients.

  Each example's gradient (flattened over the whole parameter pytree) is
  scaled by `min(1, clip_norm / ||g||)`; the scaled gradients of real examples
  are summed in float32.

  Formal guarantees:
    The returned callable `f` has `f.sensitivity == clip_norm`: for any inputs,
    adding or removing one real example changes the returned sum by at most
    `clip_norm` in L2 norm (`2 * clip_norm` for replacing one). Padding rows
    (`mask == 0`) and examples with non-finite loss or gradient contribute
    exactly zero, whatever their content (selected with `jnp.where`, so NaNs
    cannot leak through `0 * NaN`). Zeroing is itself a valid clip (norm 0), so
    it does not affect the sensitivity.

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example (the batch
      pytree indexed at a leading position). Must not couple examples.
    clip_norm: The L2 bound `C > 0` on each example's gradient.
    microbatch_size: If set, the batch (leading dim `n`, which it must divide)
      is processed in `n // microbatch_size` chunks under `lax.scan`, bounding
      peak memory to one chunk of per-example gradients. The result is the same
      single sum, so K microbatches build one logical batch.

  Returns:
    A `ClippedGradFn` returning `(grad_sum, ClipStats)`, `grad_sum` being a
    float32 pytree shaped like `params`.

  Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda w, x: jnp.sum(w * x)  # gradient w.r.t. w is x
    >>> f = clipped_grad(loss, clip_norm=1.0)
    >>> xs = jnp.array([[3.0, 4.0], [0.4, 0.2], [jnp.nan, 0.0]])
    >>> g, stats = f(jnp.zeros(2), xs, jnp.array([1.0, 1.0, 0.0]))
    >>> print(g, stats.norms.round(4), stats.num_clipped)
    [1. 1.] [5.     0.4472 0.    ] 1
    >>> f.sensitivity
    1.0
  """
  check_bound("clip_norm", clip_norm)
  return ClippedGrad(
      fn=_make_clipped_sum(loss_fn, {"all": clip_norm}, lambda _: "all",
                           microbatch_size),
      sensitivity=float(clip_norm),
  )


def per_group_clipped_grad(
    loss_fn: LossFn,
    *,
    clip_norms: Mapping[str, float],
    group_of: Callable[[KeyPath], str],
    microbatch_size: int | None = None,
) -> ClippedGradFn:
  """Like `clipped_grad`, but clips each parameter group to its own bound.

  Formal guarantees:
    Each example's gradient restricted to the leaves of group `g` is clipped to
    L2 norm `<= clip_norms[g]`, so its whole contribution has norm
    `<= sqrt(sum_g clip_norms[g]**2) == f.sensitivity` (for add/remove one;
    twice that for replace one). Groups listed in `clip_norms` but owning no
    leaves still count towards `sensitivity`, which is then conservative.
    Padding and non-finite examples contribute zero, as in `clipped_grad`.

  Args:
    loss_fn: As in `clipped_grad`.
    clip_norms: Group name -> clip bound `C_g > 0`.
    group_of: Maps a leaf's key path (as yielded by
      `jax.tree_util.tree_flatten_with_path(params)`) to a key of `clip_norms`.
      An unknown group raises `ValueError` naming the leaf, when called.
    microbatch_size: As in `clipped_grad`.

  Returns:
    A `ClippedGradFn` with `sensitivity = sqrt(sum_g C_g**2)`.

  Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda p, x: jnp.sum(p["a"] * x[:2]) + jnp.sum(p["b"] * x[2:])
    >>> f = per_group_clipped_grad(
    ...     loss, clip_norms={"a": 1.0, "b": 2.0},
    ...     group_of=lambda path: path[0].key)
    >>> g, _ = f({"a": jnp.zeros(2), "b": jnp.zeros(1)},
    ...          jnp.array([[3.0, 4.0, 10.0]]), jnp.ones(1))
    >>> print(g["a"], g["b"])
    [0.6 0.8] [2.]
    >>> round(f.sensitivity, 4)
    2.2361
  """
  if not clip_norms:
    raise ValueError("clip_norms must name at least one group.")
  for name, bound in clip_norms.items():
    check_bound(f"clip_norms[{name!r}]", bound)
  clip_norms = dict(clip_norms)

  def group_of_checked(path: KeyPath) -> str:
    group = group_of(path)
    if group not in clip_norms:
      raise ValueError(
          f"Parameter {jax.tree_util.keystr(path)} maps to group {group!r}, "
          f"which is not in clip_norms {sorted(clip_norms)}.")
    return group

  return ClippedGrad(
      fn=_make_clipped_sum(loss_fn, clip_norms, group_of_checked,
                           microbatch_size),
      sensitivity=math.sqrt(sum(c * c for c in clip_norms.values())),
  )


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (jit)
class MultiClippedGrad:
  """`(params, batch, mask) -> ({name: clipped grad sum}, {name: ClipStats})`,
  one clipped sum per named loss, each with its own L2 sensitivity."""

  fn: Callable[[PyTree, PyTree, jax.Array],
               tuple[dict[str, PyTree], dict[str, ClipStats]]]
  sensitivities: Mapping[str, float]

  def __call__(self, params, batch, mask):
    return self.fn(params, batch, mask)


def multi_loss_clipped_grad(
    losses_fn: Callable[[PyTree, PyTree], Mapping[str, jax.Array]],
    *,
    clip_norms: Mapping[str, float],
    trainable: PyTree | None = None,
    microbatch_size: int | None = None,
) -> MultiClippedGrad:
  """One `clipped_grad` sum per named loss of one example, each its own release.

  For every name k in `clip_norms`, each example's gradient of
  `losses_fn(params, example)[k]` w.r.t. the TRAINABLE params (all leaves if
  `trainable` is None) is clipped to `clip_norms[k]` and summed over the
  real examples. Frozen leaves (`trainable` False) are not differentiated:
  they add nothing to an example's norm and are exactly zero in every sum.

  Formal guarantees:
    For each k separately, the sum of release k has every guarantee of
    `clipped_grad` with `C = clip_norms[k]`: adding or removing one real
    example changes it by at most `sensitivities[k]` in L2 norm, padding and
    non-finite examples contribute zero. The sums are computed on the same
    examples, so noising them separately is several Gaussian mechanisms on
    one sample (`accounting.PoissonGaussian(q, (s_1, ..., s_k), T)`), not
    one mechanism of sensitivity `max_k C_k`.

  Args:
    losses_fn: `losses_fn(params, example) -> {name: scalar}` for ONE example;
      must not couple examples.
    clip_norms: loss name -> its clip bound `C_k > 0`; names absent here are
      not differentiated (and must exist in the losses' output otherwise).
    trainable: bools shaped like `params` (e.g. `gpt2_disc.trainable_mask`);
      fixed when the function is built.
    microbatch_size: As in `clipped_grad`.

  Returns:
    A `MultiClippedGrad` with `sensitivities == clip_norms`.

  Example:
    >>> import jax.numpy as jnp
    >>> losses = lambda p, x: {"a": jnp.sum(p["w"] * x), "b": 10 * p["v"] * x[0]}
    >>> f = multi_loss_clipped_grad(losses, clip_norms={"a": 1.0, "b": 2.0})
    >>> g, _ = f({"w": jnp.zeros(2), "v": jnp.zeros(())},
    ...          jnp.array([[3.0, 4.0]]), jnp.ones(1))
    >>> print(g["a"]["w"], g["a"]["v"], g["b"]["w"], g["b"]["v"])
    [0.6 0.8] 0.0 [0. 0.] 2.0
  """
  if not clip_norms:
    raise ValueError("clip_norms must name at least one loss.")
  for name, bound in clip_norms.items():
    check_bound(f"clip_norms[{name!r}]", bound)
  clip_norms = dict(clip_norms)

  def fn(params, batch, mask):
    sums, stats = {}, {}
    for name, bound in clip_norms.items():
      loss = lambda p, example, name=name: losses_fn(p, example)[name]
      make = functools.partial(clipped_grad, clip_norm=bound,
                               microbatch_size=microbatch_size)
      clipped = make(loss) if trainable is None else trained_only(
          make, loss, trainable, bound)
      sums[name], stats[name] = clipped(params, batch, mask)
    return sums, stats

  return MultiClippedGrad(fn=fn, sensitivities={k: float(c) for k, c in
                                                 clip_norms.items()})


def trained_only(make: Callable[[LossFn], ClippedGradFn], loss_fn: LossFn,
                 trainable: PyTree, sensitivity: float) -> ClippedGrad:
  """`make(loss)`'s clipped sum of `loss_fn`'s gradients w.r.t. the leaves
  where `trainable` is True only; frozen leaves are constants of the loss,
  add nothing to any norm and are exactly zero in the sum.

  `make` is any clipped-gradient constructor (`clipped_grad`, ghost's); it
  sees the loss as a function of the list of trained leaves, so a frozen
  weight is no ghost site and gets no per-example gradient. Guarantees are
  `make`'s, for the trained leaves: `sensitivity` must be its bound.
  """
  flags = [bool(t) for t in jax.tree_util.tree_leaves(trainable)]

  def fn(params, batch, mask):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if len(flags) != len(leaves):
      raise ValueError(f"trainable has {len(flags)} leaves, params {len(leaves)}.")

    def with_trained(trained_leaves):
      it = iter(trained_leaves)
      return jax.tree_util.tree_unflatten(
          treedef, [next(it) if k else leaf for leaf, k in zip(leaves, flags)])

    part, stats = make(lambda t, example: loss_fn(with_trained(t), example))(
        [leaf for leaf, k in zip(leaves, flags) if k], batch, mask)
    it = iter(part)
    return jax.tree_util.tree_unflatten(treedef, [
        next(it) if k else jnp.zeros(jnp.shape(leaf), jnp.float32)
        for leaf, k in zip(leaves, flags)]), stats

  return ClippedGrad(fn=fn, sensitivity=float(sensitivity))


def _make_clipped_sum(
    loss_fn: LossFn,
    clip_norms: Mapping[str, float],
    group_of: Callable[[KeyPath], str],
    microbatch_size: int | None,
):
  """Builds the (grad_sum, ClipStats) function for a leaf -> group mapping."""
  group_names = list(clip_norms)
  bounds = np.asarray([clip_norms[g] for g in group_names], np.float32)
  per_example = vmap_examples(jax.value_and_grad(loss_fn), in_axes=(None, 0))

  def clip_chunk(params, batch, mask):
    """Clipped grad sum and per-example stats for one [m, ...] chunk."""
    losses, grads = per_example(params, batch)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaf_groups = [group_names.index(group_of(p)) for p, _ in paths_and_leaves]
    # float32 for the norm and the sum, whatever the parameter dtype.
    leaves = [g.astype(jnp.float32) for _, g in paths_and_leaves]

    sq_norms = jnp.zeros((losses.shape[0], len(group_names)), jnp.float32)
    for leaf, group in zip(leaves, leaf_groups):
      sq_norms = sq_norms.at[:, group].add(sum_squares(leaf))
    scales, keep, stats = clip_scales(losses, sq_norms, mask, bounds)

    summed = [weighted_sum(leaf, scales[:, group], keep)
              for leaf, group in zip(leaves, leaf_groups)]
    return jax.tree_util.tree_unflatten(treedef, summed), stats

  return scan_chunks(clip_chunk, microbatch_size)


# Building blocks shared with `dpjax.privacy.ghost`.


# (mesh axis names, their total size) a batch's examples are split over,
# while a step is traced for a mesh (`examples_split_over`).
_EXAMPLE_AXES: contextvars.ContextVar[tuple[tuple[str, ...], int] | None] = (
    contextvars.ContextVar("dpjax_example_axes", default=None))
_ONE_EXAMPLE = contextvars.ContextVar("dpjax_one_example", default=False)


@contextlib.contextmanager
def examples_split_over(axes: tuple[str, ...], size: int):
  """While a step is traced inside, `vmap_examples` declares its vmapped
  axis split over the mesh `axes` (`size` devices in all), as the batch is
  (`partitioning.batch_laid_out` enters it)."""
  token = _EXAMPLE_AXES.set((tuple(axes), size))
  try:
    yield
  finally:
    _EXAMPLE_AXES.reset(token)


def vmap_examples(fn: Callable, in_axes) -> Callable:
  """`jax.vmap(fn, in_axes)` over a batch's examples (the per-example pass).

  Inside `examples_split_over`, and where the batch divides over its
  devices, the vmapped axis is declared split over the batch's mesh axes
  (`spmd_axis_name`): the model's activations inside, which it keeps whole
  per example (`common.along_batch`), are then split along the examples
  as the batch is. Left open, XLA's partitioner may follow FSDP's weights
  instead (the tiny T5's ghost step over 32 v4 chips moved 30% more bytes).
  Computes the same values either way."""
  def mapped(*args):
    split, spmd_axis_name = _EXAMPLE_AXES.get(), None
    if split is not None and split[0]:
      axes, size = split
      sizes = {jnp.shape(leaf)[axis]
               for arg, axis in zip(args, _tuple(in_axes, args))
               if axis is not None for leaf in jax.tree.leaves(arg)}
      if all(n % size == 0 for n in sizes):
        spmd_axis_name = axes
    token = _ONE_EXAMPLE.set(True)
    try:
      return jax.vmap(fn, in_axes=in_axes,
                      spmd_axis_name=spmd_axis_name)(*args)
    finally:
      _ONE_EXAMPLE.reset(token)
  return mapped


def one_example_traced() -> bool:
  """Whether what is being traced is one example of `vmap_examples` (its
  loops' and rematerialised functions' bodies included, which are traced
  apart from the vmap)."""
  return _ONE_EXAMPLE.get()


def _tuple(in_axes, args) -> tuple:
  return in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)


def check_bound(name: str, value: float) -> None:
  """Raises ValueError unless clip bound `value` is positive and finite."""
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name} must be positive and finite, got {value}.")


def sum_squares(x: jax.Array) -> jax.Array:
  """[m, ...] -> [m] float32 squared L2 norm of each row."""
  x = x.astype(jnp.float32)
  return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))


def clip_scales(losses: jax.Array, sq_norms: jax.Array, mask: jax.Array,
                bounds: np.ndarray) -> tuple[jax.Array, jax.Array, tuple]:
  """Per-example, per-group clip scales, the kept examples, and chunk stats.

  Args:
    losses: [m] per-example losses.
    sq_norms: [m, G] float32 squared gradient norm of each example's group.
    mask: [m]; > 0 marks real examples, whose weight is `min(mask, 1)`.
    bounds: [G] clip bounds.

  Returns:
    `(scales [m, G], keep [m], stats)`: `scales` is
    `min(mask, 1) * min(1, C_g / norm_g)` for kept examples and 0 for the
    others; `keep` marks real examples with
    a finite loss and norm; `stats` is (norms, losses, num_clipped,
    num_nonfinite) of the chunk.
  """
  group_norms = jnp.sqrt(sq_norms)  # [m, G]
  norms = jnp.sqrt(jnp.sum(sq_norms, axis=1))  # [m]
  real = mask > 0
  # A NaN/inf entry makes its squared norm non-finite; so does a norm that
  # overflows float32, which is dropped rather than trusted.
  finite = jnp.isfinite(losses) & jnp.isfinite(norms)
  keep = real & finite
  # C / max(norm, C) == min(1, C / norm) with no division by zero (C > 0),
  # and exactly 1 for unclipped examples.
  weight = jnp.minimum(mask, 1.0).astype(jnp.float32)[:, None]
  scales = jnp.where(keep[:, None],
                     weight * (bounds / jnp.maximum(group_norms, bounds)), 0.0)
  stats = (
      jnp.where(keep, norms, 0.0),
      jnp.where(keep, losses.astype(jnp.float32), 0.0),
      jnp.sum(keep & jnp.any(group_norms > bounds, axis=1)),
      jnp.sum(real & ~finite),
  )
  return scales, keep, stats


def weighted_sum(x: jax.Array, weights: jax.Array, keep: jax.Array
                 ) -> jax.Array:
  """sum_i weights[i] * x[i] over kept rows, in float32.

  `where` (not a 0/1 multiply) so that NaN/inf in a dropped row cannot leak.
  """
  shape = (-1,) + (1,) * (x.ndim - 1)
  scaled = x.astype(jnp.float32) * weights.reshape(shape)
  return jnp.sum(jnp.where(keep.reshape(shape), scaled, 0.0), axis=0)


def scan_chunks(clip_chunk: Callable, microbatch_size: int | None
                ) -> Callable[[PyTree, PyTree, jax.Array],
                              tuple[PyTree, ClipStats]]:
  """`(params, batch, mask) -> (grad_sum, ClipStats)` from a chunk function.

  `clip_chunk(params, batch, mask) -> (grad_sum, (norms, losses,
  num_clipped, num_nonfinite))` handles `microbatch_size` examples (all of
  them if None); the chunks run under `lax.scan` and their sums add up.
  """

  def clipped_sum(params, batch, mask):
    mask = jnp.asarray(mask)
    n = mask.shape[0]
    m = n if microbatch_size is None else microbatch_size
    if m <= 0 or n % m:
      raise ValueError(
          f"microbatch_size={microbatch_size} must be positive and divide the "
          f"batch size {n}.")
    chunked = jax.tree_util.tree_map(
        lambda x: x.reshape((n // m, m) + x.shape[1:]), (batch, mask))

    def step(acc, chunk):
      grad_sum, stats = clip_chunk(params, *chunk)
      return jax.tree_util.tree_map(jnp.add, acc, grad_sum), stats

    zeros = jax.tree_util.tree_map(
        lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    grad_sum, (norms, losses, clipped, nonfinite) = jax.lax.scan(
        step, zeros, chunked)
    return grad_sum, ClipStats(
        norms=norms.reshape(n),
        losses=losses.reshape(n),
        num_clipped=jnp.sum(clipped),
        num_nonfinite=jnp.sum(nonfinite),
        num_examples=jnp.sum(mask > 0),
    )

  return clipped_sum
