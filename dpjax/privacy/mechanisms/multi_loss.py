"""Multi-loss releases: one clipped sum, and one Gaussian, per named loss.

A model with several named per-example losses (`Trainable.example_losses`,
e.g. GPT-2 + a discriminator head: an ICLR 2023 submission, OpenReview
LUql3ZOFwFD) makes one release per loss each step: every per-example
gradient of loss k (w.r.t. the trained params) is clipped to its own C_k,
and each clipped sum gets its own Gaussian σ·C_k (the paper's Algorithm 1:
separate clipping, not one joint clip of the summed gradient). A model with
one loss is the case of one name, `{LOSS: sum}`. Every mechanism builds its
clipped sums here, and its privatizer releases each name.

Formal guarantees
-----------------
`clipped_grad` returns the clipped-gradient callable of `dpjax.privacy.
clipping` (one loss, by the chosen method) or `clipping.
multi_loss_clipped_grad` (several, by vmap), each sum with sensitivity its
bound; `sensitivities` reads them off. k releases on the same sample with
one σ compose as `PoissonGaussian(q, (σ,)*k, T)` (the plan's
`releases_per_step`).
"""
from __future__ import annotations

from typing import Mapping

from dpjax import errors
from dpjax.privacy import clipping, ghost
from dpjax.privacy.clipping_method import make_clipped_grad

# The name of a model's one loss: its clipped sum is release {LOSS: sum}.
LOSS = "loss"
CLIPPING_METHODS = ("vmap", "ghost", "auto")


def trainable_mask(model):
  """The model's trainable-leaf mask (of its abstract params), or None."""
  if model.trainable_mask is None:
    return None
  return model.trainable_mask(model.abstract_params()[0])


def release_bounds(model, clip_norm: float,
                   clip_norms: Mapping[str, float] | None
                   ) -> dict[str, float] | None:
  """A multi-loss model's bound per loss (`clip_norms`, else `clip_norm`
  for every loss); None for a one-loss model."""
  if model.example_losses is None:
    if clip_norms:
      raise errors.UsageError(
          f"train.clip_norms {dict(clip_norms)} is for a model with several "
          "losses; this one has one: set train.clip_norm")
    return None
  extra = set(clip_norms or {}) - set(model.loss_names)
  if extra:
    raise errors.UsageError(f"train.clip_norms names {sorted(extra)}; the "
                             f"model's losses are {list(model.loss_names)}")
  return {k: float((clip_norms or {}).get(k, clip_norm))
          for k in model.loss_names}


def release_names(model) -> list[str]:
  """The names of one step's clipped sums: the model's losses, or LOSS."""
  return list(model.loss_names if model.example_losses is not None
              else [LOSS])


def check_clipping(method: str, summation: str = "auto") -> None:
  """Refuses an unknown `train.clipping_method` or `train.ghost_summation`,
  or a summation other than 'auto' for vmap (it has none): one
  UsageError naming the binding."""
  if method not in CLIPPING_METHODS:
    raise errors.UsageError("train.clipping_method must be 'vmap', 'ghost' "
                             f"or 'auto', got {method!r}")
  if summation not in ghost.SUMMATIONS:
    raise errors.UsageError(
        "train.ghost_summation must be 'auto', 'book_keeping' or "
        f"'second_pass', got {summation!r}")
  if method == "vmap" and summation != "auto":
    raise errors.UsageError(
        f"train.ghost_summation = {summation!r} needs ghost clipping, and "
        "train.clipping_method is 'vmap': set it to 'ghost' or 'auto', or "
        "leave ghost_summation 'auto'")


def clipped_grad(example_loss, example_losses, *, clip_norm: float,
                 bounds: Mapping[str, float] | None, method: str, trainable,
                 summation: str = "auto"):
  """The clipped-gradient callable of one loss (`example_loss` clipped to
  `clip_norm` by `method`: 'vmap', 'ghost' or 'auto'; ghost's sum formed by
  `summation`), or of several (`example_losses`, each to its `bounds`
  entry; vmap only)."""
  check_clipping(method, summation)
  if bounds is None:
    return make_clipped_grad(example_loss, clip_norm=clip_norm, method=method,
                             summation=summation, trainable=trainable)
  if method == "ghost":
    raise errors.UsageError(
        "train.clipping_method = 'ghost' does not support a model with "
        "several losses; use 'vmap'")
  return clipping.multi_loss_clipped_grad(example_losses, clip_norms=bounds,
                                          trainable=trainable)


def sensitivities(clipped) -> dict[str, float]:
  """The L2 sensitivity of each named sum of a clipped-gradient callable
  (one loss: `{LOSS: its sensitivity}`)."""
  if isinstance(clipped, clipping.MultiClippedGrad):
    return dict(clipped.sensitivities)
  return {LOSS: clipped.sensitivity}


def named(clipped):
  """`(params, batch, mask) -> ({name: sum}, {name: ClipStats})` of either
  kind of clipped-gradient callable."""
  if isinstance(clipped, clipping.MultiClippedGrad):
    return clipped

  def one(params, batch, mask):
    grad_sum, stats = clipped(params, batch, mask)
    return {LOSS: grad_sum}, {LOSS: stats}

  return one
