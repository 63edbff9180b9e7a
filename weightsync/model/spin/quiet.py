"""The silent-wave reduction (:mod:`weightsync.model.system.reduction`) in the generated Promela: after each
move (and after the settle reduction), every rank's wave FIFO loses the START_DP_WAVE messages that
:meth:`~weightsync.model.system.reduction.SilentWaves.quiet_rank` removes, so SPIN explores the explorer's
reduced graph state for state (``tests/test_spin_silent.py`` counts both).

The predicate is :func:`~weightsync.spec.rank_vars.wave_dropped_for_good`, read as code by the same
translator as the tables' guards, so it is not written twice. Both premises of the reduction are checked on
every state SPIN reaches, as the explorer checks them on every state it reaches:

- the table drops every message the predicate names (:meth:`~weightsync.model.system.reduction.SilentWaves.
  check_drops`): at every rank that can receive (not blocked, not in ``error``), for every ``wave`` up to its
  ``current_wave`` and every ``exclude`` (-1 or a rank) the predicate names, the START_DP_WAVE row the rank
  would take is legal, has no effect and leaves its variables as they are. It is checked on the initial
  state and, after each move, at each rank whose variables or blocked collective the move changed (a rank
  state it left alone was checked in the state before; the explorer keeps a set of checked rank states
  instead, which a SPIN state cannot hold);
- no move lowers a rank's ``current_wave`` (checked from the state before the move to the state after it;
  the explorer checks each row it fires, the argument needs it from state to state).

A state that breaks one stops the run: pan prints ``PREMISE`` with the rank, the wave, the exclude (or
``lowered``) and fails an assertion; :func:`~weightsync.model.spin.run.parse_trail` raises
:class:`~weightsync.model.system.premise.ReductionPremiseError`, never a verdict.

Only the ``per-socket`` and ``one-api-server`` channels, whose wave FIFO holds START_DP_WAVE alone: under
``ordered`` ones the settle and silent-wave reductions take from one FIFO and the model applies them to a
fixpoint (:meth:`Model.reduced`), which the generator does not write (:class:`UnsupportedModel`)."""

from __future__ import annotations

from weightsync.model.spin.build import RANK_TYPES, UnsupportedModel, kind
from weightsync.model.spin.ranks import RankCode
from weightsync.model.spin.translate import Expr, Value, and_, not_, text
from weightsync.spec.rank import RankVars
from weightsync.spec.states import RankEvent, RankState
from weightsync.spec.table import Transition


class QuietWaves(RankCode):
    """The silent-wave reduction's code: :meth:`quiet` after every move, :meth:`premise_snapshot` before
    it and :meth:`premise_check` after it (all empty without ``silent_waves``)."""

    def check_quiet_supported(self) -> None:
        """Raises:
        UnsupportedModel: ``silent_waves`` under ``ordered`` channels (see the module docstring)."""
        if self.m.silent_waves and self.m.ordered:
            raise UnsupportedModel(
                "--silent-waves: not under --channels ordered: the settle and silent-wave reductions take "
                "from one FIFO there and the model applies them to a fixpoint, which the generator does not write"
            )

    def dropped(self, i: int, wave: str, exclude: str) -> Value:
        """:func:`~weightsync.spec.rank_vars.wave_dropped_for_good` of rank ``i`` for the Promela
        expressions ``wave`` and ``exclude``."""
        tr = self.rank_tables[i].tr
        return tr.call("wave_dropped_for_good", "v", i, Expr(wave), Expr(exclude))

    def quiet(self) -> str:
        """``SilentWaves.quiet``: compact every rank's wave FIFO without the messages the predicate names
        (only START_DP_WAVE messages before them; a rank in ``error`` keeps its FIFO)."""
        if not self.m.silent_waves:
            return ""
        fw, w = self.m.f_wave, kind("W")
        out = []
        for i in range(self.n):
            qi, b = i * self.nf + fw, self.qbase(i, fw)
            drop = text(self.codes, self.dropped(i, f"q_a[{b} + s_k]", f"q_b[{b} + s_k]"))
            keep = (
                f"if :: q_k[{b} + s_k] != {w} -> s_only = 0 :: else -> skip fi; "
                + "; ".join(f"q_{x}[{b} + s_h] = q_{x}[{b} + s_k]" for x in "kabc")
                + "; s_h++"
            )
            zero = "; ".join(f"q_{x}[{b} + q_len[{qi}]] = 0" for x in "kabc")
            out.append(
                f"if :: r_state[{i}] != {self.c(RankState.ERROR)} && q_len[{qi}] > 0 -> "
                "s_k = 0; s_h = 0; s_only = 1; "
                f"do :: s_k < q_len[{qi}] -> "
                f"if :: s_only && q_k[{b} + s_k] == {w} && {drop} -> skip :: else -> {keep} fi; s_k++ "
                ":: else -> break od; "
                f"do :: s_h < q_len[{qi}] -> q_len[{qi}]--; {zero} :: else -> break od "
                ":: else -> skip fi"
            )
        return "; ".join(out)

    def premise_snapshot(self) -> str:
        """Each rank's variables and blocked collective before the move (``p_<field>``, ``p_blocked``)."""
        if not self.m.silent_waves:
            return ""
        return "; ".join(
            f"p_{f}[{i}] = r_{f}[{i}]" for i in range(self.n) for f in (*RankVars._fields, "blocked")
        )

    def premise_check(self) -> str:
        """Both premises on the state after the move (see the module docstring). The drop check runs where a
        rank's variables or its blocked collective changed: a rank state the move left as it was has been
        checked in the state before (every state SPIN reaches was checked when it was reached, the initial
        one by :meth:`premise_check_initial`)."""
        if not self.m.silent_waves:
            return ""
        out = []
        for i in range(self.n):
            out.append(
                f"if :: r_current_wave[{i}] < p_current_wave[{i}] -> "
                f'printf("PREMISE {i} lowered %d %d\\n", p_current_wave[{i}], r_current_wave[{i}]); assert(false) '
                ":: else -> skip fi"
            )
            changed = " || ".join(f"p_{f}[{i}] != r_{f}[{i}]" for f in (*RankVars._fields, "blocked"))
            out.append(self._drops_check(i, changed))
        return "; ".join(out)

    def premise_check_initial(self) -> str:
        """The drop check on the initial state."""
        if not self.m.silent_waves:
            return ""
        return "; ".join(self._drops_check(i, "true") for i in range(self.n))

    def _drops_check(self, i: int, when: str) -> str:
        """``SilentWaves.check_drops`` at rank ``i`` when ``when`` holds (and the rank can receive)."""
        args = {**self.base_args(i), "wave": Expr("s_w"), "exclude": Expr("s_e")}
        t = self.rank_tables[i]

        def acts_on(row: Transition | None) -> Value:
            return True if row is None or row.effects else not_(t.noop(row, args))

        acts = self.row_condition(i, RankEvent.START_DP_WAVE, args, acts_on)
        bad = text(self.codes, and_(self.dropped(i, "s_w", "s_e"), acts))
        return (
            f"if :: r_blocked[{i}] == {self.c('')} && r_state[{i}] != {self.c(RankState.ERROR)} && ({when}) -> "
            f"s_w = 0; do :: s_w <= r_current_wave[{i}] -> s_e = -1; "
            f"do :: s_e < {self.n} -> if :: {bad} -> "
            f'printf("PREMISE {i} %d %d\\n", s_w, s_e); assert(false) :: else -> skip fi; s_e++ '
            ":: else -> break od; s_w++ :: else -> break od "
            ":: else -> skip fi"
        )

    def declarations(self) -> str:
        """:meth:`Build.declarations` and this code's scratch variables (zeroed by :meth:`reset`)."""
        out = super().declarations()
        if self.m.silent_waves:
            out += "".join(f"{RANK_TYPES[f]} p_{f}[{self.n}]; " for f in RankVars._fields)
            out += f"byte p_blocked[{self.n}]; byte s_k, s_h; bit s_only; short s_w, s_e;\n"
        return out

    def reset(self) -> str:
        """:meth:`Build.reset` and this code's scratch variables."""
        out = super().reset()
        if self.m.silent_waves:
            out += "; " + "; ".join(
                f"p_{f}[{i}] = 0" for i in range(self.n) for f in (*RankVars._fields, "blocked")
            )
            out += "; s_k = 0; s_h = 0; s_only = 0; s_w = 0; s_e = 0"
        return out


__all__ = ["QuietWaves"]
