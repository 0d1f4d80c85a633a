"""Training, benchmark, profiling and report scripts, each run from the
repository root as ``python3 -m experiments.NAME``.

Every script reads its runs in one grammar, starts its children by one
protocol and writes its records in one form: :mod:`experiments.harness`.
Each checks correctness first and reports medians of device-synchronised
timings beside a baseline from the same run (:mod:`experiments.common`).
"""
