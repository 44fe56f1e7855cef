"""Scores of gradient canaries from the observed releases, and the ε lower
bound they prove (jax-privacy's one-run estimators).

The adversary (white box) sees every DP step's release; `observations`
holds it at the m canary coordinates and at m control coordinates that no
canary touches. Its score of canary i is the log-likelihood ratio of "i is
in" against "i is out" under the mechanism the run claims: each step's
release along i is the step's noise (its scale read off the controls: a
robust standard deviation, per params leaf, so the real examples' gradients
there count as noise too) plus, if i is in and the step samples it, a signal of 1/σ noise
standard deviations (σ the ledger's noise multiplier: a unit's clipped
contribution over the noise σ·C). Under Poisson sampling at rate q a step
contributes log(1 - q + q·exp(x/σ - 1/(2σ²))) for the standardized
release x; under shuffling an epoch contributes the log of the mean over
its steps of the same likelihood ratio; under cyclic Poisson (BandMF) the
steps of each group t ≡ g (mod b) contribute as Poisson steps and the score
is the mean over the b groups (the canary's is secret), the releases first
decorrelated by BandMF's strategy C (C times the correlated noise is
i.i.d.) and read along C's column s for a participation at step s. Without noise (σ = 0) the score is
the sum of the releases along i.

Formal guarantees
-----------------
The scores are a function of the releases alone (and of public settings:
σ, q, the coordinates), never of the coins, so the one-run audit's
guarantee holds whatever the score's quality: with probability at least
the confidence, the bound does not exceed the ε of any (ε, δ) guarantee the
run truly has for its canaries. A score built for a mechanism the run does
not have (noise smaller than claimed) only loses power: the bound is then
still valid. `lower_bound` calls jax-privacy's `CanaryScoreAuditor`:
Mahloujifar et al., "Auditing f-Differential Privacy in One Run" (arXiv
2410.22235) for the bound reported, and Steinke, Nasr and Jagielski (NeurIPS
2023, arXiv 2305.08846) beside it, each over all thresholds with a
Bonferroni correction.
"""
from __future__ import annotations

import numpy as np
from jax_privacy import auditing

from dpjax.audit.canaries import Participation

ESTIMATOR = "epsilon_one_run_fdp"  # jax_privacy.auditing.CanaryScoreAuditor's
_MAD_TO_STD = 1.4826  # a normal's standard deviation over its median |x - m|
MIN_CONTROLS = 20  # a leaf's own noise scale from at least this many


def standardized(observations: np.ndarray, groups: np.ndarray
                 ) -> np.ndarray:
  """float64[T, m]: each step's release at the m canaries, centred and in
  units of the step's noise as the controls show it: the controls of the
  canary's params leaf (`groups`: the leaf of each of the 2m coordinates)
  where it has `MIN_CONTROLS`, else all controls. A leaf's own scale
  weighs its canaries by how much the real examples' gradients add there."""
  obs = np.asarray(observations, np.float64)
  count = obs.shape[1] // 2
  out = np.empty((obs.shape[0], count))
  canary_groups, control_groups = groups[:count], groups[count:]
  everywhere = obs[:, count:]
  for g in np.unique(canary_groups):
    mine = canary_groups == g
    controls = obs[:, count:][:, control_groups == g]
    if controls.shape[1] < MIN_CONTROLS:
      controls = everywhere
    center = np.median(controls, axis=1, keepdims=True)
    spread = _MAD_TO_STD * np.median(np.abs(controls - center), axis=1,
                                     keepdims=True)
    out[:, mine] = (obs[:, :count][:, mine] - center) / np.maximum(
        spread, np.finfo(np.float64).tiny)
  return out


def scores(observations: np.ndarray, groups: np.ndarray,
           noise_multiplier: float, participation: Participation,
           strategy: np.ndarray | None = None) -> np.ndarray:
  """float64[m]: each canary's score (higher: more likely in). `strategy`:
  correlated noise's `C` (BandMF's `Strategy.matrix()`), which decorrelates
  the releases first."""
  obs = np.asarray(observations, np.float64)
  count = len(groups) // 2
  if strategy is not None:
    obs = strategy @ obs
  if noise_multiplier == 0:  # no noise to scale by: the sum of the releases
    return obs[:, :count].sum(axis=0)
  w = standardized(obs, groups)
  if strategy is not None:  # a participation at s is C's column s (norm 1)
    w = strategy.T @ w
  a = 1.0 / noise_multiplier
  llr = a * w - a * a / 2
  if participation.steps_per_epoch:
    s = participation.steps_per_epoch
    total = np.zeros(count)
    for start in range(0, len(llr), s):  # per epoch (host, post-training)
      epoch = llr[start:start + s]
      total += np.logaddexp(np.log(s - len(epoch)) if s > len(epoch)
                            else -np.inf,
                            np.logaddexp.reduce(epoch, axis=0)) - np.log(s)
    return total
  q, b = participation.rate, participation.cycle_length
  steps = (llr if q >= 1 else
           np.logaddexp(np.log1p(-q), np.log(q) + llr))
  # Cyclic Poisson: the canary's group is unknown, each equally likely.
  per_group = np.stack([steps[g::b].sum(axis=0) for g in range(b)])
  return np.logaddexp.reduce(per_group, axis=0) - np.log(b)


def lower_bound(canary_scores: np.ndarray, coins: np.ndarray, *,
                delta: float, confidence: float) -> dict:
  """The ε lower bound at `confidence` of the canaries' scores given which
  were in (`coins`), by jax-privacy's estimators; 0 where the coins put
  every canary on one side (nothing can be shown)."""
  coins = np.asarray(coins, bool)
  inside, outside = canary_scores[coins], canary_scores[~coins]
  if not inside.size or not outside.size:
    return {"epsilon_lower_bound": 0.0, "epsilon_one_run": 0.0}
  auditor = auditing.CanaryScoreAuditor(inside, outside)
  significance = 1.0 - confidence
  return {
      "epsilon_lower_bound": float(auditor.epsilon_one_run_fdp(
          significance, delta)),
      "epsilon_one_run": float(auditor.epsilon_one_run(significance, delta)),
  }
