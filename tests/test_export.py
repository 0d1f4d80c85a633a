"""poetx export, a run started from an export (--init-from-hf), plot and the
help of eval/export/plot (tiny run, CPU).

The export is checked against what transformers reads, without transformers or
torch: the keys of config.json, generation_config.json, tokenizer_config.json
and special_tokens_map.json, and their token ids against tokenizer.json.
"""

import dataclasses
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
import tokenizers

from poetx_jax.models import hf
from poetx_jax.pretrain import cli, export, factories, rundir
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.metrics import read_metrics
from poetx_jax.pretrain.data import tokenizer_files
from poetx_jax.pretrain.data.tokenizer import EOS, file_hash
from poetx_jax.pretrain.train import train
from poetx_jax.pretrain.plan import make_plan
from conftest import SMALL, write_corpus

HF_FILES = {'model.safetensors', 'config.json', 'generation_config.json', 'tokenizer.json',
            'tokenizer_config.json', 'special_tokens_map.json'}


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """One trained tiny run for the whole module."""
  tmp = tmp_path_factory.mktemp('export')
  (tmp / 'corpus').mkdir()
  cfg = TrainConfig(model='tiny', model_overrides=SMALL,
                    data=[str(write_corpus(tmp / 'corpus'))], vocab_size=300, seq_len=32,
                    batch_size=4, steps=2, warmup=1, merge_every=2, block_size=8,
                    eval_every=2, eval_batches=1, log_every=1, dtype='float32',
                    out_dir=str(tmp / 'run'), cache_dir=str(tmp / 'cache'))
  train(cfg, log=lambda *_: None)
  return pathlib.Path(cfg.out_dir)


def _json(path):
  return json.loads(pathlib.Path(path).read_text())


def _one_line_error(capsys, command):
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith(f'poetx {command}: error: '), err
  return err


@pytest.mark.slow
def test_export_names_the_special_tokens_transformers_reads(run, tmp_path, capsys):
  out = tmp_path / 'hf'
  assert cli.main(['export', str(run), '--out', str(out)]) == 0
  assert HF_FILES <= {p.name for p in out.iterdir()}
  assert f'wrote {out}: ' in capsys.readouterr().out
  tok = tokenizers.Tokenizer.from_file(str(out / 'tokenizer.json'))
  vocab = tok.get_vocab(with_added_tokens=True)
  eos = vocab[EOS]

  config = _json(out / 'config.json')
  assert config['vocab_size'] == tok.get_vocab_size(with_added_tokens=True) == len(vocab)
  assert (config['bos_token_id'], config['eos_token_id'], config['pad_token_id']) == (eos,) * 3
  gen = _json(out / 'generation_config.json')
  assert gen == {'bos_token_id': eos, 'eos_token_id': eos, 'pad_token_id': eos}

  # AutoTokenizer: the class named here (not the Llama default, which adds an
  # out-of-vocabulary <s>), no BOS added, every named token in the vocabulary.
  tc = _json(out / 'tokenizer_config.json')
  assert tc['tokenizer_class'] == 'PreTrainedTokenizerFast'
  assert tc['add_bos_token'] is False and tc['add_eos_token'] is False
  assert tc['model_max_length'] == config['max_position_embeddings']
  assert tc['clean_up_tokenization_spaces'] is False  # decode(encode(text)) == text
  assert tc['model_input_names'] == ['input_ids', 'attention_mask']  # no token_type_ids
  assert {k: tc[k] for k in ('bos_token', 'eos_token', 'pad_token')} == {
      'bos_token': EOS, 'eos_token': EOS, 'pad_token': EOS}
  assert 'unk_token' not in tc  # the byte-level BPE has none; transformers would add one
  added = {str(t['id']): {k: v for k, v in t.items() if k != 'id'}
           for t in _json(out / 'tokenizer.json')['added_tokens']}
  assert tc['added_tokens_decoder'] == added and added[str(eos)]['special']
  stm = _json(out / 'special_tokens_map.json')
  assert set(stm) == {'bos_token', 'eos_token', 'pad_token'}
  for entry in stm.values():
    assert entry == {'content': EOS, 'lstrip': False, 'normalized': False, 'rstrip': False,
                     'single_word': False}
  assert all(t['content'] in vocab for t in stm.values())
  # Encoding adds nothing around the text, as in training.
  text = 'the end of one document'
  assert tok.encode(text).ids == tok.encode(text, add_special_tokens=False).ids
  assert tok.decode(tok.encode(text).ids) == text


def test_eval_and_export_of_a_run_without_checkpoints_write_nothing(run, tmp_path, capsys):
  bare = tmp_path / 'bare'
  shutil.copytree(run, bare, ignore=shutil.ignore_patterns('checkpoints'))
  before = sorted(p.relative_to(bare) for p in bare.rglob('*'))
  for command in (['eval', str(bare)], ['export', str(bare), '--out', str(tmp_path / 'hf')]):
    capsys.readouterr()
    assert cli.main(command) == 2
    assert 'no checkpoint in' in _one_line_error(capsys, command[0])
  assert sorted(p.relative_to(bare) for p in bare.rglob('*')) == before
  assert not (tmp_path / 'hf').exists()


@pytest.mark.parametrize('name, text, why', [
    ('run.json', 'x', 'Expecting value'), ('run.json', '[]', 'a JSON list, not an object'),
    ('data.json', '{}', "no 'tokenizer', 'tokenizer_sha256'")])
def test_a_damaged_run_record_is_named(run, tmp_path, capsys, name, text, why):
  damaged = tmp_path / 'damaged'
  shutil.copytree(run, damaged)
  (damaged / name).write_text(text)
  for command in (['eval', str(damaged)], ['export', str(damaged), '--out', str(tmp_path / 'hf')]):
    capsys.readouterr()
    assert cli.main(command) == 2
    err = _one_line_error(capsys, command[0])
    assert f'{damaged / name} is damaged ({why}' in err, err
  assert not (tmp_path / 'hf').exists()


def test_a_damaged_hugging_face_config_is_named(tmp_path):
  (tmp_path / 'config.json').write_text('{"model_type": "llama",')
  with pytest.raises(ValueError, match=f'{tmp_path / "config.json"} is damaged .*not a Hugging '
                                       f'Face config'):
    hf.from_hf(str(tmp_path))


def test_export_refuses_an_existing_export_unless_forced(run, tmp_path, capsys):
  out = tmp_path / 'hf'
  old_umask = os.umask(0o022)
  try:
    assert cli.main(['export', str(run), '--out', str(out)]) == 0
  finally:
    os.umask(old_umask)
  for p in out.iterdir():  # readable like any other output, not 0600
    assert os.stat(p).st_mode & 0o777 == 0o644, (p.name, oct(os.stat(p).st_mode))
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  (out / 'config.json').write_text('{"other": "export"}')
  before['config.json'] = (out / 'config.json').read_bytes()
  capsys.readouterr()
  assert cli.main(['export', str(run), '--out', str(out)]) == 2
  err = _one_line_error(capsys, 'export')
  assert str(out) in err and 'already holds an export' in err and 'with --force, or' in err
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert cli.main(['export', str(run), '--out', str(out), '--force']) == 0
  assert _json(out / 'config.json')['architectures'] == ['LlamaForCausalLM']

  (tmp_path / 'file').write_text('x')
  assert cli.main(['export', str(run), '--out', str(tmp_path / 'file')]) == 2
  assert 'is a file' in _one_line_error(capsys, 'export')
  assert cli.main(['export', str(run), '--out', str(run)]) == 2
  assert 'is the run directory' in _one_line_error(capsys, 'export')


def test_export_writes_bfloat16_shards_with_an_index_covering_each_tensor_once(
    run, tmp_path, capsys):
  import ml_dtypes
  import numpy as np
  from safetensors import safe_open
  full, out = tmp_path / 'f32', tmp_path / 'hf'
  assert cli.main(['export', str(run), '--out', str(full)]) == 0
  assert cli.main(['export', str(run), '--out', str(out), '--dtype', 'bfloat16',
                   '--max-shard-size', '20KB']) == 0
  index = _json(out / 'model.safetensors.index.json')
  shards = sorted(p.name for p in out.glob('model-*.safetensors'))
  n = len(shards)
  assert n > 2 and shards == [f'model-{i:05d}-of-{n:05d}.safetensors' for i in range(1, n + 1)]
  assert not (out / 'model.safetensors').exists()
  assert _json(out / 'config.json')['torch_dtype'] == 'bfloat16'
  held, total = {}, 0  # every tensor in exactly one shard, the one the index names
  for shard in shards:
    with safe_open(str(out / shard), framework='numpy') as f:
      tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, x in tensors.items():
      assert name not in held and index['weight_map'][name] == shard
      assert x.dtype == ml_dtypes.bfloat16
    sizes = [x.nbytes for x in tensors.values()]
    assert sum(sizes) <= 20_000 or len(sizes) == 1, (shard, sizes)
    held.update(tensors)
    total += sum(sizes)
  with safe_open(str(full / 'model.safetensors'), framework='numpy') as f:
    want = {name: f.get_tensor(name) for name in f.keys()}
  assert set(held) == set(index['weight_map']) == set(want)
  assert index['metadata'] == {'total_size': total}
  for name, x in want.items():  # float32 rounded to bfloat16
    np.testing.assert_array_equal(held[name], x.astype(ml_dtypes.bfloat16))
  # Replaced by a one-file export: the shards and the index go.
  assert cli.main(['export', str(run), '--out', str(out), '--force']) == 0
  assert not list(out.glob('model-*')) and not (out / 'model.safetensors.index.json').exists()
  assert (out / 'model.safetensors').read_bytes() == (full / 'model.safetensors').read_bytes()
  capsys.readouterr()
  bad = tmp_path / 'bad'
  assert cli.main(['export', str(run), '--out', str(bad), '--max-shard-size', '5 parsecs']) == 2
  assert ("max_shard_size (--max-shard-size): size '5 parsecs' is not a number of bytes"
          in _one_line_error(capsys, 'export'))
  assert cli.main(['export', str(run), '--out', str(bad), '--max-shard-size', '0']) == 2
  assert ("--max-shard-size): size must be at least one byte, got '0'"
          in _one_line_error(capsys, 'export'))
  with pytest.raises(SystemExit):  # argparse: not one of the choices
    cli.main(['export', str(run), '--out', str(bad), '--dtype', 'int8'])
  assert not bad.exists()


def _val_loss(run, step):
  return next(r['val_loss'] for r in read_metrics(run) if r['step'] == step and 'val_loss' in r)


@pytest.mark.slow
def test_an_exported_poet_run_starts_a_new_run_with_the_same_function(run, tmp_path, capsys):
  """poetx train --init-from-hf: the model is config.json's, the tokenizer the
  checkpoint's, the step-0 state (poetized afresh) the exported function: the
  new run's first validation loss is the old run's last. The source is
  recorded; the new run exports again (its model config read from the record,
  its checkpoint restored into a model built without the source); AdamW
  starts from the same weights; disagreeing options and vocabularies are
  refused by name."""
  exp = tmp_path / 'exp'
  assert cli.main(['export', str(run), '--out', str(exp)]) == 0
  old = rundir.read_config(run)
  new = TrainConfig(init_from_hf=str(exp), data=old.data, seq_len=32, batch_size=4, steps=1,
                    warmup=1, eval_every=1, eval_batches=1, log_every=1, block_size=8,
                    dtype='float32', out_dir=str(tmp_path / 'new'), cache_dir=old.cache_dir)
  train(new, log=lambda *_: None)
  assert _val_loss(new.out_dir, 0) == pytest.approx(_val_loss(run, old.steps), rel=1e-5)
  saved = _json(pathlib.Path(new.out_dir) / 'run.json')
  assert saved['init_from_hf'] == str(exp) and saved['tokenizer'] == str(exp / 'tokenizer.json')
  record = _json(pathlib.Path(new.out_dir) / 'data.json')['init_from_hf']
  assert record['path'] == str(exp.resolve())
  assert record['weights_sha256'] == {'model.safetensors': file_hash(exp / 'model.safetensors')}
  assert record['config_sha256'] == file_hash(exp / 'config.json')
  assert record['model']['hidden'] == 32 and record['model']['vocab_size'] == 300
  shutil.rmtree(exp)  # never read again
  assert cli.main(['export', new.out_dir, '--out', str(tmp_path / 'again')]) == 0
  assert _json(tmp_path / 'again' / 'config.json')['hidden_size'] == 32

  assert cli.main(['export', str(run), '--out', str(exp)]) == 0
  config, weights = hf.from_hf(exp)
  adamw = dataclasses.replace(new, optimizer='adamw')
  model = factories.build_model(make_plan(adamw, 300, config), None, weights)
  for name, x in hf.hf_state_dict(model).items():
    np.testing.assert_array_equal(x, weights[name])

  base = ['train', '--init-from-hf', str(exp), '--data', *old.data, '--seq-len', '32',
          '--cache-dir', old.cache_dir, '--steps', '1']
  capsys.readouterr()

  def refused(*options):
    assert cli.main([*base, *options, '--out-dir', str(tmp_path / 'refused')]) == 2
    assert not (tmp_path / 'refused').exists()  # a refused run writes nothing
    return _one_line_error(capsys, 'train')

  assert (f'--model-overrides sets hidden=64, {exp}/config.json gives 32'
          in refused('--model-overrides', 'hidden=64'))
  assert f'--model 60m sets hidden=512, {exp}/config.json gives 32' in refused('--model', '60m')
  spec = _json(exp / 'tokenizer.json')  # one token added: 301 against 300
  spec['added_tokens'].append({**spec['added_tokens'][0], 'id': 300, 'content': '<pad>'})
  (tmp_path / 'tok.json').write_text(json.dumps(spec))
  assert (f'{exp} has a vocabulary of 300 (config.json vocab_size), the run\'s tokenizer 301 '
          'tokens' in refused('--tokenizer', str(tmp_path / 'tok.json')))
  before = {p.name: p.read_bytes() for p in exp.iterdir()}  # an export is not a run directory
  assert cli.main([*base, '--out-dir', str(exp)]) == 2
  assert f'{exp} holds a Hugging Face export' in _one_line_error(capsys, 'train')
  assert {p.name: p.read_bytes() for p in exp.iterdir()} == before
  hf_config = _json(exp / 'config.json')
  (exp / 'config.json').write_text(json.dumps({**hf_config, 'intermediate_size': 96}))
  assert 'model.layers.0.mlp.gate_proj.weight has shape (32, 32)' in refused()
  (exp / 'config.json').write_text(json.dumps(hf_config))
  weights = exp / 'model.safetensors'
  raw = weights.read_bytes()
  for damaged in (raw[:20] + bytes([raw[20] ^ 0xFF]) + raw[21:], raw[:len(raw) // 2]):
    weights.write_bytes(damaged)  # a flipped header byte; a file cut short
    assert f'{weights} is not a readable safetensors file' in refused()


def _proto(*fields):
  """A protobuf message of (field number, int or bytes) fields."""
  def varint(v):
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
      out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
      v >>= 7
      if not v:
        return bytes(out)
  msg = b''
  for num, value in fields:
    if isinstance(value, int):
      msg += varint(num << 3) + varint(value)
    else:
      msg += varint(num << 3 | 2) + varint(len(value)) + value
  return msg


def _sp_model(pieces, **ids):
  fields = {'unk_id': 40, 'bos_id': 41, 'eos_id': 42, 'pad_id': 43}
  trainer = _proto((4, len(pieces)), *[(fields[k], v) for k, v in ids.items()])
  return _proto(*[(1, _proto((1, p.encode()), (3, 1))) for p in pieces], (2, trainer),
                (3, _proto((3, 0))))


@pytest.mark.slow
def test_a_chunk_permutation_run_exports_the_function_it_trained(run, tmp_path):
  """A run drawing chunk permutations (runs of 4 in blocks of 8, merged once)
  exports its function: a run started from the export begins at the chunk
  run's last validation loss, and draws chunk permutations itself when
  asked (recorded in its plan)."""
  old = rundir.read_config(run)
  base = dict(data=old.data, seq_len=32, batch_size=4, warmup=1, eval_every=2,
              eval_batches=1, log_every=1, block_size=8, dtype='float32',
              cache_dir=old.cache_dir, permutation='chunk', chunk_size=4)
  chunk = TrainConfig(model='tiny', model_overrides=SMALL, vocab_size=300, steps=2,
                      merge_every=2, out_dir=str(tmp_path / 'chunk'), **base)
  train(chunk, log=lambda *_: None)
  assert _json(tmp_path / 'chunk' / 'run.json')['plan']['permutation'] == 'chunk'
  assert cli.main(['export', chunk.out_dir, '--out', str(tmp_path / 'exp')]) == 0
  new = TrainConfig(init_from_hf=str(tmp_path / 'exp'), steps=1,
                    out_dir=str(tmp_path / 'new'), **{**base, 'eval_every': 1})
  train(new, log=lambda *_: None)
  assert _val_loss(new.out_dir, 0) == pytest.approx(_val_loss(chunk.out_dir, 2), rel=1e-5)
  assert _json(tmp_path / 'new' / 'run.json')['plan']['permutation'] == 'chunk'


def test_a_sentencepiece_run_exports_its_model_and_no_stale_tokenizer(run, tmp_path, capsys):
  # The run's BPE is replaced by a sentencepiece model of the same size (made
  # here: sentencepiece is not needed to export one).
  sp_run = tmp_path / 'sp-run'
  shutil.copytree(run, sp_run)
  (sp_run / 'tokenizer.json').unlink()
  pieces = ['<pad>', '<s>', '</s>', '<unk>'] + [f'\u2581w{i}' for i in range(296)]
  (sp_run / 'tokenizer.model').write_bytes(_sp_model(pieces, unk_id=3, bos_id=1, eos_id=2,
                                                     pad_id=0))
  record = _json(sp_run / 'data.json')
  record.update(tokenizer='tokenizer.model',
                tokenizer_sha256=file_hash(sp_run / 'tokenizer.model'))
  (sp_run / 'data.json').write_text(json.dumps(record))

  out = tmp_path / 'hf'
  assert cli.main(['export', str(run), '--out', str(out)]) == 0
  (out / 'notes.txt').write_text('mine')
  assert cli.main(['export', str(sp_run), '--out', str(out)]) == 2
  assert cli.main(['export', str(sp_run), '--out', str(out), '--force']) == 0
  names = {p.name for p in out.iterdir()}
  assert names == HF_FILES - {'tokenizer.json'} | {'tokenizer.model', 'notes.txt'}
  assert (out / 'tokenizer.model').read_bytes() == (sp_run / 'tokenizer.model').read_bytes()
  tc = _json(out / 'tokenizer_config.json')
  assert tc['tokenizer_class'] == 'LlamaTokenizer'  # its vocab_file is tokenizer.model
  assert (tc['bos_token'], tc['eos_token'], tc['pad_token'], tc['unk_token']) == (
      '<s>', '</s>', '<pad>', '<unk>')
  assert tc['add_bos_token'] is False and tc['add_prefix_space'] is False
  assert 'vocab_file' not in tc  # a relative path there would be read from the cwd
  assert {i: t['content'] for i, t in tc['added_tokens_decoder'].items()} == {
      '0': '<pad>', '1': '<s>', '2': '</s>', '3': '<unk>'}
  config = _json(out / 'config.json')
  assert (config['bos_token_id'], config['eos_token_id'], config['pad_token_id'],
          config['vocab_size']) == (1, 2, 0, 300)
  assert _json(out / 'generation_config.json')['eos_token_id'] == 2

  # Trainer-spec defaults: unk 0, bos 1, eos 2 and no pad (padding with eos).
  path = tmp_path / 'default.model'
  path.write_bytes(_sp_model(['<unk>', '<s>', '</s>', 'a']))
  special, size, _ = tokenizer_files.tokenizer_files(path, model_max_length=8)
  assert special == tokenizer_files.SpecialTokens(bos=('<s>', 1), eos=('</s>', 2), pad=('</s>', 2),
                                         unk=('<unk>', 0)) and size == 4
  path.write_bytes(_sp_model(['<unk>', 'a'], eos_id=-1))
  with pytest.raises(ValueError, match='no end-of-sentence id'):
    tokenizer_files.tokenizer_files(path, model_max_length=8)
  path.write_bytes(b'\xff\xff')
  with pytest.raises(ValueError, match='is not a sentencepiece model'):
    tokenizer_files.tokenizer_files(path, model_max_length=8)


def test_plot_prints_the_path_written_and_refuses_runs_without_losses(run, tmp_path, capsys):
  assert cli.main(['plot', str(run), '--out', str(tmp_path / 'plots')]) == 0
  assert capsys.readouterr().out.strip() == f'wrote {tmp_path / "plots.png"}'
  assert (tmp_path / 'plots.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert not (tmp_path / 'plots').exists()
  assert cli.main(['plot', str(run), '--out', str(tmp_path / 'c.svg')]) == 0
  assert capsys.readouterr().out.strip() == f'wrote {tmp_path / "c.svg"}'
  assert b'<svg' in (tmp_path / 'c.svg').read_bytes()[:1000]

  empty, val_only, missing = tmp_path / 'empty', tmp_path / 'val-only', tmp_path / 'missing'
  empty.mkdir()
  (empty / 'metrics.jsonl').write_text('')
  val_only.mkdir()
  (val_only / 'metrics.jsonl').write_text('{"step": 0, "val_loss": 5.0, "val_ppl": 150.0}\n')
  missing.mkdir()
  for bad in (empty, val_only, missing):
    assert cli.main(['plot', str(run), str(bad), '--out', str(tmp_path / 'bad.png')]) == 2
    err = _one_line_error(capsys, 'plot')
    assert f'nothing to plot for run {bad}' in err
  assert not (tmp_path / 'bad.png').exists()
  assert cli.main(['plot', str(run), '--out', '']) == 2
  assert "--out '': an empty path" in _one_line_error(capsys, 'plot')


def test_plot_tells_runs_of_the_same_folder_name_apart(run, tmp_path, monkeypatch):
  import matplotlib.axes  # pylint: disable=g-import-not-at-top
  labels = []
  monkeypatch.setattr(matplotlib.axes.Axes, 'plot',
                      lambda self, *a, label=None, **k: labels.append(label))
  for where in ('sweep-a', 'sweep-b'):
    (tmp_path / where / 'poetx').mkdir(parents=True)
    shutil.copyfile(run / 'metrics.jsonl', tmp_path / where / 'poetx' / 'metrics.jsonl')
  assert cli.main(['plot', str(tmp_path / 'sweep-a' / 'poetx'), str(tmp_path / 'sweep-b' / 'poetx'),
                   str(run), '--out', str(tmp_path / 'p.png')]) == 0
  assert labels[::2] == ['sweep-a/poetx', 'sweep-b/poetx', run.name]  # loss, then val_ppl


@pytest.mark.parametrize('command', ['eval', 'export', 'plot'])
def test_help_describes_every_argument(command, capsys):
  sub = next(a for a in cli.build_parser()._actions if a.dest == 'command')
  parser = sub.choices[command]
  assert parser.description
  for action in parser._actions:
    assert action.help and len(action.help) > 10, (command, action.dest)
    if action.default not in (None, False, '==SUPPRESS==') and action.option_strings:
      assert 'default' in action.help, (command, action.dest)
  with pytest.raises(SystemExit) as e:
    cli.main([command, '--help'])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for action in parser._actions:
    assert action.help.split('%')[0][:30] in ' '.join(text.split()), (command, action.dest)
