"""The Llama pretraining app built on the poetx_jax library: run options,
data, the training loop, checkpoints, export, plots and the ``poetx`` command.

It needs the ``pretrain`` extra (grain, orbax-checkpoint, tokenizers, pyarrow,
safetensors, matplotlib, tqdm); the library (``poetx_jax`` itself) never
imports it.
"""
