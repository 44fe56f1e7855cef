"""The run secret: the key of every random choice a DP guarantee rests on.

Formal guarantees
-----------------
Differential privacy bounds what an adversary learns from a release when
the noise and the sample are unknown to them. The adversary is assumed to
have the code, the configuration and every published file, so a key a
configuration sets (a default seed, `train.seed`) protects nothing.

`RunSecret.draw()` takes 256 bits from the operating system's entropy
(`secrets`). Everything the guarantee depends on is derived from it, one
independent key per purpose (keyed BLAKE2b, so one purpose's key says
nothing about another's): `noise_key()` (128 bits for `noise.privatizer`:
two independent 64-bit halves, each expanded by jax's threefry, together
the key of the noise's Threefry-4x32),
`sampling_seed()` (Poisson or shuffle sampling) and `purpose_key(name)`
(e.g. SeqPATE's stored aggregator noise) and `meta_key()` (the MAC of each
checkpoint's meta: `dpjax.training.checkpoints`). Randomness the guarantee does not
rest on (initialisation, dropout, the public coins of a redaction schedule,
public batches) keeps the configured `seed`.

The secret lives in one file, `MODEL_DIR/secret_key.json`, created with mode
0600 and atomically, so that a resumed run redraws exactly the batches and
noise of an uninterrupted one. It must never be published: the run
directory is private, and `dpjax.export` writes a release without it.

`RunSecret.pinned(seed)` derives the secret from an integer, for tests and
debugging only: anyone who knows the integer can regenerate every noise
draw and batch, so the guarantee does not hold against them. A pinned
secret is marked as such in its file and in the privacy ledger.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets

import numpy as np

SECRET_FILENAME = "secret_key.json"
_FORMAT = "dpjax-run-secret-1"
_BYTES = 32  # 256 bits of OS entropy


class SecretFileError(ValueError):
  """A secret file is missing, unreadable or disagrees with the run."""


@dataclasses.dataclass(frozen=True, repr=False)
class RunSecret:
  """256 secret bits and whether the user pinned them (`pinned(seed)`)."""
  key: bytes
  is_pinned: bool = False

  def __post_init__(self):
    if len(self.key) != _BYTES:
      raise ValueError(f"a run secret is {_BYTES} bytes, got {len(self.key)}")

  def __repr__(self) -> str:  # never print the key
    return f"RunSecret({'pinned' if self.is_pinned else 'os_entropy'})"

  @classmethod
  def draw(cls) -> RunSecret:
    """A fresh secret from the operating system's entropy."""
    return cls(secrets.token_bytes(_BYTES))

  @classmethod
  def pinned(cls, seed: int) -> RunSecret:
    """A secret that is a public function of `seed` (tests, debugging)."""
    digest = hashlib.blake2b(str(int(seed)).encode(), digest_size=_BYTES,
                             person=b"dpjax-pinned")
    return cls(digest.digest(), is_pinned=True)

  @property
  def source(self) -> str:
    """What the ledger records: 'os_entropy' or 'pinned'."""
    return "pinned" if self.is_pinned else "os_entropy"

  def purpose_key(self, purpose: str, num_bytes: int = 32) -> bytes:
    """An independent key for `purpose`, derived by keyed BLAKE2b."""
    return hashlib.blake2b(purpose.encode(), key=self.key,
                           digest_size=num_bytes).digest()

  def noise_key(self, purpose: str = "gaussian-noise") -> np.ndarray:
    """uint32[4]: the 128-bit key `noise.noise_key` expands per step."""
    return np.frombuffer(self.purpose_key(purpose, 16), np.uint32).copy()

  def sampling_seed(self, purpose: str = "sampling") -> int:
    """A 256-bit integer for `numpy.random.SeedSequence` (the samplers)."""
    return int.from_bytes(self.purpose_key(purpose), "little")

  def meta_key(self) -> bytes:
    """The HMAC key that authenticates the run's checkpoint metas."""
    return self.purpose_key("checkpoint-meta-mac")

  # --- The file in MODEL_DIR. ----------------------------------------------
  def save(self, directory: str) -> str:
    """Writes `directory/secret_key.json` (mode 0600, atomically); returns
    its path. Refuses to replace an existing file."""
    path = os.path.join(directory, SECRET_FILENAME)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
      with os.fdopen(fd, "w") as f:
        json.dump({"format": _FORMAT, "key": self.key.hex(),
                   "pinned": self.is_pinned}, f)
        f.flush()
        os.fsync(f.fileno())
      if os.path.exists(path):
        raise SecretFileError(f"{path} exists; a run's secret is never "
                              "replaced")
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    return path

  @classmethod
  def load(cls, directory: str) -> RunSecret:
    """Reads the secret saved in `directory`; SecretFileError if unusable."""
    path = os.path.join(directory, SECRET_FILENAME)
    try:
      with open(path) as f:
        d = json.load(f)
      if d.get("format") != _FORMAT:
        raise ValueError(f"unknown format {d.get('format')!r}")
      return cls(bytes.fromhex(d["key"]), bool(d["pinned"]))
    except FileNotFoundError:
      raise SecretFileError(f"{path} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise SecretFileError(f"{path} is unreadable: {e}") from None


def exists(directory: str) -> bool:
  """Whether `directory` holds a run secret file."""
  return os.path.isfile(os.path.join(directory, SECRET_FILENAME))


def for_run(directory: str, *, resuming: bool,
            pinned_seed: int | None = None) -> RunSecret:
  """The secret of the run in `directory`: its file if there is one, else a
  fresh draw (or `pinned(pinned_seed)`), not yet written.

  Refuses a resumed run without its file (its noise and batches could not
  be redrawn) and a pinned seed that is not the one the file was made with.
  """
  if exists(directory):
    found = RunSecret.load(directory)
    if pinned_seed is not None and found != RunSecret.pinned(pinned_seed):
      raise SecretFileError(
          f"train.pinned_secret_seed = {pinned_seed} is not the secret this "
          f"run was started with ({os.path.join(directory, SECRET_FILENAME)}"
          f", {found.source}); drop the binding or use a fresh MODEL_DIR")
    return found
  if resuming:
    raise SecretFileError(
        f"{directory} has checkpoints but no {SECRET_FILENAME}: the run's "
        "noise and batches cannot be redrawn without it. Restore the file, "
        "or start over in a fresh MODEL_DIR")
  return (RunSecret.pinned(pinned_seed) if pinned_seed is not None
          else RunSecret.draw())
