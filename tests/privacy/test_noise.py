"""Gaussian noise keyed by the run secret, `privatizer`, and the DP optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import randomgen
from scipy import special, stats

from dpjax.privacy import noise
from dpjax.privacy import optimizers
from dpjax.privacy.secret import RunSecret

SECRET = RunSecret.pinned(7).noise_key()


def key_data(keys):
  return np.asarray(jax.random.key_data(keys))


def test_noise_key_is_both_halves_folded_with_stream_and_step():
  k = noise.noise_key(SECRET, 3)
  for half, key in zip(SECRET.reshape(2, 2), k):
    expected = jax.random.fold_in(jax.random.fold_in(
        jax.random.wrap_key_data(jnp.asarray(half)),
        noise.NOISE_STREAM_CONSTANT), 3)
    np.testing.assert_array_equal(jax.random.key_data(key),
                                  jax.random.key_data(expected))


def test_noise_key_of_a_traced_step_equals_the_python_ints():
  np.testing.assert_array_equal(
      key_data(noise.noise_key(SECRET, 3)),
      key_data(noise.noise_key(SECRET, jnp.int32(3))))


def test_noise_key_differs_at_another_step():
  assert not np.array_equal(key_data(noise.noise_key(SECRET, 3)),
                            key_data(noise.noise_key(SECRET, 4)))


def test_noise_key_differs_for_another_secret():
  other = RunSecret.pinned(8).noise_key()
  assert not np.array_equal(key_data(noise.noise_key(SECRET, 3)),
                            key_data(noise.noise_key(other, 3)))


def standard_normal_0(shape=(1000,)):
  return np.asarray(noise.standard_normal(noise.noise_key(SECRET, 0), shape))


def randomgen_blocks(key, counters):
  """Threefry-4x32-20 blocks from randomgen's build of Random123 (an
  independent implementation): one uint32[4] block per counter row."""
  out = []
  for counter in counters:
    gen = randomgen.ThreeFry(number=4, width=32, key=0)
    state = gen.state
    state["state"]["key"] = np.asarray(key, np.uint32)
    # randomgen steps its counter (a 128-bit integer, word 0 the lowest)
    # before a block: start it one below.
    value = sum(int(w) << (32 * i) for i, w in enumerate(counter)) - 1
    state["state"]["counter"] = np.asarray(
        [(value % 2**128 >> (32 * i)) & 0xFFFFFFFF for i in range(4)],
        np.uint32)
    gen.state = state
    out.append(gen.random_raw(4).astype(np.uint32))
  return np.asarray(out)


@pytest.mark.parametrize("rolled", [False, True])
def test_threefry4x32_is_random123s(rolled):
  """Random123's known answer for the zero key and counter, and randomgen's
  blocks for random keys and counters (words carrying into word 1 too),
  straight-line and rolled."""
  zero = np.asarray(noise.threefry4x32([0] * 4, [0] * 4, rolled))
  np.testing.assert_array_equal(
      zero, [0x9C6CA96A, 0xE17EAE66, 0xFC10ECD4, 0x5256A7D8])
  rng = np.random.default_rng(0)
  key = rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32)
  counters = rng.integers(0, 2**32, (6, 4), dtype=np.uint64).astype(np.uint32)
  counters[0, 0] = 0
  got = np.stack(noise.threefry4x32(key, counters.T, rolled), axis=1)
  np.testing.assert_array_equal(got, randomgen_blocks(key, counters))


def reference_bits(keys, shape):
  """The draw's bits recomputed from randomgen's blocks, numbered by
  row-major index: where the rows (axis -2) are a multiple of 32, block b's
  word w gives the w-th of four runs of 8 rows (block b = (matrix, run of
  32 rows, row in the run of 8, column)); elsewhere block p's first word
  gives position p."""
  key = np.asarray(jax.random.key_data(keys)).ravel()
  grouped = len(shape) >= 2 and shape[-2] % 32 == 0
  size = int(np.prod(shape))
  index = np.arange(size // 4 if grouped else size, dtype=np.uint64)
  counters = np.stack([index, index >> 32, 0 * index, 0 * index], 1)
  blocks = randomgen_blocks(key, counters.astype(np.uint32))
  if not grouped:
    return blocks[:, 0].reshape(shape)
  *lead, rows, cols = shape
  blocks = blocks.reshape(*lead, rows // 32, 8, cols, 4)
  return np.moveaxis(blocks, -1, -3).reshape(shape)


@pytest.mark.parametrize("shape", [(1000,), (64, 7), (6, 7), (3, 32, 5),
                                   (32, 3, 5)])
def test_standard_normal_is_threefry4x32_bits_mapped_like_jax(shape):
  """Independent recomputation: randomgen's Threefry-4x32 under the pair's
  128 bits, then `jax.random.normal`'s map in float64 scipy."""
  keys = noise.noise_key(SECRET, 0)
  bits = reference_bits(keys, shape)
  unit = ((bits >> 9) | np.uint32(0x3F800000)).view(np.float32) - 1.0
  low = np.nextafter(np.float32(-1), np.float32(0))
  u = np.maximum(low, unit * (1 - low) + low)
  np.testing.assert_allclose(standard_normal_0(shape), np.sqrt(2) * special.erfinv(
      u.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_accelerators_and_cpus_hash_the_same_bits(monkeypatch):
  """Straight-line code per request (accelerators) and rolled loops (CPUs:
  the small requests laid end to end in one, each larger one alone) both
  give each pair randomgen's bits, laid out as `reference_bits` says."""
  monkeypatch.setattr(noise, "_SHARED_LOOP_BLOCKS", 100)
  keys = noise.noise_key(SECRET, 3)
  stacked = jax.vmap(lambda k: jax.random.split(k, 2), out_axes=1)(keys)
  # Blocks: 112 alone, 200 alone, 2 x 42 shared, 2 x 120 alone, 40 shared.
  requests = [(keys, (64, 7)), (keys, (200,)), (stacked, (6, 7)),
              (stacked, (3, 32, 5)), (keys, (40,))]
  plans = [noise._plan(k, shape) for k, shape in requests]
  bits = lambda b: b
  for draws in (jax.jit(lambda: noise._straight(plans, bits))(),
                jax.jit(lambda: noise._rolled(plans, bits))()):
    for (k, shape), draw in zip(requests, draws):
      pairs = [k] if k.ndim == 1 else list(k)
      np.testing.assert_array_equal(
          draw, np.stack([reference_bits(p, shape) for p in pairs]
                         ).reshape(draw.shape))


def test_positions_are_numbered_one_to_one_past_32_bits():
  """Row-major under 2^32 positions; past it, the leading axis goes to the
  high word (a slice of such a draw, computed without the whole)."""
  low, high = map(np.asarray, noise._positions((5, 3, 4)))
  np.testing.assert_array_equal(low.ravel(), np.arange(60))
  assert not high.any()
  corner = jax.jit(lambda: [x[:, -2:, :3] for x in noise._positions(
      (3, 2**15, 2**16 + 1))])()
  low, high = map(np.asarray, corner)
  cols = np.arange(2**15 - 2, 2**15)[:, None] * (2**16 + 1) + np.arange(3)
  np.testing.assert_array_equal(low, np.broadcast_to(cols, (3, 2, 3)))
  np.testing.assert_array_equal(high, np.broadcast_to(
      np.arange(3)[:, None, None], (3, 2, 3)))


@pytest.mark.parametrize("half", [0, 1])
def test_replacing_either_half_of_the_secret_gives_unrelated_noise(half):
  changed = SECRET.copy()
  changed[2 * half] ^= 1
  other = np.asarray(noise.standard_normal(noise.noise_key(changed, 0),
                                           (1000,)))
  assert abs(np.corrcoef(standard_normal_0(), other)[0, 1]) < 0.15


def test_laplace_is_standard():
  z = np.asarray(noise.standard_laplace(noise.noise_key(SECRET, 1), (20000,)))
  assert stats.kstest(z, stats.laplace.cdf).pvalue > 1e-3


STDDEV = 2.5
# 120k entries each: "a" takes four runs of 8 rows from a block, "b" a
# block per position (`noise._draws`).
ZEROS = {"a": jnp.zeros((320, 375)), "b": jnp.zeros((300, 400))}


@pytest.fixture(scope="module")
def gaussian_noise():
  """N(0, 2.5²) added to two zero leaves of 120k entries (flat)."""
  out = noise.add_gaussian_noise(ZEROS, noise.noise_key(SECRET, 0), STDDEV)
  return np.asarray(out["a"]).ravel(), np.asarray(out["b"]).ravel()


@pytest.mark.parametrize("leaf", [0, 1])
def test_gaussian_noise_has_the_stddev(gaussian_noise, leaf):
  """120k draws per leaf: sample std within ~0.2% (1 sigma) of stddev."""
  assert np.std(gaussian_noise[leaf]) == pytest.approx(STDDEV, rel=0.01)


@pytest.mark.parametrize("leaf", [0, 1])
def test_gaussian_noise_has_mean_zero(gaussian_noise, leaf):
  a = gaussian_noise[leaf]
  assert abs(np.mean(a)) < 5 * STDDEV / np.sqrt(a.size)


@pytest.mark.parametrize("leaf", [0, 1])
def test_gaussian_noise_is_normal(gaussian_noise, leaf):
  a = gaussian_noise[leaf]
  assert stats.kstest(a / STDDEV, "norm").pvalue > 1e-3


def test_gaussian_noise_rows_of_one_block_are_uncorrelated(gaussian_noise):
  """Leaf "a"'s rows 8 apart come from the same blocks' other words."""
  a = gaussian_noise[0].reshape(320, 375)
  assert abs(np.corrcoef(a[0:8].ravel(), a[8:16].ravel())[0, 1]) < 0.06


def test_gaussian_noise_leaves_get_independent_keys(gaussian_noise):
  a, b = gaussian_noise
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.02


def test_gaussian_noise_of_the_same_key_is_the_same(gaussian_noise):
  again = noise.add_gaussian_noise(ZEROS, noise.noise_key(SECRET, 0), STDDEV)
  np.testing.assert_array_equal(gaussian_noise[0],
                                np.asarray(again["a"]).ravel())


# Three leaves of one shape (two with one layout), one of another.
MIXED = {"q": jnp.ones((4, 6)), "o": jnp.zeros((4, 6)), "k": jnp.ones((4, 6)),
         "b": jnp.arange(5.0)}


@pytest.mark.parametrize("layouts, draws", [
    (None, 2),
    ({"q": ("embed", "heads"), "o": ("heads", "embed"),
      "k": ("embed", "heads"), "b": ("embed",)}, 3)])
def test_leaves_drawn_together_get_the_bits_of_a_draw_each(
    layouts, draws, monkeypatch):
  """Leaf i is `leaf + stddev * standard_normal(split i of both keys)`,
  drawn alone: grouping the leaves of one shape and layout changes no bit.
  An accelerator hashes each group once (straight-line); a CPU hashes
  every group in one loop."""
  keys = noise.noise_key(SECRET, 7)
  got = noise.add_gaussian_noise(MIXED, keys, STDDEV, layouts)
  leaves, treedef = jax.tree_util.tree_flatten(MIXED)
  split = jax.vmap(lambda k: jax.random.split(k, len(leaves)))(keys)
  want = treedef.unflatten([
      leaf + STDDEV * noise.standard_normal(split[:, i], leaf.shape)
      for i, leaf in enumerate(leaves)])
  for name in MIXED:
    np.testing.assert_array_equal(got[name], want[name])
  hashes = []
  threefry = noise.threefry4x32
  monkeypatch.setattr(noise, "threefry4x32", lambda key, counter, rolled=False:
                      hashes.append(rolled) or threefry(key, counter, rolled))
  jax.make_jaxpr(lambda t, k: noise.add_gaussian_noise(
      t, k, STDDEV, layouts))(MIXED, keys)
  assert sorted(hashes) == [False] * draws + [True]


BF16 = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)}


def test_gaussian_noise_of_bfloat16_is_float32():
  out = noise.add_gaussian_noise(BF16, noise.noise_key(SECRET, 1), 0.0)
  assert out["w"].dtype == jnp.float32


def test_gaussian_noise_of_zero_stddev_is_identity():
  out = noise.add_gaussian_noise(BF16, noise.noise_key(SECRET, 1), 0.0)
  np.testing.assert_array_equal(out["w"], BF16["w"].astype(jnp.float32))


def _one(sigma, sens, normalizer):
  """A privatizer of one release (a one-loss model's)."""
  return noise.privatizer(noise_multipliers={"loss": sigma},
                          sensitivities={"loss": sens}, normalizer=normalizer)


SIGMA, SENS, NORMALIZER = 1.3, 0.5, 64.0
GRAD_SUM = {"w": jnp.linspace(-3, 3, 200_000).reshape(400, 500)}


@pytest.fixture(scope="module")
def privatized():
  """GRAD_SUM privatized (σ 1.3, sensitivity 0.5, normaliser 64) as
  releases 0 and 1."""
  privatize = jax.jit(_one(SIGMA, SENS, NORMALIZER))
  return [privatize({"loss": GRAD_SUM}, step, SECRET) for step in (0, 1)]


def test_privatize_adds_calibrated_noise_and_normalizes(privatized):
  residual = (np.asarray(privatized[0]["w"]) * NORMALIZER
              - np.asarray(GRAD_SUM["w"]))
  assert np.std(residual) == pytest.approx(SIGMA * SENS, rel=0.01)


@pytest.mark.parametrize("step", [0, 1])
def test_privatize_is_keyed_by_secret_and_release_count(privatized, step):
  want = noise.add_gaussian_noise(GRAD_SUM, noise.noise_key(SECRET, step),
                                  SIGMA * SENS)["w"] / NORMALIZER
  np.testing.assert_allclose(privatized[step]["w"], want, rtol=1e-6,
                             atol=1e-7)


def test_privatize_draws_fresh_noise_per_release(privatized):
  assert not np.allclose(privatized[0]["w"], privatized[1]["w"])


def test_privatize_without_noise_is_exact_mean():
  grad_sum = {"w": jax.random.normal(jax.random.PRNGKey(2), (5, 7))}
  out = jax.jit(_one(0.0, 1.0, 8.0))({"loss": grad_sum}, 3, SECRET)
  np.testing.assert_array_equal(out["w"], grad_sum["w"] / 8.0)


@pytest.mark.parametrize("kwargs", [
    dict(noise_multiplier=-1.0), dict(sensitivity=0.0), dict(normalizer=0.0)])
def test_privatize_rejects_bad_arguments(kwargs):
  args = dict(noise_multiplier=1.0, sensitivity=1.0, normalizer=1.0) | kwargs
  with pytest.raises(ValueError):
    _one(args["noise_multiplier"], args["sensitivity"], args["normalizer"])


DP = dict(noise_multiplier=0.8, sensitivity=1.5, normalizer=16.0)
SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)


@pytest.mark.parametrize("base", [
    optax.sgd(0.1), optax.sgd(SCHEDULE, momentum=0.9),
    optax.adam(1e-3, b1=0.8), optax.adamw(SCHEDULE, weight_decay=0.1),
    optax.adafactor(1e-2, min_dim_size_to_factor=2),
])
def test_dp_optimizer_equals_manual_noise_scale_base(base):
  """`DPOptimizer.update` is `base` on the noised, normalised sum, release
  `count` keyed by (secret, count), and keeps no counter of its own: its
  state is `base`'s."""
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  grad_sums = [jax.tree_util.tree_map(lambda p, i=i: (i + 1.0) * p + 0.5,
                                      params) for i in range(2)]
  tx = optimizers.dp_optimizer(
      base, noise_multipliers={"loss": DP["noise_multiplier"]},
      sensitivities={"loss": DP["sensitivity"]}, normalizer=DP["normalizer"])
  state, base_state = tx.init(params), base.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(base_state)
  for step, grad_sum in enumerate(grad_sums):
    got, state, _, _ = tx.update({"loss": grad_sum}, state, params, count=step,
                              noise_secret=SECRET)
    noisy = noise.add_gaussian_noise(
        grad_sum, noise.noise_key(SECRET, step),
        DP["noise_multiplier"] * DP["sensitivity"])
    scaled = jax.tree_util.tree_map(lambda x: x / DP["normalizer"], noisy)
    want, base_state = base.update(scaled, base_state, params)
    for g, w in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    params = optax.apply_updates(params, got)


def test_privatize_has_no_default_key():
  grads = {"w": jnp.zeros(3)}
  with pytest.raises(TypeError):
    _one(1.0, 1.0, 1.0)({"loss": grads}, 0)


@pytest.mark.parametrize("target, shape", [("gpu:h100", (12, 768, 3072)),
                                           ("tpu:v5e:2x2", (3, 64, 256))])
def test_a_blocks_rounds_are_computed_once_for_its_four_words(target, shape):
  """Compiled for an accelerator, a value of a draw whose rows take a
  block's four words costs under half the FLOPs of a value of a draw
  taking a block per value (on a GPU 0.41 with the words' barrier; left to
  itself, the GPU compiler fuses the rounds into some words' consumers,
  0.56, and computes those blocks again)."""
  from dpjax.training import step_cost, targets
  device = targets.resolve(target).devices[0]
  one = jax.sharding.SingleDeviceSharding(device)

  def flops_per_value(shape):
    leaf = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=one)
    secret = jax.ShapeDtypeStruct((4,), jnp.uint32, sharding=one)
    with targets.without_persistent_cache():
      compiled = jax.jit(lambda x, s: noise.add_gaussian_noise(
          x, noise.noise_key(s, 0), 1.0)).lower(leaf, secret).compile()
    return step_cost.cost_analysis(compiled)["flops"] / np.prod(shape)

  rows_short_of_32 = (*shape[:-2], shape[-2] - 1, shape[-1])
  assert flops_per_value(shape) < 0.5 * flops_per_value(rows_short_of_32)
