"""The tokenizer of a corpus: a byte-level BPE trained on it (or a given
``tokenizers`` JSON / sentencepiece ``.model`` file) and the corpus encoded as
one int32 token stream, both cached by content hash.

    tok = load_or_train_tokenizer(docs, vocab_size=4096, cache_dir='cache')
    tokens = tokenize_corpus(docs, tok, cache_dir='cache')   # eos after each doc
"""

from __future__ import annotations

import hashlib
import os
import typing as tp
from pathlib import Path

import numpy as np

from poetx_jax.pretrain.atomic import atomic_write, write_array
from poetx_jax.pretrain.unwritable import writing_in

PathLike = tp.Union[str, os.PathLike]

EOS = '<|endoftext|>'
# The smallest trained BPE vocabulary: the 256 byte tokens and EOS.
MIN_BPE_VOCAB = 257
# The largest: the tokenizers BPE trainer allocates about 66 bytes per entry of
# the vocabulary asked for before it reads the corpus (2^31 entries: 141 GB, an
# abort), and 2^24 is 64 times the largest vocabularies in use (262,144).
MAX_BPE_VOCAB = 2 ** 24
# The option that names the cache directory, in the messages about it.
CACHE_OPTION = '--cache-dir'
# End-of-document tokens looked for, in order, in a loaded tokenizer.json.
_EOS_CANDIDATES = (EOS, '</s>', '<|end_of_text|>', '<eos>')


def check_bpe_vocab(vocab_size) -> None:
  """ValueError unless ``vocab_size`` is a BPE vocabulary that can be trained
  (an int in [:data:`MIN_BPE_VOCAB`, :data:`MAX_BPE_VOCAB`])."""
  if (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
      or not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB):
    raise ValueError(f'vocab_size must be an int in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] (at '
                     f'least 256 bytes + {EOS}), got {vocab_size!r}')


def corpus_hash(docs: tp.Sequence[str]) -> str:
  """A sha256 hex digest of the documents and their boundaries."""
  h = hashlib.sha256()
  for d in docs:
    b = d.encode('utf-8', 'surrogatepass')
    h.update(len(b).to_bytes(8, 'little'))
    h.update(b)
  return h.hexdigest()


def file_hash(path: PathLike) -> str:
  """The sha256 hex digest of a file's bytes."""
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


# ----------------------------------------------------------------------------- tokenizer


class Tokenizer:
  """A tokenizer with an end-of-document id: a Hugging Face ``tokenizers``
  JSON file or a sentencepiece ``.model``.

  Make one with :meth:`load` or :meth:`train_bpe`. ``encode`` adds no special
  tokens; ``decode`` keeps them.
  """

  def __init__(self, backend: tp.Any, *, kind: str, path: Path, eos_id: int,
               vocab_size: int):
    self._backend = backend
    self._kind = kind
    self.path = path
    self.eos_id = eos_id
    self.vocab_size = vocab_size

  def __repr__(self) -> str:
    return (f'Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, '
            f'eos_id={self.eos_id})')

  @classmethod
  def load(cls, path: PathLike) -> Tokenizer:
    """Loads a ``tokenizers`` JSON file, or a sentencepiece ``.model`` (needs the
    sentencepiece package)."""
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f'no tokenizer file at {path}')
    if path.suffix == '.model':
      try:
        import sentencepiece as spm  # pylint: disable=g-import-not-at-top
      except ImportError as e:
        raise ImportError(f'loading the sentencepiece model {path} needs the '
                          'sentencepiece package (pip install sentencepiece); '
                          'or give a tokenizers .json file') from e
      sp = spm.SentencePieceProcessor(model_file=os.fspath(path))
      if sp.eos_id() < 0:
        raise ValueError(f'sentencepiece model {path} defines no end-of-sentence id')
      return cls(sp, kind='sentencepiece', path=path, eos_id=int(sp.eos_id()),
                 vocab_size=int(sp.get_piece_size()))
    import tokenizers  # pylint: disable=g-import-not-at-top
    try:
      tok = tokenizers.Tokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files.
      raise ValueError(f'{path} is not a tokenizers JSON file ({e}); '
                       'expected a tokenizer.json or a sentencepiece .model') from e
    eos_id = next((i for t in _EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None), None)
    if eos_id is None:
      raise ValueError(f'tokenizer {path} has no end-of-document token; looked for '
                       f'{", ".join(_EOS_CANDIDATES)}')
    return cls(tok, kind='tokenizers', path=path, eos_id=int(eos_id),
               vocab_size=int(tok.get_vocab_size(with_added_tokens=True)))

  @classmethod
  def train_bpe(cls, docs: tp.Sequence[str], *, vocab_size: int,
                path: PathLike) -> Tokenizer:
    """Trains a byte-level BPE on ``docs``, saves it to ``path`` and loads it.

    Byte-level pre-tokenizer without an added prefix space and a byte-level
    decoder, no normalizer: ``decode(encode(text)) == text`` for any text. The
    vocabulary holds the 256 bytes, the merges and ``'<|endoftext|>'``.
    """
    from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
    import tokenizers  # pylint: disable=g-import-not-at-top

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    check_bpe_vocab(vocab_size)
    if not docs:
      raise ValueError('train_bpe needs at least one document, got none')
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, tok.save)
    return cls.load(path)

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``, no special tokens added."""
    if self._kind == 'sentencepiece':
      return list(self._backend.encode(text))
    return self._backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: tp.Sequence[str]) -> list[list[int]]:
    """``[encode(t) for t in texts]``, in parallel where the backend can."""
    if self._kind == 'sentencepiece':
      return [list(ids) for ids in self._backend.encode(list(texts))]
    return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: tp.Iterable[int]) -> str:
    """The text of ``ids`` (special tokens kept)."""
    ids = [int(i) for i in ids]
    if self._kind == 'sentencepiece':
      return self._backend.decode(ids)
    return self._backend.decode(ids, skip_special_tokens=False)


train_bpe = Tokenizer.train_bpe


def load_or_train_tokenizer(docs: tp.Sequence[str], *, path: PathLike | None = None,
                            vocab_size: int = 4096, cache_dir: PathLike) -> Tokenizer:
  """Loads ``path`` if given; else the BPE of ``docs`` cached in ``cache_dir``
  (keyed by a hash of the corpus and the vocabulary size), trained and saved
  there first if absent: a ``cache_dir`` that cannot be written in is a
  ValueError naming it (:func:`~poetx_jax.pretrain.unwritable.writing_in`), a full
  disk a DiskFull naming the file."""
  if path is not None:
    return Tokenizer.load(path)
  cached = Path(cache_dir).expanduser() / f'bpe-v{vocab_size}-{corpus_hash(docs)[:16]}.json'
  if cached.is_file():
    return Tokenizer.load(cached)
  check_bpe_vocab(vocab_size)  # before the directory is made
  with writing_in(cached.parent, cached, CACHE_OPTION):
    return Tokenizer.train_bpe(docs, vocab_size=vocab_size, path=cached)


def tokenize_corpus(docs: tp.Sequence[str], tokenizer: Tokenizer, *,
                    cache_dir: PathLike | None = None) -> np.ndarray:
  """All documents encoded and concatenated, each followed by ``eos_id``: int32.

  With ``cache_dir`` the result is cached there, keyed by the hashes of the
  corpus and of the tokenizer file (a cache that cannot be written: as
  :func:`load_or_train_tokenizer`).
  """
  cached = None
  if cache_dir is not None:
    key = f'{corpus_hash(docs)[:16]}-{file_hash(tokenizer.path)[:16]}'
    cached = Path(cache_dir).expanduser() / f'tokens-{key}.npy'
    if cached.is_file():
      return np.load(cached)
  chunks = []
  for start in range(0, len(docs), 1024):
    for ids in tokenizer.encode_batch(docs[start:start + 1024]):
      chunks.append(np.asarray(ids, np.int32))
      chunks.append(np.asarray([tokenizer.eos_id], np.int32))
  tokens = np.concatenate(chunks) if chunks else np.zeros((0,), np.int32)
  if cached is not None:
    with writing_in(cached.parent, cached, CACHE_OPTION):
      atomic_write(cached, lambda tmp: write_array(tmp, tokens, npy=True))
  return tokens
