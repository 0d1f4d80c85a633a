"""Export a run as merged dense weights a Hugging Face Llama loader accepts.

The POET layers are merged (``R W0 P``) into plain kernels, so the exported
model runs with zero POET overhead: ``model.safetensors`` (float32, HF names and
(out, in) layouts), ``config.json`` (``LlamaForCausalLM``) and the tokenizer
(``tokenizer.json``, or ``tokenizer.model`` for sentencepiece).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import poetx_jax
from poetx_jax.models import hf, llama


def export_model(model, mc: llama.LlamaConfig, out_dir: str | pathlib.Path,
                 tokenizer_path: str | pathlib.Path | None = None) -> pathlib.Path:
  """Writes ``model`` (POET or plain Llama) to ``out_dir``; returns the weights' path."""
  from safetensors.numpy import save_file
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  plain = poetx_jax.unpoetize(model)
  weights = out / 'model.safetensors'
  save_file(hf.hf_state_dict(plain), str(weights), metadata={'format': 'pt'})
  (out / 'config.json').write_text(json.dumps(hf.hf_config(mc), indent=1))
  if tokenizer_path:
    suffix = '.model' if str(tokenizer_path).endswith('.model') else '.json'
    shutil.copyfile(tokenizer_path, out / f'tokenizer{suffix}')
  return weights


def export_run(run: str | pathlib.Path, out_dir: str | pathlib.Path,
               step: int | None = None) -> pathlib.Path:
  """Exports the newest (or given) checkpoint of a run directory with the
  tokenizer stored in it; the corpus is not read."""
  from poetx_jax.pretrain import rundir
  tokenizer = rundir.stored_tokenizer(run)
  _, mc, model, _ = rundir.load_model(run, step=step)
  return export_model(model, mc, out_dir, tokenizer)
