"""Ghost-norm clipping against vmap clipping and an explicit per-example loop.

The models are tiny (one layer per stack) so that the compilations stay short;
each model's batch holds a padding row full of garbage (NaN loss weights,
out-of-range ids), a real example forced non-finite, dropout keys, and a clip
norm that clips some examples but not all.
"""

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.models import gpt2, t5
from dpjax.privacy import clipping, clipping_method, ghost, ghost_algebra

N = 6
VOCAB = 97
PAD_ROW, NONFINITE_ROW = 2, 4
MASK = np.array([1, 1, 0, 1, 1, 1], np.float32)
# XLA's CPU backend optimisations cost most of the compile time of these
# (tiny, run-once) programs and change no result the tests compare.
jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def random_params(abstract, seed=0):
  """Gaussian params of the model's shapes (no init compilation). Norm
  scales and biases are randomized too, so their gradients are not special."""
  rng = np.random.RandomState(seed)

  def draw(path, x):
    name = path[-1].key
    noise = rng.standard_normal(x.shape).astype(np.float32)
    if name == "scale":
      return jnp.asarray(1.0 + 0.1 * noise)
    if name == "kernel":
      return jnp.asarray(noise / np.sqrt(x.shape[0]))
    return jnp.asarray(0.3 * noise)  # embeddings, biases, relpos tables

  return jax.tree_util.tree_map_with_path(draw, abstract)


def t5_problem(**overrides):
  fields = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.1)
  cfg = t5.T5Config(**{**fields, **overrides})
  params = random_params(t5.abstract_params(cfg, input_length=8,
                                            target_length=8)[0])
  rng = np.random.RandomState(0)
  # Encoder length 64, decoder length 8: 'auto' takes the direct path in
  # the encoder (64 x 97 <= 2 * 64^2) and the ghost path in the decoder.
  enc = rng.randint(1, VOCAB, (N, 64)).astype(np.int32)
  enc[:, 50:] = 0
  dec = rng.randint(1, VOCAB, (N, 8)).astype(np.int32)
  weights = np.ones((N, 8), np.float32)
  weights[:, 6:] = 0.0
  enc[PAD_ROW, :3] = [10**6, -5, -10**6]
  weights[PAD_ROW] = np.nan
  weights[NONFINITE_ROW, 0] = np.inf
  batch = dict(encoder_input_tokens=enc, decoder_input_tokens=dec,
               decoder_target_tokens=np.roll(dec, -1, axis=1),
               decoder_loss_weights=weights)
  return t5.make_example_loss(cfg), params, batch


def gpt2_problem(**overrides):
  fields = dict(vocab_size=VOCAB, n_positions=32, d_model=64, num_layers=1,
                num_heads=4)
  cfg = gpt2.GPT2Config(**{**fields, **overrides})
  params = random_params(gpt2.abstract_params(cfg, max_length=8)[0])
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, VOCAB, (N, 12)).astype(np.int32)
  weights = np.ones((N, 12), np.float32)
  weights[:, :4] = 0.0  # the prompt
  tokens[PAD_ROW, :2] = [VOCAB + 3, -200]
  weights[PAD_ROW] = np.nan
  weights[NONFINITE_ROW, 5] = np.inf
  return gpt2.make_example_loss(cfg), params, dict(tokens=tokens,
                                                   loss_weights=weights)


PROBLEMS = {
    "t5": t5_problem,
    "t5.1.1": functools.partial(t5_problem, feed_forward="gated-gelu",
                                tie_embeddings=False),
    "gpt2": gpt2_problem,
}


def with_dropout(batch, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), N)
  return dict(batch, dropout_rng=keys)


def leaves64(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def assert_close(got, want, rtol=1e-5):
  """Float32 sums: relative, with an absolute slack scaled to the leaf
  (rounding of large entries) plus a floor (leaves that are zero in exact
  arithmetic, like attention key biases, hold rounding noise)."""
  np.testing.assert_allclose(got, want, rtol=rtol,
                             atol=rtol * np.abs(want).max() + 1e-6)


def loop_reference(loss, params, batch):
  """Python loop over examples: jax.grad of each, float64 norms."""
  grad_fn = jit(jax.value_and_grad(loss))
  grads, norms, finite = [], [], []
  for i in range(N):
    value, grad = grad_fn(params, jax.tree.map(lambda x: x[i], batch))
    grad = leaves64(grad)
    norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in grad))
    grads.append(grad)
    norms.append(norm)
    finite.append(math.isfinite(float(value)) and math.isfinite(norm))
  return grads, np.array(norms), np.array(finite)


@pytest.fixture(scope="module")
def problems():
  """name -> (loss, params, batch, reference, clip norm, vmap result)."""
  out = {}
  for name, make in PROBLEMS.items():
    loss, params, batch = make()
    batch = with_dropout(batch)
    grads, norms, finite = loop_reference(loss, params, batch)
    keep = (MASK > 0) & finite
    clip = float(np.median(norms[keep]))  # clips about half of them
    expected_sum = [sum(grads[i][j] * min(1.0, clip / norms[i])
                        for i in range(N) if keep[i])
                    for j in range(len(grads[0]))]
    vmap_result = jit(clipping.clipped_grad(loss, clip_norm=clip))(
        params, batch, MASK)
    out[name] = (loss, params, batch, (expected_sum, np.where(keep, norms, 0)),
                 clip, vmap_result)
  return out


def first_example(batch):
  return jax.tree.map(lambda x: x[0], batch)


# 'auto' on T5 mixes the paths on the tied table (direct encoder lookup,
# ghost decoder lookup and projection); forced 'ghost' on T5.1.1 pairs its
# two lookups of one table; forced 'direct' on GPT-2 sums its lookup and
# projection of one table. The second pass taps the single-site kernels and
# records the tied tables; with remat ('layer') the kernels sit inside
# jax.checkpoint, 'auto' summation is the second pass, and book-keeping
# takes their factors out as their taps' cotangents. The references
# are computed without remat.
@pytest.mark.parametrize("name, norm, microbatch_size, summation, remat", [
    ("t5", "auto", None, "auto", "none"),
    ("t5.1.1", "ghost", None, "auto", "none"),
    ("gpt2", "direct", 2, "auto", "none"),
    ("gpt2", "direct", None, "second_pass", "none"),
    ("t5", "auto", 2, "auto", "layer"),
    ("t5", "auto", None, "book_keeping", "layer"),
])
def test_matches_vmap_and_loop(problems, name, norm, microbatch_size,
                               summation, remat):
  loss, params, batch, (expected_sum, expected_norms), clip, vmap_result = (
      problems[name])
  if remat != "none":
    loss = PROBLEMS[name](remat=remat)[0]
  sites = ghost.find_sites(loss, params, first_example(batch), norm=norm)
  paths = {s.norm for s in sites}
  assert paths == ({"ghost", "direct"} if norm == "auto" else {norm})
  assert any(s.remat for s in sites) == (remat != "none")
  fn = ghost.ghost_clipped_grad(loss, clip_norm=clip, norm=norm,
                                microbatch_size=microbatch_size,
                                summation=summation)
  assert fn.sensitivity == clip
  compiled = jit(fn)
  got, stats = compiled(params, batch, MASK)
  want, want_stats = vmap_result

  assert {g.dtype for g in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
  for g, v, e in zip(leaves64(got), leaves64(want), expected_sum):
    assert_close(g, v)
    assert_close(g, e)
  np.testing.assert_allclose(stats.norms, expected_norms, rtol=1e-5)
  np.testing.assert_allclose(stats.norms, want_stats.norms, rtol=1e-5)
  np.testing.assert_allclose(stats.losses, want_stats.losses, rtol=1e-6)
  assert int(stats.num_nonfinite) == 1 == int(want_stats.num_nonfinite)
  assert int(stats.num_examples) == int(MASK.sum())
  kept = int(np.sum(expected_norms > 0))
  assert 0 < int(stats.num_clipped) == int(want_stats.num_clipped) < kept
  # The dropout keys are used: other keys, another sum.
  other, _ = compiled(params, with_dropout(batch, seed=1), MASK)
  assert any(not np.allclose(o, g, atol=1e-4)
             for o, g in zip(leaves64(other), leaves64(got)))


@pytest.mark.parametrize("name, tied", [("t5", 3), ("t5.1.1", 2),
                                        ("gpt2", 2)])
def test_sites_are_the_kernels_and_embeddings(problems, name, tied):
  """Every kernel and embedding table is large, norm scales, biases and
  T5's relative position tables are not (a naming rule, independent of the
  interception)."""
  loss, params, batch = problems[name][:3]
  sites = ghost.find_sites(loss, params, first_example(batch))
  paths = [jax.tree_util.keystr(p)
           for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert {s.param for s in sites} == {
      p for p in paths if p.endswith(("['kernel']", "['embedding']"))}
  token = "['token_embedder']['embedding']"
  assert len([s for s in sites if s.param == token]) == tied
  assert len({s.key for s in sites}) == len(sites)


def all_shapes(jaxpr):
  for eqn in jaxpr.eqns:
    yield from (tuple(v.aval.shape) for v in eqn.outvars)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from all_shapes(sub)


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_no_per_example_gradient_of_large_params(problems, remat):
  loss, params, batch = problems["t5"][:3]
  loss = t5_problem(remat=remat)[0]
  # Encoder length 16: no activation or Gram is shaped like a parameter.
  batch = dict(batch,
               encoder_input_tokens=batch["encoder_input_tokens"][:, :16])
  large = {s.shape for s in ghost.find_sites(loss, params,
                                             first_example(batch))}
  per_example = {(N,) + shape for shape in large}

  def shapes(fn):
    return set(all_shapes(jax.make_jaxpr(fn)(params, batch, MASK).jaxpr))

  assert per_example <= shapes(clipping.clipped_grad(loss, clip_norm=1.0))
  assert not per_example & shapes(
      ghost.ghost_clipped_grad(loss, clip_norm=1.0, norm="ghost"))


def test_bfloat16_compute_close_to_vmap():
  loss, params, batch = gpt2_problem(dtype="bfloat16")
  got, stats = jit(ghost.ghost_clipped_grad(loss, clip_norm=5.0))(
      params, batch, MASK)
  want, want_stats = jit(clipping.clipped_grad(loss, clip_norm=5.0))(
      params, batch, MASK)
  # Ghost forms A^T B in float32 from the bf16 factors (the logits'
  # gradient rounded to bf16 too), vmap's backward pass rounds A^T B to
  # bf16: close, not equal.
  np.testing.assert_allclose(stats.norms, want_stats.norms, rtol=1e-3)
  assert {g.dtype for g in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
  scale = max(np.abs(w).max() for w in leaves64(want))
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          leaves64(want)):
    if jax.tree_util.keystr(path).endswith("['key']['bias']"):
      # Zero in exact arithmetic (a softmax ignores a constant per query):
      # both hold rounding noise, below the rounding of the largest sums.
      np.testing.assert_allclose(g, w, atol=1e-2 * scale)
    else:
      assert_close(np.asarray(g, np.float64), w, rtol=1e-2)


def bfloat16_rounded_down(x) -> np.ndarray:
  """float32 `x >= 0` cut to its leading 8 significant bits."""
  bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
  return bits.view(np.float32)


@pytest.mark.parametrize("model", ["gpt2", "t5"])
def test_bfloat16_contributions_have_the_clipped_norm(model):
  """Under bf16 compute the tied projection's factor is its logits'
  gradient rounded to bf16; the norm and the sum must both be of that
  rounded gradient. The clip weight min(1, C / norm) is rounded down to
  bf16 (book-keeping's exact two-part products need it), so each example
  adds exactly that weight times its norm: at most C, at most 2^-7 below
  min(C, norm)."""
  loss, params, batch = (gpt2_problem if model == "gpt2" else t5_problem)(
      dtype="bfloat16")
  example = jax.tree.map(lambda x: x[0], batch)
  attend = [s for s in ghost.find_sites(loss, params, example)
            if s.kind == "attend"]
  assert [s.dtype for s in attend] == [jnp.dtype(jnp.bfloat16)]
  assert attend[0].output.dtype == jnp.float32  # the logits
  clip = jit(ghost.ghost_clipped_grad(loss, clip_norm=1.0))
  clipped = 0
  for i in np.flatnonzero(MASK):
    alone = np.where(np.arange(N) == i, 1.0, 0.0).astype(np.float32)
    got, stats = clip(params, batch, alone)
    if not np.isfinite(stats.norms[i]) or stats.norms[i] == 0:
      continue  # dropped (non-finite): adds zero, tested elsewhere
    norm = np.sqrt(sum(np.sum(g ** 2) for g in leaves64(got)))
    weight = bfloat16_rounded_down(
        np.float32(1) / np.maximum(stats.norms[i], np.float32(1)))
    clipped += weight < 1
    # Float32 sums: within 2e-7 here; a sum of the unrounded gradient
    # under the rounded one's norm is off by 1.5e-6 to 9e-6.
    np.testing.assert_allclose(norm, weight * np.float64(stats.norms[i]),
                               rtol=5e-7)
    assert (1 - 2.0 ** -7) * min(1.0, stats.norms[i]) <= norm * (1 + 5e-7)
    assert norm <= min(1.0, stats.norms[i]) * (1 + 5e-7)
  assert clipped  # the rounding was exercised


class TiedToy(nn.Module):
  """Embedding lookup, a dense layer and the tied projection."""

  @nn.compact
  def __call__(self, ids):
    embed = gpt2.Embed(11, 8, ("vocab", "embed"), name="embed")
    hidden = gpt2.Dense(16, ("embed", "mlp"), 0.5, name="dense")(embed(ids))
    return embed.attend(jnp.tanh(hidden[..., :8]))


TOY = TiedToy()
TOY_PARAMS = nn.meta.unbox(
    TOY.init(jax.random.PRNGKey(0), jnp.zeros(5, jnp.int32))["params"])
TOY_BATCH = {"ids": jax.random.randint(jax.random.PRNGKey(1), (4, 5), 0, 11)}


def toy_loss(params, example):
  return jnp.mean(jax.nn.logsumexp(
      TOY.apply({"params": params}, example["ids"]), axis=-1))


def decayed_toy_loss(params, example):
  """Also reads the dense kernel outside the Dense call."""
  return toy_loss(params, example) + 0.1 * jnp.sum(
      params["dense"]["kernel"] ** 2)


@pytest.mark.parametrize("loss, large", [
    (toy_loss, {"['embed']['embedding']", "['dense']['kernel']"}),
    (decayed_toy_loss, {"['embed']['embedding']"}),
])
def test_param_used_outside_sites_is_small(loss, large):
  sites = ghost.find_sites(loss, TOY_PARAMS, first_example(TOY_BATCH))
  assert {s.param for s in sites} == large
  mask = jnp.array([1.0, 0.0, 1.0, 1.0])
  got, stats = ghost.ghost_clipped_grad(loss, clip_norm=0.5)(
      TOY_PARAMS, TOY_BATCH, mask)
  want, want_stats = clipping.clipped_grad(loss, clip_norm=0.5)(
      TOY_PARAMS, TOY_BATCH, mask)
  for g, w in zip(leaves64(got), leaves64(want)):
    assert_close(g, w)
  np.testing.assert_allclose(stats.norms, want_stats.norms, rtol=1e-5)


def test_make_clipped_grad_selects():
  mask = jnp.ones(4)
  per_example_kernel = (4,) + TOY_PARAMS["dense"]["kernel"].shape

  def shapes(method):
    fn = clipping_method.make_clipped_grad(toy_loss, clip_norm=1.0, method=method)
    assert fn.sensitivity == 1.0
    return set(all_shapes(
        jax.make_jaxpr(fn)(TOY_PARAMS, TOY_BATCH, mask).jaxpr))

  assert per_example_kernel in shapes("vmap")
  assert per_example_kernel not in shapes("ghost")
  assert per_example_kernel not in shapes("auto")

  # No flax model, no sites: 'auto' is vmap clipping, 'ghost' refuses.
  def plain_loss(w, x):
    return jnp.sum(w * x)
  xs = jnp.array([[3.0, 4.0], [0.3, 0.4]])
  auto = clipping_method.make_clipped_grad(plain_loss, clip_norm=1.0)
  np.testing.assert_allclose(auto(jnp.zeros(2), xs, jnp.ones(2))[0],
                             [0.9, 1.2], rtol=1e-6)
  with pytest.raises(ValueError, match="no intercepted site"):
    ghost.ghost_clipped_grad(plain_loss, clip_norm=1.0)(
        jnp.zeros(2), xs, jnp.ones(2))


class Block(nn.Module):
  """A dense layer, applied once or (`twice`) twice."""
  twice: bool = False

  @nn.compact
  def __call__(self, x):
    dense = gpt2.Dense(4, ("embed", "mlp"), 0.5, name="dense")
    y = jnp.tanh(dense(x))
    return dense(y) if self.twice else y


class RematToy(nn.Module):
  twice: bool = False

  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)(self.twice, name="block")(x)


REMAT_PARAMS = nn.meta.unbox(RematToy().init(
    jax.random.PRNGKey(0), jnp.zeros((3, 4)))["params"])
REMAT_BATCH = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 4))


def remat_toy_loss(params, x):
  return jnp.sum(RematToy().apply({"params": params}, x) ** 2)


def doubled_kernel_loss(params, x):
  """The kernel reaches the layer doubled: the call's parameter is computed,
  not a leaf, so it cannot be a site (a tap's norm would be of the doubled
  kernel's gradient, half the leaf's)."""
  dense = dict(params["block"]["dense"], kernel=2 * params["block"]["dense"]["kernel"])
  return remat_toy_loss({"block": {"dense": dense}}, x)


@pytest.mark.parametrize("loss, sites", [
    (remat_toy_loss, [("['block']['dense']['kernel']", True)]),
    (doubled_kernel_loss, []),
])
def test_remat_sites_are_leaves_passed_unchanged(loss, sites):
  assert [(s.param, s.remat) for s in ghost.find_sites(
      loss, REMAT_PARAMS, REMAT_BATCH[0])] == sites
  stats = assert_matches_vmap(clipping_method.make_clipped_grad, loss,
                              REMAT_PARAMS)
  assert int(stats.num_clipped) > 0


def assert_matches_vmap(make, loss, params):
  """`make(loss, clip_norm=0.5)`'s sum and norms on REMAT_BATCH equal vmap
  clipping's; returns its stats."""
  mask = jnp.array([1.0, 1.0, 0.0, 1.0])
  want, want_stats = clipping.clipped_grad(loss, clip_norm=0.5)(
      params, REMAT_BATCH, mask)
  got, stats = make(loss, clip_norm=0.5)(params, REMAT_BATCH, mask)
  np.testing.assert_allclose(stats.norms, want_stats.norms, rtol=1e-5)
  for g, w in zip(leaves64(got), leaves64(want)):
    assert_close(g, w)
  return stats


def test_refuses_a_remat_module_called_twice():
  """Its norm needs the cross term of the two calls' factors, which a
  rematerialised call cannot record."""
  params = nn.meta.unbox(RematToy(twice=True).init(
      jax.random.PRNGKey(0), jnp.zeros((3, 4)))["params"])

  def loss(params, x):
    return jnp.sum(RematToy(twice=True).apply({"params": params}, x))

  with pytest.raises(ValueError, match="2 ghost sites.*rematerialised"):
    ghost.find_sites(loss, params, REMAT_BATCH[0])


@pytest.mark.parametrize("remat, summation, loop", [
    ("none", "auto", "unrolled"), ("none", "second_pass", "loop"),
    ("layer", "auto", "loop"), ("layer", "book_keeping", "loop")])
def test_scanned_layers_match_the_unrolled_per_example_loop(remat, summation,
                                                            loop):
  """`T5Config.scan_layers`: each layer kernel is one site on its stacked
  leaf, whose factors its sink can carry out of the loop, rematerialised
  or not (book-keeping; 'auto' takes the second pass under remat), and the
  clipped sum and norms equal the float64 loop over the unrolled model's
  examples every way. The loop unrolled into straight-line code (a cost
  program's `scan_unrolled`) gives the same, and its program does not
  copy the layers' factors into one stack (jax's unrolled scan stacks
  them by concatenation, where the loop writes them in place). (No
  dropout: the scan draws a layer's mask from its split of the key, the
  unrolled model from its module path.)"""
  layers = dict(num_encoder_layers=2, num_decoder_layers=2)
  loss, params, batch = t5_problem(**layers)
  scanned_loss = t5_problem(**layers, scan_layers=True, remat=remat,
                            scan_unrolled=loop == "unrolled")[0]
  grads, norms, finite = loop_reference(loss, params, batch)
  keep = (MASK > 0) & finite
  clip = float(np.median(norms[keep]))
  expected = [sum(grads[i][j] * min(1.0, clip / norms[i])
                  for i in range(N) if keep[i]) for j in range(len(grads[0]))]
  stacked = t5.scan_params(params)
  sites = ghost.find_sites(scanned_loss, stacked, first_example(batch))
  in_loop = {jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(stacked)[0]
             if "['layers']" in jax.tree_util.keystr(p)
             and jax.tree_util.keystr(p).endswith("['kernel']")}
  assert {s.param for s in sites if s.scanned} == in_loop
  assert all(s.remat == (remat == "layer") for s in sites if s.scanned)
  assert all(s.sink and s.unrolled == (loop == "unrolled")
             for s in sites if s.scanned)
  assert not any(s.scanned for s in sites if s.param not in in_loop)
  clipped = jit(ghost.ghost_clipped_grad(
      scanned_loss, clip_norm=clip, summation=summation)).lower(
          stacked, batch, MASK).compile()
  if loop == "unrolled":  # no [layers, examples, T, rows or cols] concatenate
    assert not re.findall(rf"f32\[2,{N},\d+,\d+\]\S* concatenate\(",
                          clipped.as_text())
  got, stats = clipped(stacked, batch, MASK)
  np.testing.assert_allclose(stats.norms, np.where(keep, norms, 0), rtol=1e-5)
  assert 0 < int(stats.num_clipped) < int(np.sum(keep))
  for g, e in zip(leaves64(t5.unscan_params(got)), expected):
    assert_close(g, e)


class ScanToy(nn.Module):
  """`Block` looped twice over stacked params (`nn.scan`)."""
  twice: bool = False

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(lambda block, c: (block(c), None), variable_axes={"params": 0},
                   split_rngs={"params": True}, length=2,
                   metadata_params={nn.PARTITION_NAME: "layers"})
    return scan(Block(self.twice, name="block"), x)[0]


def test_a_scanned_module_is_a_site_once_and_refused_twice():
  """Called once per loop body its stacked kernel is one site of the
  layer's shape, book-kept through its sink; in a loss that rebuilds the
  params tree (the sink never reaches the module) it is tapped and summed
  by the second pass; called twice, its norm needs the cross term the
  loop cannot give out, and it is refused."""
  params = nn.meta.unbox(ScanToy().init(jax.random.PRNGKey(0),
                                        jnp.zeros((3, 4)))["params"])
  loss = lambda p, x: jnp.sum(ScanToy().apply({"params": p}, x) ** 2)
  (site,) = ghost.find_sites(loss, params, REMAT_BATCH[0])
  assert (site.param, site.shape, site.scanned, site.sink) == (
      "['block']['dense']['kernel']", (4, 4), True, True)
  assert_matches_vmap(functools.partial(ghost.ghost_clipped_grad,
                                        summation="book_keeping"),
                      loss, params)

  treedef = jax.tree.structure(params)
  rebuilt = lambda p, x: loss(jax.tree.unflatten(treedef, jax.tree.leaves(p)),
                              x)
  (site,) = ghost.find_sites(rebuilt, params, REMAT_BATCH[0])
  assert (site.scanned, site.sink) == (True, False)
  assert_matches_vmap(ghost.ghost_clipped_grad, rebuilt, params)
  with pytest.raises(ValueError, match="cannot record"):
    ghost.ghost_clipped_grad(rebuilt, clip_norm=0.5, summation="book_keeping")(
        params, REMAT_BATCH, jnp.ones(4))

  twice = nn.meta.unbox(ScanToy(twice=True).init(
      jax.random.PRNGKey(0), jnp.zeros((3, 4)))["params"])
  with pytest.raises(ValueError, match="2 ghost sites.*loop body"):
    ghost.find_sites(
        lambda p, x: jnp.sum(ScanToy(twice=True).apply({"params": p}, x)),
        twice, REMAT_BATCH[0])


def test_invalid_arguments():
  with pytest.raises(ValueError, match="method"):
    clipping_method.make_clipped_grad(toy_loss, clip_norm=1.0, method="fast")
  with pytest.raises(ValueError, match="norm"):
    ghost.ghost_clipped_grad(toy_loss, clip_norm=1.0, norm="gram")
  with pytest.raises(ValueError, match="clip_norm"):
    ghost.ghost_clipped_grad(toy_loss, clip_norm=0.0)
  with pytest.raises(ValueError, match="summation"):
    ghost.ghost_clipped_grad(toy_loss, clip_norm=1.0, summation="twice")


def _site(kind, rows, cols, length, dtype):
  """A site of one parameter `[rows, cols]` over `length` positions, whose
  output (gradient) has `dtype`: the algebra's functions read no more."""
  return ghost.Site(key=((), "x", 0), kind=kind, param="p", leaf=0,
                    shape=(rows, cols), length=length,
                    output=jax.ShapeDtypeStruct((length, cols), dtype),
                    norm="ghost", remat=False)


@pytest.mark.parametrize("length", [12, 64, 130, 256])
@pytest.mark.parametrize("kind", ["dense", "lookup", "attend"])
def test_a_sites_own_norm_equals_the_float64_gradient_norm(length, kind):
  rng = np.random.RandomState(length)
  rows, cols = 40, 24
  b = rng.standard_normal((length, cols)).astype(np.float32)
  if kind == "lookup":
    a = rng.randint(0, rows, length).astype(np.int32)
    grad = np.zeros((rows, cols))
    np.add.at(grad, a, b.astype(np.float64))
  else:
    a = rng.standard_normal((length, rows)).astype(np.float32)
    grad = a.astype(np.float64).T @ b.astype(np.float64)
  site = _site(kind, rows, cols, length, jnp.float32)
  own = lambda site, f: ghost_algebra.ghost_inner(site, f, site, f)
  got = float(jax.jit(own, static_argnums=0)(site, (a, b)))
  np.testing.assert_allclose(got, np.sum(grad ** 2), rtol=1e-5)


def test_bfloat16_parts_hold_a_product_of_two_bfloat16_exactly():
  rng = np.random.RandomState(0)
  def bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  u = bf16(rng.standard_normal((3, 50)) * np.exp(rng.uniform(-30, 30, (3, 50))))
  v = bf16(rng.uniform(0.01, 1.0, (3, 1)))  # clip weights
  x = (u * v).astype(np.float32)
  np.testing.assert_array_equal(x, u * v)  # 16 bits: exact in float32
  parts = jax.jit(ghost_algebra.bfloat16_parts)(x)
  assert parts.dtype == jnp.bfloat16 and parts.shape == (3, 100)
  hi, lo = np.split(np.asarray(parts, np.float64), 2, axis=-1)
  np.testing.assert_array_equal(hi + lo, u * v)
  # Rounding to bf16 alone would not do: most need both parts.
  assert np.mean(lo != 0) > 0.9
  # 24 significant bits do not fit in two parts: that is what the rounded
  # weights are for.
  third = np.float32(1 / 3)
  hi, lo = np.asarray(ghost_algebra.bfloat16_parts(
      jnp.asarray([third])), np.float64)
  assert hi + lo != third


def test_pinned_is_the_bfloat16_conversion_by_integer_ops():
  """`pinned` rounds as the conversion does (to nearest, ties to even);
  NaN and inf stay; from the float32 value a compiler may fuse in place of
  a bf16 one, it gives that bf16 value."""
  rng = np.random.RandomState(2)
  wide = (rng.standard_normal(4000) * np.exp(rng.uniform(-40, 40, 4000))
          ).astype(np.float32)
  wide[:7] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1 + 2.0 ** -8,  # a tie
              -np.float32(3.4e38)]
  want = np.asarray(jnp.asarray(wide).astype(jnp.bfloat16), np.float32)
  got = jax.jit(ghost_algebra.pinned)(jnp.asarray(wide).astype(jnp.bfloat16))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  # Its integer ops on the float32 values themselves: the same rounding.
  np.testing.assert_array_equal(
      np.asarray(jax.jit(ghost_algebra.pinned)(wide)), want)


def _pins(fn, *args) -> int:
  """How many bf16 roundings by integer ops (`ghost_algebra.pinned`: a mask
  of the high 16 bits) `fn` lowers to for a TPU."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  return len(re.findall(r"stablehlo.and .*tensor<[^>]*xui32>", text))


def test_a_bfloat16_factor_beside_a_float32_operand_is_pinned():
  """Where a bf16 factor meets float32 arithmetic (a direct site's gradient,
  a float32 output gradient), a compiler allowed excess precision could
  hand the product the float32 value the factor was rounded from, while
  the book-kept sum (pinned) sees the bf16 one: the norm would not be the
  contribution's. Such operands are pinned to their bf16 values; two bf16
  operands need not be (their algorithm takes bf16), nor float32 ones."""
  rng = np.random.RandomState(3)
  t, rows, cols = 16, 24, 40
  a = jnp.asarray(rng.standard_normal((t, rows)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((t, cols)), jnp.bfloat16)
  grad = jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)
  ids = jnp.asarray(rng.randint(0, rows, t))
  dense = _site("dense", rows, cols, t, jnp.bfloat16)
  lookup = _site("lookup", rows, cols, t, jnp.bfloat16)
  a64, b64, g64 = (np.asarray(x, np.float64) for x in (a, b, grad))
  mixed = {
      "dot": (lambda x, y: ghost_algebra.dot(x.T, y), (a, grad[:, :t].T),
              a64.T @ g64[:, :t].T),
      "float32_sum": (ghost_algebra.float32_sum, (a[None], grad[None, :t]),
                      a64.T @ g64[:t]),
      "inner": (lambda g, x, y: ghost_algebra.inner(g, dense, (x, y)),
                (grad, a, b), np.sum(g64 * (a64.T @ b64))),
      "inner of a lookup": (
          lambda g, i, y: ghost_algebra.inner(g, lookup, (i, y)),
          (grad, ids, b), np.sum(g64[np.asarray(ids)] * b64)),
      "site_grad of a lookup": (
          lambda i, y: ghost_algebra.site_grad(lookup, (i, y)), (ids, b),
          np.stack([b64[np.asarray(ids) == r].sum(0) for r in range(rows)])),
  }
  for name, (fn, args, want) in mixed.items():
    assert _pins(fn, *args) >= 1, name
    np.testing.assert_allclose(jax.jit(fn)(*args), want, rtol=2e-6,
                               atol=2e-6 * np.abs(want).max(), err_msg=name)
  # Two bf16 operands, or two float32 ones: nothing to pin.
  assert _pins(lambda x, y: ghost_algebra.dot(x.T, y), a, b) == 0
  assert _pins(lambda x, y: ghost_algebra.dot(x.T, y),
               a.astype(jnp.float32), grad[:, :t].T) == 0


def _dot_operands(lowered) -> list[tuple[str, str]]:
  """The operand types of every dot_general of a lowered program."""
  return re.findall(r"stablehlo.dot_general.*?: \((tensor<[^>]*>), "
                    r"(tensor<[^>]*>)\)", lowered.as_text())


def test_bfloat16_book_keeping_is_the_exact_weighted_sum_in_bfloat16_products():
  """bf16 factors: the clip weights are rounded down to bf16 (never above
  min(1, C / norm), at most 2^-7 below), and the sum is then exact: on a
  GPU from written-out bf16 parts (a float32 operand runs on its CUDA
  cores), on a TPU by the two-part X3 algorithm, elsewhere in float32."""
  rng = np.random.RandomState(1)
  m, length, rows, cols = 5, 16, 24, 40
  a = jnp.asarray(rng.standard_normal((m, length, rows)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((m, length, cols)), jnp.bfloat16)
  weights = rng.uniform(0.01, 1.0, m).astype(np.float32)
  weights[0] = 1.0  # an example not clipped keeps its weight
  keep = np.array([True, True, False, True, True])
  site = _site("dense", rows, cols, length, jnp.bfloat16)
  rounded = bfloat16_rounded_down(weights)
  assert np.all(rounded <= weights) and rounded[0] == 1.0
  assert np.all(rounded > weights * (1 - 2.0 ** -7))
  np.testing.assert_array_equal(
      np.asarray(ghost_algebra.truncated(jnp.asarray(weights))), rounded)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  want = sum(np.float64(rounded[i]) * a64[i].T @ b64[i]
             for i in range(m) if keep[i])
  weighted = (np.where(keep[:, None, None], b64, 0)
              * rounded[:, None, None]).astype(np.float32)
  masked = jnp.where(keep[:, None, None], a, 0)
  for got in (jax.jit(ghost_algebra.book_keeping, static_argnums=0)(
                  site, a, b, weights, keep),
              jax.jit(ghost_algebra.bfloat16_parts_sum)(masked, weighted),
              jax.jit(ghost_algebra.two_part_sum)(masked, weighted)):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-6,
                               atol=2e-6 * abs(want).max())
  traced = jax.jit(ghost_algebra.book_keeping, static_argnums=0).trace(
      site, a, b, weights, keep)
  bf16 = f"tensor<{m}x{length}x{rows}xbf16>"
  assert _dot_operands(traced.lower(lowering_platforms=("cuda",))) == [
      (bf16, f"tensor<{m}x{length}x{2 * cols}xbf16>")]
  tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert re.findall(r"dot_general.*?algorithm = <([^>]*)>", tpu) == [
      "lhs_precision_type = bf16, rhs_precision_type = bf16, "
      "accumulation_type = f32, lhs_component_count = 1, "
      "rhs_component_count = 1, num_primitive_operations = 3, "
      "allow_imprecise_accumulation = false"]
  # A float32 output gradient keeps its float32 weights and HIGHEST sum:
  # two bf16 parts would not hold its 24 bits.
  wide = jnp.asarray(b, jnp.float32) + 2.0 ** -12
  np.testing.assert_allclose(
      jax.jit(ghost_algebra.book_keeping, static_argnums=0)(
          site, a, wide, weights, keep),
      sum(np.float64(weights[i]) * a64[i].T @ np.asarray(wide[i], np.float64)
          for i in range(m) if keep[i]),
      rtol=2e-6, atol=2e-6 * abs(want).max())
  lowered = jax.jit(ghost_algebra.book_keeping, static_argnums=0).trace(
      site, a, wide, weights, keep).lower(lowering_platforms=("tpu",))
  assert _dot_operands(lowered) == [
      (bf16, f"tensor<{m}x{length}x{cols}xf32>")]
  assert "algorithm" not in lowered.as_text()
