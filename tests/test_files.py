"""atomic_write: the file is replaced whole, with a new file's mode, or left as
it was; write_array: an array written whole or an error; the errors of a full
disk told apart from others."""

import errno
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from poetx_jax.pretrain.atomic import atomic_write, write_array
from poetx_jax.pretrain.disk_full import DiskFull, full_disk, writing

# Writes 2000 uint16 (4000 bytes) as .npy to ARGV[1] under a 1000-byte file
# size limit; prints the error code, or 'ok'.
LIMITED_WRITE = '''
import resource, sys
import numpy as np
from poetx_jax.pretrain.atomic import write_array
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
try:
  write_array(sys.argv[1], np.arange(2000, dtype=np.uint16), npy=True)
  print('ok')
except OSError as e:
  print(e.errno)
'''


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


def test_write_array_raises_where_numpy_cuts_the_file_short(tmp_path):
  """Under a file size limit write_array raises EFBIG (np.save and tofile of
  an array this small write 1000 of its bytes and say nothing). Without a
  limit it writes what np.save writes."""
  proc = subprocess.run([sys.executable, '-c', LIMITED_WRITE, str(tmp_path / 'a.npy')],
                        capture_output=True, text=True, check=True)
  assert proc.stdout.strip() == str(errno.EFBIG), proc.stdout
  array = np.arange(7, dtype=np.int32)
  write_array(tmp_path / 'a.npy', array, npy=True)
  np.save(tmp_path / 'b.npy', array)
  assert (tmp_path / 'a.npy').read_bytes() == (tmp_path / 'b.npy').read_bytes()


def test_the_errors_of_a_full_disk_are_told_apart():
  """ENOSPC, EDQUOT and EFBIG in an OSError, in a cause, or as the code in
  TensorStore's and Rust's messages; other errors are not; DiskFull keeps
  its code across processes."""
  tensorstore = ValueError('OUT_OF_RANGE: Error writing local file "x": Failed to write '
                           "95 bytes to file 21: File too large [os_error_code='27']")
  assert full_disk(tensorstore) == errno.EFBIG
  assert full_disk(Exception('No space left on device (os error 28)')) == errno.ENOSPC
  assert full_disk(OSError(errno.EDQUOT, 'Disk quota exceeded')) == errno.EDQUOT
  try:
    try:
      raise OSError(errno.ENOSPC, 'No space left on device')
    except OSError as e:
      raise RuntimeError('the save failed') from e
  except RuntimeError as e:
    assert full_disk(e) == errno.ENOSPC
  for other in (OSError(errno.EACCES, 'Permission denied'), ValueError('bad'),
                ValueError("[os_error_code='2']")):
    assert full_disk(other) is None
  with pytest.raises(DiskFull, match=r'^no space left on device writing /x/m.jsonl$') as e:
    with writing('/x/m.jsonl'):
      raise OSError(errno.ENOSPC, 'No space left on device')
  again = pickle.loads(pickle.dumps(e.value))
  assert (type(again), str(again), again.errno, again.remedy) == (
      DiskFull, str(e.value), errno.ENOSPC, 'free space')
  with pytest.raises(PermissionError):
    with writing('/x/m.jsonl'):
      raise PermissionError(errno.EACCES, 'Permission denied')
