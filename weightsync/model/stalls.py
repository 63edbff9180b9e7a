"""Liveness of the DP collectives over an explored graph: which waits in a DP collective are transient,
stalls or hangs (``weightsync check --stalls``)."""

from __future__ import annotations

from array import array

from weightsync.model.explorer import Exploration, build_reverse_csr, reverse_reachable_csr
from weightsync.model.system import DP_KINDS, G

#: Transition labels that are new client traffic (a request, a client ABORT).
CLIENT_TRAFFIC = frozenset({"send", "abort"})


def stranded_counts(ex: Exploration[G]) -> dict[str, int]:
    """Liveness of the DP collectives, by reverse reachability over the explored graph: every reachable
    state in which some rank waits in a DP collective (``dp_step``, ``dp_sync``, ``resume_barrier``) is
    ``transient`` when the ranks can leave every DP collective without new client traffic (the peers join
    on their own), a ``stall`` when only a new request or client ABORT can free it (vLLM 0.32's
    non-latching coordinator re-broadcasts START_DP_WAVE on the next FIRST_REQ), and a ``hang`` when
    nothing can (the collective's timeout is the only way out). Needs the exploration's edge labels."""
    assert ex.src is not None and ex.dst is not None and ex.labels is not None
    n = len(ex.states)
    waiting = [any(r.blocked in DP_KINDS for r in s.ranks) for s in ex.states]
    free = [i for i in range(n) if not waiting[i]]
    start, rev = build_reverse_csr(n, ex.src, ex.dst)
    anyhow = reverse_reachable_csr(n, start, rev, free)
    calm = [k for k, lab in enumerate(ex.labels) if lab[0] not in CLIENT_TRAFFIC]
    qsrc = array("q", (ex.src[k] for k in calm))
    qdst = array("q", (ex.dst[k] for k in calm))
    qstart, qrev = build_reverse_csr(n, qsrc, qdst)
    alone = reverse_reachable_csr(n, qstart, qrev, free)
    out = {"transient": 0, "stall": 0, "hang": 0}
    for i in range(n):
        if waiting[i]:
            out["transient" if alone[i] else ("stall" if anyhow[i] else "hang")] += 1
    return out
