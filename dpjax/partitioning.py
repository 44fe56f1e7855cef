"""Device mesh and logical-axis rules: how params and batches are laid out.

Models name every parameter axis logically ('embed', 'mlp', 'heads', ...), as
t5x does; rules map logical names onto mesh axes. Data parallelism is the
default: params replicated, the example axis of a batch split over 'data'.
Nothing here imports TensorFlow.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import gin
import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Logical axis -> mesh axis (None = replicated). The microbatch axis of a batch
# is called 'batch'; every parameter axis is replicated under plain data
# parallelism.
DATA_PARALLEL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", None),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv", None),
    ("joined_kv", None),
    ("relpos_buckets", None),
    ("abspos", None),
)


@gin.configurable
def make_mesh(mesh_shape: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over all devices; `mesh_shape` like {'data': -1} (-1 = the rest)."""
  devices = list(devices if devices is not None else jax.devices())
  shape = dict(mesh_shape or {"data": -1})
  known = math.prod(v for v in shape.values() if v != -1)
  if list(shape.values()).count(-1) > 1:
    raise ValueError(f"mesh_shape {shape}: at most one axis may be -1")
  shape = {k: (len(devices) // known if v == -1 else v) for k, v in shape.items()}
  if math.prod(shape.values()) != len(devices):
    raise ValueError(f"mesh_shape {shape} does not cover the {len(devices)} "
                     "available devices")
  grid = np.asarray(devices).reshape(tuple(shape.values()))
  return Mesh(grid, tuple(shape.keys()))


@gin.configurable
def logical_axis_rules(rules=DATA_PARALLEL_RULES):
  return tuple(tuple(r) for r in rules)


def param_shardings(mesh: Mesh, logical_axes, rules=None):
  """NamedShardings for a pytree of logical PartitionSpecs."""
  rules = rules if rules is not None else logical_axis_rules()
  return jax.tree.map(
      lambda spec: NamedSharding(
          mesh, nn.logical_to_mesh_axes(tuple(spec), rules)),
      logical_axes, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, rank: int, batch_dim: int = 0, rules=None):
  """Sharding for an array whose `batch_dim` axis holds examples."""
  rules = rules if rules is not None else logical_axis_rules()
  names = [None] * rank
  names[batch_dim] = "batch"
  return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(names), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
