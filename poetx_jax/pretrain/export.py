"""Export a run as a directory any Hugging Face client uses as it is.

    OUT/model.safetensors        merged dense weights: float32 or bfloat16, HF names,
                                 (out, in); above --max-shard-size (5GB) in shards,
                                 model-0000i-of-0000n.safetensors, with
                                 model.safetensors.index.json
    OUT/config.json              LlamaForCausalLM, with the tokenizer's bos/eos/pad ids
    OUT/generation_config.json   the same ids, for generate() and pipelines
    OUT/tokenizer.json           the run's tokenizer (tokenizer.model for sentencepiece)
    OUT/tokenizer_config.json    its transformers class, special tokens, no added
                                 BOS, model_max_length
    OUT/special_tokens_map.json  the bos / eos / pad (/ unk) tokens

    poetx export runs/tiny-poetx --out exported/
    poetx export runs/1b-poetx --out exported/ --dtype bfloat16 --max-shard-size 2GB
    # with transformers and torch: pipeline('text-generation', model='exported/')
    # or back into a run: poetx train --init-from-hf exported/ ...

The POET layers are merged (``R W0 P``) into plain kernels, so the exported
model runs with zero POET overhead.

The special tokens are those training used. In the training stream each
document is followed by EOS and preceded by nothing, so the tokenizer adds no
BOS (``add_bos_token`` false). A BPE trained by this app has one special token,
``<|endoftext|>``: it is EOS, BOS (the token before a document) and padding
(padded positions are masked). A given ``tokenizer.json`` is exported the same
way around the EOS that training used. A sentencepiece model keeps the ids of
its trainer spec, read from the model's protobuf (sentencepiece is not needed
to export), and pads with EOS where it defines no pad.

An export never mixes with another: a directory that already holds one is
refused unless ``force``, which also removes the old export's files that the
new one does not write (a ``tokenizer.json`` where a sentencepiece run is
exported, shards of another count). Each file is written whole (a temporary
file renamed) with the mode of any other new file (0666 less the umask): the
weights first (the shards before their index), then config.json and the
tokenizer files.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import typing as tp

import poetx_jax
from poetx_jax import models
from poetx_jax.models import hf, hf_files
from poetx_jax.pretrain.files import atomic_write

# A directory holding any of these holds an export: the files written here, and
# those of other Hugging Face exports that a loader would read beside them.
EXPORT_FILES = ('model.safetensors', 'config.json', 'generation_config.json',
                'tokenizer.json', 'tokenizer.model', 'tokenizer_config.json',
                'special_tokens_map.json', 'model.safetensors.index.json',
                'pytorch_model.bin', 'added_tokens.json')


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
  from poetx_jax.pretrain.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
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


def _json_writer(obj) -> tp.Callable[[str], object]:
  return lambda tmp: pathlib.Path(tmp).write_text(json.dumps(obj, indent=1) + '\n')


def check_destination(out_dir: str | pathlib.Path, *, force: bool = False) -> list[str]:
  """The export files already in ``out_dir`` (which may not exist yet).

  Raises:
    ValueError: ``out_dir`` is a file, or holds an export and not ``force``.
  """
  out = pathlib.Path(out_dir)
  if out.exists() and not out.is_dir():
    raise ValueError(f'{out} is a file; an export is a directory: give a new or '
                     f'empty directory')
  held = [n for n in EXPORT_FILES if (out / n).exists()]
  if out.is_dir():
    held += sorted(p.name for p in out.iterdir() if hf_files.SHARD.fullmatch(p.name))
  if held and not force:
    raise ValueError(f'{out} already holds an export ({", ".join(held)}); replace it '
                     f'with --force (force=True), or choose another directory')
  return held


def export_model(model, mc: models.LlamaConfig, out_dir: str | pathlib.Path,
                 tokenizer_path: str | pathlib.Path | None = None, *,
                 force: bool = False, dtype: str = 'float32',
                 max_shard_size: int | str = '5GB') -> list[pathlib.Path]:
  """Writes ``model`` (POET or plain Llama) and its tokenizer to ``out_dir``.

  Args:
    model: the Llama; POET layers are merged into plain kernels.
    mc: its configuration.
    out_dir: the export directory (created if missing).
    tokenizer_path: the tokenizer (JSON or sentencepiece ``.model``) whose
      vocabulary the model has; without it only weights and config.json are
      written, with no special-token ids.
    force: replace an export already in ``out_dir``, removing its files that
      this one does not write.
    dtype: of the weights, ``'float32'`` or ``'bfloat16'`` (config.json's
      ``torch_dtype`` says which).
    max_shard_size: the largest weight file (bytes, or text such as ``'5GB'``,
      10^9 bytes, or ``'2GiB'``); more weights are split into shards, each
      holding whole tensors, listed by ``model.safetensors.index.json``.

  Returns:
    The paths written.

  Raises:
    ValueError: ``out_dir`` is a file or holds an export (and not ``force``);
      the tokenizer's vocabulary is not the model's; a bad dtype or size.
  """
  hf.check_exportable(mc)
  max_bytes = _checked_options(dtype, max_shard_size)
  out = pathlib.Path(out_dir)
  held = check_destination(out, force=force)
  files: dict[str, tp.Callable[[str], object]] = {}
  ids = {}
  if tokenizer_path is not None:
    tokenizer_path = pathlib.Path(tokenizer_path)
    special, vocab_size, tok_files = tokenizer_files(tokenizer_path,
                                                     model_max_length=mc.max_seq_len)
    if vocab_size != mc.vocab_size:
      raise ValueError(f'the tokenizer {tokenizer_path} has {vocab_size} tokens, the '
                       f'model a vocabulary of {mc.vocab_size}: they must be equal')
    ids = {'bos_token_id': special.bos[1], 'eos_token_id': special.eos[1],
           'pad_token_id': special.pad[1]}
  files.update(_weight_files(hf.hf_state_dict(poetx_jax.unpoetize(model), dtype=dtype),
                             max_bytes))
  files['config.json'] = _json_writer(hf.hf_config(mc, torch_dtype=dtype, **ids))
  if tokenizer_path is not None:
    files['generation_config.json'] = _json_writer(hf.hf_generation_config(mc, **ids))
    name = 'tokenizer.model' if tokenizer_path.suffix == '.model' else 'tokenizer.json'
    files[name] = lambda tmp: shutil.copyfile(tokenizer_path, tmp)
    files.update({n: _json_writer(d) for n, d in tok_files.items()})
  out.mkdir(parents=True, exist_ok=True)
  written = [atomic_write(out / name, write) for name, write in files.items()]
  for name in held:
    if name not in files:
      (out / name).unlink()
  return written


def _checked_options(dtype: str, max_shard_size: int | str) -> int:
  """The largest shard in bytes; ValueError for a dtype or size that is none."""
  if dtype not in hf.DTYPES:
    raise ValueError(f'dtype must be one of {", ".join(hf.DTYPES)}, got {dtype!r}')
  return hf_files.parse_size(max_shard_size)


def _weight_files(state: dict, max_bytes: int) -> dict[str, tp.Callable[[str], object]]:
  """Writers of the safetensors files of ``state`` in shards of at most
  ``max_bytes`` (one file ``model.safetensors`` when it fits), then the index."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  names, index = hf_files.plan_shards({k: x.nbytes for k, x in state.items()}, max_bytes)
  files = {name: (lambda tmp, keys=keys: save_file({k: state[k] for k in keys}, tmp,
                                                   metadata={'format': 'pt'}))
           for name, keys in names.items()}
  if index is not None:  # written after its shards
    files[hf_files.INDEX] = _json_writer(index)
  return files


def export_run(run: str | pathlib.Path, out_dir: str | pathlib.Path,
               step: int | None = None, *, force: bool = False, dtype: str = 'float32',
               max_shard_size: int | str = '5GB') -> list[pathlib.Path]:
  """Exports the newest (or given) checkpoint of a run directory with the
  tokenizer stored in it (the corpus is not read); returns the paths written.
  See :func:`export_model` for the options and the errors."""
  from poetx_jax.pretrain import loading, rundir  # pylint: disable=g-import-not-at-top
  if pathlib.Path(out_dir).resolve() == pathlib.Path(run).resolve():
    raise ValueError(f'the export directory {out_dir} is the run directory; choose '
                     f'another one')
  check_destination(out_dir, force=force)  # before the checkpoint is read
  _checked_options(dtype, max_shard_size)
  cfg = rundir.read_config(run)
  try:
    hf.check_exportable(models.get_config(cfg.model, **cfg.model_overrides))
  except ValueError as e:
    raise ValueError(f'{run} trained model {cfg.model!r}: {e}') from None
  tokenizer = rundir.stored_tokenizer(run)
  _, mc, model, _ = loading.load_model(run, step=step)
  return export_model(model, mc, out_dir, tokenizer, force=force, dtype=dtype,
                      max_shard_size=max_shard_size)
