"""CheckedEngine around a real vLLM 0.32: adapters that give a running ``AsyncLLM`` (or a ``vllm serve``
with ``VLLM_SERVER_DEV_MODE=1``) the engine-client API of :class:`weightsync.impl.checked.CheckedEngine`,
and derive the per-rank table transitions that vLLM itself never reports.

Use :func:`checked_async_llm` (or :func:`checked_http`): every controller call (``pause``, ``resume``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``) is
checked against the table of every DP rank before it reaches vLLM. vLLM has no gate of its own (vLLM 0.32
``v1/engine/core.py:1073-1080``: ``collective_rpc`` runs in any state; a ``start_weight_update`` while
serving runs, and so does a resume in the middle of an update; only the worker, once the call has crossed
into the engine, refuses an ``update_weights`` outside a round and a second start, by its own flag,
``v1/worker/gpu_worker.py:1534-1538, 1566-1569``), so an
illegal call -- ``update_weights`` while serving, ``start_weight_update`` twice -- raises
:class:`~weightsync.spec.errors.LocalProtocolError` in this process and no message leaves it for vLLM.
A :class:`~weightsync.impl.checked.CheckedEngine` is itself a vLLM ``VLLMWeightSyncClient``, so a trainer
built by ``WeightTransferTrainerFactory.trainer_init(..., client=<checked engine>)`` goes through the checks.

What the adapters **observe** from vLLM, and what they **infer**:

- Observed: that a vLLM call returned, or raised (and its error); ``is_paused()`` right after a pause and a
  resume returned (must be True / False: else the adapter stops, :class:`RemoteProtocolError`);
  ``get_weight_version()`` when attaching and after every finish (must equal the version the table now
  holds); the front-end's count of unfinished requests per DP rank just before every call it sends and just
  after each pause (``AsyncLLM.output_processor`` for one engine, the DP client's
  ``reqs_in_flight`` routing table for several; :class:`HTTPServerAdapter` sees none and records -1).
- Inferred: every table transition. vLLM reports none, so each returned call is mapped onto the table's
  rows from the rank's state, as the reference engine (:mod:`weightsync.impl.engine.core`) would fire them:

  ========================  ====================================================================================
  call returned             transitions recorded on every rank, in lockstep
  ========================  ====================================================================================
  ``pause(mode)``           ``pause`` (args ``mode``, ``clear_cache``, ``running`` = the rank's unfinished count
                            before the call), then ``step`` -> ``dp_sync_done`` (or ``dp_step_done`` and again,
                            with ``sync_interval`` > 1) until the rank is ``verified``: a returned pause *is*
                            phase 2's agreement. The outcome arguments (``sum_unfinished``, ``sum_pending_pause``)
                            are the SUM the table's all-reduce would compute from the ranks' states and counts.
  ``resume()``              ``resume`` -> ``resume_barrier_done`` (``max_unfinished`` from the counts before the
                            call, ``max_wave`` from the ranks' waves): ``running``.
  ``init_weight_transfer``  ``init_weight_transfer_engine`` -> ``transfer_init_done``
  ``start_weight_update``   ``start_weight_update`` (-> ``updating``)
  ``update_weights``        ``update_weights`` -> ``weight_broadcast_done``
  ``finish_weight_update``  ``finish_weight_update`` -> ``finish_done`` (``weight_version``): ``verified``
  a weight call raised      the call's transition, then ``transfer_failed`` (``phase``, ``error``): ``failed``
  ``update_weight_version`` no transition: a relabel record (``relabel_weight_version``) on every rank
  ========================  ====================================================================================

  Each record's ``waiting`` / ``running`` are the front-end's unfinished counts, split by inference: vLLM's
  scheduler split is not visible from the client. Requests kept by ``pause(mode="keep")`` count as running
  (frozen); requests still unfinished after an ``abort`` or ``wait`` pause returned count as waiting (held:
  the only split under which a returned pause agrees with the table). The waves, the step counter and the
  sync cadence are the table's, not vLLM's: a dense vLLM engine has no DP waves at all (reference section
  3), and the adapters model each returned pause with ``sync_interval=1`` by default (one inferred sync step
  per pause; vLLM's real cadence, 16 steps, is invisible to a client).

Rules of the adapters:

1. **Refusals stay local.** A call with no row in some rank's state raises ``LocalProtocolError`` (the
   adapter checks too, so it is safe without CheckedEngine); a call whose row is the table's ``refuse`` (a
   ``failed`` rank asked to pause, resume, update or finish) records that row and raises
   ``LocalProtocolError``. In neither case is vLLM called. A ``resume`` whose row is the local no-op (a
   rank already running, ``two-phase-epoch``'s safe resume) records it and does not call vLLM.
2. **Failures are table events.** A weight call that vLLM answers with an error records the call's row and
   then ``transfer_failed``; the error is raised. A new round (``start_weight_update``) is legal from
   ``failed``. A pause or resume that raises, any call that times out, or an observation that disagrees
   with the table leaves vLLM's state unknown: the adapter records nothing more and refuses every later
   controller call with :class:`RemoteProtocolError` (attach a new adapter to a known state).
3. **No monotonic guard.** vLLM has no monotonic version guard, and the adapters do not emulate the table's
   ``version_older`` row: ``finish_weight_update(monotonic=True)`` raises ``ValueError`` before vLLM is called.
4. **Attach to a serving engine.** The adapter starts every rank at the table's initial state (``running``)
   with vLLM's current ``weight_version``; it refuses an engine that ``is_paused()``.

Failed rounds: after a weight call that failed in vLLM (``init``, ``start``, ``update_weights`` or
``finish_weight_update``, e.g. weightsync's backend raising ``IncompleteUpdateError``), every rank is
``failed`` in the table and a new round recovers it, in vLLM too: the backend abandons the round
(:mod:`weightsync.vllm.engine` rule 4), and the plugin's patch ``0003`` makes vLLM 0.32's worker end its
session on a failed finish (shipped, it keeps ``_weight_update_active``, ``v1/worker/gpu_worker.py:1592-1600``,
and refuses the new start: run with ``WEIGHTSYNC_VLLM_FIX=none`` to see it). ``tests/test_vllm_recovery.py``
recovers from a failure at each phase without a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from weightsync.impl.checked import CheckedEngine
from weightsync.vllm_tools.checked.adapter import VLLMAdapter
from weightsync.vllm_tools.checked.async_llm import AsyncLLMAdapter
from weightsync.vllm_tools.checked.http import HTTPServerAdapter, VLLMCallError


def checked_async_llm(
    llm: Any, loop: asyncio.AbstractEventLoop, trace_path: str | Path | None = None, **kw: Any
) -> CheckedEngine:
    """A :class:`~weightsync.impl.checked.CheckedEngine` around an :class:`AsyncLLMAdapter` of ``llm``
    (``kw``: ``variant``, ``sync_interval``, ``timeout_s``); ``trace_path``: the JSONL trace that
    ``weightsync replay`` validates."""
    return CheckedEngine(AsyncLLMAdapter(llm, loop, **kw), trace_path=trace_path)


def checked_http(base_url: str, trace_path: str | Path | None = None, **kw: Any) -> CheckedEngine:
    """A :class:`~weightsync.impl.checked.CheckedEngine` around an :class:`HTTPServerAdapter` of a
    ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1``."""
    return CheckedEngine(HTTPServerAdapter(base_url, **kw), trace_path=trace_path)


__all__ = [
    "AsyncLLMAdapter",
    "HTTPServerAdapter",
    "VLLMAdapter",
    "VLLMCallError",
    "checked_async_llm",
    "checked_http",
]
