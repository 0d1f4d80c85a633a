"""Places a command cannot write, injected on the CPU: a token cache
(``--cache-dir``) or an output (``--out`` of prepare, export and plot) that is
a file, or under one, or a read-only directory, and a token cache on a full
disk. Each ends in one line on stderr naming the directory (or the file) and
what is wrong, with exit status 2 (6 for a full disk), and nothing written."""

import errno
import json
import os
import pathlib
import shutil

import pytest

from poetx_jax.pretrain import cli
from poetx_jax.pretrain.data import tokenizer as tokenizer_lib
from test_faults import _one_line_error
from test_faults_data import TINY_ARGS
from test_faults_runs import _tree


def _read_only(directory: pathlib.Path, monkeypatch) -> None:
  """Makes ``directory`` read-only: by its mode, and for root, whom modes do
  not bind, by the answer of os.access (what the commands ask first)."""
  directory.mkdir(parents=True, exist_ok=True)
  directory.chmod(0o555)
  if os.geteuid() == 0:
    real = os.access
    monkeypatch.setattr(os, 'access', lambda p, mode, *a, **k: (
        not (mode & os.W_OK and pathlib.Path(p).absolute() == directory.absolute()))
        and real(p, mode, *a, **k))


def _train(corpus, tmp_path, cache, *extra):
  return cli.main(['train', '--data', str(corpus), *TINY_ARGS, '--vocab-size', '300',
                   '--out-dir', str(tmp_path / 'run'), '--cache-dir', str(cache),
                   '--compile-cache', '', '--plot', '', *extra])


@pytest.mark.parametrize('where', ['a file', 'under a file', 'read-only'])
def test_a_cache_dir_that_cannot_be_written_is_refused_in_one_line(
    where, corpus, tmp_path, capsys, monkeypatch):
  """poetx train with a --cache-dir that is a file, lies under one, or is a
  read-only directory: exit 2, one line naming it and what is wrong; no run
  directory, nothing in the cache."""
  a_file = tmp_path / 'a_file'
  a_file.write_text('kept')
  cache = {'a file': a_file, 'under a file': a_file / 'cache',
           'read-only': tmp_path / 'ro'}[where]
  if where == 'read-only':
    _read_only(cache, monkeypatch)
  assert _train(corpus, tmp_path, cache) == 2
  line = _one_line_error(capsys)
  why = ('permission denied' if where == 'read-only' else f'{a_file} is a file, not a directory')
  assert line.startswith(f'poetx train: error: --cache-dir {cache} cannot be written: {why}'), line
  assert sorted(p.name for p in tmp_path.iterdir()) == (['a_file', 'ro'] if where == 'read-only'
                                                        else ['a_file'])
  assert a_file.read_text() == 'kept'
  if where == 'read-only':
    assert list(cache.iterdir()) == []


@pytest.mark.slow
def test_eval_and_resume_with_a_read_only_cache_that_lost_its_tokens(
    reference, tmp_path, capsys, monkeypatch):
  """A run whose cache is read-only and no longer holds its token stream:
  poetx eval and --resume stop in one line naming the cache (exit 2) and
  leave the run directory as it was; eval with another --cache-dir scores it."""
  run = tmp_path / 'run'
  shutil.copytree(reference[0].out_dir, run)
  ro = tmp_path / 'ro'
  config = json.loads((run / 'run.json').read_text())
  config['cache_dir'] = str(ro)
  (run / 'run.json').write_text(json.dumps(config))
  _read_only(ro, monkeypatch)
  before = _tree(run)
  assert cli.main(['eval', str(run)]) == 2
  assert f'--cache-dir {ro} cannot be written: permission denied' in _one_line_error(
      capsys, 'eval')
  assert cli.main(['train', '--resume', '--out-dir', str(run), '--cache-dir', str(ro),
                   '--plot', '']) == 2
  assert f'--cache-dir {ro} cannot be written: permission denied' in _one_line_error(capsys)
  assert _tree(run) == before and list(ro.iterdir()) == []
  assert cli.main(['eval', str(run), '--cache-dir', str(tmp_path / 'other')]) == 0  # elsewhere


@pytest.mark.slow
@pytest.mark.parametrize('command', ['prepare', 'export', 'plot'])
@pytest.mark.parametrize('where', ['under a file', 'read-only'])
def test_an_output_that_cannot_be_written_is_refused_in_one_line(
    command, where, reference, corpus, tmp_path, capsys, monkeypatch):
  """prepare, export and plot with --out under a file or in a read-only
  directory: exit 2, one line naming the directory and what is wrong;
  nothing written."""
  a_file = tmp_path / 'a_file'
  a_file.write_text('kept')
  parent = a_file if where == 'under a file' else tmp_path / 'ro'
  if where == 'read-only':
    _read_only(parent, monkeypatch)
  out = parent / ('loss.png' if command == 'plot' else 'out')
  run = reference[0].out_dir
  args = {'prepare': ['prepare', str(corpus), '--vocab-size', '300'],
          'export': ['export', run], 'plot': ['plot', run]}[command]
  assert cli.main([*args, '--out', str(out)]) == 2
  line = _one_line_error(capsys, command)
  why = ('permission denied' if where == 'read-only' else f'{a_file} is a file, not a directory')
  where_ = f'--out {out}: the directory {parent}' if command == 'plot' else f'--out {out}'
  assert f'error: {where_} cannot be written: {why}' in line, line
  assert sorted(p.name for p in tmp_path.iterdir()) == (['a_file', 'ro'] if where == 'read-only'
                                                        else ['a_file'])
  assert a_file.read_text() == 'kept'
  if where == 'read-only':
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize('what', ['tokenizer', 'tokens'])
def test_a_full_cache_dir_names_the_file(what, corpus, tmp_path, capsys, monkeypatch):
  """No space for the BPE the run trains (the tokenizers library's own error,
  which names no file) or for its token stream, in --cache-dir: exit 6, one
  line naming the cache file; no run directory."""
  cache = tmp_path / 'cache'
  if what == 'tokenizer':
    def full(path, write):  # as the tokenizers library says it
      raise Exception('No space left on device (os error 28)')  # pylint: disable=broad-except
    monkeypatch.setattr(tokenizer_lib, 'atomic_write', full)
  else:
    def full(path, array, npy=False):
      raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(tokenizer_lib, 'write_array', full)
  assert _train(corpus, tmp_path, cache) == 6
  line = _one_line_error(capsys)
  name = 'bpe-v300-' if what == 'tokenizer' else 'tokens-'
  assert f'no space left on device writing {cache}/{name}' in line, line
  assert line.endswith('free space and run the command again'), line
  assert not (tmp_path / 'run').exists()
