"""Repro: the model's counterexamples driven through real engines, and the runtime checker's self-test.

- :mod:`weightsync.repro.schedule`: the schedule compiler (the model's labels and states -> per-step rows,
  channels and front-end/coordinator beliefs), shared by both engines.
- :mod:`weightsync.repro.engine` / :mod:`weightsync.repro.driver`: ``weightsync repro VARIANT`` on the
  reference engine (the run and its verdict / the per-step driver).
- :mod:`weightsync.repro.gated` / :mod:`weightsync.repro.faults`: the gated engine core the driver steps,
  and the deliberately broken engine cores of the self-test.
- :mod:`weightsync.repro.selftest`: ``weightsync replay --self-test``.
- :mod:`weightsync.repro.vllm`: ``weightsync repro VARIANT --engine vllm`` (the only part that imports vllm).

Layering: repro imports impl, model and spec; nothing in impl, model or spec imports repro.
"""
