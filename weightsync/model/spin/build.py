"""The Promela model's declarations, initial state, and its building blocks: FIFO operations, request
queries, and firing a rank's table with the effects the model interprets (:mod:`weightsync.model.system.
effects`)."""

from __future__ import annotations

from collections.abc import Callable

from weightsync.model.spin.tables import TEMPS, TableCode
from weightsync.model.spin.translate import Codes, Expr, Registry, Translator, Value
from weightsync.model.system import Model
from weightsync.spec.calls import Phase
from weightsync.spec.collectives import CALL_FAIL_PHASE
from weightsync.spec.controller import CtrlVars
from weightsync.spec.coordinator import CoordVars
from weightsync.spec.front_end import FrontVars
from weightsync.spec.rank import RankVars
from weightsync.spec.rank_vars import GUARDS, UPDATES
from weightsync.spec.states import PauseMode, RankEvent
from weightsync.spec.worker import WORKER_TABLE, WorkerVars

#: Request places (``rq_where``): not at a rank's scheduler (unsent, or an ADD in a FIFO), waiting, running,
#: finished, aborted.
NOWHERE, WAITING, RUNNING_Q, DONE, ABORTED = 0, 1, 2, 3, 4
#: Default FIFO capacity (the model's FIFOs are unbounded; a send past the capacity stops SPIN with a
#: :class:`~weightsync.model.spin.run.SpinError` naming it, never with a verdict).
CAP = 8
#: Message kinds in FIFOs (0: an empty slot).
KINDS = ("ADD", "ABORT", "W", "U", "FIRST_REQ", "wave_complete", "start_wave")

#: Promela types of the rank variables.
RANK_TYPES = {
    "state": "byte",
    "pause_state": "byte",
    "engines_running": "bit",
    "current_wave": "byte",
    "step_counter": "byte",
    "pending_pause": "bit",
    "ignore_start_dp_wave": "bit",
    "collective": "byte",
    "weight_version": "short",
    "clear_cache": "bit",
    "wave_started": "bit",
    "first_synced": "bit",
    "was_running": "bit",
}
_WORKER_TYPES = {
    "state": "byte",
    "initialized": "bit",
    "is_checkpoint_format": "bit",
    "weight_version": "byte",
    "updates_in_round": "byte",
    "partial": "bit",
}


def _indexed(prefix: str, i: int) -> Callable[[str], str]:
    """The Promela lvalue of field ``f`` of element ``i`` of a per-rank array: ``<prefix><f>[i]``."""

    def var(f: str) -> str:
        return f"{prefix}{f}[{i}]"

    return var


class UnsupportedModel(ValueError):
    """The Promela generator does not cover a bound, mode or channel semantics of the model (named)."""


def kind(name: str) -> int:
    """A message kind's code in the FIFOs."""
    return KINDS.index(name) + 1


class Build:
    """Declarations, initial state and building blocks (see the module docstring)."""

    def __init__(self, model: Model, checks: bool, cap: int = CAP) -> None:
        if model.guards != GUARDS or model.updates != UPDATES:
            raise UnsupportedModel(
                "the model replaces rank guards or updates of weightsync.spec.rank_vars: the generator reads "
                "the registries as code, so it would check the spec's functions instead; edit the table"
            )
        self.m = model
        self.cap = cap
        self.n = model.n
        self.checks = checks
        self.any_mode = model.any_mode
        #: the model's one pause mode (None under ANY_MODE: each pause message names its own)
        self.mode: PauseMode | None = None if model.any_mode else model.pause_modes[0]
        self.codes = Codes()
        self.nf = model.n_fifos
        self.R = model.requests
        ranks = Registry("weightsync.spec.rank_vars", "GUARDS", "UPDATES")
        workers = Registry("weightsync.spec.worker", "WORKER_GUARDS", "WORKER_UPDATES")
        #: each rank's table, its variables named ``r_<field>[i]`` (so ``rank`` folds to a constant)
        self.rank_tables = [
            TableCode(model.table, ranks, self.codes, _indexed("r_", i), RankVars._fields)
            for i in range(self.n)
        ]
        self.worker_tables = [
            TableCode(WORKER_TABLE, workers, self.codes, _indexed("w_", i), WorkerVars._fields)
            for i in range(self.n)
        ]
        self.coord_table = TableCode(
            model.coord_table,
            Registry("weightsync.spec.coordinator", "COORD_GUARDS", "COORD_UPDATES"),
            self.codes,
            lambda f: "co_state" if f == "state" else "co_wave",
            CoordVars._fields,
        )
        self.front_table = TableCode(
            model.front_table,
            Registry("weightsync.spec.front_end", "FRONT_END_GUARDS", "FRONT_END_UPDATES"),
            self.codes,
            lambda f: {"state": "f_state", "current_wave": "f_wave", "gated": "f_gated"}[f],
            FrontVars._fields,
        )
        self.ctrl_table = TableCode(
            model.ctrl_table,
            Registry("weightsync.spec.controller", "CTRL_GUARDS", "CTRL_UPDATES"),
            self.codes,
            lambda f: f"ct_{f}",
            CtrlVars._fields,
        )
        self.states_fn = Translator(Registry("weightsync.spec.states", None, None), self.codes, str, ())
        self.ctrl_fn = self.ctrl_table.tr
        self.c = self.codes.value

    # ------------------------------------------------------------------ parts the checks supply

    def snapshot(self, label: str) -> str:  # pragma: no cover - Props overrides
        raise NotImplementedError

    def check_edge(self, label: str) -> str:  # pragma: no cover - Props overrides
        raise NotImplementedError

    def check_state(self) -> str:  # pragma: no cover - Props overrides
        raise NotImplementedError

    def all_replied_expr(self, phase: Phase | None) -> Expr:  # pragma: no cover - Moves overrides
        raise NotImplementedError

    def phase_failed_expr(self) -> str:  # pragma: no cover - Moves overrides
        raise NotImplementedError

    # ------------------------------------------------------------------ declarations

    def header(self) -> str:
        m = self.m
        cfg = m.config
        return (
            f"/* weightsync: generated from weightsync/spec for variant {cfg.variant}, N={self.n}, "
            f"mode {cfg.mode.value}, channels {cfg.channels}, bounds {dict(cfg.bounds._asdict())}.\n"
            "   Do not edit: `weightsync check --engine spin` regenerates it from the tables. */\n"
        )

    def declarations(self) -> str:
        n, nf, r = self.n, self.nf, max(self.R, 1)
        lines = [f"{t} r_{f}[{n}];" for f, t in RANK_TYPES.items()]
        lines += [f"{t} w_{f}[{n}];" for f, t in _WORKER_TYPES.items()]
        lines += [
            f"byte r_blocked[{n}]; byte r_status[{n}]; byte r_ghost[{n}]; byte r_owed[{n}];",
            f"byte q_len[{n * nf}]; byte q_k[{n * nf * self.cap}]; short q_a[{n * nf * self.cap}]; "
            f"short q_b[{n * nf * self.cap}]; short q_c[{n * nf * self.cap}];",
            f"byte o_len[{n}]; byte o_k[{n * self.cap}]; short o_a[{n * self.cap}]; short o_b[{n * self.cap}];",
            f"byte cq_len; byte cq_k[{self.cap}]; short cq_a[{self.cap}]; short cq_b[{self.cap}]; short cq_c[{self.cap}];",
            f"byte rq_where[{r}]; byte rq_rank[{r}]; byte rq_left[{r}]; short rq_kv[{r}];",
            f"byte r_nw[{n}]; byte r_nr[{n}]; /* requests waiting, running on each rank */",
            "byte co_state; short co_wave; bit co_pub;",
            "byte f_state; short f_wave; byte f_next; bit f_gated; byte f_cab;",
            "byte ct_state; byte ct_cycles_started; byte ct_update_rounds; bit ct_transfer_initialised;",
            "bit ct_stray_resume_used; bit ct_repeat_resume_used; byte ct_failures_used; bit ct_recovering;",
            "byte ct_extra_used;",
            "byte t_blocked; byte t_status;",
            "bit inv_bad; /* (checks off) the state violates an invariant: not expanded, as the explorer */",
            # scratch: not hidden (SPIN's BFS refuses hidden variables), so every move zeroes it again
            # (:meth:`reset`) and it adds nothing to the state space
            f"short tmp[{TEMPS}]; short m_k, m_a, m_b, m_c; byte k;",
            "short h_a, h_b, h_hw, h_w, u_retry;",
            f"byte b_where[{r}]; byte b_rank[{r}]; byte b_left[{r}]; short b_kv[{r}];",
            f"byte b_blocked[{n}]; byte b_ghost[{n}]; byte b_state; byte b_ps;",
            "short b_wv; byte b_wstate; byte b_partial;",
        ]
        return "\n".join(lines) + "\n"

    def reset(self) -> str:
        """Zero the scratch variables (end of every move)."""
        n, r = self.n, max(self.R, 1)
        out = [f"tmp[{x}] = 0" for x in range(TEMPS)]
        out += ["m_k = 0; m_a = 0; m_b = 0; m_c = 0; k = 0; h_a = 0; h_b = 0; h_hw = 0; h_w = 0; u_retry = 0"]
        out += [f"b_where[{x}] = 0; b_rank[{x}] = 0; b_left[{x}] = 0; b_kv[{x}] = 0" for x in range(r)]
        out += [f"b_blocked[{x}] = 0; b_ghost[{x}] = 0" for x in range(n)]
        out += ["b_state = 0; b_ps = 0; b_wv = 0; b_wstate = 0; b_partial = 0"]
        return "; ".join(out)

    def initial(self) -> str:
        """The model's initial state (:meth:`Model.initial`); arrays not named here start at 0."""
        m, c = self.m, self.c
        s = m.initial()
        rank = s.ranks[0]
        out = []
        for i in range(self.n):
            for f, v in rank.vars._asdict().items():
                out.append(f"r_{f}[{i}] = {c(v)}")
            for f, v in rank.worker._asdict().items():
                out.append(f"w_{f}[{i}] = {c(v)}")
            out.append(f"r_blocked[{i}] = {c(rank.blocked)}; r_status[{i}] = {rank.status}")
        out.append(
            f"co_state = {c(self.coord_state(s.coord.engines_running))}; co_wave = {s.coord.current_wave}"
        )
        out.append(
            f"f_state = {c(self.front_state(s.front.believed_running))}; f_wave = {s.front.believed_wave}"
        )
        ctrl = s.ctrl
        out.append(
            f"ct_state = {ctrl.phase}; ct_cycles_started = {ctrl.cycles_started}; "
            f"ct_update_rounds = {ctrl.update_rounds}; ct_transfer_initialised = {int(ctrl.transfer_initialised)}"
        )
        out.append(f"t_blocked = {c(s.trainer.blocked)}; t_status = {s.trainer.status}")
        for r in range(self.R):
            out.append(f"rq_where[{r}] = {NOWHERE}")
        return "; ".join(out)

    def coord_state(self, running: bool) -> object:
        from weightsync.spec.coordinator import CoordState

        return CoordState.RUNNING if running else CoordState.IDLE

    def front_state(self, running: bool) -> object:
        from weightsync.spec.front_end import FrontState

        return FrontState.RUNNING if running else FrontState.IDLE

    # ------------------------------------------------------------------ FIFOs

    def full(self, length: str) -> str:
        """Stop the run (not a verdict: ``CAPACITY``) when a FIFO of length ``length`` is full."""
        return f'if :: {length} >= {self.cap} -> printf("CAPACITY {self.cap}\\n"); assert(false) :: else -> skip fi'

    def qbase(self, i: int, f: int) -> int:
        return (i * self.nf + f) * self.cap

    def push(self, i: int, f: int, kd: str, a: str, b: str = "0", cc: str = "0") -> str:
        """Append a message to rank ``i``'s input FIFO ``f``."""
        q = i * self.nf + f
        base = self.qbase(i, f)
        at = f"{base} + q_len[{q}]"
        return (
            f"{self.full(f'q_len[{q}]')}; q_k[{at}] = {kind(kd)}; q_a[{at}] = {a}; "
            f"q_b[{at}] = {b}; q_c[{at}] = {cc}; q_len[{q}]++"
        )

    def pop(self, i: int, f: int) -> str:
        """Take the head of rank ``i``'s FIFO ``f`` into ``m_k, m_a, m_b, m_c``."""
        q = i * self.nf + f
        base = self.qbase(i, f)
        return (
            f"m_k = q_k[{base}]; m_a = q_a[{base}]; m_b = q_b[{base}]; m_c = q_c[{base}]; k = 0; "
            f"do :: k + 1 < q_len[{q}] -> q_k[{base} + k] = q_k[{base} + k + 1]; "
            f"q_a[{base} + k] = q_a[{base} + k + 1]; q_b[{base} + k] = q_b[{base} + k + 1]; "
            f"q_c[{base} + k] = q_c[{base} + k + 1]; k++ :: else -> break od; "
            f"q_len[{q}]--; q_k[{base} + q_len[{q}]] = 0; q_a[{base} + q_len[{q}]] = 0; "
            f"q_b[{base} + q_len[{q}]] = 0; q_c[{base} + q_len[{q}]] = 0"
        )

    def to_coord(self, i: int, kd: str, wave: str) -> str:
        """``_to_coord``: rank ``i``'s message to the coordinator (its FIFO, or the one ordered FIFO)."""
        if self.m.ordered:
            return (
                f"{self.full('cq_len')}; cq_k[cq_len] = {kind(kd)}; cq_a[cq_len] = {wave}; "
                f"cq_b[cq_len] = {i}; cq_c[cq_len] = 0; cq_len++"
            )
        return (
            f"{self.full(f'o_len[{i}]')}; o_k[{i * self.cap} + o_len[{i}]] = {kind(kd)}; "
            f"o_a[{i * self.cap} + o_len[{i}]] = {wave}; o_b[{i * self.cap} + o_len[{i}]] = {i}; o_len[{i}]++"
        )

    def fifo_has(self, i: int, kinds: tuple[str, ...], f: int | None = None) -> str:
        """Some FIFO of rank ``i`` (or FIFO ``f``) holds a message of one of ``kinds`` (unrolled)."""
        fs = range(self.nf) if f is None else (f,)
        terms = [
            f"q_k[{self.qbase(i, g) + p}] == {kind(kd)}" for g in fs for p in range(self.cap) for kd in kinds
        ]
        return "(" + " || ".join(terms) + ")" if terms else "false"

    def inq_empty(self, i: int) -> str:
        return "(" + " && ".join(f"q_len[{i * self.nf + g}] == 0" for g in range(self.nf)) + ")"

    # ------------------------------------------------------------------ requests

    def count(self, i: int, where: int) -> str:
        """Requests waiting (``where`` WAITING) or running on rank ``i``: the counters ``r_nw``/``r_nr``, kept
        by every effect that moves a request (a function of the request arrays, so no state of its own)."""
        return f"r_nw[{i}]" if where == WAITING else f"r_nr[{i}]"

    def any_at(self, i: int, where: int) -> str:
        return f"({self.count(i, where)} > 0)"

    def has_work(self, i: int) -> Value:
        """``_has_work``: :func:`weightsync.spec.states.schedulable` on rank ``i``'s queues."""
        return self.states_fn.call(
            "schedulable",
            Expr(f"r_pause_state[{i}]"),
            Expr(self.count(i, WAITING)),
            Expr(self.count(i, RUNNING_Q)),
        )

    # ------------------------------------------------------------------ the rank table with effects

    def base_args(self, i: int) -> dict[str, Value]:
        return {"rank": i, "dp_size": self.n, "sync_interval": self.m.sync_interval}

    def call_args(self, i: int, ev: RankEvent, mode: Value = None) -> dict[str, Value]:
        """``call_extra``: a controller call's table arguments on rank ``i``; ``mode``: the pause's mode
        (a constant, or a Promela code under ANY_MODE), None: the model's."""
        args = self.base_args(i)
        if ev is RankEvent.PAUSE:
            args.update(
                mode=self.mode if mode is None else mode,
                clear_cache=self.m.clear_cache,
                running=Expr(self.count(i, RUNNING_Q)),
                waiting=Expr(self.count(i, WAITING)),
            )
        elif self.m.worker_args and ev in CALL_FAIL_PHASE:
            args.update(worker=Expr(f"w_state[{i}]"), worker_initialized=Expr(f"w_initialized[{i}]"))
        return args


__all__ = ["CAP", "KINDS", "RANK_TYPES", "Build", "UnsupportedModel", "kind"]
