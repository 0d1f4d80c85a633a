"""Model definitions built from plain Flax NNX layers (POET enters by ``poetize``)."""
