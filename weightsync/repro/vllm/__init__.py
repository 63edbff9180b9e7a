"""``weightsync repro VARIANT --engine vllm``: the model's counterexample on a running vLLM 0.32 DP=2
deployment (:mod:`weightsync.repro.vllm.run`). With :mod:`weightsync.vllm` and
:mod:`weightsync.vllm_tools`, the only packages that import ``vllm``.
"""
