"""Walk a system trace through the model's successor function (``weightsync replay`` on a system trace).

A system trace (:mod:`weightsync.impl.engine.tracing`) records what every process of a reference DP cluster
observed and did: messages received and sent with their sockets, the transitions each rank fired, the
scheduler's counts and the requests each step finished or aborted, every coordinator and front-end
transition and every controller call. :func:`walk_trace` starts from :meth:`Model.initial` of the
configuration the trace's header names and, step by step, requires the recorded step to be an edge of the
product graph from the model's current state: the successor with the step's label (a rank receiving from
one socket, a rank's loop step, a collective's joint completion, the coordinator receiving from one
source, the front-end sending a request or adopting stats, the controller fanning out a call) must exist,
and the state it leads to must agree with everything the engine recorded for that step:

- the message taken is the head of the model's FIFO for that socket (ADD with its wave stamp, the call and
  its version, START_DP_WAVE with its wave and exclusion; a FIRST_REQ, start_wave or wave_complete at the
  coordinator);
- the rank's protocol variables after the step (weight versions compared through the round -> label map
  the controller's finish calls establish), the collective it blocks in, its waiting / running counts, the
  requests the step finished and aborted, and the messages it sent to the coordinator;
- the event arguments the engine computed from its scheduler (``has_work``, the pause's ``running``) and a
  collective's outcome (``sum_unfinished``, ``max_wave``...) equal the model's;
- the coordinator's variables and START_DP_WAVE broadcasts, the front-end's stamp and FIRST_REQ.

Steps are taken in the order of their first record in the file: a step's first record is written before
it sends anything and a receipt after its message arrived, so that order respects causality. One place
where the model is more atomic than the processes: the model's stats refresh reads the coordinator's
current state, while the real front-end adopts stats the coordinator published earlier. A recorded
adoption of stats the coordinator no longer holds is placed back at the latest point after the
front-end's previous step where the coordinator held them; this is sound because the refresh changes only
the front-end's belief, which no rank or coordinator step reads, so it commutes with every step in
between (the partial-order reduction argument), and the moved steps are re-applied through the successor
function to confirm it.

A trace whose steps all match is accepted. On the first mismatch the walk stops and reports the record's
line, the model state (its description) and the legal steps from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from weightsync.model.system import (
    CALL_EVENT,
    CHANNEL_FIFOS,
    DONE_EVENT,
    G,
    Label,
    Model,
    describe,
)
from weightsync.model.system.effects import collective_args
from weightsync.model.trace_read import SCHEMA, EngineStep, TraceFormatError, config_of, read_trace
from weightsync.model.trace_result import WalkResult, _diff, _state_lines
from weightsync.spec.calls import CALL_ARGS, front_end_answers
from weightsync.spec.coordinator import CoordState
from weightsync.spec.states import PauseMode, RankEvent

#: A rank's sockets (system trace ``recv.socket``) -> the model's input FIFO name.
_SOCKET_FIFO = {"front": "add", "control": "ctrl", "wave": "wave"}
#: Completion events of the collectives (and the failure every member of a transfer collective may take).
_DONE_EVENTS = frozenset(str(ev.value) for ev in DONE_EVENT.values()) | {RankEvent.TRANSFER_FAILED.value}
_FRONT_LABELS = frozenset({"send", "refresh", "abort", "fe"})


class _Mismatch(Exception):
    def __init__(self, step: EngineStep | Sequence[EngineStep], reason: str) -> None:
        self.steps = [step] if isinstance(step, EngineStep) else list(step)
        self.reason = reason
        super().__init__(reason)


class _Walker:
    def __init__(self, model: Model, steps: list[EngineStep]) -> None:
        self.m = model
        self.steps = steps
        self.s: G = model.initial()
        self.path: list[tuple[Label, G]] = []  # (label, state after) of every step taken
        self.last_front = 0  # len(path) after the front-end's last step
        self.versions: dict[int, str | None] = {0: "default"}  # model round -> engine label
        self.call_versions: dict[int, str] = {}  # the round a call carries -> the label the engine's carries
        self.requests: dict[str, int] = {}  # engine request id -> model request number
        self.blocked = ["" for _ in range(model.n)]  # each rank's collective, by its last settle
        self.consumed: set[int] = set()
        self.notes: list[str] = []
        names = CHANNEL_FIFOS["per-socket"]
        self.fifo = {"add": names[1], "ctrl": names[2], "wave": names[3]}

    # -- translation of engine messages into the model's
    def _engine_msg(self, msg: Mapping[str, Any]) -> tuple[Any, ...]:
        t = msg["type"]
        if t == "AddMsg":
            return ("ADD", self.requests.get(msg["req"], -1), msg["wave"])
        if t == "AbortMsg":
            return ("ABORT", self.requests.get(msg["req"], -1))
        if t == "StartDPWave":
            return ("W", msg["wave"], msg["exclude"])
        if t == "UtilityCall":
            return ("U", msg["method"], msg.get("kwargs", {}).get("weight_version"))
        if t == "StartWave":
            return ("start_wave", msg["wave"], msg["sender"])
        if t == "WaveComplete":
            return ("wave_complete", msg["wave"])
        if t == "FirstReq":
            return ("FIRST_REQ", msg["exclude"], msg["wave"])
        raise TraceFormatError(f"unknown message type {t!r}")

    def _model_msg(self, m: tuple[Any, ...]) -> tuple[Any, ...]:
        if m[0] == "U":  # the model's call carries a round number where the engine's carries a version label
            return ("U", m[1], self.call_versions.get(m[2]))
        if m[0] == "wave_complete":
            return ("wave_complete", m[1])
        return m

    # -- the walk
    def successor(self, label: Label, step: EngineStep | Sequence[EngineStep]) -> G:
        for lab, t in self.m.successors(self.s):
            if lab == label:
                return t
        raise _Mismatch(step, f"the model has no step {label!r} from here")

    def take(self, label: Label, t: G) -> None:
        self.path.append((label, t))
        self.s = t
        if label[0] in _FRONT_LABELS:
            self.last_front = len(self.path)

    def run(self) -> None:
        for k, st in enumerate(self.steps):
            if k in self.consumed:
                continue
            self.consumed.add(k)
            if st.proc.startswith("rank"):
                self.rank_step(k, st)
            elif st.proc == "coord":
                self.coord_step(st)
            elif st.proc == "front":
                self.front_step(st)
            elif st.proc == "ctrl":
                self.call_step(st)
            else:
                raise _Mismatch(st, f"unknown process {st.proc!r}")

    # -- ranks
    def rank_step(self, k: int, st: EngineStep) -> None:
        i = int(st.proc[4:])
        recv = st.of("recv")
        trans = st.of("transition")
        if recv:
            msg = recv[0]["msg"]
            if msg["type"] == "UtilityCall" and msg["method"] not in CALL_EVENT:
                if trans:
                    raise _Mismatch(st, f"query {msg['method']!r} fired a transition")
                return  # a query (get_state, snapshot...) is no protocol step
            f = self.fifo[_SOCKET_FIFO[recv[0]["socket"]]]
            q = self.s.ranks[i].inq[f]
            got = self._engine_msg(msg)
            if not q:
                raise _Mismatch(
                    st,
                    f"rank {i} received {got} on socket {recv[0]['socket']}, but the model's FIFO is empty",
                )
            want = self._model_msg(q[0])
            if got != want:
                raise _Mismatch(st, f"rank {i} received {got}; the head of the model's FIFO is {want}")
            label: Label = ("recv", i, f)
            t = self.successor(label, st)
            self.check_rank(st, i, t, self.s)
            self.take(label, t)
            return
        if self.blocked[i]:  # the rank's collective completed: a joint step of every member
            kind = self.blocked[i]
            members = [st]
            for j in range(self.m.n):
                if j == i:
                    continue
                nxt = self._next_of(f"rank{j}", k)
                if nxt is None:
                    raise _Mismatch(st, f"rank {i} completed {kind}; rank {j} has no completion in the trace")
                members.append(self.steps[nxt])
                self.consumed.add(nxt)
            for mem in members:
                tr = mem.of("transition")
                if not tr or tr[0]["event"] not in _DONE_EVENTS:
                    raise _Mismatch(mem, f"{mem.proc} was blocked in {kind}; its next step is no completion")
            label = ("done", kind)
            t = self.successor(label, members)
            self.check_outcome(kind, members)
            for mem in members:
                try:
                    self.check_rank(mem, int(mem.proc[4:]), t, self.s)
                except _Mismatch as bad:  # the joint step is what failed: name every member
                    raise _Mismatch(members, bad.reason) from None
            self.take(label, t)
            return
        if not trans:
            raise _Mismatch(st, f"rank {i}: a step without transition or input")
        label = ("step", i)
        t = self.successor(label, st)
        self.check_rank(st, i, t, self.s)
        self.take(label, t)

    def check_outcome(self, kind: str, members: Sequence[EngineStep]) -> None:
        """Each member's completion carries the outcome the model computes from the members' states at
        entry (spec/collectives.py: contributions and reduction)."""
        want = dict(collective_args(self.s.ranks, kind))
        for mem in members:
            first = mem.of("transition")[0]
            if first["event"] != DONE_EVENT[kind].value:
                continue  # a failure carries no outcome: compared through the variables (check_rank)
            got = {k: first.get("args", {}).get(k) for k in want}
            if got != want:
                raise _Mismatch(
                    list(members), f"{mem.proc} completed {kind} with {got}; the model's outcome is {want}"
                )

    def _next_of(self, proc: str, after: int) -> int | None:
        for k in range(after + 1, len(self.steps)):
            if k not in self.consumed and self.steps[k].proc == proc:
                return k
        return None

    def _vars(self, v: Any) -> dict[str, Any]:
        out = {}
        for name, x in v._asdict().items():
            out[name] = x.value if hasattr(x, "value") else x
        return out

    def check_rank(self, st: EngineStep, i: int, t: G, s: G) -> None:
        m_rank, m_before = t.ranks[i], s.ranks[i]
        trans = st.of("transition")
        settle = st.of("settle")
        # the event arguments the engine computed from its own scheduler
        if trans:
            first = trans[0]
            ev = RankEvent(first["event"])
            args = first.get("args", {})
            if "has_work" in args and args["has_work"] != self.m._has_work(m_before):
                raise _Mismatch(
                    st,
                    f"rank {i} fired {ev.value} with has_work={args.get('has_work')}; the model's scheduler "
                    f"(PauseState {m_before.vars.pause_state.name}, {len(m_before.waiting)} waiting, "
                    f"{len(m_before.running)} running) gives {self.m._has_work(m_before)}",
                )
            if ev in CALL_ARGS:  # the call's own arguments (spec call_args), as the model's rank has them
                for key, val in self.m.call_extra(m_before, ev):
                    got = args.get(key)
                    want = val.value if hasattr(val, "value") else val
                    if got != want:
                        raise _Mismatch(
                            st, f"rank {i}'s pause argument {key}={got!r}; the model's is {want!r}"
                        )
        # protocol variables after the step
        engine_vars = trans[-1]["vars_after"] if trans else None
        model_vars = self._vars(m_rank.vars)
        if engine_vars is None:
            if m_rank.vars != m_before.vars:
                raise _Mismatch(
                    st,
                    f"rank {i} fired no transition for its input; the model's rank moves "
                    f"{m_before.vars.state.value} -> {m_rank.vars.state.value} ({_diff(self._vars(m_before.vars), model_vars)})",
                )
        else:
            want = dict(model_vars)
            want["weight_version"] = self.versions.get(int(model_vars["weight_version"]), "?")
            diff = _diff(want, engine_vars)
            if diff:
                evs = " -> ".join(
                    r["event"] + (f" ({r['args']['error']})" if "error" in r.get("args", {}) else "")
                    for r in trans
                )
                raise _Mismatch(st, f"rank {i} after {evs}: engine and model differ in {diff} (model first)")
        # the scheduler's observable counts, finished and aborted requests, the collective it blocks in
        if not settle:
            raise _Mismatch(st, f"rank {i}: the step has no settle record (the trace ends inside it)")
        end = settle[-1]
        counts = (end["waiting"], end["running"])
        want_counts = (len(m_rank.waiting), len(m_rank.running))
        if counts != want_counts:
            raise _Mismatch(
                st,
                f"rank {i} has {counts[0]} waiting / {counts[1]} running; the model {want_counts[0]} / {want_counts[1]}",
            )
        if end["blocked"] != m_rank.blocked:
            raise _Mismatch(
                st, f"rank {i} blocks in {end['blocked']!r}; the model's rank in {m_rank.blocked!r}"
            )
        self.blocked[i] = end["blocked"]
        for key, now, before in (("finished", t.done, s.done), ("aborted", t.aborted, s.aborted)):
            got_ids = sorted(self.requests.get(r, -1) for r in end[key])
            new = sorted(set(now) - set(before))
            mine = [r for r in new if self._was_on(s, r, i)]
            if got_ids != mine:
                raise _Mismatch(st, f"rank {i} {key} requests {got_ids} in this step; the model {mine}")
        sent = [self._engine_msg(r["msg"]) for r in st.of("send")]
        out_before, out_after = m_before.outq, m_rank.outq
        model_sent = (
            [self._model_msg(x) for x in out_after[len(out_before) :]]
            if len(out_after) >= len(out_before)
            else []
        )
        if sent != model_sent:
            raise _Mismatch(
                st, f"rank {i} sent {sent} to the coordinator; the model's rank sends {model_sent}"
            )

    def _was_on(self, s: G, r: int, i: int) -> bool:
        rk = s.ranks[i]
        return (
            any(q[0] == r for q in rk.waiting)
            or any(q[0] == r for q in rk.running)
            or any(m[0] in ("ADD", "ABORT") and m[1] == r for q in rk.inq for m in q)
        )

    # -- coordinator
    def coord_step(self, st: EngineStep) -> None:
        rec = st.records[0]
        src = int(rec["source"])
        got = self._engine_msg(rec["msg"])
        if src < 0:
            q = self.s.coord_q[0]
            label: Label = ("coord", -1, 0)
        else:
            q = self.s.ranks[src].outq
            label = ("coord", src, 0)
        if not q or self._model_msg(q[0]) != got:
            head = self._model_msg(q[0]) if q else "nothing"
            raise _Mismatch(st, f"the coordinator received {got} from {src}; the model's FIFO holds {head}")
        t = self.successor(label, st)
        after = rec["after"]
        if t.coord[:2] != (after["current_wave"], after["state"] == CoordState.RUNNING.value):
            raise _Mismatch(
                st, f"coordinator after {got}: engine {after}, model (wave, running) = {tuple(t.coord[:2])}"
            )
        f = self.fifo["wave"]
        for j in range(self.m.n):
            new = [m for m in t.ranks[j].inq[f][len(self.s.ranks[j].inq[f]) :]]
            if new != [("W", w, x) for w, x in rec["broadcasts"]]:
                raise _Mismatch(st, f"coordinator broadcast {rec['broadcasts']} to rank {j}; the model {new}")
        self.take(label, t)

    # -- front-end
    def front_step(self, st: EngineStep) -> None:
        rec = st.records[0]
        if rec["event"] == "send_request":
            i = int(rec["target"])
            nxt = self.s.front.next_request
            self.requests[rec["req"]] = nxt
            label: Label = ("send", i)
            t = self.successor(label, st)
            f = self.fifo["add"]
            q = t.ranks[i].inq[f]
            if "send_add" in rec["effects"] and (not q or q[-1] != ("ADD", nxt, rec["wave"])):
                raise _Mismatch(
                    st,
                    f"front-end stamped request {nxt} with wave {rec['wave']}; the model sends {q[-1] if q else None}",
                )
            if ("send_first_req" in rec["effects"]) != (len(t.coord_q[0]) > len(self.s.coord_q[0])):
                raise _Mismatch(st, "front-end and model disagree on sending FIRST_REQ")
            self.take(label, t)
            return
        if rec["event"] != "stats":
            raise _Mismatch(st, f"front-end event {rec['event']!r} is not walked (front-end-pause gate)")
        stats = (rec["wave"], rec["running"])
        if stats == (self.s.front.believed_wave, self.s.front.believed_running):
            return  # a refresh that changes nothing (a self-loop)
        if stats == self.s.coord[:2]:
            t = self.successor(("refresh",), st)
            self.take(("refresh",), t)
            return
        self._refresh_back(st, stats)

    def _refresh_back(self, st: EngineStep, stats: tuple[Any, ...]) -> None:
        """Adopt ``stats`` at the latest point since the front-end's last step where the coordinator held
        them, and re-apply the steps after it (module docstring)."""
        states = [self.path[k - 1][1] if k else self.m.initial() for k in range(len(self.path) + 1)]
        for k in range(len(self.path), self.last_front - 1, -1):
            if states[k].coord[:2] != stats:
                continue
            s = states[k]
            t = next((u for lab, u in self.m.successors(s) if lab == ("refresh",)), None)
            if t is None:
                break
            redo = [("refresh",), *[lab for lab, _ in self.path[k:]]]
            new_path = self.path[:k]
            cur = s
            for lab in redo:
                nxt = next((u for lb, u in self.m.successors(cur) if lb == lab), None)
                if nxt is None:
                    raise _Mismatch(
                        st, f"stats {stats} moved back {len(redo) - 1} steps: {lab!r} no longer an edge"
                    )
                new_path.append((lab, nxt))
                cur = nxt
            self.path = new_path
            self.s = cur
            self.last_front = k + 1
            self.notes.append(f"line {st.line}: stats {stats} adopted {len(redo) - 1} steps earlier")
            return
        raise _Mismatch(
            st,
            f"front-end adopted stats {stats}; the coordinator never held them since the front-end's last step "
            f"(it holds {tuple(self.s.coord[:2])})",
        )

    # -- controller
    def call_step(self, st: EngineStep) -> None:
        rec = st.records[0]
        method = rec["method"]
        kwargs = rec["kwargs"]
        label: Label = (
            ("fe", method)
            if front_end_answers(self.m.variant.pause_in_front_end, method)
            else ("fan", method, -1)
        )
        mode = kwargs.get("mode")
        if mode is not None and PauseMode(mode) is not self.m.mode:
            raise _Mismatch(
                st, f"controller called {method} with mode {mode}; the walk's model uses {self.m.mode.value}"
            )
        t = self.successor(label, st)
        version = kwargs.get("weight_version")
        if version is not None:  # the model's call carries its round number: that round is this label
            f = self.fifo["ctrl"]
            sent = [q[-1] for r in t.ranks for q in (r.inq[f],) if q and q[-1][:2] == ("U", method)]
            for m in sent:
                self.call_versions[m[2]] = version
                self.versions[m[2]] = version
        self.take(label, t)


def walk_trace(lines: Iterable[str]) -> WalkResult:
    """Walk the system trace ``lines`` through the model's successor function (module docstring).

    Raises:
        TraceFormatError: the file is no system trace (see :func:`read_trace`).
    """
    header, steps, _ = read_trace(lines)
    model = Model(config_of(header, steps))
    w = _Walker(model, steps)
    try:
        w.run()
    except _Mismatch as bad:
        legal = [describe(model, w.s, lab, t).text for lab, t in model.successors(w.s)]
        return WalkResult(
            False,
            len(w.path),
            min(s.line for s in bad.steps),
            bad.reason,
            _state_lines(w.s),
            legal,
            [[s.proc, s.group] for s in bad.steps if s.proc.startswith("rank")],
            w.notes,
        )
    return WalkResult(True, len(w.path), notes=w.notes)


__all__ = ["SCHEMA", "EngineStep", "TraceFormatError", "config_of", "read_trace", "walk_trace"]
