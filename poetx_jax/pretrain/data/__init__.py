"""The corpus wing of the pretraining app: from text to token windows.

    documents.py      corpus files and folders read as documents (.txt .md .rst
                      .py, .jsonl / .json.gz / .jsonl.zst records, .parquet columns)
    corpus.py         the built-in corpus (installed Python sources and prose)
    hfdata.py         Hugging Face datasets as documents (the hf extra)
    tokenizer.py      the byte-level BPE: trained, cached, loaded; the token cache
    tokenizer_files.py  the files transformers reads beside a tokenizer (export)
    windows.py        token streams split, packed into windows and batched (grain):
                      TextData, a corpus tokenized in memory
    prepare.py        ``poetx prepare``: a corpus tokenized once into token shards
    prepare_tasks.py  its work, in worker processes
    shards.py         prepared shards read window by window: PreparedData
    mixture.py        weighted sources drawn together: MixtureData

Every source gives the same interface to the training loop (``train_windows``,
``val_windows``, ``tokenizer``, ``fingerprint``, ``description``); which one a
run reads is decided in :mod:`poetx_jax.pretrain.loading`.
"""
