"""A training corpus and a validation corpus of other sources, from the
installed Python packages' text: what a machine without network holds most of.

The top-level entries of every site-packages directory (packages, modules,
their documentation) are split by name: an entry whose name hashes into
bucket 0 of ``--val-every`` goes to validation, the rest to training, so no
package is in both. Only their text files (.py .md .rst .txt) are read, through
a folder of links to them (OUT/src), so packages' data files stay out. Both are prepared with ``poetx prepare``: training with a
byte-level BPE trained on it, validation with that tokenizer::

    python3 -m experiments.site_corpus --out data/site --sample-chars 30000000
    poetx train --model 130m --data data/site/train --val-data data/site/val

It also writes OUT/prose: the standard library's prose documentation (the
help topics of ``pydoc_data.topics``, one .txt file each), text of another
kind than the mostly-code training side and from no installed package, for
scoring a run on what it did not train on::

    python3 -m experiments.compare_quality --data data/site/train --val-data data/site/val \
        --other-val prose=data/site/prose ...

Options it does not know go to the training side's ``poetx prepare``
(``--vocab-size``, ``--sample-chars``, ``--workers``, ...). It prints the two sides' entries and sizes first (``--dry-run``: only that).
The split depends only on the entry names, so it is the same on every machine
with the same packages; another set of packages gives another corpus, which
data/site/*/manifest.json describes (files, documents, tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

TEXT = ('.py', '.md', '.rst', '.txt')  # what prepare reads as documents here


def site_dirs() -> list[pathlib.Path]:
  """The site-packages directories of this interpreter (and PYTHONPATH's
  entries that are not this checkout), deduplicated, in order."""
  dirs = [*site.getsitepackages(), sysconfig.get_paths()['purelib']]
  here = pathlib.Path(__file__).resolve().parents[1]
  dirs += [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
           if p and pathlib.Path(p).resolve() != here]
  out = []
  for d in map(pathlib.Path, dirs):
    if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
      out.append(d)
  return out


def entries(dirs: list[pathlib.Path]) -> list[pathlib.Path]:
  """Top-level packages and modules of ``dirs`` (no metadata or caches)."""
  skip = ('.dist-info', '.egg-info', '__pycache__', '.pth', '.so', '.libs')
  return sorted((e for d in dirs for e in d.iterdir()
                 if not e.name.endswith(skip) and not e.name.startswith(('.', '_'))
                 and (e.is_dir() or e.suffix in TEXT)), key=lambda e: (e.name, str(e)))


def text_files(entry: pathlib.Path) -> list[pathlib.Path]:
  """The text files of ``entry`` (itself, or those under it), in sorted order:
  packages' data files (.jsonl, .parquet, ...) are not text to train on."""
  if entry.is_file():
    return [entry]
  return sorted(f for f in entry.rglob('*')
                if f.suffix in TEXT and f.is_file() and not f.is_symlink())


def stage(items: list[pathlib.Path], files: dict, dest: pathlib.Path) -> pathlib.Path:
  """``dest``, a folder of links to the text files of ``items`` (``files[entry]``,
  each under its entry's name, kept in order), for ``poetx prepare`` to read as
  a folder: leniently, skipping what is not UTF-8."""
  if dest.exists():
    shutil.rmtree(dest)
  for i, e in enumerate(items):
    root = dest / f'{i:04d}-{e.name}'
    for f in files[e]:
      link = root / (f.relative_to(e) if e.is_dir() else f.name)
      link.parent.mkdir(parents=True, exist_ok=True)
      link.symlink_to(f.resolve())
  return dest


def split(items: list[pathlib.Path], every: int) -> tuple[list, list]:
  """(train, val): an entry is validation when sha256(name) % every == 0."""
  val = [e for e in items if int(hashlib.sha256(e.name.encode()).hexdigest(), 16) % every == 0]
  return [e for e in items if e not in val], val


def _first(items: list, sizes: dict, mb: float | None) -> list:
  """The entries of ``items``, in order, that fit in ``mb`` MB (None: all)."""
  if mb is None:
    return items
  kept, total = [], 0
  for e in items:
    if total + sizes[e] <= mb * 1e6:
      kept.append(e)
      total += sizes[e]
  return kept


def write_prose(dest: pathlib.Path) -> int:
  """Writes the standard library's help topics (``pydoc_data.topics``) into
  ``dest``, one ``NAME.txt`` each (replacing what was there); returns the
  characters written."""
  from pydoc_data.topics import topics
  if dest.exists():
    shutil.rmtree(dest)
  dest.mkdir(parents=True)
  for name, text in sorted(topics.items()):
    (dest / f'{name}.txt').write_text(text, encoding='utf-8')
  return sum(map(len, topics.values()))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              epilog='other options go to poetx prepare of the training side')
  p.add_argument('--out', required=True, help='writes OUT/train and OUT/val')
  p.add_argument('--val-every', type=int, default=40,
                 help='one entry name in N (by hash) goes to validation (default: %(default)s)')
  p.add_argument('--train-mb', type=float, default=None,
                 help='at most this much training text: the training entries in name '
                      'order while they fit (default: all)')
  p.add_argument('--val-mb', type=float, default=30,
                 help='at most this much validation text, likewise (default: %(default)s)')
  p.add_argument('--dry-run', action='store_true', help='print the split, prepare nothing')
  a, prepare_args = p.parse_known_args(argv)
  if a.val_every < 2:
    p.error(f'--val-every must be >= 2, got {a.val_every}')
  train, val = split(entries(site_dirs()), a.val_every)
  files = {e: text_files(e) for e in train + val}  # each tree walked once
  sizes = {e: sum(f.stat().st_size for f in fs) for e, fs in files.items()}
  train = _first(train, sizes, a.train_mb)
  val = _first(val, sizes, a.val_mb)
  if not train or not val:
    p.error(f'no {"training" if not train else "validation"} entries among the installed '
            f'packages ({len(train) + len(val)} entries); try another --val-every or a '
            f'larger --train-mb')
  mb = lambda es: sum(sizes[e] for e in es) / 1e6  # noqa: E731
  print(f'train: {len(train)} entries, {mb(train):.1f} MB of text; '
        f'val: {len(val)} entries, {mb(val):.1f} MB: {", ".join(e.name for e in val)}',
        flush=True)
  if a.dry_run:
    return {'train': train, 'val': val}
  out = pathlib.Path(a.out)
  poetx = [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'prepare']
  train_src = stage(train, files, out / 'src' / 'train')
  val_src = stage(val, files, out / 'src' / 'val')
  subprocess.run([*poetx, str(train_src), '--out', str(out / 'train'), *prepare_args],
                 check=True)
  subprocess.run([*poetx, str(val_src), '--out', str(out / 'val'), '--tokenizer',
                  str(out / 'train' / 'tokenizer.json')], check=True)
  chars = write_prose(out / 'prose')
  print(f'prose: {chars:,} characters of the standard library\'s help topics in '
        f'{out / "prose"}', flush=True)
  return {'train': train, 'val': val}


if __name__ == '__main__':
  main()
