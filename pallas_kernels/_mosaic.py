"""What the Mosaic GPU kernels of this package share: the shared-memory budget,
operand layouts and the interpreter switch."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_LIMIT_BYTES = 227 * 1024  # H100 / H200 dynamic shared memory per block


def swizzle(cols: int, itemsize: int):
  """Tiling and swizzle transforms for a shared-memory tile ``cols`` elements
  of ``itemsize`` bytes wide (the layout WGMMA and TMA want)."""
  s = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, s // itemsize)), plgpu.SwizzleTransform(s))


def static_interpret(interpret):
  """``interpret`` as a hashable static argument: a bool or the
  ``plgpu.InterpretGPUParams`` given."""
  return bool(interpret) if isinstance(interpret, bool) or interpret is None else interpret


def interpret_params(interpret):
  """The ``interpret=`` of ``plgpu.kernel``: True -> default interpreter
  parameters, False/None -> compiled, an ``InterpretGPUParams`` as given."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False or interpret is None:
    return None
  return interpret
