"""The clipping method: per-example gradients by vmap, ghost norms, or
whichever applies (`make_clipped_grad`).

Formal guarantees
-----------------
Every method returns the same clipped sum with the same `sensitivity`
(`clipping.clipped_grad`'s), so the choice is one of cost only: vmap
materialises each example's gradient, ghost clipping (`dpjax.privacy.ghost`)
computes the weight matrices' per-example norms from their inputs and output
gradients. This module sits above both, so neither imports the other's
chooser.
"""
from __future__ import annotations

import jax

from dpjax.privacy import clipping, ghost


METHODS = ("auto", "vmap", "ghost")


def make_clipped_grad(
    loss_fn: clipping.LossFn,
    *,
    clip_norm: float,
    method: str = "auto",
    summation: str = "auto",
    microbatch_size: int | None = None,
    trainable=None,
) -> clipping.ClippedGradFn:
  """`clipping.clipped_grad` by the chosen method: same result, same guarantees.

  Args:
    loss_fn: As in `clipping.clipped_grad`.
    clip_norm: As in `clipping.clipped_grad`.
    method: 'vmap' (`clipping.clipped_grad`: per-example gradients of every
      parameter); 'ghost' (`dpjax.privacy.ghost.ghost_clipped_grad`: ghost
      norms for the weight matrices and embeddings of the dpjax models,
      summed by book-keeping or, through rematerialised layers, a second
      backward pass); 'auto': ghost if the loss has ghost sites (decided when
      the callable is traced), vmap otherwise.
    summation: How ghost clipping forms the clipped sum
      (`ghost.ghost_clipped_grad`'s `summation`: 'auto', 'book_keeping' or
      'second_pass'); a cost only. Vmap has no such choice: with
      `method='vmap'` it must be 'auto'.
    microbatch_size: As in `clipping.clipped_grad`.
    trainable: Optional bools shaped like the params (e.g. LoRA's
      `lora.trainable_mask`): only those leaves are differentiated, clipped
      and summed (`clipping.trained_only`); the others are zero in the sum
      and frozen weights are no ghost sites.

  Returns:
    A `ClippedGradFn` with `sensitivity == clip_norm`.

  Example:
    >>> import jax.numpy as jnp
    >>> f = make_clipped_grad(lambda w, x: jnp.sum(w * x), clip_norm=1.0)
    >>> g, _ = f(jnp.zeros(2), jnp.array([[3.0, 4.0]]), jnp.ones(1))
    >>> print(g)  # no flax model, no sites: computed by vmap
    [0.6 0.8]
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if summation not in ghost.SUMMATIONS:
    raise ValueError(
        f"summation must be one of {ghost.SUMMATIONS}, got {summation!r}.")
  if method == "vmap" and summation != "auto":
    raise ValueError(f"summation={summation!r} is ghost clipping's; "
                     "method='vmap' sums per-example gradients.")

  def make(loss):
    by_vmap = clipping.clipped_grad(loss, clip_norm=clip_norm,
                                    microbatch_size=microbatch_size)
    if method == "vmap":
      return by_vmap
    by_ghost = ghost.ghost_clipped_grad(loss, clip_norm=clip_norm,
                                        microbatch_size=microbatch_size,
                                        summation=summation)
    if method == "ghost":
      return by_ghost

    def auto(params, batch, mask):
      example = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[0], b),
                               batch)
      use_ghost = resolved(loss, params, example) == "ghost"
      return (by_ghost if use_ghost else by_vmap)(params, batch, mask)

    return clipping.ClippedGrad(fn=auto, sensitivity=float(clip_norm))

  if trainable is None:
    return make(loss_fn)
  return clipping.trained_only(make, loss_fn, trainable, clip_norm)


def resolved(loss_fn: clipping.LossFn, params, example,
             method: str = "auto", trainable=None) -> str:
  """'vmap' or 'ghost': the method `make_clipped_grad(method=method,
  trainable=trainable)` clips `loss_fn` by, for `params` and one `example`
  (abstract shapes do)."""
  return resolution(loss_fn, params, example, method, trainable=trainable)[0]


def resolution(loss_fn: clipping.LossFn, params, example,
               method: str = "auto", summation: str = "auto",
               trainable=None) -> tuple[str, str | None]:
  """(`resolved`'s method, and with ghost how it forms the sum for
  `summation`: 'book_keeping' or 'second_pass'; None for vmap), the sites
  found once. A ValueError where 'book_keeping' cannot record a site."""
  if method == "vmap":
    return "vmap", None
  sites = _trained_sites(loss_fn, params, example, trainable)
  if method == "auto" and not sites:
    return "vmap", None
  second = ghost.uses_second_pass(summation, tuple(sites))
  return "ghost", "second_pass" if second else "book_keeping"


def _trained_sites(loss_fn, params, example, trainable) -> list:
  """`loss_fn`'s ghost sites whose parameter is trained (a frozen weight is
  no site: `trained_only`)."""
  sites = ghost.find_sites(loss_fn, params, example)
  if trainable is not None:
    flags = [bool(t) for t in jax.tree.leaves(trainable)]
    sites = [s for s in sites if flags[s.leaf]]
  return sites
