"""Privacy auditing: an empirical ε lower bound beside the ε a run reports
(`python -m dpjax.audit`).

`canaries` puts gradient canaries into a run's releases and reads the
releases back; `scores` turns what the releases show into each canary's
score and, with the secret coins, into the ε lower bound of a one-run audit
(jax-privacy's estimators).
"""
