"""The built-in corpus: real text that every installation of poetx_jax carries.

:func:`default_corpus` is what ``poetx train`` trains on without ``--data``:
the standard library's Python sources (:func:`stdlib_sources`), the sources
of the packages the app runs on (:func:`package_sources`), the pydoc topics,
and Debian's Python documentation where it is installed.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import re
import sysconfig
import typing as tp
import zipfile
from pathlib import Path

PathLike = tp.Union[str, os.PathLike]


def _utf8_sources(named: tp.Iterable[tuple[str, tp.Callable[[], bytes]]]) -> list[str]:
  """The non-empty UTF-8 texts of ``(name, read)`` pairs, sorted by name."""
  docs = []
  for _, read in sorted(named, key=lambda nr: nr[0]):
    try:
      text = read().decode('utf-8')
    except (UnicodeDecodeError, OSError):
      continue
    if text.strip():
      docs.append(text)
  return docs


def _read(path: str) -> bytes:
  with open(path, 'rb') as f:
    return f.read()


def _py_files(root: PathLike, *, skip_top: tp.Container[str] = ()) -> list[str]:
  """The paths of the ``*.py`` files under ``root`` (symbolic links to files
  included, to directories not followed), leaving out the top-level
  directories named in ``skip_top``: what ``Path(root).rglob('*.py')``
  finds, several times faster (one ``os.scandir`` per directory)."""
  out, stack = [], [(os.fspath(root), True)]
  while stack:
    folder, top = stack.pop()
    try:
      entries = list(os.scandir(folder))
    except OSError:
      continue
    for e in entries:
      if e.is_dir(follow_symlinks=False):
        if not (top and e.name in skip_top):
          stack.append((e.path, False))
      elif e.name.endswith('.py') and e.is_file():
        out.append(e.path)
  return out


def stdlib_sources(root: PathLike | None = None) -> list[str]:
  """The Python sources of the standard library: every ``*.py`` under
  ``root`` (default: this interpreter's ``sysconfig`` stdlib directory), sorted
  by path, its own tests included, then the ``*.py`` inside the wheels it
  bundles (``ensurepip/_bundled``: pip); not ``site-packages`` /
  ``dist-packages`` (:func:`package_sources` reads chosen ones), not
  ``pydoc_data`` (the topics, read as text by :func:`default_corpus`), and not
  the few files that are not UTF-8 or are empty (test data of the tokenizer
  and codecs)."""
  root = Path(sysconfig.get_paths()['stdlib'] if root is None else root)
  skip = ('site-packages', 'dist-packages', 'pydoc_data')
  docs = _utf8_sources((path, functools.partial(_read, path))
                       for path in _py_files(root, skip_top=skip))
  for wheel in sorted((root / 'ensurepip' / '_bundled').glob('*.whl')):
    with zipfile.ZipFile(wheel) as z:
      docs += _utf8_sources((n, functools.partial(z.read, n)) for n in z.namelist()
                            if n.endswith('.py'))
  return docs


# The packages ``poetx train`` runs on that carry Python sources (the library's
# and the ``pretrain`` extra's requirements), read by :func:`package_sources`.
CORPUS_PACKAGES = ('flax', 'grain', 'jax', 'matplotlib', 'numpy', 'optax', 'orbax',
                   'pyarrow', 'tqdm')


def package_sources(names: tp.Sequence[str] = CORPUS_PACKAGES) -> tuple[list[str], list[str]]:
  """The Python sources of installed packages: every UTF-8 ``*.py`` of each
  import name in ``names``, in that order, each package's sorted by path.

  Returns:
    ``(documents, found)``, ``found`` naming each package read with its
    distribution's version (``'jax 0.11.2'``); a package not installed is
    left out of both.
  """
  dists = None
  docs, found = [], []
  for name in names:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      continue
    docs += _utf8_sources((path, functools.partial(_read, path))
                          for root in spec.submodule_search_locations
                          for path in _py_files(root))
    try:  # most import names are their distribution's name
      found.append(f'{name} {importlib.metadata.version(name)}')
      continue
    except importlib.metadata.PackageNotFoundError:
      pass
    if dists is None:  # a scan of every installed distribution: only when needed
      dists = importlib.metadata.packages_distributions()
    try:
      found.append(f'{name} {importlib.metadata.version((dists.get(name) or [name])[0])}')
    except importlib.metadata.PackageNotFoundError:
      found.append(name)
  return docs, found


def default_corpus(*, doc_root: PathLike = '/usr/share/doc',
                   stdlib_root: PathLike | None | bool = None,
                   packages: tp.Sequence[str] = CORPUS_PACKAGES) -> tuple[list[str], str]:
  """The built-in corpus: real text that every installation of poetx_jax carries.

  In this order: the standard library's Python sources
  (:func:`stdlib_sources`: about 37 M characters under CPython 3.12, pip's
  bundled wheel included), the Python sources of the packages ``poetx train``
  runs on (:func:`package_sources` of ``packages``: about 40 M characters
  at the pinned versions), the reference text of the standard library's
  ``pydoc_data.topics`` (one document per topic, English prose, 0.5 M
  characters), and, when installed (Debian's ``python3.X-doc``), the
  reStructuredText sources of the Python documentation,
  ``{doc_root}/python3.X/html/_sources/**/*.rst.txt`` (the newest 3.X
  found). The validation split is the corpus's last tokens.

  Args:
    doc_root: where to look for the documentation sources.
    stdlib_root: the standard library's directory; None: this interpreter's;
      False: leave the sources out (the topics alone train a tokenizer in
      seconds).
    packages: the import names of the packages whose sources are read; ()
      leaves them out.

  Returns:
    ``(documents, description)``, the description a line naming the sizes and
    sources.
  """
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  docs = [] if stdlib_root is False else stdlib_sources(stdlib_root or None)
  parts = [f'{len(docs)} standard library sources'] if docs else []
  package_docs, found = package_sources(packages)
  if package_docs:
    docs += package_docs
    parts.append(f'{len(package_docs)} sources of {", ".join(found)}')
  docs += [topics.topics[k] for k in sorted(topics.topics)]
  parts.append(f'{len(topics.topics)} pydoc_data.topics entries')
  # python3.11, python3.11-doc, ... are often links to one directory.
  found = {}
  for d in glob.glob(os.path.join(os.fspath(doc_root), 'python3.*', 'html', '_sources')):
    m = re.match(r'python3\.(\d+)', Path(d).parents[1].name)
    files = glob.glob(os.path.join(d, '**', '*.rst.txt'), recursive=True)
    if m and files:
      found[os.path.realpath(d)] = int(m.group(1))
  if found:
    real, minor = max(found.items(), key=lambda kv: (kv[1], kv[0]))
    files = sorted(glob.glob(os.path.join(real, '**', '*.rst.txt'), recursive=True))
    rst = [Path(f).read_text(encoding='utf-8') for f in files]
    rst = [t for t in rst if t.strip()]
    docs += rst
    parts.append(f'{len(rst)} Python 3.{minor} documentation sources from {real}')
  chars = sum(map(len, docs))
  return docs, (f'default corpus: {len(docs)} documents, {chars:,} characters '
                f'({" + ".join(parts)})')
