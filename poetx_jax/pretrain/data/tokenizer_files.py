"""The files transformers reads beside a tokenizer (``tokenizer_config.json``,
``special_tokens_map.json``), made from a ``tokenizers`` JSON file or a
sentencepiece ``.model`` as training used it; ``poetx export`` writes them.

The special tokens are those training used. In the training stream each
document is followed by EOS and preceded by nothing, so the tokenizer adds no
BOS (``add_bos_token`` false). A BPE trained by this app has one special token,
``<|endoftext|>``: it is EOS, BOS (the token before a document) and padding
(padded positions are masked). A given ``tokenizer.json`` is described the
same way around the EOS that training used. A sentencepiece model keeps the
ids of its trainer spec, read from the model's protobuf (sentencepiece is not
needed), and pads with EOS where it defines no pad.
"""

from __future__ import annotations

import json
import os
import pathlib
import typing as tp

from poetx_jax.pretrain.data.tokenizer import Tokenizer


class SpecialTokens(tp.NamedTuple):
  """(text, id) of a tokenizer's special tokens; ``unk`` is None where it has none."""
  bos: tuple[str, int]
  eos: tuple[str, int]
  pad: tuple[str, int]
  unk: tuple[str, int] | None = None


def tokenizer_files(path: str | pathlib.Path, *, model_max_length: int
                    ) -> tuple[SpecialTokens, int, dict[str, dict]]:
  """What transformers needs to load the tokenizer at ``path`` as training used it.

  Args:
    path: a ``tokenizers`` JSON file or a sentencepiece ``.model``.
    model_max_length: the longest input the model takes (its ``max_seq_len``).

  Returns:
    (special tokens, vocabulary size with added tokens, {file name: dict}) with
    the tokenizer_config.json and special_tokens_map.json dicts. Only tokens of
    the vocabulary are named (transformers would append any other one).
  """
  path = pathlib.Path(path)
  if path.suffix == '.model':
    special, vocab_size, decoder, extra = _sentencepiece(path)
    cls = 'LlamaTokenizer'  # reads OUT/tokenizer.model (its vocab_file)
  else:
    special, vocab_size, decoder, extra = _tokenizers_json(path)
    cls = 'PreTrainedTokenizerFast'  # reads OUT/tokenizer.json as it is
  named = {f'{role}_token': tok for role, tok in special._asdict().items() if tok}
  config = {'tokenizer_class': cls, **{k: text for k, (text, _) in named.items()},
            'add_bos_token': False, 'add_eos_token': False,
            'model_max_length': model_max_length, 'clean_up_tokenization_spaces': False,
            # No token_type_ids: LlamaForCausalLM takes none (model(**inputs), generate).
            'model_input_names': ['input_ids', 'attention_mask'], 'padding_side': 'left',
            **extra, 'added_tokens_decoder': decoder}
  flags = {'lstrip': False, 'normalized': False, 'rstrip': False, 'single_word': False}
  tokens_map = {k: {'content': text, **{f: decoder.get(str(i), flags).get(f, False)
                                        for f in flags}}
                for k, (text, i) in named.items()}
  files = {'tokenizer_config.json': config, 'special_tokens_map.json': tokens_map}
  return special, vocab_size, files


def _tokenizers_json(path: pathlib.Path):
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = Tokenizer.load(path)  # the end-of-document token training used
  backend = tokenizers.Tokenizer.from_file(os.fspath(path))
  eos = (backend.id_to_token(tok.eos_id), tok.eos_id)
  spec = json.loads(path.read_text(encoding='utf-8'))
  unk_text = (spec.get('model') or {}).get('unk_token')
  unk_id = backend.token_to_id(unk_text) if unk_text else None
  unk = (unk_text, unk_id) if unk_id is not None else None
  decoder = {str(t['id']): {k: t[k] for k in ('content', 'lstrip', 'normalized', 'rstrip',
                                              'single_word', 'special') if k in t}
             for t in spec.get('added_tokens') or []}
  return SpecialTokens(bos=eos, eos=eos, pad=eos, unk=unk), tok.vocab_size, decoder, {}


def _sentencepiece(path: pathlib.Path):
  """Special tokens of a sentencepiece ModelProto: pieces (field 1, each a
  piece string in its field 1), TrainerSpec (2: unk_id 40, bos_id 41, eos_id
  42, pad_id 43, defaults 0, 1, 2, -1), NormalizerSpec (3: add_dummy_prefix 3)."""
  try:
    pieces, trainer, normalizer = [], {}, {}
    for num, value in _proto_fields(path.read_bytes()):
      if num == 1:
        pieces.append(dict(_proto_fields(value)).get(1, b'').decode('utf-8'))
      elif num == 2:
        trainer = dict(_proto_fields(value))
      elif num == 3:
        normalizer = dict(_proto_fields(value))
    ids = {role: _int32(trainer.get(field, default)) for role, field, default in
           (('unk', 40, 0), ('bos', 41, 1), ('eos', 42, 2), ('pad', 43, -1))}
  except (IndexError, TypeError, UnicodeDecodeError, ValueError) as e:
    raise ValueError(f'{path} is not a sentencepiece model ({e})') from e
  for role, i in ids.items():
    if not -1 <= i < len(pieces):
      raise ValueError(f'{path}: {role}_id={i} is outside its {len(pieces)} pieces')
  if ids['eos'] < 0:
    raise ValueError(f'sentencepiece model {path} defines no end-of-sentence id')
  tok = {role: (pieces[i], i) if i >= 0 else None for role, i in ids.items()}
  special = SpecialTokens(bos=tok['bos'] or tok['eos'], eos=tok['eos'],
                          pad=tok['pad'] or tok['eos'], unk=tok['unk'])
  decoder = {str(i): {'content': text, 'lstrip': False, 'normalized': False,
                      'rstrip': False, 'single_word': False, 'special': True}
             for text, i in sorted(set(filter(None, special)), key=lambda t: t[1])}
  # legacy: encode as sentencepiece itself does; a dummy prefix only if the model adds one.
  extra = {'legacy': True, 'add_prefix_space': bool(normalizer.get(3, 1))}
  return special, len(pieces), decoder, extra


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    b = buf[i]
    i += 1
    value |= (b & 0x7F) << shift
    if b < 0x80:
      return value, i
    shift += 7


def _proto_fields(buf: bytes) -> tp.Iterator[tuple[int, int | bytes]]:
  """(field number, value) of each field of a protobuf message: an int for a
  varint, bytes otherwise."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    wire = key & 7
    if wire == 0:
      value, i = _varint(buf, i)
    elif wire == 2:
      n, i = _varint(buf, i)
      value, i = buf[i:i + n], i + n
    elif wire in (1, 5):
      n = 8 if wire == 1 else 4
      value, i = buf[i:i + n], i + n
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    if i > len(buf):
      raise ValueError('truncated protobuf message')
    yield key >> 3, value


def _int32(value) -> int:
  if not isinstance(value, int):
    raise ValueError(f'expected a varint, got {value!r}')
  return value - (1 << 64) if value >= 1 << 63 else value
