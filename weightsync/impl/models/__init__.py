"""The reference causal LM used by the inference engine (fused params + ``load_weights`` name mapping).

Public API: :class:`LMConfig` (from a Hugging Face config.json), :class:`CausalLM` (the module; satisfies the
transfer layer's ``LoadableModel`` protocol), :class:`KVCache` (one per request), and sampling
(:class:`SamplingParams`, :class:`RequestSampler`).
"""

from weightsync.impl.models.causal_lm import CausalLM, KVCache, TiedWeightMismatchError
from weightsync.impl.models.config import SUPPORTED_ARCHITECTURES, LMConfig
from weightsync.impl.models.sampling import RequestSampler, SamplingParams, sample_batch

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "KVCache",
    "LMConfig",
    "RequestSampler",
    "SamplingParams",
    "TiedWeightMismatchError",
    "sample_batch",
]
