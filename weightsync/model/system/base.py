"""The model's core: configuration, the initial state, and firing an event through the table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from weightsync.model.system.premise import ReductionPremiseError
from weightsync.model.system.state import (
    ANY_MODE,
    CHANNEL_FIFOS,
    CHANNELS,
    GHOST_MODES,
    GHOST_STRIDE,
    IDLE,
    NOT_SENT,
    TRAINER_IDLE,
    AnyMode,
    Config,
    Coordinator,
    Ctrl,
    FrontEnd,
    GlobalState,
    ModeSetting,
    Rank,
    _new_tuple,
)
from weightsync.spec.controller import Policy, controller_table
from weightsync.spec.coordinator import coordinator_table
from weightsync.spec.front_end import FrontEvent, FrontState, FrontVars, front_end_fire, front_end_table
from weightsync.spec.rank import GUARDS, UPDATES, RankVars, Table, Variant, apply, get_variant, select
from weightsync.spec.states import DRAINS_BEFORE_RETURN, PauseMode, RankEvent, RankState
from weightsync.spec.table import Transition, apply_transition, select_transition
from weightsync.spec.worker import (
    WORKER_GUARDS,
    WORKER_TABLE,
    WORKER_UPDATES,
    WorkerEvent,
    WorkerState,
    WorkerVars,
)


class ModelBase:
    """Configuration, initial state and the table lookups shared by every part of :class:`Model`."""

    def __init__(
        self,
        config: Config,
        table: Table | None = None,
        guards: Mapping[str, Callable[[RankVars, Mapping[str, Any]], bool]] | None = None,
        updates: Mapping[str, Callable[[RankVars, Mapping[str, Any]], RankVars]] | None = None,
        silent_waves: bool = False,
    ) -> None:
        if config.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {config.ranks}")
        if config.channels not in CHANNEL_FIFOS:
            raise ValueError(f"channels must be one of {', '.join(CHANNELS)}, got {config.channels!r}")
        b = config.bounds
        if b.sync_interval < 1 or b.tokens < 1 or b.requests < 0 or b.cycles < 0:
            raise ValueError(f"bad bounds {b}")
        self.config = config
        self.variant: Variant = get_variant(config.variant)
        self.table: Table = table if table is not None else self.variant.table
        self.guards = guards if guards is not None else GUARDS
        self.updates = updates if updates is not None else UPDATES
        self.n = config.ranks
        self.ordered = config.channels == "ordered"
        self.n_fifos, self.f_add, self.f_ctrl, self.f_wave = CHANNEL_FIFOS[config.channels]
        self.mode: ModeSetting = config.mode if config.mode is ANY_MODE else PauseMode(config.mode)
        #: the controller picks the mode at each pause (the pause messages and ghosts carry it)
        self.any_mode = self.mode is ANY_MODE
        #: the modes a pause may have
        self.pause_modes: tuple[PauseMode, ...] = (
            tuple(PauseMode) if isinstance(self.mode, AnyMode) else (self.mode,)
        )
        #: some pause returns only once the rank's requests drained (property ``wait_drains``)
        self.drains_before_return = any(m in DRAINS_BEFORE_RETURN for m in self.pause_modes)
        self.sync_interval = b.sync_interval
        self.tokens = b.tokens
        self.requests = b.requests
        self.cycles = b.cycles
        self.clear_cache = b.clear_cache
        self.client_aborts = b.client_aborts
        self.init_transfer = b.init_transfer
        self.stray_resume = b.stray_resume
        self.repeat_resume = b.repeat_resume
        self.failures = b.failures
        self.pause_during_update = b.pause_during_update
        self.repeat_pause = b.repeat_pause
        self.init_while_serving = b.init_while_serving
        self.resume_during_update = b.resume_during_update
        #: the silent-wave reduction (:mod:`~weightsync.model.system.reduction`) is on
        self.silent_waves = silent_waves
        self.track_owed = self.variant.untracked_replies
        self.worker_args = self.variant.worker_flags_decide
        if b.failures < 0:
            raise ValueError(f"bad bounds {b}: failures must be >= 0")
        self._cache: dict[tuple[Any, ...], tuple[Transition | None, RankVars]] = {}
        self._worker_cache: dict[tuple[WorkerVars, WorkerEvent], WorkerVars] = {}
        # the silent-wave reduction's memos: the messages it removes from a rank's slice, the rank states checked
        self._quiet_cache: dict[tuple[int, Any, RankVars], tuple[tuple[Any, ...], ...] | None] = {}
        self._drops_checked: set[tuple[int, RankVars]] = set()
        # a controller call's table arguments by (event, requests running on the rank): spec call_args
        self._call_args_cache: dict[
            tuple[RankEvent, int, int, PauseMode | None], tuple[tuple[str, Any], ...]
        ] = {}
        # the DP coordinator's table (spec/coordinator.py) for this variant, and its firings by input
        self.coord_table = coordinator_table(
            self.variant.coordinator_latches, self.variant.first_req_exclusion
        )
        # the front-end's table (spec/front_end.py) for this variant
        self.front_table = front_end_table(self.variant.front_end_latches)
        # the RL controller's table (spec/controller.py) for this variant, the policy the model explores it
        # under, and its choices by (controller, event, no request sent yet)
        self.ctrl_table = controller_table(self.variant.pause_in_front_end)
        self.ctrl_policy = Policy.RECOVER
        self._ctrl_cache: dict[tuple[Any, ...], tuple[tuple[str, str, Ctrl], ...]] = {}
        # the front-end's table by (believed wave, believed running, gated, event, args): the row's effects
        # and the new (believed wave, believed running, gated), None if unchanged
        self._front_cache: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[int, bool, bool] | None]] = {}
        self._coord_cache: dict[tuple[Any, ...], tuple[Coordinator, tuple[tuple[int, int], ...]]] = {}
        # non-vacuity witnesses, set while exploring
        self.seen_all_verified = False
        self.seen_update_with_wave_in_flight = False

    # ------------------------------------------------------------------ state construction

    def initial(self) -> GlobalState:
        """Every rank running and idle, wave 0, no messages, controller idle, no request sent."""
        worker = WorkerVars(WorkerState.READY, initialized=not self.init_transfer)
        rank = Rank(RankVars(), "", (), (), ((),) * self.n_fifos, (), NOT_SENT, 0, worker)
        return GlobalState(
            (rank,) * self.n,
            ((),),
            Coordinator(current_wave=0, engines_running=False, publishing=False),
            FrontEnd(believed_wave=0, believed_running=False, next_request=0, gated=False, client_aborted=()),
            Ctrl(IDLE, 0, 0, not self.init_transfer, False, False, 0, False, 0),
            TRAINER_IDLE,
            (),
            (),
        )

    # ------------------------------------------------------------------ the table

    def ghost_mode(self, ghost: int) -> PauseMode:
        """The mode of the pause a rank's ghost records (the model's one mode unless :data:`ANY_MODE`).

        Raises:
            ValueError: under ANY_MODE, a ghost with no mode field (no pause in effect)."""
        if not isinstance(self.mode, AnyMode):
            return self.mode
        k = ghost // GHOST_STRIDE - 1
        if k < 0:
            raise ValueError(f"pause ghost {ghost} carries no mode")
        return GHOST_MODES[k]

    def fire(
        self, i: int, v: RankVars, event: RankEvent, extra: tuple[tuple[str, Any], ...]
    ) -> tuple[Transition | None, RankVars]:
        """Fire ``event`` on rank ``i`` with variables ``v`` through the table: ``(transition, new vars)``;
        an illegal event gives ``(None, vars in ERROR)`` (the sticky error state).

        Raises:
            ReductionPremiseError: with :attr:`silent_waves`, a row that lowers ``current_wave``."""
        key = (v, event, i, extra)
        r = self._cache.get(key)
        if r is None:
            args: dict[str, Any] = {"rank": i, "dp_size": self.n, "sync_interval": self.sync_interval}
            args.update(extra)
            tr = select(self.table, v, event, args, self.guards)
            if tr is None:
                r = (None, v._replace(state=RankState.ERROR))
            else:
                r = (tr, apply(v, tr, args, self.updates))
                if self.silent_waves and r[1].current_wave < v.current_wave:
                    raise ReductionPremiseError(
                        f"rank {i}: {event.value} row {tr.guard!r} moves current_wave from {v.current_wave} to "
                        f"{r[1].current_wave} in {v.state.value}: the silent-wave reduction needs current_wave "
                        "never to decrease (vLLM 0.32 v1/engine/core.py:2284-2297); check without it"
                    )
            self._cache[key] = r
        return r

    def worker_fire(self, wv: WorkerVars, event: WorkerEvent) -> WorkerVars:
        """Fire ``event`` on a rank's worker machine (:data:`weightsync.spec.worker.WORKER_TABLE`); an
        illegal call leaves it in ``error``."""
        key = (wv, event)
        r = self._worker_cache.get(key)
        if r is None:
            tr = select_transition(WORKER_TABLE, wv.state, event, wv, {}, WORKER_GUARDS)
            r = (
                wv._replace(state=WorkerState.ERROR)
                if tr is None
                else apply_transition(wv, tr, {}, WORKER_UPDATES)
            )
            self._worker_cache[key] = r
        return r

    def _front(self, front: FrontEnd, event: FrontEvent, **args: Any) -> tuple[tuple[str, ...], FrontEnd]:
        """The front-end's table (spec/front_end.py) on ``event``: the row's effects and the new
        :class:`FrontEnd` (``next_request`` and ``client_aborted`` unchanged; ``front`` itself when the row
        changes nothing)."""
        believed_wave, believed_running, gated = front.believed_wave, front.believed_running, front.gated
        key = (believed_wave, believed_running, gated, event, *args.values())  # each call site: one fixed set
        r = self._front_cache.get(key)
        if r is None:
            state = FrontState.RUNNING if believed_running else FrontState.IDLE
            tr, after = front_end_fire(FrontVars(state, believed_wave, gated), event, args, self.front_table)
            changed = (after.current_wave, after.engines_running, after.gated)
            r = (tr.effects, None if changed == (believed_wave, believed_running, gated) else changed)
            self._front_cache[key] = r
        effects, new = r
        if new is None:
            return effects, front
        return effects, _new_tuple(
            FrontEnd, (new[0], new[1], front.next_request, new[2], front.client_aborted)
        )
