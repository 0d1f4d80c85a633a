"""How the permutation gathers of :func:`poetx_jax.ops.permute` are laid out
and fused by XLA on GPUs.

Both helpers change no value: they constrain the compiled program on GPUs
(CUDA and ROCm) and are the identity elsewhere, so CPU results stay exactly
what they were. Which of the two applies is decided when the program is
traced, from the default backend (the platform :mod:`poetx_jax` compiles
for, as its other platform choices are): a branch per platform in the
program (``jax.lax.platform_dependent``) would cost every gather a
conditional of three traced branches, over a third of a Llama-130M step's
StableHLO, for XLA to fold away again.
"""

from __future__ import annotations

import jax
from jax.experimental.layout import Layout, with_layout_constraint

Array = jax.Array


def row_major(x: Array) -> Array:
  """``x`` with its layout pinned to row-major (the last axis minor) on GPUs.

  XLA:GPU writes the column gather of :func:`poetx_jax.ops.permute` as a
  gather of token slices, one per feature, and left to itself it then lays
  out the gather's operand (and, through it, the block products and
  elementwise ops around it) token-minor, so that the fused elementwise ops
  and gathers transpose between layouts at a fraction of memory bandwidth.
  Pinned, every gather reads and writes whole rows and its neighbours keep
  the layout of the GEMMs. Other backends keep their own choice.
  """
  return _row_major(x) if on_gpu() else x


@jax.jit  # a program of its own in eager mode (the constraint takes jax Arrays only)
def _row_major(x):
  return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def materialized(x: Array) -> Array:
  """``x`` computed into memory of its own on GPUs (an optimization barrier).

  Around a gather this keeps XLA:GPU from fusing gathers into one another or
  into the elementwise ops around them: fused, each output element re-reads
  its inputs at composed, scattered positions (a SwiGLU backward with its
  four permutations ran at a twentieth of memory bandwidth), where a gather
  of its own reads one row at a time.
  """
  return jax.lax.optimization_barrier(x) if on_gpu() else x


def on_gpu() -> bool:
  """Whether programs are compiled for GPUs (CUDA or ROCm) here."""
  return jax.default_backend() == 'gpu'
