"""SPIN on the Promela model generated from the spec tables (:mod:`weightsync.model.spin`).

- The translator against Python: every rank guard and update evaluated on sampled variables and arguments by
  SPIN's simulator and by the spec's own functions.
- The generated successor function against the model's: with the checks off, SPIN stores exactly the
  model's states (plus its pre-init state).
- Verdicts against ``proofs/``: SPIN's verdict (safety and deadlock) is the explorer's, and its trail is a
  path of the model that ends in the violation SPIN names. The full comparison over every ``proofs/`` row is
  ``slow`` and ``ci``.

Skipped without ``spin`` and ``cc`` on PATH, unless ``WEIGHTSYNC_REQUIRE_SPIN=1`` (``make test`` installs SPIN
and sets it): then a missing SPIN fails.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from weightsync.model.check import build_model
from weightsync.model.engines import explore_model
from weightsync.model.properties import SAFETY
from weightsync.model.spin.run import SpinError, replay, spin_available, spin_check, spin_once
from weightsync.model.spin.translate import Codes, Expr, Registry, TranslateError, Translator, text
from weightsync.model.system import Bounds
from weightsync.spec.rank_vars import GUARDS, UPDATES, RankVars
from weightsync.spec.states import Collective, PauseMode, PauseState, RankState
from weightsync.spec.worker import WorkerState

ROOT = Path(__file__).resolve().parent.parent

if not spin_available():
    if os.environ.get("WEIGHTSYNC_REQUIRE_SPIN") == "1":
        raise RuntimeError(
            "WEIGHTSYNC_REQUIRE_SPIN=1 but spin or cc is not on PATH (apt-get install spin gcc)"
        )
    pytest.skip("spin or cc is not on PATH (apt-get install spin gcc)", allow_module_level=True)


# ---------------------------------------------------------------------------------------------- translator

_FIELDS = {
    "state": list(RankState),
    "pause_state": list(PauseState),
    "engines_running": [False, True],
    "current_wave": [0, 1, 2, 3],
    "step_counter": [0, 1],
    "pending_pause": [False, True],
    "ignore_start_dp_wave": [False, True],
    "collective": ["", *(c.value for c in Collective)],
    "weight_version": [0, 1, 2],
    "clear_cache": [False, True],
    "wave_started": [False, True],
    "first_synced": [False, True],
    "was_running": [False, True],
}
_ARGS: dict[str, list[Any]] = {
    "rank": [0, 1, 2],
    "has_work": [False, True],
    "wave": [0, 1, 2, 3],
    "exclude": [-1, 0, 1, 2],
    "mode": list(PauseMode),
    "running": [0, 1, 2],
    "waiting": [0, 1, 2],
    "sum_unfinished": [0, 1, 2, 3],
    "sum_pending_pause": [0, 1, 2, 3],
    "max_unfinished": [0, 1],
    "max_wave": [0, 1, 2, 3],
    "weight_version": [None, 1, 2],
    "worker": [s.value for s in WorkerState],
    "worker_initialized": [False, True],
    "phase": ["init", "start", "update", "finish"],
}
#: Constants of the generated model (the translator folds them).
_CONST = {"dp_size": 3, "sync_interval": 2, "clear_cache": True}


def _spin_simulate(program: str, tmp: Path) -> str:
    (tmp / "t.pml").write_text(program)
    p = subprocess.run(["spin", "t.pml"], cwd=tmp, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_translated_guards_and_updates_match_the_spec_functions(tmp_path: Path) -> None:
    """Every rank guard and update, translated, agrees with its Python function on 60 sampled inputs
    (one SPIN simulation run for all of them)."""
    rng = random.Random(7)
    codes = Codes()
    tr = Translator(
        Registry("weightsync.spec.rank_vars", "GUARDS", "UPDATES"),
        codes,
        lambda f: f"v_{f}",
        RankVars._fields,
    )
    args_p: dict[str, Any] = {k: Expr(f"a_{k}") for k in _ARGS}
    args_p.update(_CONST)
    samples = []
    for _ in range(60):
        v = RankVars(**{f: rng.choice(vals) for f, vals in _FIELDS.items()})
        a = {k: rng.choice(vals) for k, vals in _ARGS.items()} | _CONST
        samples.append((v, a))
    guards = {g: text(codes, tr.guard(g, args_p)) for g in GUARDS}
    updates = {u: tr.update(u, args_p) for u in UPDATES}
    decl = " ".join(f"int v_{f};" for f in RankVars._fields) + " " + " ".join(f"int a_{k};" for k in _ARGS)
    decl += " int t_0, t_1, t_2, t_3, t_4, t_5;"
    lines = []
    expected = []
    for n, (v, a) in enumerate(samples):
        setv = "; ".join(f"v_{f} = {codes.value(getattr(v, f))}" for f in RankVars._fields)
        seta = "; ".join(f"a_{k} = {codes.value(a[k])}" for k in _ARGS)
        for g, expr in guards.items():
            lines.append(f'{setv}; {seta}; printf("G {n} {g} %d\\n", (({expr}) -> 1 : 0))')
            expected.append(f"G {n} {g} {int(GUARDS[g](v, a))}")
        for u, cases in updates.items():
            branches = []
            for cond, assigns in cases:
                temps = [f"t_{k} = {text(codes, val)}" for k, val in enumerate(assigns.values())]
                sets = [f"v_{f} = t_{k}" for k, f in enumerate(assigns)]
                guard = "else" if cond is True else text(codes, cond)
                branches.append(f":: {guard} -> {'; '.join(temps + sets) or 'skip'}")
            out = ", ".join(f"v_{f}" for f in RankVars._fields)
            fmt = " ".join("%d" for _ in RankVars._fields)
            lines.append(f'{setv}; {seta}; if {" ".join(branches)} fi; printf("U {n} {u} {fmt}\\n", {out})')
            after = UPDATES[u](v, a)
            expected.append(
                f"U {n} {u} " + " ".join(str(codes.value(getattr(after, f))) for f in RankVars._fields)
            )
    chunks = [lines[k : k + 400] for k in range(0, len(lines), 400)]
    got: list[str] = []
    for chunk in chunks:
        out = _spin_simulate(f"{decl}\ninit {{\n" + ";\n".join(chunk) + "\n}\n", tmp_path)
        got += [line.strip() for line in out.splitlines() if line.strip()[:2] in ("G ", "U ")]
    assert got == expected


def test_the_translator_names_what_it_cannot_translate() -> None:
    """A guard that reads an argument the call site does not pass is refused by name, before any Promela."""
    tr = Translator(
        Registry("weightsync.spec.rank_vars", "GUARDS", "UPDATES"),
        Codes(),
        lambda f: f"v_{f}",
        RankVars._fields,
    )
    with pytest.raises(TranslateError, match="reads argument 'wave'"):
        tr.guard("add_newer_wave", {"rank": 0, "dp_size": 2, "sync_interval": 2})
    with pytest.raises(TranslateError, match=r"not in weightsync\.spec\.rank_vars"):
        tr.guard("no_such_guard", {})


# ---------------------------------------------------------------------------------------------- the model

#: The larger four (22-99 s each on the 2-core machine) are ``slow``: the default suite keeps two.
_COUNTED = [
    ("two-phase", "keep", "per-socket", Bounds()),
    ("vllm-0.32-epoch", "abort", "ordered", Bounds()),
    pytest.param("front-end-pause", "wait", "per-socket", Bounds(), marks=pytest.mark.slow),
    pytest.param("vllm-0.32", "keep", "one-api-server", Bounds(), marks=pytest.mark.slow),
    pytest.param(
        "two-phase-epoch",
        "any",
        "per-socket",
        Bounds(stray_resume=True, repeat_resume=True),
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "vllm-0.32-epoch",
        "keep",
        "per-socket",
        Bounds(failures=1, pause_during_update=True),
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("variant", "mode", "channels", "bounds"), _COUNTED)
def test_spin_stores_the_models_states(variant: str, mode: str, channels: str, bounds: Bounds) -> None:
    """With the checks off (a state violating an invariant is not expanded, as the explorer does), SPIN's
    stored states are the model's states plus SPIN's own state before ``init`` runs."""
    model = build_model(variant, 2, mode, channels, bounds)
    ex = explore_model(model)
    res = spin_check(build_model(variant, 2, mode, channels, bounds), checks=False, optimize=0)
    assert res.states == len(ex.states) + 1


def _row(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((ROOT / "proofs" / name).read_text())
    return out


def _agree(name: str, mode: str) -> None:
    """SPIN's verdict on one mode of ``proofs/`` row ``name`` is the explorer's (safety and deadlock), and
    a violation it names is one the explorer found, reached by its trail replayed on the model."""
    row = _row(name)
    model = build_model(row["variant"], row["ranks"], mode, row["channels"], Bounds(**row["bounds"]))
    # pan's compile time against its search (2026-12-07, 2-core machine): -O0 compiles 4x faster than -O2
    # and searches about 2.3x slower, so it pays on small rows; -O1 searches within 4% of -O2 and compiles
    # in half the time (N = 3 stray-repeat-resume keep, 4.16 M states: 53 s against 70 s in all). SPIN
    # explores the full product: an N = 3 row's count is of symmetry-reduced states.
    small = row["ranks"] == 2 and row["per_mode"][mode]["states"] < 300_000
    res = spin_check(model, optimize=0 if small else 1)
    found = [p for p in row.get("violations", {}).get(mode, {}) if p in SAFETY]
    assert res.verdict == ("counterexample" if found else "verified"), (name, mode, res.violation, found)
    if found:
        assert res.violation in found
        assert res.path and tuple(res.path[-1][1]) == res.labels[-1]


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("two-phase__per-socket__n2.json", "wait"),
        ("two-phase-epoch__per-socket__n2.json", "keep"),
        ("vllm-0.32__per-socket__n2__any-mode.json", "any"),
    ],
)
def test_spin_verdicts_match_the_proofs(name: str, mode: str) -> None:
    _agree(name, mode)


def test_a_table_edit_changes_the_generated_model() -> None:
    """The Promela comes from the table in use: with the verified variant's VERIFIED rows for START_DP_WAVE
    removed (a late wave is then illegal there), SPIN finds the protocol error, on a trail the mutated model
    takes."""
    from weightsync.model.system import Config, Model
    from weightsync.spec.rank import get_variant
    from weightsync.spec.states import RankEvent

    table = dict(get_variant("two-phase-epoch").table)
    del table[(RankState.VERIFIED, RankEvent.START_DP_WAVE)]
    model = Model(Config("two-phase-epoch", 2, PauseMode.KEEP, "per-socket", Bounds()), table=table)
    res = spin_check(model, optimize=0)
    assert res.verdict == "counterexample" and res.violation == "phase_bracketing"
    assert res.path[-1][2].ranks[res.labels[-1][1]].vars.state is RankState.ERROR


def test_the_generated_model_does_not_depend_on_the_hash_seed() -> None:
    """The same tables give the same Promela text in every process (no set's iteration order leaks into the
    string codes)."""
    import sys

    prog = (
        "from weightsync.model.check import build_model\n"
        "from weightsync.model.spin.compose import PromelaModel\n"
        "from weightsync.model.system import Bounds\n"
        "m = build_model('vllm-0.32-epoch', 2, 'any', 'per-socket', Bounds(failures=1, pause_during_update=True))\n"
        "print(PromelaModel(m).text())\n"
    )
    texts = {
        subprocess.run(
            [sys.executable, "-c", prog],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(texts) == 1


def test_a_trail_the_model_does_not_take_is_refused() -> None:
    """Replay checks SPIN: a label the model does not offer, or a violation it does not find, is an error."""
    model = build_model("two-phase", 2, "keep", "per-socket")
    with pytest.raises(SpinError, match="step 1"):
        replay(model, [("step", 7)], "no_deadlock")
    with pytest.raises(SpinError, match="the model finds"):
        replay(model, [("send", 0)], "no_deadlock")


def _rows() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "proofs").glob("*__n*.json")):
        row = _row(path.name)
        out += [(path.name, mode) for mode in row["per_mode"]]
    return out


def test_a_full_fifo_is_no_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's FIFOs are unbounded, the Promela model's are not: a run that fills one stops with an error
    naming the capacity; by default the capacity doubles until no FIFO overflows, and only that run's
    verdict counts."""
    import weightsync.model.spin.run as run

    model = build_model("vllm-0.32-epoch", 2, "keep", "ordered")
    with pytest.raises(run.CapacityError, match="capacity of 1 messages"):
        spin_check(model, fifo_capacity=1, optimize=0)
    monkeypatch.setattr(run, "CAP", 1)
    res = spin_check(model, optimize=0)
    assert res.fifo_capacity >= 2 and res.verdict == "verified"


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(5400)
def test_spin_agrees_with_every_proofs_row() -> None:
    """Issue 19 item 6: SPIN and the explorer agree on the verdict (safety and deadlock) of every mode of
    every ``proofs/`` row; two SPIN runs at a time (the machine's two cores)."""
    rows = _rows()
    failures: list[str] = []

    def one(nm: tuple[str, str]) -> None:
        try:
            _agree(*nm)
        except (AssertionError, SpinError) as exc:
            failures.append(f"{nm}: {exc}")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, rows))
    assert not failures, "\n".join(failures)


def test_the_compile_level_reaches_the_compiler_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``optimize`` is the ``-O`` of the ``cc`` command (the tests' speed rests on it); a level outside 0-3 is
    refused before SPIN runs."""
    import weightsync.model.spin.run as run

    model = build_model("two-phase", 2, "keep", "per-socket")
    calls: list[list[str]] = []

    def record(cmd: list[str], d: Path, timeout: float) -> str:
        calls.append(cmd)
        if cmd[0] == "spin":  # `spin -a` writes pan.c, which spin_once then patches
            (d / "pan.c").write_text("")
        if cmd[0] == "cc":
            raise SpinError("stopped after the compile command")
        return ""

    monkeypatch.setattr(run, "_run", record)
    with pytest.raises(ValueError, match="optimize=7"):
        spin_once(model, optimize=7)
    assert calls == []
    with pytest.raises(SpinError, match="stopped after the compile"):
        spin_once(model, optimize=1)
    assert calls[-1][0] == "cc" and "-O1" in calls[-1] and "-O2" not in calls[-1]
