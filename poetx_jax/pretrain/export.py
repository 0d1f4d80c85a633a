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

    poetx export runs/tiny-poetx-muon --out exported/
    poetx export runs/1b-poetx-muon --out exported/ --dtype bfloat16 --max-shard-size 2GB
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
exported, shards of another count). Every file is written first into a
hidden folder of the directory, with the mode of any other new file (0666
less the umask), and moved in only once all are written: the weights first
(the shards before their index), then config.json and the tokenizer files.
So an export that fails (a write refused for want of space: DiskFull, naming
the file) leaves the directory as it was, holding the export it held or
none.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import tempfile
import typing as tp

import poetx_jax
from poetx_jax import models
from poetx_jax.models import hf, hf_files
from poetx_jax.pretrain.data.tokenizer_files import tokenizer_files
from poetx_jax.pretrain.atomic import atomic_write
from poetx_jax.pretrain.disk_full import DiskFull, writing
from poetx_jax.pretrain.footprint import first_missing
from poetx_jax.pretrain.unwritable import check_writable, refused_unless_writable

# A directory holding any of these holds an export: the files written here, and
# those of other Hugging Face exports that a loader would read beside them.
EXPORT_FILES = ('model.safetensors', 'config.json', 'generation_config.json',
                'tokenizer.json', 'tokenizer.model', 'tokenizer_config.json',
                'special_tokens_map.json', 'model.safetensors.index.json',
                'pytorch_model.bin', 'added_tokens.json')


def _json_writer(obj) -> tp.Callable[[str], object]:
  return lambda tmp: pathlib.Path(tmp).write_text(json.dumps(obj, indent=1) + '\n')


def check_destination(out_dir: str | pathlib.Path, *, force: bool = False,
                      force_name: str = 'force=True') -> list[str]:
  """The export files already in ``out_dir`` (which may not exist yet).

  Raises:
    ValueError: ``out_dir`` is a file, or holds an export and not ``force``
      (the message says to give ``force_name``).
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
                     f'with {force_name}, or choose another directory')
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
    ValueError: ``out_dir`` is a file or holds an export (and not ``force``),
      or cannot be written in; the tokenizer's vocabulary is not the model's;
      a bad dtype or size.
    DiskFull: a file could not be written for want of space; ``out_dir`` is
      left as it was.
  """
  hf.check_exportable(mc)
  max_bytes = _checked_options(dtype, max_shard_size)
  out = pathlib.Path(out_dir)
  held = check_destination(out, force=force)
  check_writable(out, 'the export directory')
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
  dense = poetx_jax.unpoetize(model, detach=False)  # read once, here
  files.update(_weight_files(hf.hf_state_dict(dense, dtype=dtype), max_bytes))
  files['config.json'] = _json_writer(hf.hf_config(mc, torch_dtype=dtype, **ids))
  if tokenizer_path is not None:
    files['generation_config.json'] = _json_writer(hf.hf_generation_config(mc, **ids))
    name = 'tokenizer.model' if tokenizer_path.suffix == '.model' else 'tokenizer.json'
    files[name] = lambda tmp: shutil.copyfile(tokenizer_path, tmp)
    files.update({n: _json_writer(d) for n, d in tok_files.items()})
  created = first_missing(out)
  with refused_unless_writable(out, 'the export directory'):
    out.mkdir(parents=True, exist_ok=True)
    stage = pathlib.Path(tempfile.mkdtemp(dir=out, prefix='.export-'))
  try:
    for name, write in files.items():
      with _no_partial_export(out, name, held, created):
        atomic_write(stage / name, write)
    written = [(stage / name).replace(out / name) for name in files]
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  for name in held:
    if name not in files:
      (out / name).unlink()
  return written


@contextlib.contextmanager
def _no_partial_export(out: pathlib.Path, name: str, held: list[str],
                       created: pathlib.Path | None) -> tp.Iterator[None]:
  """A write of ``name`` refused for want of space: DiskFull naming it and
  saying that ``out`` is as it was (removed, if the export ``created`` it)."""
  try:
    with writing(out / name):
      yield
  except DiskFull as e:
    if created is not None:
      shutil.rmtree(created, ignore_errors=True)
    kept = (f'{out} holds the export it held, as it was' if held else
            f'{out} holds no file of this export')
    raise DiskFull(f'{e}; {kept}: {e.remedy} and run the command again', e.errno) from e


def _checked_options(dtype: str, max_shard_size: int | str) -> int:
  """The largest shard in bytes; ValueError for a dtype or size that is none."""
  if dtype not in hf.DTYPES:
    raise ValueError(f'dtype must be one of {", ".join(hf.DTYPES)}, got {dtype!r}')
  try:
    return hf_files.parse_size(max_shard_size)
  except ValueError as e:
    raise ValueError(f'max_shard_size (--max-shard-size): {e}') from None


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
  check_destination(out_dir, force=force, force_name='--force')  # before the checkpoint is read
  check_writable(out_dir, '--out')
  _checked_options(dtype, max_shard_size)
  cfg = rundir.read_config(run)
  try:
    hf.check_exportable(models.get_config(cfg.model, **cfg.model_overrides))
  except ValueError as e:
    raise ValueError(f'{run} trained model {cfg.model!r}: {e}') from None
  tokenizer = rundir.stored_tokenizer(run)
  plan, model, _ = loading.load_model(run, step=step)
  return export_model(model, plan.model, out_dir, tokenizer, force=force, dtype=dtype,
                      max_shard_size=max_shard_size)
