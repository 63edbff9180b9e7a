"""The global model: N rank machines x DP coordinator x API front-end x controller x trainer x channels.

Each rank's protocol state is a :class:`~weightsync.spec.rank.RankVars` advanced *only* through
:func:`weightsync.spec.rank.select` / :func:`~weightsync.spec.rank.apply` on the variant's table;
:mod:`~weightsync.model.system.effects` interprets the table's *effects* symbolically:

- ``queue_request`` / ``abort_requests`` / ``execute_step`` / ``clear_cache``: scheduler changes on the rank;
- ``emit_start_wave`` / ``emit_wave_complete``: a message on the rank's socket to the DP coordinator;
- ``enter_<collective>``: the rank is blocked in that collective until every member entered it;
- ``reply`` / ``reply_pause`` / ``reply_resume``: the controller sees the rank's reply;
- ``front_end_gate`` / ``front_end_ungate``: the API front-end holds / releases new requests.

Processes (reference sections 1, 5, 6):

- **Ranks**: take one input (the head of one of their FIFOs) or run one loop step per transition.
- **DP coordinator** (vLLM's ``DPCoordinator``): ``(current_wave, engines_running)``.
- **Front-end**: stamps each request with its believed wave, sends ADD to any rank, and FIRST_REQ to the
  coordinator when it believes engines idle; a nondeterministic stats refresh copies the coordinator's
  ``(current_wave, engines_running)`` (the 100 ms stats).
- **Controller** (the RL orchestrator, its own socket per rank): pause -> start -> update (with the trainer
  joining the broadcast) -> finish -> resume, or pause -> resume; at most ``cycles`` cycles, started at
  any point; every row of the controller table (:mod:`weightsync.spec.controller`) whose guard holds.
- **Trainer**: the sender of the weight broadcast.

Channels: ``per-socket`` (default): one FIFO per (source, destination, socket) -- front-end->rank (ADD),
controller->rank (utility calls), coordinator->rank (START_DP_WAVE), rank->coordinator, front-end->
coordinator -- mutually unordered, and fan-outs reach ranks one at a time in any order (two or more API
servers: requests and utility calls come from different processes). ``one-api-server``: ADD, ABORT and
utility calls share one FIFO per rank (vLLM 0.32 with one API server: one ROUTER socket per engine,
``v1/engine/core_client.py:1250-1257``), START_DP_WAVE from the coordinator comes on another (the engine's
input thread polls both sockets, ``v1/engine/core.py:1831-1931``), the coordinator's inputs as under
per-socket. ``ordered``: one FIFO per destination for everything sent to it, and atomic fan-outs.

The global state is a tree of NamedTuples (see :class:`GlobalState`, alias ``G``); everything in it is hashable.

The package, by concern (:class:`Model` combines the parts as mixins; every name is re-exported here):

- :mod:`~weightsync.model.system.state`: the constants, :class:`Bounds`, :class:`Config`, :class:`Rank`,
  :class:`Ctrl`, :class:`Coordinator`, :class:`FrontEnd`, :class:`Trainer`, :class:`GlobalState` (``G``) and
  the scratch copy a successor is built in;
- :mod:`~weightsync.model.system.base`: configuration, the initial state and the table lookups;
- :mod:`~weightsync.model.system.effects`: the rank transitions and the interpretation of the effects;
- :mod:`~weightsync.model.system.environment`: coordinator, front-end, controller, trainer and channel moves;
- :mod:`~weightsync.model.system.properties`: invariants, transition checks, terminal states, progress goals;
- :mod:`~weightsync.model.system.symmetry`: rank renaming and the canonical form;
- :mod:`~weightsync.model.system.model`: :class:`Model` and its successor function;
- :mod:`~weightsync.model.system.steps`: :class:`Step`, :func:`fmt_msg`, :func:`message_event`,
  :func:`describe`.
"""

from weightsync.model.system.model import Model
from weightsync.model.system.state import (
    CALL_EVENT,
    CHANNEL_FIFOS,
    CHANNELS,
    DONE_EVENT,
    DP_KINDS,
    ENTER_EFFECT,
    F_ADD,
    F_CTRL,
    F_WAVE,
    FAIL_PHASE,
    FAILABLE_EFFECTS,
    FAILED_REPLY,
    FINISH,
    IDLE,
    INIT,
    NOT_SENT,
    OWE_PAUSE,
    OWE_RESUME,
    PAUSE,
    PHASE_CALL,
    REPLIED,
    RESUME,
    RETRY,
    SENT,
    SPURIOUS,
    START,
    TRAINER_IDLE,
    TRANSFER_KINDS,
    UPDATE,
    X_PAUSE,
    X_RESUME,
    Bounds,
    Config,
    Coordinator,
    Ctrl,
    FrontEnd,
    G,
    GlobalState,
    Label,
    Rank,
    Trainer,
)
from weightsync.model.system.steps import Step, describe, fmt_msg, message_event

__all__ = [
    "CALL_EVENT",
    "CHANNELS",
    "CHANNEL_FIFOS",
    "DONE_EVENT",
    "DP_KINDS",
    "ENTER_EFFECT",
    "FAILABLE_EFFECTS",
    "FAILED_REPLY",
    "FAIL_PHASE",
    "FINISH",
    "F_ADD",
    "F_CTRL",
    "F_WAVE",
    "IDLE",
    "INIT",
    "NOT_SENT",
    "OWE_PAUSE",
    "OWE_RESUME",
    "PAUSE",
    "PHASE_CALL",
    "REPLIED",
    "RESUME",
    "RETRY",
    "SENT",
    "SPURIOUS",
    "START",
    "TRAINER_IDLE",
    "TRANSFER_KINDS",
    "UPDATE",
    "X_PAUSE",
    "X_RESUME",
    "Bounds",
    "Config",
    "Coordinator",
    "Ctrl",
    "FrontEnd",
    "G",
    "GlobalState",
    "Label",
    "Model",
    "Rank",
    "Step",
    "Trainer",
    "describe",
    "fmt_msg",
    "message_event",
]
