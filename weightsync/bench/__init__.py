"""The benchmarks behind ``weightsync bench WHAT``, one module per benchmark.

- :mod:`weightsync.bench.transfer`: packed broadcast against raw and per-tensor broadcast, CPU IPC against
  memcpy, resident-memory growth (``weightsync bench transfer``);
- :mod:`weightsync.bench.pause`: pause and resume latency of 2 DP ranks of the reference engine;
- :mod:`weightsync.bench.explorer`: the model checker's exploration against a networkx BFS baseline;
- :mod:`weightsync.bench.vllm`: one sync round into a real ``AsyncLLM`` against raw and per-tensor
  broadcasts. Only :mod:`weightsync.vllm` may import vllm, so the part that drives vLLM is
  :mod:`weightsync.vllm_tools.bench` (the trainer side) and :mod:`weightsync.vllm_tools.bench_worker` (run inside vLLM's
  worker); this module holds the benchmark's definition, its figures and their rendering, and the command
  imports :mod:`weightsync.vllm_tools.bench` only when it runs.

The command is :mod:`weightsync.cli.bench`.
"""
