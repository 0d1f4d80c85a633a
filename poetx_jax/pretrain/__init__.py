"""The Llama pretraining app built on the poetx_jax library: run options,
data, the training loop, checkpoints, export, plots and the ``poetx`` command.

It needs the ``pretrain`` extra (grain, orbax-checkpoint, tokenizers, pyarrow,
safetensors, matplotlib, tqdm); the library (``poetx_jax`` itself) never
imports it.

A run goes: ``cli`` parses the command line into a ``config.TrainConfig``
(``config_text`` reads K=V overrides and config files); ``plan.make_plan``
finishes the options (resume, ``--init-from-hf``, prepared data) and
resolves every default once into a frozen ``plan.Plan``, recorded in
run.json; ``recipes`` says how each optimizer family builds its chain;
``factories`` builds the model, optimizer and step from the plan; ``train``
runs the loop (``hooks``, ``loss``, ``evaluation``, ``metrics``, ``tracking``,
``checkpoint``, ``rundir``); ``data`` is the corpus wing; ``loading``,
``export`` and ``hf_init`` read and write finished runs.
"""
