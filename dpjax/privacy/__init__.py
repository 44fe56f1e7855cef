"""dpjax.privacy: the differential-privacy core of dpjax (no TensorFlow).

The privacy contract of a DP training step, module by module:

1. `sampling`: a data-independent batch selection. `PoissonSampler` includes
   each example independently with probability q and never drops a sampled
   example; `UserPoissonSampler` does so for users, each giving at most k
   examples weighted 1/c (so a user, not an example, is the unit);
   `CyclicPoissonSampler` (BandMF's) Poisson-samples one of b groups per
   step; `ShuffleSampler` puts each example in at most one fixed-size batch
   per epoch.
2. `clipping`: `clipped_grad` / `per_group_clipped_grad` return the SUM of
   per-example gradients each clipped to L2 norm <= C (padding and non-finite
   examples contribute zero), so one example changes the sum by at most
   `sensitivity` (add/remove) or `2 * sensitivity` (replace).
   `ghost.ghost_clipped_grad` computes the same sum with ghost norms (no
   per-example gradients of the weight matrices; book-keeping, or a second
   backward pass through rematerialised layers);
   `clipping_method.make_clipped_grad(method='vmap'|'ghost'|'auto')` picks
   one.
3. `noise` / `optimizers`: `privatizer` adds N(0, (sigma * sensitivity)^2) to
   each named sum (one per loss) exactly once per logical batch, keyed by
   (secret, release index), and divides by a data-independent normalizer;
   the base optax optimizer after it (`DPOptimizer`) is post-processing.
   `mechanisms` holds each mechanism as one object (DP-SGD, BandMF's
   correlated noise C⁻¹z with z keyed the same way and its state secret,
   adaptive clipping, user-level), whose `privatizer` is its release.
4. `accounting` / `ledger`: each release is recorded as an event
   (`PoissonGaussian` per Poisson step, `Gaussian` per shuffled epoch with
   sigma / 2, or any other Gaussian query); epsilon at delta is the
   composition of all recorded events, checked against the budget before
   training and saved atomically.

The guarantee covers the model parameters (and anything computed from them
and public data). It does not cover `ClipStats`, realised batch sizes, or
sampled indices, which must not be released; and it assumes the noise and
sampling keys are secret: `secret.RunSecret` draws them from the operating
system's entropy, never from a configured seed.
"""

from dpjax.privacy.accounting import (
    Event,
    Gaussian,
    PoissonGaussian,
    calibrate_noise_multiplier,
    dpsgd_epsilon,
    dpsgd_noise_multiplier,
    effective_noise_multiplier,
    epsilon,
    event_from_json,
    shuffle_epochs_event,
)
from dpjax.privacy.clipping import (
    ClippedGradFn,
    ClipStats,
    clipped_grad,
    per_group_clipped_grad,
)
from dpjax.privacy.clipping_method import make_clipped_grad
from dpjax.privacy.ghost import Site, find_sites, ghost_clipped_grad
from dpjax.privacy.ledger import (
    LEDGER_FILENAME,
    BudgetExceededError,
    PrivacyLedger,
)
from dpjax.privacy.noise import add_gaussian_noise, noise_key, privatizer
from dpjax.privacy.optimizers import DPOptimizer, dp_optimizer
from dpjax.privacy.sampling import (
    CyclicPoissonSampler,
    PoissonSampler,
    ShuffleSampler,
    UserPoissonSampler,
)
from dpjax.privacy.secret import RunSecret

__all__ = [
    "BudgetExceededError",
    "ClipStats",
    "ClippedGradFn",
    "CyclicPoissonSampler",
    "DPOptimizer",
    "Event",
    "Gaussian",
    "LEDGER_FILENAME",
    "PoissonGaussian",
    "PoissonSampler",
    "PrivacyLedger",
    "RunSecret",
    "ShuffleSampler",
    "Site",
    "UserPoissonSampler",
    "add_gaussian_noise",
    "calibrate_noise_multiplier",
    "clipped_grad",
    "dp_optimizer",
    "dpsgd_epsilon",
    "dpsgd_noise_multiplier",
    "effective_noise_multiplier",
    "epsilon",
    "event_from_json",
    "find_sites",
    "ghost_clipped_grad",
    "make_clipped_grad",
    "noise_key",
    "per_group_clipped_grad",
    "privatizer",
    "shuffle_epochs_event",
]
