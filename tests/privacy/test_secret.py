"""The run secret: OS entropy, one 0600 file, never replaced, pinned only
on request."""
import os
import stat

import numpy as np
import pytest

from dpjax.privacy import secret
from dpjax.privacy.sampling import PoissonSampler


def test_drawn_secrets_are_fresh_and_purposes_independent():
  a, b = secret.RunSecret.draw(), secret.RunSecret.draw()
  assert a != b and not a.is_pinned and a.source == "os_entropy"
  assert len(a.key) * 8 == 256
  words = a.noise_key()
  assert words.dtype == np.uint32 and words.shape == (4,)  # 128 bits
  assert a.purpose_key("sampling") != a.purpose_key("gaussian-noise")
  assert a.noise_key("seqpate-aggregation").tobytes() != words.tobytes()
  assert a.key.hex() not in repr(a) and "os_entropy" in repr(a)


def test_pinned_secret_is_a_public_function_of_its_seed():
  assert secret.RunSecret.pinned(3) == secret.RunSecret.pinned(3)
  assert secret.RunSecret.pinned(3) != secret.RunSecret.pinned(4)
  assert secret.RunSecret.pinned(3).source == "pinned"


def test_file_is_owner_only_and_round_trips(tmp_path):
  s = secret.RunSecret.draw()
  path = s.save(str(tmp_path))
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  assert secret.RunSecret.load(str(tmp_path)) == s
  assert os.listdir(tmp_path) == [secret.SECRET_FILENAME]  # no temporaries
  with pytest.raises(secret.SecretFileError, match="never replaced"):
    secret.RunSecret.draw().save(str(tmp_path))
  assert secret.RunSecret.load(str(tmp_path)) == s


def test_for_run_keeps_refuses_and_pins(tmp_path):
  fresh = secret.for_run(str(tmp_path), resuming=False)
  assert not fresh.is_pinned and not secret.exists(str(tmp_path))  # not written
  with pytest.raises(secret.SecretFileError, match="cannot be redrawn"):
    secret.for_run(str(tmp_path), resuming=True)
  fresh.save(str(tmp_path))
  assert secret.for_run(str(tmp_path), resuming=True) == fresh
  with pytest.raises(secret.SecretFileError, match="pinned_secret_seed"):
    secret.for_run(str(tmp_path), resuming=True, pinned_seed=0)
  pinned_dir = tmp_path / "pinned"
  pinned_dir.mkdir()
  secret.RunSecret.pinned(5).save(str(pinned_dir))
  assert secret.for_run(str(pinned_dir), resuming=True).is_pinned
  (tmp_path / "garbled").mkdir()
  (tmp_path / "garbled" / secret.SECRET_FILENAME).write_text("{not json")
  with pytest.raises(secret.SecretFileError, match="unreadable"):
    secret.for_run(str(tmp_path / "garbled"), resuming=False)


def test_two_secrets_sample_different_batches():
  a, b = secret.RunSecret.draw(), secret.RunSecret.draw()
  draw = lambda s: [PoissonSampler(1000, 50, seed=s.sampling_seed()).indices(t)
                    for t in range(3)]
  first, second = draw(a), draw(b)
  assert all(not np.array_equal(x, y) for x, y in zip(first, second))
  assert all(np.array_equal(x, y) for x, y in zip(first, draw(a)))
