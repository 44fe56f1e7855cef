"""Teacher cache, noisy aggregation (distributions or votes, Gaussian or
Laplace noise) and query accounting, against explicit dense computations,
dp_accounting and the analytic Gaussian mechanism."""
import math
import os

import dp_accounting as dpa
from dp_accounting import rdp
import numpy as np
import pytest
from scipy import optimize, stats

from dpjax.privacy import accounting as privacy_accounting
from dpjax.privacy.ledger import BudgetExceededError
from dpjax.privacy.secret import RunSecret
from dpjax.pipelines.seqpate import accounting, aggregation, cache

M, P, L, V, K = 5, 6, 4, 30, 7
FP = "pseudo"


def random_top_k(rng, shape=(P, L)):
  """Each teacher's top-K ids (distinct) and a sub-probability vector."""
  ids = np.argsort(rng.random(shape + (V,)), -1)[..., :K]
  probs = rng.dirichlet(np.ones(K + 1), size=shape)[..., :K]  # sum < 1
  return ids.astype(np.int32), probs.astype(np.float32)


def write_cache(directory, per_teacher, group_size=2,
                aggregate="distribution"):
  for g, first in enumerate(range(0, len(per_teacher), group_size)):
    members = per_teacher[first:first + group_size]
    cache.write_group(str(directory), g, list(range(first, first + len(members))),
                      np.stack([i for i, _ in members]),
                      np.stack([p for _, p in members]),
                      pseudo_fingerprint=FP, vocab_size=V)
  return cache.TeacherSums.from_cache(str(directory), len(per_teacher),
                                      aggregate=aggregate)


def dense_sum(per_teacher):
  """[P, L, V]: the teachers' top-K probabilities summed, one by one."""
  total = np.zeros((P, L, V))
  for ids, probs in per_teacher:
    for s in range(P):
      for j in range(L):
        for i, p in zip(ids[s, j], probs[s, j]):
          total[s, j, i] += p
  return total


def dense_votes(per_teacher):
  """[P, L, V]: how many teachers have each token as their most likely."""
  total = np.zeros((P, L, V))
  for ids, probs in per_teacher:
    for s in range(P):
      for j in range(L):
        best = max(range(K), key=lambda i: (probs[s, j, i], -i))
        total[s, j, ids[s, j, best]] += 1
  return total


DENSE = {"distribution": dense_sum, "votes": dense_votes}
ALL_TOKENS = np.tile(np.arange(V), (P * L, 1))
ALL_S, ALL_J = np.divmod(np.arange(P * L), L)


@pytest.fixture(scope="module")
def teachers():
  rng = np.random.default_rng(0)
  return [random_top_k(rng) for _ in range(M)]


@pytest.fixture(scope="module")
def cache_dir(teachers, tmp_path_factory):
  directory = tmp_path_factory.mktemp("cache")
  write_cache(directory, teachers)
  return directory


@pytest.fixture(scope="module")
def sums(cache_dir):
  return cache.TeacherSums.from_cache(str(cache_dir), M)


@pytest.fixture(scope="module")
def all_sums(cache_dir):
  return {a: cache.TeacherSums.from_cache(str(cache_dir), M, aggregate=a)
          for a in accounting.AGGREGATES}


def test_restricted_sums_equal_dense_sum(teachers, sums):
  got = sums.restricted(ALL_S, ALL_J, ALL_TOKENS).reshape(P, L, V)
  np.testing.assert_allclose(got, dense_sum(teachers), rtol=1e-6)
  cand = np.array([[3, -1, 0], [V - 1, 5, -1]])
  np.testing.assert_allclose(
      sums.restricted(np.array([1, 4]), np.array([2, 0]), cand),
      np.where(cand >= 0, dense_sum(teachers)[[1, 4], [2, 0]][
          np.arange(2)[:, None], np.maximum(cand, 0)], 0), rtol=1e-6)


def test_cache_rejects_missing_teachers_and_mixed_pseudo_data(teachers,
                                                              tmp_path):
  write_cache(tmp_path, teachers[:3])
  with pytest.raises(ValueError, match="missing \\[3, 4\\]"):
    cache.TeacherSums.from_cache(str(tmp_path), M)
  ids, probs = teachers[3]
  cache.write_group(str(tmp_path), 7, [3], ids[None], probs[None],
                    pseudo_fingerprint="other", vocab_size=V)
  with pytest.raises(ValueError, match="differ"):
    cache.TeacherSums.from_cache(str(tmp_path), 4)


@pytest.mark.parametrize("seed", range(4))
def test_one_teacher_changed_moves_sum_by_at_most_sqrt2(teachers, tmp_path,
                                                        seed):
  rng = np.random.default_rng(100 + seed)
  changed = list(teachers)
  changed[seed % M] = random_top_k(rng)
  before = write_cache(tmp_path / "a", teachers)
  after = write_cache(tmp_path / "b", changed)
  diff = (before.restricted(ALL_S, ALL_J, ALL_TOKENS)
          - after.restricted(ALL_S, ALL_J, ALL_TOKENS))
  norms = np.linalg.norm(diff, axis=-1)
  assert norms.max() <= math.sqrt(2) + 1e-6
  # Restricting to a candidate subset never increases the change.
  subset = ALL_TOKENS[:, ::3]
  sub = (before.restricted(ALL_S, ALL_J, subset)
         - after.restricted(ALL_S, ALL_J, subset))
  assert (np.linalg.norm(sub, axis=-1) <= norms + 1e-12).all()


def test_disjoint_point_masses_reach_sqrt2(teachers, tmp_path):
  def point_mass(token):
    ids = np.broadcast_to((token + np.arange(K)) % V, (P, L, K)).astype(np.int32)
    probs = np.zeros((P, L, K), np.float32)
    probs[..., 0] = 1.0
    return ids, probs

  before = write_cache(tmp_path / "a", teachers[:-1] + [point_mass(0)])
  after = write_cache(tmp_path / "b", teachers[:-1] + [point_mass(1)])
  diff = (before.restricted(ALL_S, ALL_J, ALL_TOKENS)
          - after.restricted(ALL_S, ALL_J, ALL_TOKENS))
  np.testing.assert_allclose(np.linalg.norm(diff, axis=-1), math.sqrt(2),
                             rtol=1e-6)


def test_votes_equal_explicit_top1_histogram(teachers, all_sums):
  got = all_sums["votes"].restricted(ALL_S, ALL_J, ALL_TOKENS)
  np.testing.assert_array_equal(got.reshape(P, L, V), dense_votes(teachers))
  assert (got.sum(-1) == M).all()  # one vote per teacher


@pytest.mark.parametrize("seed", range(3))
def test_one_teacher_changed_moves_votes_by_at_most_sqrt2(teachers, tmp_path,
                                                          seed):
  rng = np.random.default_rng(200 + seed)
  changed = list(teachers)
  changed[seed % M] = random_top_k(rng)
  before = write_cache(tmp_path / "a", teachers, aggregate="votes")
  after = write_cache(tmp_path / "b", changed, aggregate="votes")
  diff = (before.restricted(ALL_S, ALL_J, ALL_TOKENS)
          - after.restricted(ALL_S, ALL_J, ALL_TOKENS))
  assert np.linalg.norm(diff, axis=-1).max() <= math.sqrt(2) + 1e-12
  assert np.abs(diff).sum(-1).max() <= 2  # the Laplace (L1) bound


def test_a_flipped_vote_moves_the_histogram_by_exactly_sqrt2(teachers,
                                                             tmp_path):
  # Teacher 0's top-1 moves from its old top-1 to its old second choice.
  ids, probs = teachers[0]
  order = np.argsort(-probs, -1, kind="stable")
  flipped = probs.copy()
  first = np.take_along_axis(probs, order[..., :1], -1)
  second = np.take_along_axis(probs, order[..., 1:2], -1)
  np.put_along_axis(flipped, order[..., :1], second, -1)
  np.put_along_axis(flipped, order[..., 1:2], first, -1)
  before = write_cache(tmp_path / "a", teachers, aggregate="votes")
  after = write_cache(tmp_path / "b", [(ids, flipped)] + teachers[1:],
                      aggregate="votes")
  diff = (before.restricted(ALL_S, ALL_J, ALL_TOKENS)
          - after.restricted(ALL_S, ALL_J, ALL_TOKENS))
  np.testing.assert_allclose(np.linalg.norm(diff, axis=-1), math.sqrt(2))
  np.testing.assert_array_equal(np.abs(diff).sum(-1), 2)


def test_write_group_keeps_sub_probability_vectors(tmp_path):
  ids = np.tile(np.arange(3, dtype=np.int32), (1, 1, 1, 1))
  probs = np.array([[[[0.5, 0.4, 0.2]]]], np.float32)  # sums to 1.1
  cache.write_group(str(tmp_path), 0, [0], ids, probs, pseudo_fingerprint=FP,
                    vocab_size=V)
  sums = cache.TeacherSums.from_cache(str(tmp_path), 1)
  got = sums.restricted(np.array([0]), np.array([0]), np.array([[0, 1, 2]]))
  np.testing.assert_allclose(got, [[0.5 / 1.1, 0.4 / 1.1, 0.2 / 1.1]],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="token ids"):
    cache.write_group(str(tmp_path), 1, [0], ids + V, probs,
                      pseudo_fingerprint=FP, vocab_size=V)


# ---------------------------------------------------------------------------
# Noise and normalisation.
# ---------------------------------------------------------------------------


def test_noise_scale_before_clipping(sums):
  # Many (sentence, position, token) triples: noisy - noiseless = sigma * Z.
  sigma = 2.5
  n = 400
  s = np.arange(n) % P
  j = (np.arange(n) // P) % L
  queries = (np.arange(n) * 7919) % 10**6  # distinct pseudo sentences ids
  cand = np.tile(np.arange(V), (n, 1))
  noiseless = sums.restricted(s, j, cand)
  noisy = noiseless + sigma * aggregation.standard_noise(
      RunSecret.pinned(11), queries, j, cand)
  z = ((noisy - noiseless) / sigma).ravel()
  assert z.size == 12000
  assert np.std(z) == pytest.approx(1.0, abs=0.02)
  assert abs(np.mean(z)) < 0.03
  assert stats.kstest(z, "norm").pvalue > 1e-3
  # Distinct tokens of one query get independent draws.
  assert abs(np.corrcoef(z.reshape(n, V)[:, 0], z.reshape(n, V)[:, 1])[0, 1]) < 0.15
  # Padding candidates get no noise.
  padded = aggregation.standard_noise(RunSecret.pinned(11), queries[:2], j[:2],
                                        np.array([[1, -1], [-1, 2]]))
  assert padded[0, 1] == 0 and padded[1, 0] == 0


def test_laplace_noise_has_scale_b():
  b, n = 1.7, 12000
  q = np.arange(n) // V
  cand = (np.arange(n) % V).reshape(-1, V)
  noise = b * aggregation.standard_noise(RunSecret.pinned(3), q[::V], q[::V] % L, cand,
                                         "laplace").ravel()
  assert np.mean(np.abs(noise)) == pytest.approx(b, rel=0.03)  # E|X| = b
  assert abs(np.mean(noise)) < 0.05 * b
  assert stats.kstest(noise, stats.laplace(scale=b).cdf).pvalue > 1e-3
  # Not the Gaussian stream rescaled: another distribution.
  assert stats.kstest(noise / np.std(noise), "norm").pvalue < 1e-6


def test_normalize_clips_renormalises_and_falls_back_to_uniform():
  noisy = np.array([[0.5, -0.2, 1.5, 9.0], [-1.0, -0.1, -3.0, 9.0]])
  valid = np.array([[True, True, True, False], [True, True, True, False]])
  got = aggregation.normalize(noisy, valid)
  np.testing.assert_allclose(got, [[0.25, 0, 0.75, 0], [1 / 3, 1 / 3, 1 / 3, 0]])


# ---------------------------------------------------------------------------
# The aggregator: answers, storage, budget.
# ---------------------------------------------------------------------------

Q = 12


def make_aggregator(sums, seed=0, max_queries=Q, scale=None,
                    mechanism="gaussian"):
  ledger = accounting.make_ledger(3.0 if scale is None else math.inf,
                                  max_queries, num_teachers=M,
                                  dataset_size=1000, scale=scale,
                                  mechanism=mechanism,
                                  aggregate=sums.aggregate)
  return aggregation.Aggregator(sums, ledger, secret=RunSecret.pinned(seed),
                               max_candidates=6)


def candidate_sets(rng, n):
  return np.stack([rng.permutation(V)[:6] for _ in range(n)])


SETUPS = [("gaussian", "distribution"), ("laplace", "distribution"),
          ("gaussian", "votes")]


@pytest.mark.parametrize("mechanism,aggregate", SETUPS)
def test_answers_equal_explicit_computation(teachers, all_sums, mechanism,
                                            aggregate):
  agg = make_aggregator(all_sums[aggregate], scale=0.3, mechanism=mechanism)
  rng = np.random.default_rng(5)
  s, j = np.array([0, 0, 3, 5]), np.array([0, 1, 2, 3])
  cand = candidate_sets(rng, 4)
  cand[2, 4:] = -1
  got = agg.answer(s, j, cand)
  dense = DENSE[aggregate](teachers)
  for q in range(4):
    valid = cand[q] >= 0
    noisy = dense[s[q], j[q], cand[q][valid]] + 0.3 * aggregation.standard_noise(
        RunSecret.pinned(0), s[q:q + 1], j[q:q + 1], cand[q:q + 1, valid], mechanism)[0]
    kept = np.maximum(noisy, 0)
    expected = (kept / kept.sum() if kept.sum() > 0
                else np.full(len(kept), 1 / len(kept)))
    np.testing.assert_allclose(got.probs[q][valid], expected, rtol=1e-5)
    assert (got.probs[q][~valid] == 0).all()
    np.testing.assert_array_equal(got.candidates[q], cand[q])
  np.testing.assert_allclose(got.probs.sum(-1), 1.0, rtol=1e-6)
  assert got.fresh.all() and agg.remaining == Q - 4


def test_aggregator_refuses_sums_of_another_aggregate(all_sums):
  ledger = accounting.make_ledger(3.0, Q, num_teachers=M, dataset_size=1000,
                                  aggregate="votes")
  with pytest.raises(ValueError, match="votes"):
    aggregation.Aggregator(all_sums["distribution"], ledger,
                           secret=RunSecret.pinned(0),
                           max_candidates=6)


@pytest.mark.parametrize("mechanism,aggregate", SETUPS)
def test_answers_are_stored_and_reused_bit_for_bit(all_sums, tmp_path,
                                                   mechanism, aggregate):
  sums = all_sums[aggregate]
  agg = make_aggregator(sums, mechanism=mechanism)
  rng = np.random.default_rng(6)
  s, j = np.array([0, 1, 2]), np.array([3, 3, 0])
  first = agg.answer(s, j, candidate_sets(rng, 3))
  spent = agg.ledger.epsilon_spent()
  # Same queries with other candidate sets, plus one new query and a
  # duplicate: the old ones come back byte-identical, only one is charged.
  again = agg.answer(np.array([2, 0, 5, 5]), np.array([0, 3, 1, 1]),
                     candidate_sets(rng, 4))
  for new_row, old_row in ((0, 2), (1, 0)):
    assert again.probs[new_row].tobytes() == first.probs[old_row].tobytes()
    assert np.array_equal(again.candidates[new_row], first.candidates[old_row])
  assert again.fresh.tolist() == [False, False, True, True]
  assert again.probs[2].tobytes() == again.probs[3].tobytes()
  assert agg.remaining == Q - 4
  assert agg.ledger.epsilon_spent() > spent
  # Saved and restored: still the same bytes, nothing new is charged.
  agg.save(str(tmp_path))
  restored = aggregation.Aggregator.restore(str(tmp_path), sums,
                                            max_candidates=6)
  third = restored.answer(s, j, candidate_sets(rng, 3))
  assert third.probs.tobytes() == first.probs.tobytes()
  assert not third.fresh.any() and restored.remaining == Q - 4
  # The noise key is kept with the answers, readable by the owner only.
  assert restored.secret == agg.secret
  assert os.stat(tmp_path / "secret_key.json").st_mode & 0o777 == 0o600


def test_noise_is_keyed_by_secret_sentence_position_token(sums):
  cand = np.tile(np.arange(6), (3, 1))
  s, j = np.array([0, 1, 2]), np.array([1, 1, 1])
  a = make_aggregator(sums, seed=1, scale=1.0).answer(s, j, cand)
  b = make_aggregator(sums, seed=1, scale=1.0).answer(s, j, cand)
  c = make_aggregator(sums, seed=2, scale=1.0).answer(s, j, cand)
  assert a.probs.tobytes() == b.probs.tobytes()
  assert not np.allclose(a.probs, c.probs)


def test_budget_refuses_query_q_plus_one(sums):
  agg = make_aggregator(sums)
  rng = np.random.default_rng(7)
  keys = rng.permutation(P * L)[:Q + 1]
  s, j = np.divmod(keys, L)
  agg.answer(s[:Q], j[:Q], candidate_sets(rng, Q))
  assert agg.remaining == 0
  before = (agg.store.keys.copy(), list(agg.ledger.events))
  with pytest.raises(BudgetExceededError):
    agg.answer(s[Q:], j[Q:], candidate_sets(rng, 1))
  assert np.array_equal(agg.store.keys, before[0])
  assert agg.ledger.events == before[1]
  # Stored answers are still free.
  assert not agg.answer(s[:2], j[:2], candidate_sets(rng, 2)).fresh.any()


def test_bad_requests_are_rejected(sums):
  agg = make_aggregator(sums)
  with pytest.raises(ValueError, match="repeats"):
    agg.answer([0], [0], [[1, 1, 2]])
  with pytest.raises(ValueError, match="outside"):
    agg.answer([P], [0], [[1]])
  with pytest.raises(ValueError, match="at least one"):
    agg.answer([0], [0], [[-1, -1]])
  with pytest.raises(ValueError, match="max_candidates"):
    agg.answer([0], [0], [list(range(7))])


# ---------------------------------------------------------------------------
# Accounting.
# ---------------------------------------------------------------------------

DELTA = 1e-5


def test_ledger_epsilon_equals_dp_accounting(sums):
  agg = make_aggregator(sums)
  rng = np.random.default_rng(8)
  s, j = np.divmod(rng.permutation(P * L)[:Q], L)
  agg.answer(s[:5], j[:5], candidate_sets(rng, 5))
  agg.answer(s[5:], j[5:], candidate_sets(rng, Q - 5))
  sigma = agg.scale
  direct = rdp.RdpAccountant(orders=privacy_accounting.RDP_ORDERS).compose(
      dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / math.sqrt(2)), Q)
  ).get_epsilon(DELTA)
  assert agg.ledger.epsilon_spent() == pytest.approx(direct, rel=1e-12)
  # Calibrated to the target: at most 3, within 1%.
  assert 3.0 * 0.99 <= direct <= 3.0 * (1 + 1e-9)


def test_laplace_ledger_equals_dp_accounting_and_refuses_query_q_plus_one(
    sums):
  agg = make_aggregator(sums, mechanism="laplace")
  rng = np.random.default_rng(10)
  s, j = np.divmod(rng.permutation(P * L)[:Q + 1], L)
  agg.answer(s[:5], j[:5], candidate_sets(rng, 5))
  agg.answer(s[5:Q], j[5:Q], candidate_sets(rng, Q - 5))
  b = agg.scale  # Laplace scale on the sum; L1 sensitivity 2
  direct = rdp.RdpAccountant(orders=privacy_accounting.RDP_ORDERS).compose(
      dpa.SelfComposedDpEvent(dpa.LaplaceDpEvent(b / 2), Q)).get_epsilon(DELTA)
  assert agg.ledger.epsilon_spent() == pytest.approx(direct, rel=1e-12)
  assert 3.0 * 0.99 <= direct <= 3.0 * (1 + 1e-9)
  assert agg.ledger.to_json()["events"] == [
      {"type": "laplace", "noise_multiplier": b / 2, "count": Q}]
  with pytest.raises(BudgetExceededError):
    agg.answer(s[Q:], j[Q:], candidate_sets(rng, 1))
  assert agg.remaining == 0 and len(agg.store) == Q


def analytic_gaussian_epsilon(multiplier, delta):
  """Exact epsilon of one Gaussian mechanism (Balle & Wang 2018)."""
  def delta_of(eps):
    return (stats.norm.cdf(1 / (2 * multiplier) - eps * multiplier)
            - math.exp(eps) * stats.norm.cdf(-1 / (2 * multiplier)
                                             - eps * multiplier)) - delta
  return optimize.brentq(delta_of, 0, 100)


def test_pld_ledger_matches_analytic_gaussian_composition():
  # Q Gaussians with multiplier s compose exactly to one with s / sqrt(Q).
  queries, sigma = 400, 30.0
  ledger = accounting.make_ledger(math.inf, queries, num_teachers=10,
                                  dataset_size=100, scale=sigma,
                                  accountant="pld")
  ledger.record(accounting.query_event(sigma, queries))
  exact = analytic_gaussian_epsilon(sigma / math.sqrt(2) / math.sqrt(queries),
                                    DELTA)
  assert exact <= ledger.epsilon_spent() <= exact * 1.02


def test_calibrated_ledger_refuses_a_sigma_below_the_budget():
  sigma = accounting.calibrate_noise(3.0, 100)
  with pytest.raises(BudgetExceededError):
    accounting.make_ledger(3.0, 100, num_teachers=4, dataset_size=10,
                           scale=0.9 * sigma)


@pytest.mark.parametrize("mechanism", accounting.MECHANISMS)
def test_phrase_epsilons_scale_sensitivity_with_teachers(mechanism):
  scale, queries = 20.0, 300
  ledger = accounting.make_ledger(math.inf, queries, num_teachers=10,
                                  dataset_size=100, scale=scale,
                                  mechanism=mechanism)
  ledger.record(accounting.query_event(scale, 120, mechanism=mechanism))
  ledger.record(accounting.query_event(scale, 180, mechanism=mechanism))
  counts = np.array([1, 2, 1, 0, 3, 1])
  eps = accounting.phrase_epsilons(ledger, counts)
  for n_s in (1, 2, 3):
    # n_s teachers changed: L2 sensitivity sqrt(2) n_s, L1 sensitivity 2 n_s.
    event = (dpa.GaussianDpEvent(scale / (math.sqrt(2) * n_s))
             if mechanism == "gaussian"
             else dpa.LaplaceDpEvent(scale / (2 * n_s)))
    direct = rdp.RdpAccountant(orders=privacy_accounting.RDP_ORDERS).compose(
        dpa.SelfComposedDpEvent(event, queries)).get_epsilon(DELTA)
    np.testing.assert_allclose(eps[counts == n_s], direct, rtol=1e-12)
  assert eps[0] == ledger.epsilon_spent()
  assert eps[3] == 0 and eps[0] < eps[1] < eps[4]
  summary = accounting.summarize_phrase_epsilons(eps, counts)
  held = eps[counts > 0]
  assert summary["phrases"] == 5
  assert summary["epsilon_min"] == held.min()
  assert summary["epsilon_max"] == held.max()
  assert summary["epsilon_avg"] == pytest.approx(held.mean())
  assert summary["teachers_per_phrase"] == {1: 3, 2: 1, 3: 1}


def test_candidate_sets_equal_explicit_top_p_and_top_k():
  rng = np.random.default_rng(9)
  logits = rng.normal(size=(20, V)) * 3
  for top_p, top_k in ((0.95, 0), (1.0, 5), (0.8, 3)):
    got = aggregation.candidate_sets(logits, max_candidates=8, top_p=top_p,
                                     top_k=top_k)
    for row, ids in zip(logits, got):
      order = np.argsort(-row, kind="stable")
      if top_k:
        order = order[:top_k]
      p = np.exp(row[order] - row[order].max())
      p /= p.sum()
      before = np.cumsum(p) - p  # mass of the more likely kept tokens
      keep = order[before < top_p][:8]
      assert ids.tolist() == keep.tolist() + [-1] * (8 - len(keep))
