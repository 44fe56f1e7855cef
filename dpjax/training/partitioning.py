"""Device mesh and logical-axis rules: how params, optimizer state and batches
are laid out.

Models name every parameter axis logically ('embed', 'mlp', 'heads', ...), as
t5x does; a rule set maps logical names onto the mesh axes 'data', 'fsdp' and
'tensor':

* 'data_parallel' (default): params replicated;
* 'fsdp': every parameter with a d_model ('embed') axis is split along it over
  'fsdp', and so are its gradient sum and optimizer moments (each stored once
  across the 'fsdp' devices, gathered where used). Parameters without one
  (T5's [heads, buckets] relative-position tables, GPT-2's biases of width
  d_ff or heads * d_head) are O(d_ff) scalars each and stay replicated;
* 'tensor': 'heads', 'mlp', 'vocab' and 'joined_kv' over 'tensor'
  (Megatron-style: each device holds a slice of the heads and MLP units);
* 'fsdp_tensor': both.

In every set the example axis of a batch ('batch') is split over all
data-like axes, 'data' and 'fsdp', so the per-example work of DP clipping
stays on the devices that hold the examples. What a step computes once per
logical batch for a parameter (its clipped sum, the noise, its optimizer
moments) is laid out like the parameter and also split over those axes
where the parameter leaves them free (`update_spec`), so no device noises
or updates what another one does.

A rule's mesh axes that the mesh lacks are dropped, so one rule set works on
any mesh ('fsdp' rules on a {'data': 8} mesh replicate), and a dimension its
mesh axes do not divide is replicated (T5's vocabulary of 32128 over 3
devices, GPT-2's 50257 over any): sharding moves work, never changes results.
Nothing here imports TensorFlow.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dpjax.models import common
from dpjax.training.state import TrainState, init_state
from dpjax.privacy import clipping, optimizers

PyTree = Any
# (logical axis name, mesh axis | tuple of mesh axes | None = replicated).
# A logical name may have several rules: the first that fits wins.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_BATCH = ("batch", ("data", "fsdp"))

DATA_PARALLEL_RULES: Rules = (_BATCH,)
FSDP_RULES: Rules = (_BATCH, ("embed", "fsdp"))
TENSOR_PARALLEL_RULES: Rules = (
    _BATCH,
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("joined_kv", "tensor"),
)
FSDP_TENSOR_RULES: Rules = TENSOR_PARALLEL_RULES + (("embed", "fsdp"),)

RULE_SETS: dict[str, Rules] = {
    "data_parallel": DATA_PARALLEL_RULES,
    "fsdp": FSDP_RULES,
    "tensor": TENSOR_PARALLEL_RULES,
    "fsdp_tensor": FSDP_TENSOR_RULES,
}


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


def logical_axis_rules(name: str = "data_parallel") -> Rules:
  """The rule set called `name` (`RULE_SETS`)."""
  if name not in RULE_SETS:
    raise ValueError(f"unknown logical_axis_rules {name!r}; choose from "
                     f"{sorted(RULE_SETS)}")
  return RULE_SETS[name]


def mesh_axes(logical: Sequence[str | None], mesh: Mesh, rules: Rules,
              shape: Sequence[int] | None = None) -> P:
  """The PartitionSpec of one array with logical axis names `logical`.

  Dimension by dimension, the first rule for its name whose mesh axes (those
  in `mesh`) are not taken by an earlier dimension and, if `shape` is given,
  divide its size; no such rule: replicated.
  """
  taken: set[str] = set()
  spec = []
  for i, name in enumerate(logical):
    chosen = ()
    for rule_name, target in rules:
      if rule_name != name or target is None:
        continue
      axes = tuple(a for a in _as_tuple(target) if a in mesh.shape)
      if not axes or taken.intersection(axes):
        continue
      if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in axes):
        continue
      chosen = axes
      break
    taken.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1
                else chosen)
  return P(*spec)


def param_shardings(mesh: Mesh, logical_axes: PyTree, rules: Rules | None = None,
                    shapes: PyTree | None = None) -> PyTree:
  """NamedShardings for a pytree of logical PartitionSpecs.

  `shapes` (params or ShapeDtypeStructs, same tree) enables the divisibility
  fallback; without it every rule that fits the mesh applies.
  """
  rules = rules if rules is not None else logical_axis_rules()
  is_spec = lambda x: isinstance(x, P)
  if shapes is None:
    return jax.tree.map(lambda s: NamedSharding(mesh, mesh_axes(s, mesh, rules)),
                        logical_axes, is_leaf=is_spec)
  return jax.tree.map(
      lambda s, x: NamedSharding(mesh, mesh_axes(s, mesh, rules, np.shape(x))),
      logical_axes, shapes, is_leaf=is_spec)


def update_spec(spec: P, shape: Sequence[int], mesh: Mesh,
                rules: Rules | None = None) -> P:
  """The layout of what a step computes once per logical batch for a
  parameter laid out as `spec`: its clipped gradient sum, the noise, its
  optimizer moments (weight-update sharding: Xu et al., "Automatic
  Cross-Replica Sharding of Weight Update in Data-Parallel Training",
  arXiv:2004.13336).

  `spec` with the batch's mesh axes that it leaves free added to its first
  dimension whose size they divide (with what that dimension already has);
  `spec` itself where none does. A data-parallel step then sums its
  devices' gradients by a reduce-scatter instead of an all-reduce, and each
  device draws the noise and updates the moments of its own slice, where
  every device did all of it: the parameters are gathered once, after the
  update, which is the all-reduce's other half. So the bytes moved are the
  same, the noise and the optimizer's work a device does are divided by
  the data-parallel devices, and so is the moments' memory. Values are
  unchanged: a noise value's bits depend on its index alone
  (`noise.uniform`), the same on any layout.
  """
  rules = rules if rules is not None else logical_axis_rules()
  batch_axes = mesh_axes(("batch",), mesh, rules)[0]
  used = {a for entry in spec if entry is not None for a in _as_tuple(entry)}
  free = tuple(a for a in (() if batch_axes is None else _as_tuple(batch_axes))
               if a not in used and mesh.shape[a] > 1)
  if not free:
    return spec
  entries = list(spec) + [None] * (len(shape) - len(spec))
  for i, entry in enumerate(entries):
    axes = () if entry is None else _as_tuple(entry)
    if shape[i] % math.prod(mesh.shape[a] for a in axes + free) == 0:
      entries[i] = axes + free if len(axes + free) > 1 else free[0]
      return P(*entries)
  return spec


def update_shardings(mesh: Mesh, logical_axes: PyTree, rules: Rules | None,
                     shapes: PyTree) -> PyTree:
  """`param_shardings`, each spread over the batch's mesh axes by
  `update_spec`: the layout of the gradient sums and the noise."""
  return jax.tree.map(
      lambda sh, x: NamedSharding(
          mesh, update_spec(sh.spec, np.shape(x), mesh, rules)),
      param_shardings(mesh, logical_axes, rules, shapes=shapes), shapes)


def _moment_axes(param_axes: P, param_shape, shape) -> tuple:
  """Logical axes of an optimizer-state leaf that mirrors a parameter: its own
  if the shapes agree, minus the reduced axis for a factored moment
  (Adafactor's row/column statistics), else none (a placeholder)."""
  if tuple(shape) == tuple(param_shape):
    return tuple(param_axes)
  for i in range(len(param_shape)):
    if tuple(shape) == tuple(param_shape[:i]) + tuple(param_shape[i + 1:]):
      return tuple(param_axes[:i]) + tuple(param_axes[i + 1:])
  return (None,) * len(shape)


def state_shardings(mesh: Mesh, optimizer: optax.GradientTransformation |
                    optimizers.DPOptimizer, params: PyTree,
                    logical_axes: PyTree, rules: Rules | None = None
                    ) -> TrainState:
  """Shardings of `state.init_state(params, optimizer)`.

  Optimizer states that mirror the params (Adam's moments, Adafactor's
  factored statistics, momentum; found structurally by
  `optax.tree_map_params`) are laid out like their parameters, spread over
  the batch's devices (`update_spec`); so are a mechanism's params-shaped
  noise buffers. Everything else (step and update counters, the noise
  counter) is replicated.
  `params` may be arrays or ShapeDtypeStructs.
  """
  rules = rules if rules is not None else logical_axis_rules()
  state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
  everywhere = replicated(mesh)

  def mirror(leaf, param, axes):
    if isinstance(leaf, optax.MaskedNode):  # a frozen leaf keeps no state
      return leaf
    logical = _moment_axes(axes, np.shape(param), leaf.shape)
    return NamedSharding(mesh, update_spec(
        mesh_axes(logical, mesh, rules, leaf.shape), leaf.shape, mesh, rules))

  base = (optimizer.base if isinstance(optimizer, optimizers.DPOptimizer)
          else optimizer)
  opt = optax.tree_map_params(
      base, mirror, state.opt_state, params, logical_axes,
      transform_non_params=lambda t: jax.tree.map(lambda _: everywhere, t),
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  params_sh = param_shardings(mesh, logical_axes, rules, shapes=params)
  noise_state = None
  if state.noise_state is not None:  # e.g. BandMF's buffers, like the sums
    noise_state = optimizer.privatizer.noise_state_shardings(
        state.noise_state, update_shardings(mesh, logical_axes, rules, params),
        everywhere)
  return TrainState(
      step=everywhere, params=params_sh, opt_state=opt, noise_count=everywhere,
      clip_norms=jax.tree.map(lambda _: everywhere, state.clip_norms),
      noise_state=noise_state)


def batch_sharding(mesh: Mesh, rank: int, batch_dim: int = 0,
                   rules: Rules | None = None,
                   shape: Sequence[int] | None = None) -> NamedSharding:
  """Sharding for an array whose `batch_dim` axis holds examples (whole
  along that axis too where `shape`'s does not divide over its devices)."""
  rules = rules if rules is not None else logical_axis_rules()
  names = [None] * rank
  names[batch_dim] = "batch"
  return NamedSharding(mesh, mesh_axes(names, mesh, rules, shape))


def batch_laid_out(fn: Callable, mesh: Mesh, rules: Rules) -> Callable:
  """`fn` (a step, to be jitted) whose model activations are split along
  their example axis as the rules split a batch, and kept whole along the
  others (`common.along_batch`), while it is traced; its per-example
  passes' vmapped axis too (`clipping.vmap_examples`).

  Only where the rules split parameters over `mesh` (FSDP, tensor
  parallelism), which the partitioner might otherwise follow: where only
  the batch is split there is nothing else to follow, and the constraints
  cost fusions (GPT-2 small's data-parallel ghost step on a v5e 2x2:
  35.2 ms with them, 29.5 ms without), so `fn` is returned as it is."""
  if not splits_parameters(mesh, rules):
    return fn

  def sharding_for(shape):
    return batch_sharding(mesh, len(shape), rules=rules, shape=shape)

  axes = batch_sharding(mesh, 1, rules=rules).spec[0]
  axes = () if axes is None else _as_tuple(axes)

  @functools.wraps(fn)
  def laid_out(*args, **kwargs):
    with common.batch_layout(sharding_for), clipping.examples_split_over(
        axes, data_parallel_size(mesh, rules)):
      return fn(*args, **kwargs)
  return laid_out


def splits_parameters(mesh: Mesh, rules: Rules) -> bool:
  """Whether `rules` map any logical axis but the batch's to a mesh axis
  of `mesh` with more than one device."""
  return any(name != "batch" and axes is not None and any(
      mesh.shape.get(a, 1) > 1 for a in _as_tuple(axes))
             for name, axes in rules)


def data_parallel_size(mesh: Mesh, rules: Rules | None = None) -> int:
  """How many ways the example axis is split: microbatch sizes must be a
  multiple of it."""
  spec = batch_sharding(mesh, 1, rules=rules).spec[0]
  return math.prod(mesh.shape[a] for a in _as_tuple(spec)) if spec else 1


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding that places a whole copy on every device of `mesh`."""
  return NamedSharding(mesh, P())


def _as_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes)
