"""Benchmarks: the case registry and runner (``sparsefocus bench``), the fastest-dense rule, the
profiler's counts, the training-step bench (``--model``) and the plots. Nothing in the core imports it."""
