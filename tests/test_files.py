"""atomic_write: the file is replaced whole, with a new file's mode, or left as it was."""

import os

import numpy as np
import pytest

from poetx_jax.pretrain.files import atomic_write


def test_atomic_write_replaces_the_file_with_a_new_files_mode(tmp_path):
  path = tmp_path / 'run.json'
  path.write_text('old')
  old_umask = os.umask(0o027)
  try:
    assert atomic_write(str(path), lambda tmp: open(tmp, 'w').write('new')) == path
  finally:
    os.umask(old_umask)
  assert path.read_text() == 'new'
  assert os.stat(path).st_mode & 0o777 == 0o640
  assert sorted(p.name for p in tmp_path.iterdir()) == ['run.json']


def test_atomic_write_keeps_the_suffix_for_writers_that_add_one(tmp_path):
  path = tmp_path / 'tokens.npy'
  atomic_write(path, lambda tmp: np.save(tmp, np.arange(3)))
  np.testing.assert_array_equal(np.load(path), np.arange(3))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['tokens.npy']


def test_atomic_write_leaves_the_file_as_it_was_on_failure(tmp_path):
  path = tmp_path / 'manifest.json'
  path.write_text('old')

  def fail(tmp):
    open(tmp, 'w').write('half')
    raise OSError('disk full')

  with pytest.raises(OSError, match='disk full'):
    atomic_write(path, fail)
  assert path.read_text() == 'old'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['manifest.json']
