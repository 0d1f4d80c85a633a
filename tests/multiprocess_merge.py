"""Run by tests/test_multiprocess.py as one of two processes (``PORT ID``), each
with two CPU devices: builds sharded_check's POET Llama replicated over the
four devices of both (``--strategy dp``), merges it with a shared key, and
prints one JSON line: a digest of this process's copies of the permutations
after the merge, whether they changed, and how many collectives the merge
programs hold."""

import hashlib
import json
import sys


def local_permutations(model) -> list:
  """Every permutation array as this process holds it (its first device's copy)."""
  import numpy as np
  from flax import nnx
  from poetx_jax.linear import Permutation
  return [np.asarray(v.get_value().addressable_shards[0].data)
          for _, v in nnx.to_flat_state(nnx.state(model, Permutation))]


def main(port: str, process_id: int) -> None:
  from poetx_jax.pretrain import processes
  processes.initialize(f'localhost:{port}', 2, process_id, timeout=120)
  import jax
  import numpy as np
  from poetx_jax import cycle, sharding
  import sharded_check
  mesh = sharding.make_mesh()  # (data 4, fsdp 1) over both processes
  model, _ = sharded_check.build(mesh=mesh, strategy='dp')
  before = local_permutations(model)
  cycle.merge(model, rngs=jax.random.key(7))
  after = local_permutations(model)
  digest = hashlib.sha256(b''.join(a.tobytes() for a in after)).hexdigest()
  collectives = sum(len(sites) for _, sites in cycle.merge_collectives(model))
  print(json.dumps({'digest': digest,
                    'changed': any(not np.array_equal(a, b) for a, b in zip(before, after)),
                    'permutations': len(after), 'collectives': collectives,
                    'devices': jax.device_count(), 'processes': jax.process_count()}))


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]))
