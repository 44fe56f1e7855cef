"""Sharding rules: layouts, and a sharded DP step equal to the 1-device step.

The multi-device check runs this file as a script in a subprocess with 8
virtual CPU devices (XLA_FLAGS must be set before jax is imported).
"""
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.training import partitioning, state as state_lib, step as step_lib
from dpjax.models import gpt2, t5
from dpjax.privacy import clipping_method, optimizers
from dpjax.privacy.secret import RunSecret
from tests import numerics, xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ({"data": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2})
K, M, LENGTH, CLIP = 2, 8, 8, 0.5


class FakeMesh:
  """Just the `shape` mapping the rule resolution reads (no devices needed)."""

  def __init__(self, **shape):
    self.shape = shape


@pytest.mark.parametrize("rules, mesh, logical, shape, expected", [
    # Absent mesh axes drop out: the batch goes over 'data' alone.
    ("fsdp", FakeMesh(data=4), ("batch", None), (8, 3), P("data", None)),
    ("fsdp", FakeMesh(data=2, fsdp=4), ("batch",), (8,), P(("data", "fsdp"))),
    ("fsdp", FakeMesh(data=8), ("vocab", "embed"), (32, 64), P(None, None)),
    ("fsdp", FakeMesh(fsdp=4), ("vocab", "embed"), (32, 64), P(None, "fsdp")),
    ("fsdp_tensor", FakeMesh(fsdp=4, tensor=2), ("embed", "mlp"), (64, 128),
     P("fsdp", "tensor")),
    # Not divisible: replicated instead of an error (T5's 32128 over 3,
    # GPT-2's 50257 over 2).
    ("fsdp_tensor", FakeMesh(fsdp=3, tensor=2), ("vocab", "embed"),
     (32128, 1024), P("tensor", None)),
    ("tensor", FakeMesh(tensor=2), ("vocab", "embed"), (50257, 768),
     P(None, None)),
    # A mesh axis is used once per array.
    ("fsdp", FakeMesh(fsdp=2), ("embed", "embed"), (4, 4), P("fsdp", None)),
])
def test_mesh_axes(rules, mesh, logical, shape, expected):
  got = partitioning.mesh_axes(logical, mesh, partitioning.RULE_SETS[rules],
                               shape)
  assert got == expected


@pytest.mark.parametrize("rules, mesh, spec, shape, expected", [
    # Data parallel: the first dimension the data axis divides.
    ("data_parallel", FakeMesh(data=4), P(None, None), (50257, 768),
     P(None, "data")),
    ("data_parallel", FakeMesh(data=4), P(None, None), (768, 2304),
     P("data", None)),
    ("data_parallel", FakeMesh(data=4), P(), (768,), P("data")),
    # No dimension it divides: as the parameter.
    ("data_parallel", FakeMesh(data=4), P(None,), (50257,), P(None)),
    ("data_parallel", FakeMesh(data=1), P(None,), (768,), P(None)),
    # FSDP: the free batch axes join the dimension's own where they divide.
    ("fsdp", FakeMesh(data=2, fsdp=4), P(None, "fsdp"), (50257, 768),
     P(None, ("fsdp", "data"))),
    ("fsdp", FakeMesh(data=2, fsdp=4), P(None, "fsdp"), (50257, 12),
     P(None, "fsdp")),
    ("fsdp", FakeMesh(fsdp=4), P(None, "fsdp"), (50257, 768),
     P(None, "fsdp")),
    # Tensor parallel: the batch's two axes together.
    ("fsdp_tensor", FakeMesh(data=2, fsdp=2, tensor=2), P("tensor", None),
     (12, 64), P("tensor", ("data", "fsdp"))),
])
def test_update_spec(rules, mesh, spec, shape, expected):
  """The update's layout: the parameter's, with the batch's mesh axes that
  it leaves free on the first dimension they divide."""
  got = partitioning.update_spec(spec, shape, mesh,
                                 partitioning.RULE_SETS[rules])
  assert got == expected


def test_unknown_rule_set_is_an_error():
  with pytest.raises(ValueError, match="unknown logical_axis_rules 'zero3'"):
    partitioning.logical_axis_rules("zero3")


def test_optimizer_state_follows_params():
  """Adam moments and Adafactor's factored statistics take their parameter's
  layout (reduced axis dropped); counters are replicated."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                           ("fsdp", "tensor"))
  params = {"w": jax.ShapeDtypeStruct((256, 512), np.float32),
            "b": jax.ShapeDtypeStruct((512,), np.float32)}
  axes = {"w": P("embed", "mlp"), "b": P("mlp")}
  rules = partitioning.FSDP_TENSOR_RULES
  dp = lambda base: optimizers.dp_optimizer(
      base, noise_multipliers={"loss": 1.0}, sensitivities={"loss": 1.0},
      normalizer=1.0)
  spec = lambda s: s.spec

  adam = jax.tree.map(spec, partitioning.state_shardings(
      mesh, dp(optax.adam(1e-3)), params, axes, rules))
  assert adam.params == {"w": P("fsdp", "tensor"), "b": P("tensor")}
  scale_by_adam, _ = adam.opt_state
  assert adam.noise_count == P() and scale_by_adam.count == P() and adam.step == P()
  assert scale_by_adam.mu == adam.params and scale_by_adam.nu == adam.params

  factored = jax.tree.map(spec, partitioning.state_shardings(
      mesh, dp(optax.adafactor(1e-3)), params, axes, rules))
  state = factored.opt_state[0]
  # optax factors [256, 512] into rows [256] and columns [512].
  assert state.v_row["w"] == P("fsdp") and state.v_col["w"] == P("tensor")
  assert state.v["w"] == P(None) and state.v["b"] == P("tensor")


# --- The sharded DP step (runs in the subprocess). ------------------------


def _configs(remat="none"):
  """Tiny one-layer T5 (vocab 97: not divisible by 2, so the tensor rules
  replicate that axis) and GPT-2, dropout off (T5 takes the fused attention
  path)."""
  t5_cfg = t5.T5Config(vocab_size=97, d_model=64, d_kv=16, d_ff=128,
                       num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
                       dropout_rate=0.0, remat=remat)
  gpt_cfg = gpt2.GPT2Config(vocab_size=96, n_positions=LENGTH, d_model=64,
                            num_layers=1, num_heads=4, dropout_rate=0.0,
                            remat=remat)
  return t5_cfg, gpt_cfg


def _models():
  """The tiny models (`_configs`): their losses, params, axes and a batch."""
  t5_cfg, gpt_cfg = _configs()
  rng = np.random.default_rng(0)
  tokens = lambda v: rng.integers(1, v, (K, M, LENGTH)).astype(np.int32)
  weights = np.ones((K, M, LENGTH), np.float32)
  t5_batch = {"encoder_input_tokens": tokens(97), "decoder_input_tokens": tokens(97),
              "decoder_target_tokens": tokens(97), "decoder_loss_weights": weights}
  gpt_batch = {"tokens": tokens(96), "loss_weights": weights}
  t5_params = t5.init_params(t5_cfg, jax.random.PRNGKey(0), input_length=LENGTH,
                             target_length=LENGTH)
  gpt_params = gpt2.init_params(gpt_cfg, jax.random.PRNGKey(1), max_length=LENGTH)
  return {"t5": (t5.make_example_loss(t5_cfg), *t5_params, t5_batch),
          "gpt2": (gpt2.make_example_loss(gpt_cfg), *gpt_params, gpt_batch)}


def _dp_step(example_loss, axes, method="vmap"):
  clipped = clipping_method.make_clipped_grad(example_loss, clip_norm=CLIP,
                                       method=method)
  # eps far above the rounding of the gradient sums, so that Adam's
  # normalisation does not blow reassociation differences (sharded sums
  # add in another order) up to the size of a step.
  tx = optimizers.dp_optimizer(optax.adam(1e-2, eps=1e-3),
                               noise_multipliers={"loss": 0.5},
                               sensitivities={"loss": CLIP}, normalizer=K * M,
                               layouts=axes)
  accumulate = step_lib.make_accumulate(clipped, seed=0, dropout=False)
  apply = step_lib.make_apply(tx)

  def step(state, batch, mask):
    grads, _ = accumulate(
        state.params, {"loss": step_lib.zeros_like_f32(state.params)},
        batch, mask, state.step, 0)
    return apply(state, grads, RunSecret.pinned(0).noise_key())

  return tx, step


def _sharded_run():
  """Two DP steps per model on each mesh (rules 'fsdp_tensor', whose absent
  axes drop out) against the same steps on one device."""
  assert jax.device_count() == 8, jax.devices()
  mask = np.ones((K, M), np.float32)
  mask[1, -3:] = 0  # padding rows
  rules = partitioning.FSDP_TENSOR_RULES
  # Ghost clipping of the rematerialised GPT-2 (a second backward pass, which
  # gathers stand-ins for the padding rows across the sharded batch) on the
  # fullest mesh, against the plain model's vmap step on one device (the
  # same params: remat changes only how the loss is computed).
  remat_loss = gpt2.make_example_loss(_configs(remat="layer")[1])
  for name, (example_loss, params, axes, batch) in _models().items():
    tx, step = _dp_step(example_loss, axes)
    one = jax.jit(step)
    reference = jax.device_put(state_lib.init_state(params, tx), jax.devices()[0])
    for _ in range(2):
      reference = one(reference, batch, mask)
    runs = [(shape, step) for shape in MESHES]
    if name == "gpt2":
      runs.append((MESHES[-1], _dp_step(remat_loss, axes, method="ghost")[1]))
    for shape, run_step in runs:
      mesh = partitioning.make_mesh(shape)
      state_sh = partitioning.state_shardings(mesh, tx, params, axes, rules)
      batch_sh = partitioning.batch_sharding(mesh, 3, batch_dim=1, rules=rules)
      mask_sh = partitioning.batch_sharding(mesh, 2, batch_dim=1, rules=rules)
      sharded = jax.jit(run_step, in_shardings=(state_sh, batch_sh, mask_sh),
                        out_shardings=state_sh)
      state = jax.device_put(state_lib.init_state(params, tx), state_sh)
      for _ in range(2):
        state = sharded(state, jax.device_put(batch, batch_sh),
                        jax.device_put(mask, mask_sh))
      # In norm, per leaf (`numerics.update_differences`): the mesh sums in
      # another order, which elementwise tolerances catch by chance at
      # near-cancelling coordinates; a wrong shard, batch or noise draw
      # moves a whole leaf.
      moved = numerics.update_differences(reference.params, state.params,
                                          params)
      assert max(moved) < 1e-4, (name, shape, moved)
      for want, got in zip(jax.tree.leaves(reference.opt_state),
                           jax.tree.leaves(state.opt_state)):
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), (
            name, shape)
      assert (int(state.step), int(state.noise_count)) == (
          int(reference.step), int(reference.noise_count)) == (2, 2)
      # Params stored sharded where the mesh has a parameter axis: every
      # parameter with a d_model axis. Its Adam moments on every mesh:
      # each device keeps and updates its slice (weight-update sharding).
      adam = state.opt_state[0]
      for x, logical in zip(jax.tree.leaves(state.params),
                            jax.tree.leaves(axes)):
        local = x.addressable_shards[0].data.shape
        if "embed" in logical:
          assert (np.prod(local) < x.size) == (shape.keys() != {"data"}), (
              name, shape, logical, local)
      for moment in (adam.mu, adam.nu):
        for x in jax.tree.leaves(moment):
          local = x.addressable_shards[0].data.shape
          if shape == {"data": 8} and any(n % 8 == 0 for n in x.shape):
            assert np.prod(local) * 8 == x.size, (name, x.shape, local)
          if any(n % 2 == 0 for n in x.shape):
            assert np.prod(local) < x.size, (name, shape, x.shape, local)
      if name == "t5" and "tensor" in shape:
        emb = state.params["token_embedder"]["embedding"]
        assert emb.sharding.spec == P(None, "fsdp"), emb.sharding.spec
      print(f"ok {name} {shape}", flush=True)


def test_sharded_dp_step_equals_one_device_step():
  env = xla_env.with_devices(8, PYTHONPATH=REPO + os.pathsep
                         + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
  done = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
  assert len(done) == 2 * len(MESHES) + 1, proc.stdout


if __name__ == "__main__":
  _sharded_run()
