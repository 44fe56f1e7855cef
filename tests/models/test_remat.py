"""Layer rematerialisation (`remat='layer'`) of T5 and GPT-2 against the same
models without it: same params tree, loss, clipped gradient sum and decoded
tokens; ghost clipping (a second backward pass through the rematerialised
layers) gives the plain model's vmap-clipped sum.

Every remat-vs-plain comparison runs both programs on the same params and
inputs; the plain model is the independent computation.
"""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import primitives

from dpjax.training import checkpoints, step as step_lib
from dpjax.generation import decoding
from dpjax.models import gpt2, t5
from dpjax.models import trainable as trainable_lib
from dpjax.privacy import clipping, ghost

VOCAB = 97
N = 4
# XLA's CPU optimisations dominate the compile time of these tiny programs
# and change no compared result beyond float rounding.
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def t5_config(remat):
  return t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                     num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
                     dropout_rate=0.1, remat=remat)


def gpt2_config(remat):
  return gpt2.GPT2Config(vocab_size=VOCAB, n_positions=32, d_model=32,
                         num_layers=2, num_heads=4, dropout_rate=0.1,
                         remat=remat)


def t5_batch(rng):
  tok = lambda n: rng.integers(1, VOCAB, (N, n)).astype(np.int32)
  enc, dec = tok(10), tok(8)
  enc[1, 6:] = 0
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
          "decoder_target_tokens": tok(8),
          "decoder_loss_weights": np.ones((N, 8), np.float32)}


def gpt2_batch(rng):
  weights = np.ones((N, 12), np.float32)
  weights[:, :3] = 0  # prompt
  return {"tokens": rng.integers(1, VOCAB, (N, 12)).astype(np.int32),
          "loss_weights": weights}


MODELS = {
    "t5": (t5_config, t5_batch,
           lambda c: t5.init_params(c, jax.random.PRNGKey(0), input_length=10,
                                    target_length=8)),
    "gpt2": (gpt2_config, gpt2_batch,
             lambda c: gpt2.init_params(c, jax.random.PRNGKey(0),
                                        max_length=12)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  """(name, {remat: config}, {remat: params}, batch with dropout keys)."""
  make_config, make_batch, init = MODELS[request.param]
  configs = {r: make_config(r) for r in t5.REMATS}
  params = {r: init(c)[0] for r, c in configs.items()}
  batch = make_batch(np.random.default_rng(0))
  batch["dropout_rng"] = jax.random.split(jax.random.PRNGKey(3), N)
  return request.param, configs, params, batch


def make_example_loss(name, config):
  return (t5 if name == "t5" else gpt2).make_example_loss(config)


def test_params_tree_is_unchanged(model):
  _, _, params, _ = model
  plain, remat = params["none"], params["layer"]
  assert (jax.tree_util.tree_structure(remat)
          == jax.tree_util.tree_structure(plain))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_array_equal(a, b)


def test_loss_and_clipped_grad_sum_match(model):
  """With dropout on: remat must recompute the same dropout masks."""
  name, configs, params, batch = model
  mask = np.array([1, 1, 0, 1], np.float32)
  results = {}
  for r, config in configs.items():
    clipped = clipping.clipped_grad(make_example_loss(name, config),
                                    clip_norm=0.5)
    results[r] = jit(clipped)(params["none"], batch, mask)
  results["ghost"] = jit(ghost.ghost_clipped_grad(
      make_example_loss(name, configs["layer"]), clip_norm=0.5))(
          params["none"], batch, mask)
  plain, plain_stats = results["none"]
  assert int(plain_stats.num_clipped) > 0  # the clip is exercised
  for method in ("layer", "ghost"):
    got, stats = results[method]
    np.testing.assert_allclose(stats.losses, plain_stats.losses, rtol=1e-5)
    np.testing.assert_allclose(stats.norms, plain_stats.norms, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(got)):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_gradient_rematerialises_every_layer(model):
  """The backward pass of the remat model holds one jax.checkpoint of a
  layer's weights per layer (so remat is in effect, not only accepted); the
  plain one none (it rematerialises only its attention core, which takes no
  weights: `common.scaled_attention`)."""
  name, configs, params, batch = model
  example = jax.tree.map(lambda x: x[0], batch)

  def count(jaxpr):
    return sum(e.primitive is primitives.remat_p
               and any(v.aval.ndim == 2 for v in e.invars)  # weight matrices
               for e in jaxpr.eqns) + sum(
        count(j) for j in jax.extend.core.subjaxprs(jaxpr))

  layers = (configs["none"].num_encoder_layers
            + configs["none"].num_decoder_layers if name == "t5"
            else configs["none"].num_layers)
  for r, expected in (("none", 0), ("layer", layers)):
    grad = jax.grad(make_example_loss(name, configs[r]))
    assert count(jax.make_jaxpr(grad)(params["none"], example).jaxpr) == (
        expected)


def test_decoding_matches(model):
  name, configs, params, batch = model
  p = params["none"]
  out = {}
  for r, config in configs.items():
    config = dataclasses.replace(config, dropout_rate=0.0)
    if name == "t5":
      out[r] = decoding.generate(config, p, batch["encoder_input_tokens"],
                                 max_length=6, rng=jax.random.PRNGKey(1),
                                 top_k=5)
    else:
      out[r] = decoding.generate_causal(
          config, p, batch["tokens"][:, :5], np.array([5, 3, 4, 1]),
          max_new_tokens=6, rng=jax.random.PRNGKey(1), top_k=5)
  np.testing.assert_array_equal(out["layer"], out["none"])
  assert len(np.unique(np.asarray(out["none"]))) > 2  # not a degenerate run


def test_ghost_sites_inside_remat(model):
  """The layers' kernels stay ghost sites under remat, marked as such, and
  book-keeping (their taps return their factors) sums what the second pass
  ('auto' under remat) does."""
  name, configs, params, batch = model
  example = jax.tree.map(lambda x: x[0], batch)
  sites = {r: ghost.find_sites(make_example_loss(name, c), params["none"],
                               example) for r, c in configs.items()}
  assert [s.param for s in sites["layer"]] == [s.param for s in sites["none"]]
  assert not any(s.remat for s in sites["none"])
  assert {s.param for s in sites["layer"] if s.remat} == {
      s.param for s in sites["none"] if "layers_" in s.param}
  loss = make_example_loss(name, configs["layer"])
  mask = np.ones(N, np.float32)
  kept, kept_stats = ghost.ghost_clipped_grad(
      loss, clip_norm=1.0, summation="book_keeping")(params["none"], batch, mask)
  passed, stats = ghost.ghost_clipped_grad(loss, clip_norm=1.0)(
      params["none"], batch, mask)
  np.testing.assert_allclose(kept_stats.norms, stats.norms, rtol=1e-5)
  for k, p in zip(jax.tree.leaves(kept), jax.tree.leaves(passed)):
    np.testing.assert_allclose(k, p, rtol=1e-4, atol=1e-6)


def test_trainer_ghost_with_remat_equals_vmap():
  """The trainer's ghost step on a remat model accumulates what its vmap
  step on the plain model does, its sum formed by the second pass ('auto'
  under remat) or by book-keeping (`ghost_summation`)."""
  batch = gpt2_batch(np.random.default_rng(1))
  batch = jax.tree.map(lambda x: x.reshape((2, N // 2) + x.shape[1:]), batch)
  mask = np.ones((2, N // 2), np.float32)
  kw = dict(clip_norm=0.3, optimizer="sgd", learning_rate=0.1,
            noise_multiplier=1.0, normalizer=4.0, seed=0)
  sums = {}
  for remat, method, summation in (("none", "vmap", "auto"),
                                   ("layer", "ghost", "auto"),
                                   ("layer", "ghost", "book_keeping")):
    model = trainable_lib.trainable(gpt2_config(remat), {"targets": 12})
    params = gpt2.init_params(model.config, jax.random.PRNGKey(0),
                              max_length=12)[0]
    _, accumulate, _ = step_lib.build_dp_step(
        model, clipping_method=method, ghost_summation=summation, **kw)
    zeros = {"loss": jax.tree.map(jnp.zeros_like, params)}
    sums[method, summation], _ = jit(accumulate)(params, zeros, batch, mask,
                                                 0, 0)
  want = jax.tree.leaves(sums["vmap", "auto"])
  for key in (("ghost", "auto"), ("ghost", "book_keeping")):
    for a, b in zip(want, jax.tree.leaves(sums[key])):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_config_field():
  cfg = t5_config("layer")
  assert t5.T5Config.from_json(cfg.to_json()) == cfg
  # Checkpoints written before the field existed read back without remat.
  old = {k: v for k, v in cfg.to_json().items() if k != "remat"}
  assert t5.T5Config.from_json(old).remat == "none"
  for make in (t5_config, gpt2_config):
    with pytest.raises(ValueError, match="remat"):
      make("full")


def test_runs_resume_and_initialise_across_remat_settings():
  """The trainer's model comparison (resume, INITIAL_CHECKPOINT_PATH) ignores
  remat, including a checkpoint written before the field existed, but not
  an architecture change."""
  saved_before_field = {k: v for k, v in checkpoints.model_json(gpt2_config("none")).items()
                        if k != "remat"}
  now = checkpoints.architecture(checkpoints.model_json(gpt2_config("layer")))
  checkpoints.check_compatible(checkpoints.architecture(saved_before_field), now, "model")
  assert checkpoints.architecture(saved_before_field) in checkpoints.model_and_parts(
      gpt2_config("layer"))
  wider = checkpoints.model_json(dataclasses.replace(gpt2_config("none"), d_model=64))
  with pytest.raises(checkpoints.CheckpointMismatchError, match="d_model"):
    checkpoints.check_compatible(checkpoints.architecture(wider), now, "model")


def test_t5_norm_keeps_its_input_not_its_float32_copy():
  """T5's RMS norm takes its statistics in float32, but its backward pass
  keeps the bf16 input (and the scale), not the float32 copy autodiff of the
  expression as written would keep; the gradients are that expression's."""
  norm = t5.LayerNorm(dtype=jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 32)),
                  jnp.bfloat16)
  params = jax.tree.map(lambda p: p + 0.1,  # not all ones / zeros
                        nn.unbox(norm.init(jax.random.PRNGKey(0), x)))

  def as_written(params, x):  # the same expression, not rematerialised
    p = params["params"]
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True)
                            + norm.epsilon)
    return y.astype(jnp.bfloat16) * p["scale"].astype(jnp.bfloat16)

  g = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.bfloat16)
  kept = {}
  for name, f in (("norm", norm.apply), ("as_written", as_written)):
    out, vjp = jax.vjp(f, params, x)
    kept[name] = sum(a.nbytes for a in jax.tree.leaves(vjp))
    kept[name + " grads"] = vjp(g)
    kept[name + " out"] = out
  params_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
  assert kept["norm"] <= x.nbytes + params_bytes
  assert kept["as_written"] >= 2 * x.nbytes  # the float32 copy
  np.testing.assert_array_equal(np.float32(kept["norm out"]),
                                np.float32(kept["as_written out"]))
  for a, b in zip(jax.tree.leaves(kept["norm grads"]),
                  jax.tree.leaves(kept["as_written grads"])):
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2,
                               atol=1e-2)
