"""Front-end client of a DP engine cluster: launches the processes, routes requests, fans out calls.

:class:`DPEngineClient` plays vLLM's ``AsyncLLM`` + DP core client (reference sections 1 and 5):

- ``start()`` spawns one DP coordinator process and ``dp_size`` engine-core processes
  (``torch.multiprocessing`` spawn) and waits until every engine joined its DP group.
- ``add_request`` stamps the request with the front-end's ``current_wave``, sends ADD to one engine (round
  robin unless a rank is given) and, when it believes the engines idle, FIRST_REQ(exclude=that engine,
  wave) to the coordinator; it refreshes its (current_wave, engines_running) belief from coordinator stats.
  The returned :class:`RequestStream` collects token ids, log-probs and weight versions as they stream.
- ``pause / resume / init_weight_transfer_engine / start_weight_update / update_weights /
  finish_weight_update / update_weight_version`` fan out to every rank and return when all have answered; a
  rank that does not answer in time raises :class:`~weightsync.spec.errors.TransferTimeoutError` naming the
  missing ranks. The weight calls are vLLM 0.32's (``v1/engine/async_llm.py:1315-1363``) with the same
  request shapes (:mod:`weightsync.impl.transfer.base`), plus a keyword-only ``timeout``; so the client is a
  vLLM ``VLLMWeightSyncClient`` (:class:`~weightsync.impl.transfer.trainer.WeightSyncClient`) and a
  trainer built by ``trainer_init(..., client=<this client>)`` drives it as it drives vLLM. Versions are
  vLLM's strings (``"default"`` before any); :meth:`DPEngineClient.get_weight_version` is vLLM's consensus
  (:class:`WeightVersionMismatchError` when the ranks differ), :meth:`DPEngineClient.get_weight_versions`
  each rank's.
- Every transition the engines fire (and every relabel by ``update_weight_version``, a
  :class:`~weightsync.impl.engine.messages.RelabelRecord`) is delivered to listeners
  (``add_transition_listener``) in the order each engine reported it; the
  :class:`~weightsync.impl.checked.CheckedEngine` and the trace recorder use this.
- ``hold=True`` (``weightsync repro``) routes every message bound for an engine (front-end input,
  controller input and the coordinator's wave socket) into per-(rank, socket) holding FIFOs, and every
  message bound for the coordinator (FIRST_REQ: ``(-1, "coord")``; an engine's wave_complete / start_wave:
  ``(rank, "coord")``) too; a schedule then releases them one by one with :meth:`DPEngineClient.release`.
  The coordinator's stats are held as well (the front-end's belief changes only at :meth:`refresh`), and
  each engine gets a step gate (:meth:`DPEngineClient.set_step_gate`).
"""

from __future__ import annotations

from weightsync.impl.engine.launcher import (
    COORD,
    SOCKETS,
    EngineCallError,
    Launcher,
    RequestStream,
    free_port,
)
from weightsync.impl.engine.rpc import RPCFanOut, WeightVersionMismatchError


class DPEngineClient(RPCFanOut):
    """Front-end + launcher of a DP engine cluster (module docstring): the process launcher and router
    (:class:`~weightsync.impl.engine.launcher.Launcher`), the front-end's request path
    (:class:`~weightsync.impl.engine.front_end.FrontEnd`) and the RPC fan-out
    (:class:`~weightsync.impl.engine.rpc.RPCFanOut`).

    Args:
        cfg: cluster configuration (``cfg.model`` is required).
        hold: route every engine-bound message through holding FIFOs (repro mode).
        start_timeout_s: how long ``start`` waits for every engine to come up, seconds.
    """

    def start(self) -> DPEngineClient:
        """Spawn the coordinator and the engines; return once all engines are ready (see
        :meth:`Launcher.start`)."""
        super().start()
        return self

    def __enter__(self) -> DPEngineClient:
        return self.start()


__all__ = [
    "COORD",
    "SOCKETS",
    "DPEngineClient",
    "EngineCallError",
    "Launcher",
    "RequestStream",
    "WeightVersionMismatchError",
    "free_port",
]
