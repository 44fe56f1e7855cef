"""LoRA adapters (dpjax.models.lora): the base model at zero-initialised B,
the adapter's own arithmetic, adapter-only clipped sums against an explicit
per-example loop in float64, and a DP update that leaves every frozen leaf
exactly as it was (no gradient, no noise)."""
import dataclasses
import functools
import json
import math
import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import configurables
from dpjax import errors, gin_cli, pretrained
from dpjax.training import state as state_lib, step as step_lib
from dpjax.models import dual_encoder, gpt2, gpt2_disc, lora, t5, trainable
from dpjax.privacy.mechanisms import multi_loss
from dpjax.privacy import clipping, clipping_method, ghost
from dpjax.pretrained import peft
from dpjax.privacy.secret import RunSecret

LORA = lora.LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "mlp"))
T5 = t5.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                 num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
GPT2 = gpt2.GPT2Config(vocab_size=64, n_positions=16, d_model=32,
                       num_layers=1, num_heads=4, dropout_rate=0.0)
LENGTHS = {"t5": {"inputs": 8, "targets": 8}, "gpt2": {"targets": 12}}
N = 5


def model(name, lora_config=LORA):
  config = (T5 if name == "t5" else GPT2).__class__(
      **{**(T5 if name == "t5" else GPT2).to_json(), "lora": lora_config})
  return trainable.trainable(config, LENGTHS[name])


def batch(name, seed=0):
  rng = np.random.RandomState(seed)
  if name == "t5":
    dec = rng.randint(1, 64, (N, 8)).astype(np.int32)
    return dict(encoder_input_tokens=rng.randint(1, 64, (N, 8)).astype(np.int32),
                decoder_input_tokens=dec,
                decoder_target_tokens=np.roll(dec, -1, 1),
                decoder_loss_weights=np.ones((N, 8), np.float32))
  return dict(tokens=rng.randint(0, 64, (N, 12)).astype(np.int32),
              loss_weights=np.ones((N, 12), np.float32))


def without_adapters(tree):
  if isinstance(tree, dict):
    return {k: without_adapters(v) for k, v in tree.items()
            if not k.endswith(lora.SUFFIX)}
  return tree


def with_random_b(params, seed=1):
  """Adapters with nonzero B (as after training), so their grads matter."""
  rng = np.random.RandomState(seed)
  def draw(path, x):
    names = [k.key for k in path]
    if any(n.endswith(lora.SUFFIX) for n in names) and names[-2] == "b":
      return jnp.asarray(0.3 * rng.standard_normal(x.shape), jnp.float32)
    return x
  return jax.tree_util.tree_map_with_path(draw, params)


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_zero_initialised_b_is_the_base_model(name):
  adapted = model(name)
  base = model(name, None)
  params, _ = adapted.init_params(jax.random.PRNGKey(0))
  b = batch(name)
  got = adapted.batch_loss(params, b)
  want = base.batch_loss(without_adapters(params), b)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Every targeted projection has its adapter, and only those.
  paths = {jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]}
  adapters = {p for p in paths if lora.SUFFIX in p}
  assert adapters and all("key_lora" not in p for p in adapters)
  assert any("wo_lora" in p for p in adapters)


def test_the_adapter_adds_scale_x_a_b():
  x = np.random.RandomState(0).standard_normal((3, 6)).astype(np.float32)
  adapter = lora.Adapter(LORA, 5, ("embed", "mlp"), jnp.float32)
  params = nn.unbox(adapter.init(jax.random.PRNGKey(0), x, True))
  params = jax.tree.map(lambda p: p + 0.5, params)  # B nonzero
  a = np.asarray(params["params"]["a"]["kernel"], np.float64)
  b = np.asarray(params["params"]["b"]["kernel"], np.float64)
  got = adapter.apply(params, x, True)
  np.testing.assert_allclose(got, LORA.alpha / LORA.rank * (x @ a @ b),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("train, extra", [("lora_only", set()),
                                          ("lora_norms_biases",
                                           {"scale", "bias"})])
def test_the_mask_trains_adapters_and_what_train_adds(train, extra):
  m = model("gpt2", lora.LoRAConfig(train=train))
  shapes = m.abstract_params()[0]
  mask = m.trainable_mask(shapes)
  for path, trains in jax.tree_util.tree_flatten_with_path(mask)[0]:
    names = [k.key for k in path]
    expected = (any(n.endswith(lora.SUFFIX) for n in names)
                or names[-1] in extra)
    assert trains == expected, names


@pytest.fixture(scope="module", params=["t5", "gpt2"])
def dp_step(request):
  """A LoRA model's DP step (vmap clipping), params with nonzero B, and the
  clipped sum by an explicit per-example loop in float64."""
  name = request.param
  m = model(name)
  params = with_random_b(m.init_params(jax.random.PRNGKey(0))[0])
  clip = 0.05
  tx, accumulate, apply = step_lib.build_dp_step(
      m, clip_norm=clip, optimizer="sgd", learning_rate=1.0,
      noise_multiplier=1.0, normalizer=float(N), seed=0,
      clipping_method="vmap")
  b = batch(name)
  trains = jax.tree.leaves(m.trainable_mask(params))
  want = [np.zeros(x.shape) for x in jax.tree.leaves(params)]
  grad = jax.jit(jax.grad(m.example_loss))
  for i in range(N):
    g = [np.asarray(x, np.float64) * t for x, t in zip(
        jax.tree.leaves(grad(params, jax.tree.map(lambda x: x[i], b))),
        trains)]
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g))
    for w, x in zip(want, g):
      w += x * min(1.0, clip / norm)
  assert any(np.abs(w).max() > 0 for w, t in zip(want, trains) if t)
  return m, params, clip, tx, accumulate, apply, b, want


def assert_sum_is(got_tree, want, m, params):
  trains = jax.tree.leaves(m.trainable_mask(params))
  for got, w, t in zip(jax.tree.leaves(got_tree), want, trains):
    if not t:
      assert not np.any(np.asarray(got)), "a frozen leaf has a gradient"
    np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-7)


def test_adapter_only_clipped_sum_equals_a_per_example_loop(dp_step):
  m, params, _, _, accumulate, _, b, want = dp_step
  zeros = {multi_loss.LOSS: jax.tree.map(jnp.zeros_like, params)}
  sums, _ = jax.jit(accumulate)(params, zeros,
                                jax.tree.map(lambda x: x[None], b),
                                np.ones((1, N), np.float32), 0, 0)
  assert_sum_is(sums[multi_loss.LOSS], want, m, params)


@pytest.mark.parametrize("norm", ["auto", "ghost"])
def test_ghost_clipping_of_the_adapters_equals_the_loop(dp_step, norm):
  # 'auto' takes the direct path at the thin adapter factors, 'ghost' the
  # Gram identity; the frozen kernels are no sites.
  m, params, clip, _, _, _, b, want = dp_step
  mask = m.trainable_mask(params)
  make = functools.partial(ghost.ghost_clipped_grad, clip_norm=clip,
                           norm=norm)
  f = clipping.trained_only(make, m.example_loss, mask, clip)
  sums, _ = jax.jit(f)(params, b, np.ones(N, np.float32))
  assert_sum_is(sums, want, m, params)
  example = jax.tree.map(lambda x: x[0], b)
  sites = ghost.find_sites(m.example_loss, params, example)
  flags = jax.tree.leaves(mask)
  assert {lora.SUFFIX in s.param for s in sites if flags[s.leaf]} == {True}
  assert clipping_method.resolved(m.example_loss, params, example,
                                  trainable=mask) == "ghost"


def test_frozen_leaves_get_no_update_and_no_noise(dp_step):
  m, params, clip, tx, _, apply, _, _ = dp_step
  state = state_lib.init_state(params, tx)
  zeros = {multi_loss.LOSS: jax.tree.map(jnp.zeros_like, params)}
  # Zero sums: whatever moves is noise (sigma C / N per coordinate).
  new = jax.jit(apply)(state, zeros, RunSecret.draw().noise_key())
  trains = jax.tree.leaves(m.trainable_mask(params))
  for old, now, t in zip(jax.tree.leaves(params), jax.tree.leaves(new.params),
                         trains):
    if t:
      moved = np.asarray(now) - np.asarray(old)
      assert np.std(moved) == pytest.approx(clip / N, rel=0.5)
    else:
      np.testing.assert_array_equal(now, old)


def test_a_ghost_lora_step_builds_and_multi_loss_ghost_is_refused():
  step_lib.build_dp_step(model("gpt2"), clip_norm=1.0, optimizer="sgd",
                      learning_rate=1.0, noise_multiplier=1.0, normalizer=1.0,
                      seed=0, clipping_method="ghost")
  disc = trainable.trainable(
      gpt2_disc.GPT2DiscConfig(lm=GPT2, label_token_ids=(5, 6)),
      LENGTHS["gpt2"])
  with pytest.raises(errors.UsageError, match="several losses"):
    step_lib.build_dp_step(disc, clip_norm=1.0, optimizer="sgd",
                        learning_rate=1.0, noise_multiplier=1.0,
                        normalizer=1.0, seed=0, clipping_method="ghost")


def test_config_round_trips_and_rejects_bad_values():
  config = model("t5").config
  assert t5.T5Config.from_json(config.to_json()) == config
  for bad in (dict(rank=0), dict(targets=("x",)), dict(train="all"),
              dict(dropout=1.0)):
    with pytest.raises(ValueError):
      lora.LoRAConfig(**bad)


def test_a_pretrained_start_loads_the_base_and_initialises_the_adapters(
    tmp_path):
  base = model("gpt2", None)
  base_params, _ = base.init_params(jax.random.PRNGKey(3))
  pretrained.export_hf(base_params, base.config, tmp_path)
  adapted = model("gpt2")
  key = jax.random.PRNGKey(5)
  params = pretrained.load_pretrained(tmp_path, adapted.config, rng=key)
  got_base, got_adapters = lora.split(params)
  jax.tree.map(np.testing.assert_array_equal, got_base, base_params)
  # The adapters a run without a checkpoint would start from (B = 0).
  want = lora.split(adapted.init_params(key)[0])[1]
  jax.tree.map(np.testing.assert_array_equal, got_adapters, want)
  assert (jax.tree.structure(lora.merge(got_base, got_adapters))
          == jax.tree.structure(params))


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_the_merged_export_computes_what_the_adapted_model_does(name, tmp_path):
  adapted = model(name)
  params = with_random_b(adapted.init_params(jax.random.PRNGKey(0))[0])
  pretrained.export_hf(params, adapted.config, tmp_path)
  base = model(name, None)
  loaded = pretrained.load_pretrained(tmp_path, base.config)
  b = batch(name)
  np.testing.assert_allclose(base.batch_loss(loaded, b),
                             adapted.batch_loss(params, b), rtol=1e-5)
  # And not merely the base model's: the adapters changed the loss.
  assert not np.allclose(base.batch_loss(without_adapters(params), b),
                         adapted.batch_loss(params, b), rtol=1e-5)


def test_the_dual_encoders_t5_encoder_takes_adapters(tmp_path):
  config = dual_encoder.DualEncoderConfig(
      encoder=t5.T5Config(**{**T5.to_json(), "lora": LORA}))
  m = trainable.trainable(config, {"queries": 8, "documents": 8})
  params, _ = m.init_params(jax.random.PRNGKey(0))
  mask = m.trainable_mask(params)
  trained = [jax.tree_util.keystr(p) for p, t in
             jax.tree_util.tree_flatten_with_path(mask)[0] if t]
  assert trained and all(lora.SUFFIX in p for p in trained)
  assert all("encoder" in p for p in trained)
  # A pretrained T5 start: its encoder, and fresh adapters (B = 0).
  t5_params, _ = model("t5", None).init_params(jax.random.PRNGKey(1))
  pretrained.export_hf(t5_params, T5, tmp_path)
  loaded = pretrained.load_pretrained(tmp_path, config,
                                      rng=jax.random.PRNGKey(2))
  base, adapters = lora.split(loaded)
  jax.tree.map(np.testing.assert_array_equal, base,
               dual_encoder.params_from_t5(t5_params))
  assert jax.tree.structure(loaded) == jax.tree.structure(params)


def test_a_discriminator_models_gpt2_takes_adapters():
  config = gpt2_disc.GPT2DiscConfig(
      lm=gpt2.GPT2Config(**{**GPT2.to_json(), "lora": LORA}),
      label_token_ids=(5, 6), frozen_layers=(0,))
  m = trainable.trainable(config, LENGTHS["gpt2"])
  mask = m.trainable_mask(m.abstract_params()[0])
  for path, trains in jax.tree_util.tree_flatten_with_path(mask)[0]:
    key = jax.tree_util.keystr(path)
    # The head trains; in the GPT-2 only adapters outside frozen layer 0.
    assert trains == (gpt2_disc.HEAD in key or (
        lora.SUFFIX in key and "layers_0" not in key)), key


def test_a_discriminator_models_pretrained_start_with_adapters(tmp_path):
  config = gpt2_disc.GPT2DiscConfig(
      lm=gpt2.GPT2Config(**{**GPT2.to_json(), "lora": LORA}),
      label_token_ids=(5, 6))
  base_params, _ = model("gpt2", None).init_params(jax.random.PRNGKey(3))
  pretrained.export_hf(base_params, GPT2, tmp_path)
  key = jax.random.PRNGKey(4)
  loaded = pretrained.load_pretrained(tmp_path, config, rng=key)
  fresh = gpt2_disc.init_params(config, key, max_length=12)[0]
  base, adapters = lora.split(gpt2_disc.lm_params(loaded))
  jax.tree.map(np.testing.assert_array_equal, base, base_params)
  # As a run without a checkpoint initialises them (up to the last bit of
  # a jitted normal draw).
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  jax.tree.map(close, adapters, lora.split(gpt2_disc.lm_params(fresh))[1])
  jax.tree.map(close, loaded[gpt2_disc.HEAD], fresh[gpt2_disc.HEAD])


@pytest.mark.parametrize("size", ["base", "xl"])
def test_the_lora_paper_gin_files_train_adapters_only(size):
  gin_cli.configure([f"msmarco_t5_{size}_eps3_lora.gin"], [])
  try:
    config = configurables.run_config()
  finally:
    gin.clear_config()
  assert config.model_config.lora == lora.LoRAConfig(
      rank=8, alpha=16.0, targets=("q", "k", "v", "o"))
  assert config.model_dir.endswith(f"msmarco_t5_{size}_eps3_lora")


def peft_reference(base_dir, peft_dir, fan_in_fan_out):
  """The HF weights PEFT computes from an adapter directory, by its
  documented rule: W + (alpha_m / r_m) B A for each target module m
  ([out, in]; transposed for Conv1D, `fan_in_fan_out`)."""
  from safetensors import numpy as st_numpy
  config = json.loads((pathlib.Path(peft_dir) / "adapter_config.json").read_text())
  weights = dict(st_numpy.load_file(str(pathlib.Path(base_dir) / "model.safetensors")))
  adapters = st_numpy.load_file(str(pathlib.Path(peft_dir) / "adapter_model.safetensors"))
  for module in config["target_modules"]:
    a = adapters[f"base_model.model.{module}.lora_A.weight"].astype(np.float64)
    b = adapters[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
    r = config["rank_pattern"].get(module, config["r"])
    alpha = config["alpha_pattern"].get(module, config["lora_alpha"])
    assert a.shape[0] == b.shape[1] == r
    delta = alpha / r * (b @ a)
    weights[f"{module}.weight"] = weights[f"{module}.weight"] + (
        delta.T if fan_in_fan_out else delta)
  return weights


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_the_peft_export_is_what_peft_computes_on_the_base(name, tmp_path):
  from safetensors import numpy as st_numpy
  adapted = model(name)
  params = with_random_b(adapted.init_params(jax.random.PRNGKey(0))[0])
  base_dir, peft_dir, merged_dir = (tmp_path / d for d in ("base", "peft",
                                                            "merged"))
  pretrained.export_hf(lora.split(params)[0], model(name, None).config,
                       base_dir)
  files = peft.export_adapters(params, adapted.config, peft_dir,
                               base=peft.describe_base(base_dir))
  assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors",
                           "base_model.json"]
  pretrained.export_hf(params, adapted.config, merged_dir)
  merged = st_numpy.load_file(str(merged_dir / "model.safetensors"))
  want = peft_reference(base_dir, peft_dir, fan_in_fan_out=name == "gpt2")
  assert set(merged) == set(want)
  for k in merged:
    np.testing.assert_allclose(want[k], merged[k], rtol=1e-5, atol=1e-6)
  config = json.loads((peft_dir / "adapter_config.json").read_text())
  if name == "gpt2":  # query and value share c_attn: one adapter of rank 2r
    assert config["rank_pattern"] == {"transformer.h.0.attn.c_attn": 8}
    assert config["alpha_pattern"] == {"transformer.h.0.attn.c_attn": 16.0}
  assert config["base_model_name_or_path"] == "base"  # never a local path


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_a_peft_directory_loads_back_as_the_adapted_model(name, tmp_path):
  adapted = model(name)
  params = with_random_b(adapted.init_params(jax.random.PRNGKey(0))[0])
  pretrained.export_hf(lora.split(params)[0], model(name, None).config,
                       tmp_path / "base")
  peft.export_adapters(params, adapted.config, tmp_path / "peft",
                       base=peft.describe_base(tmp_path / "base"))
  loaded = pretrained.load_pretrained(tmp_path / "peft", adapted.config,
                                      base_path=tmp_path / "base")
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_peft_export_refuses_what_the_layout_cannot_hold(tmp_path):
  trains_norms = model("gpt2", dataclasses.replace(LORA,
                                                   train="lora_norms_biases"))
  params = trains_norms.init_params(jax.random.PRNGKey(0))[0]
  with pytest.raises(pretrained.CheckpointError, match="merged"):
    peft.export_adapters(params, trains_norms.config, tmp_path / "a")
  with pytest.raises(pretrained.CheckpointError, match="no LoRA"):
    peft.export_adapters(params, model("gpt2", None).config, tmp_path / "b")
  # A fused module whose B mixes projections is not dpjax's adapters.
  adapted = model("gpt2")
  params = with_random_b(adapted.init_params(jax.random.PRNGKey(0))[0])
  peft.export_adapters(params, adapted.config, tmp_path / "c")
  from safetensors import numpy as st_numpy
  file = tmp_path / "c" / "adapter_model.safetensors"
  tensors = st_numpy.load_file(str(file))
  tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"][:] = 1.0
  st_numpy.save_file(tensors, str(file))
  with pytest.raises(pretrained.CheckpointError, match="mixes"):
    peft.load_adapters(tmp_path / "c", adapted.config)


def test_a_pretrained_start_under_a_gin_lora_binding(tmp_path):
  """With `T5Config.lora = @LoRAConfig()` bound (as a gin file does), the
  config read from config.json picks the binding up too: the adapters are
  not part of a checkpoint's architecture, so the start still loads."""
  base = model("t5", None)
  base_params, _ = base.init_params(jax.random.PRNGKey(3))
  pretrained.export_hf(base_params, base.config, tmp_path)
  gin.clear_config()
  try:
    gin.parse_config(["T5Config.lora = @LoRAConfig()", "LoRAConfig.rank = 4"])
    adapted = model("t5")
    params = pretrained.load_pretrained(tmp_path, adapted.config,
                                        rng=jax.random.PRNGKey(0))
  finally:
    gin.clear_config()
  jax.tree.map(np.testing.assert_array_equal, lora.split(params)[0],
               base_params)
