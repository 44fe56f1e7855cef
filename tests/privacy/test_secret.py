"""The run secret: OS entropy, one 0600 file, never replaced, pinned only
on request."""
import os
import stat

import numpy as np
import pytest

from dpjax.privacy import secret
from dpjax.privacy.sampling import PoissonSampler


def test_drawn_secrets_are_fresh_os_entropy():
  a, b = secret.RunSecret.draw(), secret.RunSecret.draw()
  assert a != b and not a.is_pinned and a.source == "os_entropy"


def test_drawn_secret_is_32_bytes_of_the_os_entropy_as_drawn(monkeypatch):
  """The key is 256 bits of the OS's CSPRNG (`secrets`) themselves: nothing
  derived from a seed, a clock or fewer bits."""
  asked = []

  def token_bytes(n):
    asked.append(n)
    return bytes(range(n))

  monkeypatch.setattr(secret.secrets, "token_bytes", token_bytes)
  assert secret.RunSecret.draw().key == bytes(range(32)) and asked == [32]


def test_noise_key_is_128_bits_of_uint32_words():
  words = secret.RunSecret.draw().noise_key()
  assert words.dtype == np.uint32 and words.shape == (4,)


def test_purpose_keys_are_independent():
  a = secret.RunSecret.draw()
  assert a.purpose_key("sampling") != a.purpose_key("gaussian-noise")


def test_noise_keys_of_other_purposes_differ():
  a = secret.RunSecret.draw()
  assert a.noise_key("seqpate-aggregation").tobytes() != \
      a.noise_key().tobytes()


def test_repr_names_the_source_but_not_the_key():
  a = secret.RunSecret.draw()
  assert a.key.hex() not in repr(a) and "os_entropy" in repr(a)


def test_pinned_secret_is_a_public_function_of_its_seed():
  assert secret.RunSecret.pinned(3) == secret.RunSecret.pinned(3)
  assert secret.RunSecret.pinned(3) != secret.RunSecret.pinned(4)
  assert secret.RunSecret.pinned(3).source == "pinned"


@pytest.fixture
def saved(tmp_path):
  """A drawn secret saved in an empty dir, and the file's path."""
  s = secret.RunSecret.draw()
  return s, s.save(str(tmp_path))


def test_file_is_owner_only(saved):
  _, path = saved
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_file_round_trips(saved, tmp_path):
  s, _ = saved
  assert secret.RunSecret.load(str(tmp_path)) == s


def test_save_leaves_no_temporaries(saved, tmp_path):
  assert os.listdir(tmp_path) == [secret.SECRET_FILENAME]


def test_file_is_never_replaced(saved, tmp_path):
  s, _ = saved
  with pytest.raises(secret.SecretFileError, match="never replaced"):
    secret.RunSecret.draw().save(str(tmp_path))
  assert secret.RunSecret.load(str(tmp_path)) == s


def test_for_a_new_run_draws_a_fresh_secret_without_writing_it(tmp_path):
  fresh = secret.for_run(str(tmp_path), resuming=False)
  assert not fresh.is_pinned and not secret.exists(str(tmp_path))


def test_resuming_without_a_secret_file_is_refused(tmp_path):
  with pytest.raises(secret.SecretFileError, match="cannot be redrawn"):
    secret.for_run(str(tmp_path), resuming=True)


def test_resuming_keeps_the_saved_secret(tmp_path):
  fresh = secret.for_run(str(tmp_path), resuming=False)
  fresh.save(str(tmp_path))
  assert secret.for_run(str(tmp_path), resuming=True) == fresh


def test_pinning_the_seed_of_a_drawn_secret_is_refused(tmp_path):
  secret.for_run(str(tmp_path), resuming=False).save(str(tmp_path))
  with pytest.raises(secret.SecretFileError, match="pinned_secret_seed"):
    secret.for_run(str(tmp_path), resuming=True, pinned_seed=0)


def test_resuming_a_pinned_run_keeps_it_pinned(tmp_path):
  secret.RunSecret.pinned(5).save(str(tmp_path))
  assert secret.for_run(str(tmp_path), resuming=True).is_pinned


def test_garbled_secret_file_is_refused_as_unreadable(tmp_path):
  (tmp_path / secret.SECRET_FILENAME).write_text("{not json")
  with pytest.raises(secret.SecretFileError, match="unreadable"):
    secret.for_run(str(tmp_path), resuming=False)


def test_two_secrets_sample_different_batches():
  a, b = secret.RunSecret.draw(), secret.RunSecret.draw()
  draw = lambda s: [PoissonSampler(1000, 50, seed=s.sampling_seed()).indices(t)
                    for t in range(3)]
  first, second = draw(a), draw(b)
  assert all(not np.array_equal(x, y) for x, y in zip(first, second))
  assert all(np.array_equal(x, y) for x, y in zip(first, draw(a)))
