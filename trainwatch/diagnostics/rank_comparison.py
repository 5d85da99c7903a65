"""Rank comparison: what the findings and progress numbers of many ranks say together.

`collapse_ranks` turns the same error printed by eight ranks into one finding
with eight ranks. `mismatch_findings` compares the collective progress each
rank printed, the way NCCL RAS does ("3 ranks reached SeqNum 8242; rank 5 only
8241"): the ranks behind are the culprits.

Everything here is pure: findings and progress points in, findings out.
"""

from __future__ import annotations

import re

from trainwatch.diagnostics.findings import NON_FACT_KEYS, error_finding, in_contract_order

# Facts one rank reports about itself. Ranks that agree on everything else
# are one finding; these stay only where every rank printed the same value.
_DETAIL = {"last_enqueued", "last_completed", "pg", "pg_name", "pid", "host", "local_rank", "pending_work",
           "last_error", "reported_by"}


def collapse_ranks(findings: list[dict]) -> list[dict]:
    """One finding per distinct fact set; `ranks` lists every rank that printed it.

    Eight ranks printing the same timeout become one finding with eight ranks;
    `rank` stays set only when exactly one rank is involved.
    """
    groups: dict[tuple, list[dict]] = {}
    for finding in findings:
        if finding.get("kind") != "error":
            # Stack and Xid findings are grouped by their own parsers.
            groups[("own", id(finding))] = [finding]
            continue
        key = tuple(sorted((k, repr(v)) for k, v in finding.items() if k not in NON_FACT_KEYS | _DETAIL))
        groups.setdefault(key, []).append(finding)
    out = []
    for members in groups.values():
        if members[0].get("kind") != "error":
            out.append(members[0])
            continue
        merged = dict(members[0])
        ranks: set[int] = set()
        for member in members:
            ranks.update(member.get("ranks") or [])
            if member.get("rank") is not None:
                ranks.add(member["rank"])
        for key in _DETAIL:
            values = [repr(m.get(key)) for m in members]
            if key in merged and len(set(values)) > 1:
                merged[key] = None
        merged["ranks"] = sorted(ranks) or None
        merged["rank"] = merged["ranks"][0] if len(ranks) == 1 else None
        out.append(merged)
    return out


def _per_rank(points: list[dict], take_max: bool) -> dict[int, int] | None:
    """rank -> value; None when a rank reports several values and `take_max` is off."""
    values: dict[int, set[int]] = {}
    for p in points:
        values.setdefault(p["rank"], set()).add(p["value"])
    if not take_max and any(len(v) > 1 for v in values.values()):
        return None
    return {rank: max(v) for rank, v in values.items()}


def _groups(points: list[dict], metric: str) -> list[tuple[str | None, dict[int, int], str | None]]:
    """(process group, rank -> value, op) for each comparable set of points."""
    chosen = [p for p in points if p["metric"] == metric]
    out = []
    if metric == "last_enqueued":
        # Enqueued counters only grow, so a rank's latest (largest) value in a
        # known group is its progress; without a group, several values may be
        # several groups, and comparing them would invent a desync.
        for pg in dict.fromkeys(p["pg"] for p in chosen):
            per_rank = _per_rank([p for p in chosen if p["pg"] == pg], take_max=pg is not None)
            if per_rank:
                out.append((pg, per_rank, None))
        return out
    # Timed-out SeqNums: compare within a group when every point names one;
    # otherwise only when the points cannot belong to different groups
    # (one value per rank, one op, at most one named group).
    if chosen and all(p["pg"] is not None for p in chosen):
        buckets = {pg: [p for p in chosen if p["pg"] == pg] for pg in dict.fromkeys(p["pg"] for p in chosen)}
    else:
        buckets = {None: chosen}
    for pg, bucket in buckets.items():
        ops = {p["op"] for p in bucket if p["op"]}
        pgs = {p["pg"] for p in bucket if p["pg"] is not None}
        per_rank = _per_rank(bucket, take_max=False)
        # Ranks that each timed out once, in one group as far as the text says, are
        # compared even when their ops differ: a rank at another SeqNum in another op
        # left the schedule. (Points naming different groups never share a bucket.)
        if per_rank and len(pgs) <= 1:
            op = next(iter(ops)) if len(ops) == 1 else None
            out.append((pg if pg is not None else next(iter(pgs), None), per_rank, op))
    return out


def _rank_list(ranks: list[int]) -> str:
    """[5] -> 'rank 5'; [5, 6] -> 'ranks 5, 6'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _op_mismatch_findings(points: list[dict]) -> list[dict]:
    """collective_mismatch findings where ranks time out at one SeqNum of one group in different ops.

    Sequence numbers count the collectives of a group in order, so two ranks
    at the same number in different ops have called different collectives:
    the schedule diverged. The ranks in the less common op are the suspects
    (all of them when no op is in the majority).
    """
    out: list[dict] = []
    chosen = [p for p in points if p["metric"] == "timeout_seq" and p["op"]]
    for pg in dict.fromkeys(p["pg"] for p in chosen):
        bucket = [p for p in chosen if p["pg"] == pg]
        for seq in sorted({p["value"] for p in bucket}):
            ops: dict[str, set[int]] = {}
            for p in bucket:
                if p["value"] == seq:
                    ops.setdefault(p["op"], set()).add(p["rank"])
            if len(ops) == 1:
                out += _size_mismatch(pg, seq, [p for p in bucket if p["value"] == seq])
                continue
            sizes = sorted(len(r) for r in ops.values())
            majority = max(ops, key=lambda op: len(ops[op])) if sizes[-1] > sizes[-2] else None
            suspects = sorted({r for op, rs in ops.items() if op != majority for r in rs})
            said = "; ".join(f"{_rank_list(sorted(rs))} in {op}" for op, rs in sorted(ops.items()))
            finding = error_finding("collective_mismatch", f"SeqNum {seq} timed out in different ops: {said}")
            finding.update(
                op=majority, seq=seq, ranks=suspects, rank=suspects[0] if len(suspects) == 1 else None, pg=pg,
                metric="timeout_op", per_rank=[{"rank": r, "seq": seq, "op": op}
                                               for op, rs in sorted(ops.items()) for r in sorted(rs)],
                evidence_lines=[p["evidence"] for p in bucket if p["value"] == seq][:8],
            )
            out.append(in_contract_order(finding))
    return out


# Collectives every rank calls with the same input size (not all-to-all's uneven splits,
# a root's scatter or gather list, point to point).
_SAME_SIZE_OPS = re.compile(r"(?i)^_?(?:ALLREDUCE|BROADCAST|REDUCE|ALLGATHER|REDUCE_SCATTER)(?:_BASE|_COALESCED)?$")


def _size_mismatch(pg, seq: int, at_seq: list[dict]) -> list[dict]:
    """A collective_mismatch where ranks time out at one SeqNum in one op with different input
    sizes (NumelIn): the same collective must move the same amount from every rank, so they
    called it on different tensors (a desync of shapes). The less common sizes are the suspects."""
    op = at_seq[0]["op"]
    by_size: dict[int, set[int]] = {}
    for p in at_seq:
        if p.get("numel_in") is not None:
            by_size.setdefault(p["numel_in"], set()).add(p["rank"])
    if len(by_size) < 2 or not _SAME_SIZE_OPS.match(op):
        return []
    counts = sorted(len(r) for r in by_size.values())
    common = max(by_size, key=lambda n: len(by_size[n])) if counts[-1] > counts[-2] else None
    suspects = sorted({r for n, rs in by_size.items() if n != common for r in rs})
    said = "; ".join(f"{_rank_list(sorted(rs))} {n}" for n, rs in sorted(by_size.items()))
    finding = error_finding("collective_mismatch", f"SeqNum {seq} timed out in {op} with different sizes (NumelIn): {said}")
    finding.update(op=op, seq=seq, ranks=suspects, rank=suspects[0] if len(suspects) == 1 else None, pg=pg,
                   metric="timeout_size", per_rank=[{"rank": r, "seq": seq, "numel_in": n}
                                                    for n, rs in sorted(by_size.items()) for r in sorted(rs)],
                   evidence_lines=[p["evidence"] for p in at_seq][:8])
    return [in_contract_order(finding)]


def mismatch_findings(points: list[dict]) -> list[dict]:
    """collective_mismatch findings where the ranks of one group disagree on progress.

    The highest sequence number is where the group got to; every rank below
    it has not launched (or not reached) that collective and is behind. Ranks
    at the same number in different ops disagree too (`_op_mismatch_findings`).
    """
    out: list[dict] = _op_mismatch_findings(points)
    reported: set[frozenset[int]] = set()
    for metric in ("last_enqueued", "timeout_seq"):
        for pg, per_rank, op in _groups(points, metric):
            if len(per_rank) < 2 or len(set(per_rank.values())) < 2:
                continue
            top = max(per_rank.values())
            leaders = sorted(r for r, v in per_rank.items() if v == top)
            behind = sorted((r for r, v in per_rank.items() if v < top), key=lambda r: (per_rank[r], r))
            if frozenset(behind) in reported:
                continue
            reported.add(frozenset(behind))
            by_value: dict[int, list[int]] = {}
            for r in behind:
                by_value.setdefault(per_rank[r], []).append(r)
            lag = "; ".join(f"{_rank_list(sorted(rs))} only {v}" for v, rs in sorted(by_value.items(), reverse=True))
            count = f"{len(leaders)} rank{'s' if len(leaders) > 1 else ''}"
            evidence = f"{count} reached SeqNum {top}; {lag}"
            if metric == "last_enqueued":
                evidence = f"{count} enqueued up to SeqNum {top}; {lag}"
            if op is None:
                # The enqueued counters carry no op; a rank that timed out
                # at the leading SeqNum of the same group names it.
                ops = {p["op"] for p in points if p["metric"] == "timeout_seq" and p["value"] == top
                       and p["op"] and p["pg"] in (pg, None)}
                op = ops.pop() if len(ops) == 1 else None
            finding = error_finding("collective_mismatch", evidence)
            lagging = sorted(behind)
            finding.update(
                op=op, seq=top, ranks=lagging, rank=lagging[0] if len(lagging) == 1 else None,
                pg=pg, metric=metric, leading_ranks=leaders,
                behind=[{"rank": r, "seq": per_rank[r]} for r in lagging],
                evidence_lines=list(dict.fromkeys(
                    p["evidence"] for p in points if p["metric"] == metric and p["pg"] == pg
                    and p["rank"] in per_rank and p["value"] == per_rank[p["rank"]]))[:8],
            )
            out.append(in_contract_order(finding))
    return out
