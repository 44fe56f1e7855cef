"""The train state: what a step changes and a checkpoint keeps."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import optimizers

PyTree = Any


class TrainState(NamedTuple):
  """`step`: optimizer updates taken, DP and public (int32 scalar);
  `opt_state`: the base optimizer's; `noise_count`: the DP releases made,
  the index that keys the next one's noise. In a run without public steps
  `step == noise_count`. The mechanism's own state (`optimizers.
  Privatizer`): `clip_norms`, each loss's current bound `{name: float32}`
  where it is a function of earlier releases (adaptive clipping), and
  `noise_state`, correlated noise's past draws (BandMF; SECRET); None (no
  leaves) where the mechanism keeps none."""
  step: jax.Array
  params: PyTree
  opt_state: optax.OptState
  noise_count: jax.Array
  clip_norms: Any = None
  noise_state: Any = None


def init_state(params: PyTree, optimizer: optimizers.DPOptimizer |
               optax.GradientTransformation) -> TrainState:
  """The state before the first step: counters at 0, the optimizer's and
  (a DP optimizer's) mechanism's initial states."""
  zero = jnp.zeros((), jnp.int32)
  clip_norms, noise_state = (
      optimizer.privatizer.init(params)
      if isinstance(optimizer, optimizers.DPOptimizer) else (None, None))
  return TrainState(zero, params, optimizer.init(params), zero, clip_norms,
                    noise_state)
