"""SIGINT and SIGTERM at instants of poetx train's start-up, in processes of
their own (experiments/signal_startup.py): each ends in a stop that wrote
nothing (before the training loop) or in a run that --resume ends exactly as
the uninterrupted one (after). The suite runs a sample; the full sweep, 50
instants for each signal:

    python3 -m experiments.signal_startup --instants 50 --out /tmp/signals
"""

import sys

import pytest

from experiments import signal_startup


@pytest.mark.slow
def test_signals_at_start_up_instants_write_nothing_or_resume_exactly(tmp_path, corpus):
  """Two instants for each signal, one in each of the first two seconds after
  the launch: the interpreter's start, the imports, the devices' start, the
  data (the whole start-up takes about 2.5 s on a 2-core CPU, its caches
  warm; the full sweep covers the loop as well)."""
  results = signal_startup.sweep(str(corpus), tmp_path, instants=2, seed=0, span=2.0)
  assert sum(r['sent'] for r in results) >= 2, results  # signals that reached a live process
  failed = [r for r in results if not r['ok']]
  assert not failed, failed


def test_a_stop_whose_exception_was_dropped_is_acted_on_at_the_next_safe_point(monkeypatch):
  """Raised inside a __del__ (as inside JAX's garbage-collection callback),
  the exception of a SIGTERM or SIGINT is dropped by Python: not reported as
  "Exception ignored", recorded, and raised by signals.check(); other
  dropped exceptions are reported as before."""
  import os
  import signal

  from poetx_jax.pretrain import signals

  reported = []
  recorder = lambda u: reported.append(u.exc_value)
  monkeypatch.setattr(sys, 'unraisablehook', recorder)

  class Dropping:
    def __init__(self, fn):
      self.fn = fn

    def __del__(self):
      self.fn()

  def bad():
    raise ValueError('not a signal')

  old = signals.install()
  try:
    for name, exit_type in (('SIGTERM', SystemExit), ('SIGINT', KeyboardInterrupt)):
      Dropping(lambda name=name: os.kill(os.getpid(), getattr(signal, name)))  # collected at once
      assert reported == []
      try:
        signals.check()
      except exit_type as e:
        assert not isinstance(e, SystemExit) or e.code == 143
      else:
        raise AssertionError(f'{name} was not acted on')
      signals.check()  # acted on once
    Dropping(bad)
    assert [str(e) for e in reported] == ['not a signal']
  finally:
    signals.restore(old)
  assert sys.unraisablehook is recorder and signal.getsignal(signal.SIGTERM) == old[signal.SIGTERM]
