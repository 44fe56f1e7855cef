"""An audit as evidence in a release (`python -m dpjax.export --audit=D`).

`statement_entry(D, release_ledger, released_dir)` reads the output of
`python -m dpjax.audit --output_dir=D` and returns what the release's
privacy statement says about it. Nothing it states is taken from audit.json
alone:
  - the audited mechanism is D/run's ledger from its newest verified
    checkpoint (`dpjax.verify`), not the copy in audit.json;
  - the coins (which canaries were in) are recomputed from D/run's secret
    and must be those scores.csv lists: coins chosen after the scores were
    seen would forge any bound;
  - the bound is recomputed from the scores and those coins by the audit's
    estimator, at audit.json's confidence and the run's δ.

An audit speaks for a release only if it audited the same mechanism: the
same mechanism name, σ, sampling method and rate, DP steps and δ, and the
same ε from the events (which also covers a count release's noise and
prior runs). Anything else is refused, as is an audit whose bound exceeds
the release's ε: at its confidence it refutes the guarantee, and a release
never states an ε its own evidence contradicts.

Limits: the scores are taken as written (recomputing them needs the
releases the audit observed and its canaries: `python -m dpjax.audit`).
A lower bound at or below ε is consistent with the guarantee; it is one
experiment's evidence, not a proof.
"""
from __future__ import annotations

import csv
import json
import math
import os

import numpy as np

from dpjax import errors, verify
from dpjax.audit import canaries, scores
from dpjax.privacy import ledger as ledger_lib, secret as secret_lib

AUDIT_LINE = "audit.json"
SCORES_FILE = "scores.csv"
RUN_DIRNAME = "run"


def mechanism(ledger: ledger_lib.PrivacyLedger) -> dict:
  """What an audit must share with a release to speak for it."""
  return {"mechanism": ledger.mechanism,
          "noise_multiplier": ledger.noise_multiplier,
          "sampling": ledger.sampling.get("method"),
          "sampling_rate": ledger.sampling.get("sampling_rate"),
          "dp_steps": ledger.steps, "delta": ledger.delta}


def _same(a, b) -> bool:
  if isinstance(a, float) and isinstance(b, float):
    return math.isclose(a, b, rel_tol=1e-9) or a == b
  return a == b


def _read(audit_dir: str) -> tuple[dict, np.ndarray, np.ndarray]:
  """The fields of audit.json's line a statement reads, and scores.csv's
  scores and coins; UsageError if any is missing."""
  try:
    with open(os.path.join(audit_dir, AUDIT_LINE)) as f:
      line = json.load(f)
    with open(os.path.join(audit_dir, SCORES_FILE), newline="") as f:
      rows = list(csv.DictReader(f))
    values = np.array([float(r["score"]) for r in rows])
    listed = np.array([r["in"] == "1" for r in rows])
    line = {k: line[k] for k in ("canaries", "confidence", "kind",
                                 "threat_model")}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise errors.UsageError(
        f"--audit {audit_dir} is not a finished `python -m dpjax.audit` "
        f"output ({AUDIT_LINE} and {SCORES_FILE}): {e}") from None
  if len(values) != line["canaries"]:
    raise errors.UsageError(
        f"--audit {audit_dir}: {SCORES_FILE} scores {len(values)} canaries, "
        f"{AUDIT_LINE} says {line['canaries']}")
  return line, values, listed


def statement_entry(audit_dir: str, release_ledger: ledger_lib.PrivacyLedger,
                    released_dir: str) -> dict:
  """The release statement's `audit` entry; UsageError (one line) if the
  audit is incomplete, inconsistent, of another mechanism, or refutes the
  release's ε."""
  run_dir = os.path.join(audit_dir, RUN_DIRNAME)
  line, values, listed = _read(audit_dir)
  try:
    audited = verify.run_ledger(run_dir)
    secret = secret_lib.RunSecret.load(run_dir)
  except (OSError, ValueError) as e:
    raise errors.UsageError(f"--audit {audit_dir}: its run {run_dir} does "
                             f"not verify: {' '.join(str(e).split())}"
                             ) from None
  drawn = np.asarray(canaries.coins(secret.noise_key(), len(values)))
  if not np.array_equal(drawn, listed):
    raise errors.UsageError(
        f"--audit {audit_dir}: the coins in {SCORES_FILE} are not the ones "
        "its run's secret drew; the scores cannot be trusted")
  want, got = mechanism(release_ledger), mechanism(audited)
  differ = [f"{k} {got[k]} (audit) vs {want[k]} (release)" for k in want
            if not _same(got[k], want[k])]
  epsilon = release_ledger.epsilon_spent()
  if not differ and not _same(audited.epsilon_spent(), epsilon):
    differ = [f"ε {audited.epsilon_spent()} (audit) vs {epsilon} (release)"]
  if differ:
    raise errors.UsageError(
        f"--audit {audit_dir} audited another mechanism than this release: "
        + "; ".join(differ))
  confidence = float(line["confidence"])
  bound = scores.lower_bound(values, drawn, delta=audited.delta,
                             confidence=confidence)
  if bound["epsilon_lower_bound"] > epsilon:
    raise errors.UsageError(
        f"--audit {audit_dir} bounds ε from below at "
        f"{bound['epsilon_lower_bound']:.4g}, above the release's ε = "
        f"{epsilon:.4g}: at {confidence:.4g} confidence the guarantee is "
        "refuted; nothing was released")
  same_run = os.path.realpath(run_dir) == os.path.realpath(released_dir)
  return {
      "kind": line["kind"],
      "threat_model": line["threat_model"],
      "audited_run": ("this run" if same_run else
                      "another run of the same mechanism, σ, sampling, DP "
                      "steps and δ"),
      "canaries": len(values),
      "canaries_in": int(drawn.sum()),
      "confidence": confidence,
      "estimator": scores.ESTIMATOR,
      **bound,
  }


def markdown(entry: dict, epsilon) -> list[str]:
  """PRIVACY.md's paragraph on the audit."""
  eps = f"{epsilon:.4g}" if isinstance(epsilon, float) else epsilon
  return [
      "## Audit", "",
      f"An empirical privacy audit of {entry['audited_run']} "
      f"({entry['canaries']:,} {entry['kind']} canaries, each in by a secret "
      f"fair coin; threat model: {entry['threat_model']}) shows "
      f"ε ≥ {entry['epsilon_lower_bound']:.3g} at "
      f"{100 * entry['confidence']:.4g}% confidence (jax-privacy "
      f"`{entry['estimator']}`). A lower bound at or below the stated "
      f"ε = {eps} is consistent with the guarantee: it is one experiment's "
      "evidence that the implementation does not leak more, not a proof "
      "that it leaks no more.", ""]
