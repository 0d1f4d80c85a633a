"""The report of the scaling study, generated from its records.

``docs/results/scaling`` holds ``calls.json`` (what ran: date, commit,
machine, and per call its records and commands), the records of
``comm_model.py --json`` (``comm-*.json``: every run's collectives per update
and per merge, read from compiled programs on simulated devices, and the
projection of the data-parallel runs) and the measured two-GPU record that
the model is checked against (``two-h200.json``). This writes the folder's
``README.md`` from them, so that every figure on the page comes from a
record::

    python3 -m experiments.scaling_report docs/results/scaling
"""

from __future__ import annotations

import pathlib

from experiments.study_page import call_lines, header, load
from experiments import study_page

KINDS = ('all-reduce', 'reduce-scatter', 'all-gather', 'all-to-all', 'collective-permute')


def _mib(d: dict) -> list[str]:
  return [f'{d[k] / 2 ** 20:,.1f}' if d.get(k) else '—' for k in KINDS]


def collective_rows(rec: dict) -> list[str]:
  """Per run and device count: MiB per update and per merge by kind."""
  head = ' | '.join(KINDS)
  out = [f'| run | devices | accum | trained MiB | per update: {head} | '
         f'on a GPU: all-reduce | per merge: {head} |',
         '|---|---|---|---|' + '---|' * (2 * len(KINDS) + 1)]
  for r in rec['records']:
    gpu = r.get('gpu_allreduce_bytes')
    out.append(f"| {r['run']} | {r['devices']} | {r['grad_accum']} | "
               f"{r['trainable_bytes'] / 2 ** 20:,.1f} | {' | '.join(_mib(r['update_bytes']))} | "
               f"{f'{gpu / 2 ** 20:,.1f}' if gpu else '—'} | "
               f"{' | '.join(_mib(r['merge_bytes']))} |")
  return out


def projection_rows(rec: dict) -> list[str]:
  """The projected scaling, one row per run, GPUs and accumulation: the
  trained arrays' MiB (dp: all-reduced; fsdp: gathered and reduce-scattered),
  the frozen bases' MiB gathered an update (fsdp), the updated parameters'
  MiB gathered (dp with the optimizer state split) and the merges' share of
  an update's communication (fsdp)."""
  out = ['| run | GPUs (projected) | micro-batches an update | trained arrays MiB | '
         'frozen bases gathered MiB | parameters gathered MiB | merges ms an update | '
         'communication ms | compute ms | efficiency, nothing overlapped | '
         'efficiency, all overlapped | compute-bound above (tokens per GPU and update) |',
         '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for p in rec.get('projection', []):
    out.append(f"| {p['run']} | {p['gpus']} | {p['grad_accum']} | {p['allreduce_mib']:,.1f} | "
               f"{p.get('frozen_gather_mib', 0):,.1f} | {p.get('param_gather_mib', 0):,.1f} | "
               f"{p.get('merge_ms_per_update', 0):.1f} | "
               f"{p['comm_ms']:.1f} | {p['compute_ms']:.1f} | "
               f"{p['efficiency_no_overlap']:.3f} | {p['efficiency_overlap']:.3f} | "
               f"{p['compute_bound_tokens']:,.0f} |")
  return out


def versus_rows(rec: dict, baseline: str = 'adamw') -> list[str]:
  """Each projected run's tokens/s per GPU against ``baseline``'s at the same
  GPUs and accumulation (both bounds), where the two step records are of the
  same tokens per micro-batch."""
  base = {(p['gpus'], p['grad_accum']): p for p in rec.get('projection', [])
          if p['run'] == baseline}
  out = ['| run | GPUs (projected) | micro-batches an update | tokens/s against '
         f'{baseline}, nothing overlapped | all overlapped |', '|---|---|---|---|---|']
  for p in rec.get('projection', []):
    b = base.get((p['gpus'], p['grad_accum']))
    if p['run'] == baseline or b is None:
      continue
    ratio = lambda key: (p[key] / p['compute_ms']) / (b[key] / b['compute_ms'])  # noqa: E731
    out.append(f"| {p['run']} | {p['gpus']} | {p['grad_accum']} | "
               f"{ratio('efficiency_no_overlap'):.3f}× | {ratio('efficiency_overlap'):.3f}× |")
  return out


def check_rows(rec: dict) -> list[str]:
  out = ['| run | GPUs | measured efficiency | predicted, nothing overlapped | error | '
         'predicted, all overlapped |', '|---|---|---|---|---|---|']
  for c in rec.get('check', []):
    out.append(f"| {c['run']} | {c['gpus']} | {c['measured']:.3f} | "
               f"{c['predicted_no_overlap']:.3f} | {c['error_no_overlap']:+.3f} | "
               f"{c['predicted_overlap']:.3f} |")
  return out


def report(folder: pathlib.Path) -> str:
  meta = load(folder, 'calls.json')
  lines = [*header(meta, 'scaling_report', folder),
           meta['summary'], '', meta['paper'], '']
  lines += call_lines(meta)
  measured = load(folder, 'two-h200.json')
  lines += ['## The model against the two-GPU measurement', '',
            f"{measured['what']}; {measured['date']}, commit `{measured['commit']}`, "
            f"{measured['device']}; its command, in the options of that commit (a script "
            f"path and `--runs`; not runnable today): `{measured['command']}`.", '']
  for r in measured['runs']:
    lines.append(f"* {r['run']}: {r['allreduce_mib']:,.1f} MiB all-reduced a step "
                 f"({r['allreduce_source']}).")
  lines.append('')
  records = sorted(folder.glob('comm-*.json'))
  first_check = next((load(folder, p.name) for p in records
                      if load(folder, p.name).get('check')), None)
  if first_check:
    links = first_check['links']
    lines += [f"NVLink {links['nvlink_gbs']:g} GB/s per GPU and direction, "
              f"{links['gpus_per_node']} GPUs a node, network {links['net_gbs']:g} GB/s per "
              'GPU between nodes:', '', *check_rows(first_check), '']
  for path in records:
    rec = load(folder, path.name)
    r0 = rec['records'][0]
    lines += [f"## `{path.name}`: {r0['model']}, {r0['per_device_batch']} sequence(s) of "
              f"{r0['seq_len']} per device and micro-batch", '',
              'Read from the compiled update and merge programs on simulated CPU devices '
              '(MiB of results, times the runs per update; the CPU compiler carries a '
              'bfloat16 all-reduce in float32, twice the bytes a GPU sends; "on a GPU": '
              'a data-parallel update\'s all-reduce of exactly its trained arrays):', '',
              *collective_rows(rec), '']
    if rec.get('projection'):
      lines += ['Projected (a model, not a measurement):', '', *projection_rows(rec), '',
                'Projected tokens per second per GPU against AdamW\'s (each one-GPU step '
                'from its record, times the efficiency):', '', *versus_rows(rec), '']
  return '\n'.join(lines)


def main(argv=None):
  study_page.main(__doc__, report, argv)


if __name__ == '__main__':
  main()
