"""Vmapped teacher groups against teachers trained one at a time by a plain
optax loop; groups sharded over two devices and their top-k cache against
the 1-device group and an explicit softmax."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.models import gpt2
from dpjax.pipelines.seqpate import cache, teachers
from tests import xla_env

CONFIG = gpt2.GPT2Config(vocab_size=50, n_positions=16, d_model=16,
                         num_layers=1, num_heads=2, dropout_rate=0.0)
LENGTH, BATCH, EPOCHS, LR = 8, 4, 2, 0.5
PSEUDO = 3  # pseudo sentences the cache covers
SETUP = teachers.TeacherSetup(batch_size=BATCH, epochs=EPOCHS,
                              learning_rate=LR, group_size=2, seed=5, top_k=4,
                              inference_chunk=2)
# Teacher 2 has 3 examples: a padded batch, then a step with no real row.
ASSIGNMENT = np.array([0, 1, 2] * 3 + [0, 1] * 5, np.int32)
# Private rows: random tokens, a few padded tails with zero loss weight.
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(0, CONFIG.vocab_size, (len(ASSIGNMENT), LENGTH),
                       dtype=np.int32)
WEIGHTS = np.ones(TOKENS.shape, np.float32)
WEIGHTS[::4, -3:] = 0
WEIGHTS[:, 0] = 0


def optimizer():
  # SGD keeps float differences small; Adam would blow up the rounding noise
  # of gradients that are zero in exact arithmetic (e.g. key biases).
  return optax.sgd(LR, momentum=0.9)


def full_softmax(params, tokens):
  """[G, P, L, V] float64 next-token distributions, teacher by teacher."""
  model = gpt2.GPT2(CONFIG)
  out = []
  for t in range(jax.tree.leaves(params)[0].shape[0]):
    logits = np.asarray(model.apply(
        {"params": jax.tree.map(lambda x: x[t], params)}, tokens), np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    out.append(p / p.sum(-1, keepdims=True))
  return np.stack(out)


@pytest.fixture(scope="module")
def init_params():
  return gpt2.init_params(CONFIG, jax.random.key(1), max_length=LENGTH)[0]


@pytest.fixture(scope="module")
def schedule():
  return teachers.batch_schedule(ASSIGNMENT, [0, 1, 2], batch_size=BATCH,
                                 epochs=EPOCHS, seed=5, num_teachers=3)


@pytest.fixture(scope="module")
def vmapped(init_params, schedule):
  opt = optimizer()
  train = teachers.make_group_train(CONFIG, opt)
  params = teachers.stack(init_params, 3)
  keys = jax.vmap(lambda t: jax.random.fold_in(jax.random.key(0), t))(
      jnp.arange(3))
  params, _, losses = train(params, jax.vmap(opt.init)(params),
                            TOKENS, WEIGHTS, schedule, keys, 0)
  return params, np.asarray(losses)


def test_schedule_gives_each_teacher_its_own_examples_once_per_epoch(schedule):
  per_epoch = schedule.shape[0] // EPOCHS
  assert schedule.shape == (EPOCHS * 2, 3, BATCH) and per_epoch == 2
  for t in range(3):
    members = np.flatnonzero(ASSIGNMENT == t)
    for e in range(EPOCHS):
      rows = schedule[e * per_epoch:(e + 1) * per_epoch, t].ravel()
      assert sorted(rows[rows >= 0].tolist()) == members.tolist()
  assert (schedule[1, 2] == -1).all()  # teacher 2: a step with no real row
  again = teachers.batch_schedule(ASSIGNMENT, [2, -1], batch_size=BATCH,
                                  epochs=EPOCHS, seed=5, num_teachers=3)
  np.testing.assert_array_equal(again[:, 0], schedule[:, 2])  # group-independent
  assert (again[:, 1] == -1).all()


def reference_teacher(init_params, rows_per_step):
  """One teacher alone: the optimizer on the mean token cross-entropy of its
  real rows; steps without rows are skipped."""
  model = gpt2.GPT2(CONFIG)
  opt = optimizer()

  def loss(params, tokens, weights):
    logp = jax.nn.log_softmax(model.apply({"params": params}, tokens)[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return (nll * weights[:, 1:]).sum() / weights[:, 1:].sum()

  @jax.jit
  def step(params, state, tokens, weights):
    value, grads = jax.value_and_grad(loss)(params, tokens, weights)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params, state, values = init_params, opt.init(init_params), []
  for rows in rows_per_step:
    rows = rows[rows >= 0]
    if len(rows):
      params, state, value = step(params, state, TOKENS[rows], WEIGHTS[rows])
      values.append(float(value))
  return params, values


def test_vmapped_group_equals_teachers_trained_alone(init_params, schedule,
                                                     vmapped):
  group_params, losses = vmapped
  for t in range(3):
    alone, values = reference_teacher(init_params, schedule[:, t])
    mine = jax.tree.map(lambda x: x[t], group_params)
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(mine)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4,
                                 atol=2e-6)
    real = (schedule[:, t] >= 0).any(-1)
    np.testing.assert_allclose(losses[real, t], values, rtol=1e-5)
  # The teachers differ from each other and from the initial params.
  w = np.asarray(group_params["decoder_norm"]["scale"])
  assert not np.allclose(w[0], w[1]) and not np.allclose(w[0], 1.0)


_SHARDED = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from dpjax.pipelines.seqpate import teachers
    from tests.seqpate import test_teachers as t
    mesh = teachers.teacher_mesh()
    assert mesh.size == 2
    init = t.gpt2.init_params(t.CONFIG, jax.random.key(1), max_length=t.LENGTH)[0]
    stacked = teachers.shard_teachers(teachers.stack(init, 2), mesh)
    assert [s.data.shape[0] for s in
            stacked["decoder_norm"]["scale"].addressable_shards] == [1, 1]
    teachers.train_and_cache(t.CONFIG, init, t.TOKENS, t.WEIGHTS, t.ASSIGNMENT,
                             t.TOKENS[:t.PSEUDO], sys.argv[1], t.SETUP,
                             mesh=mesh, optimizer=t.optimizer())
""")


def test_train_and_cache_on_two_devices_matches_the_vmapped_group(
    init_params, vmapped, tmp_path):
  """Groups of 2 teachers, one per device (teacher 2 with a padding slot),
  cache the top-k of the same teachers as the 1-device group of 3."""
  env = xla_env.with_devices(2)
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path)], check=True,
                 env=env, cwd=root, timeout=600)
  paths = cache.group_paths(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["group-0000.npz",
                                                 "group-0001.npz"]
  params, _ = vmapped
  probs = full_softmax(params, TOKENS[:PSEUDO])  # [3, P, L, V]
  for path, members in zip(paths, ([0, 1], [2])):
    with np.load(path) as group:
      assert group["teacher_ids"].tolist() == members
      ids, got = group["token_ids"], group["probs"]
    assert ids.shape == (len(members), PSEUDO, LENGTH, SETUP.top_k)
    want = np.take_along_axis(probs[members], ids, -1)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)
    assert (np.diff(want, axis=-1) <= 1e-6).all()  # most likely first
    # They are each teacher's top-k: nothing outside is more likely.
    outside = probs[members].copy()
    np.put_along_axis(outside, ids, -1.0, -1)
    assert (outside.max(-1) <= want.min(-1) + 1e-6).all()
  sums = cache.TeacherSums.from_cache(
      str(tmp_path), 3, pseudo_fingerprint=cache.fingerprint(TOKENS[:PSEUDO]))
  assert sums.values.max() <= 3 + 1e-6
  # A second run resumes: every group file exists, nothing is redone.
  mtimes = [os.path.getmtime(p) for p in paths]
  teachers.train_and_cache(CONFIG, init_params, TOKENS, WEIGHTS, ASSIGNMENT,
                           TOKENS[:PSEUDO], str(tmp_path), SETUP,
                           log=lambda _: pytest.fail("retrained a group"))
  assert [os.path.getmtime(p) for p in paths] == mtimes
