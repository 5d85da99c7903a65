"""How often `trainwatch explain` is right on the golden corpus of public failure text.

The corpus is tests/fixtures/explain/: each NAME.txt is a text as posted in a
public issue thread or log (first line: its source), NAME.expected.json its
label, written before explain ran on it. The label's "meta" says which part
of the corpus the text belongs to, split by source repository: "dev" (the
rules were developed against it), "heldout" (never seen before it is scored
here: the honest figure is its first score, kept in FIRST_UNSEEN_SCORE) or
"retired" (an earlier held-out set whose results were seen and studied, so it
no longer measures generalisation; still scored, labelled as seen), and
"healthy" for noise that must not be called a fault.

For each part this prints:

- category accuracy: the share of texts whose labelled category (the first
  expected finding's) is among explain's findings; a healthy text counts as
  right when no finding is more severe than `low`;
- top-1 accuracy: the share whose first finding above `info` has that category;
- field accuracy for op, rank, xid and severity: over the labels that state
  the field, how often the finding of the labelled category states it too;
- healthy texts called a fault above `low`.

The last line is one JSON object with the same figures.

    PYTHONPATH=. python benchmarks/explain_accuracy.py [--verbose]
    PYTHONPATH=. python benchmarks/explain_accuracy.py --smoke   # two texts of each part (for tests)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import SMOKE_HELP
from trainwatch.diagnostics.explain import explain_inputs
from trainwatch.diagnostics.xid import severity_rank

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "explain"
FIELDS = ("op", "rank", "xid", "severity")
PARTS = ("dev", "retired", "heldout")
PART_TITLES = {"dev": "dev", "retired": "retired (held-out rounds 1 to 17, seen)", "heldout": "heldout (round 18)"}
FIRST_UNSEEN_SCORE: dict[str, dict] = {
    "heldout": {"round": 18, "texts": 31, "category_right": 30, "category_accuracy": 0.9677,
                "top1_accuracy": 0.9677, "healthy_called_fault": 0, "scored_at": "c15f7b4"},
}
"""A held-out part's score from the run before any rule was written with its misses in view: the
honest generalisation figure. Once its misses are studied the live figures below stop measuring it."""
EARLIER_ROUNDS = (
    {"round": 1, "texts": 34, "category_right": 26, "category_accuracy": 0.7647},
    {"round": 2, "texts": 47, "category_right": 34, "category_accuracy": 0.7234,
     "top1_accuracy": 0.7234, "healthy_called_fault": 0, "scored_at": "82aea84"},
    {"round": 3, "texts": 40, "category_right": 31, "category_accuracy": 0.775,
     "top1_accuracy": 0.775, "healthy_called_fault": 0, "scored_at": "c7055c8"},
    {"round": 4, "texts": 40, "category_right": 32, "category_accuracy": 0.8,
     "top1_accuracy": 0.8, "healthy_called_fault": 0, "scored_at": "c4c2208"},
    {"round": 5, "texts": 36, "category_right": 33, "category_accuracy": 0.9167,
     "top1_accuracy": 0.9167, "healthy_called_fault": 0, "scored_at": "8c30ec5"},
    {"round": 6, "texts": 38, "category_right": 32, "category_accuracy": 0.8421,
     "top1_accuracy": 0.8421, "healthy_called_fault": 0, "scored_at": "4191e14"},
    {"round": 7, "texts": 38, "category_right": 35, "category_accuracy": 0.9211,
     "top1_accuracy": 0.9211, "healthy_called_fault": 0, "scored_at": "48aebd9"},
    {"round": 8, "texts": 37, "category_right": 32, "category_accuracy": 0.8649,
     "top1_accuracy": 0.8649, "healthy_called_fault": 0, "scored_at": "6eb905b"},
    {"round": 9, "texts": 52, "category_right": 40, "category_accuracy": 0.7692,
     "top1_accuracy": 0.7692, "healthy_called_fault": 0, "scored_at": "fc93010"},
    {"round": 10, "texts": 49, "category_right": 41, "category_accuracy": 0.8367,
     "top1_accuracy": 0.8367, "healthy_called_fault": 0, "scored_at": "78830b7"},
    {"round": 11, "texts": 30, "category_right": 26, "category_accuracy": 0.8667,
     "top1_accuracy": 0.8667, "healthy_called_fault": 0, "scored_at": "71b7ee9"},
    {"round": 12, "texts": 36, "category_right": 23, "category_accuracy": 0.6389,
     "top1_accuracy": 0.6389, "healthy_called_fault": 0, "scored_at": "5478d4b"},
    {"round": 13, "texts": 39, "category_right": 30, "category_accuracy": 0.7692,
     "top1_accuracy": 0.7692, "healthy_called_fault": 0, "scored_at": "fd851b4"},
    {"round": 14, "texts": 39, "category_right": 31, "category_accuracy": 0.7949,
     "top1_accuracy": 0.7692, "healthy_called_fault": 0, "scored_at": "1014a46"},
    {"round": 15, "texts": 42, "category_right": 36, "category_accuracy": 0.8571,
     "top1_accuracy": 0.8571, "healthy_called_fault": 0, "scored_at": "e93cfb4"},
    {"round": 16, "texts": 42, "category_right": 32, "category_accuracy": 0.7619,
     "top1_accuracy": 0.7381, "healthy_called_fault": 1, "scored_at": "dbc8a76"},
    {"round": 17, "texts": 42, "category_right": 37, "category_accuracy": 0.881,
     "top1_accuracy": 0.881, "healthy_called_fault": 0, "scored_at": "095c338"},
)
"""First unseen scores of the held-out sets now retired (round 1 as the issue that asked for the
corpus measured it), kept for the record."""
MISSES_STUDIED = {"dev": True, "retired": True, "heldout": True}
"""Whether a part's misses have been looked at while writing rules. The round-18 held-out set's one
miss has been (a single watchdog time-out whose desync only the fix shows; left alone): its first
score is its figure."""


def _label(path: Path) -> dict:
    return json.loads(path.with_name(path.stem + ".expected.json").read_text())


def _fault(finding: dict) -> bool:
    """A finding that calls the text a fault: more severe than `low`."""
    return severity_rank(finding.get("severity") or "info") > severity_rank("low")


def score_text(path: Path) -> dict:
    """One text's result: category right?, top-1 right?, field hits, false alarm."""
    label = _label(path)
    meta = label.get("meta", {})
    started = time.perf_counter()
    findings = explain_inputs([(path.name, path.read_bytes())])["findings"]
    result = {"name": path.stem, "part": meta.get("split", "dev"), "seconds": time.perf_counter() - started,
              "healthy": bool(meta.get("healthy")), "fields": {}, "got": [f["category"] for f in findings]}
    if result["healthy"] or not label.get("findings"):
        result["category_ok"] = result["top1_ok"] = not any(_fault(f) for f in findings)
        result["false_alarm"] = not result["category_ok"]
        result["want"] = "healthy"
        return result
    want = label["findings"][0]
    result["want"] = want["category"]
    same = [f for f in findings if f["category"] == want["category"]]
    result["category_ok"] = bool(same)
    ranked = [f for f in findings if severity_rank(f.get("severity") or "info") > 0] or findings
    result["top1_ok"] = bool(ranked) and ranked[0]["category"] == want["category"]
    result["false_alarm"] = False
    stated = [field for field in FIELDS if field in want]
    # The finding of the labelled category that agrees with the label the most.
    best = max(same, key=lambda f: sum(f.get(k) == want[k] for k in stated), default={})
    result["fields"] = {field: best.get(field) == want[field] for field in stated}
    return result


def summarize(results: list[dict]) -> dict:
    """Accuracy figures of one part of the corpus."""
    n = len(results)
    out: dict = {
        "texts": n,
        "category_accuracy": round(sum(r["category_ok"] for r in results) / n, 4) if n else None,
        "top1_accuracy": round(sum(r["top1_ok"] for r in results) / n, 4) if n else None,
        "healthy_texts": sum(r["healthy"] for r in results),
        "healthy_called_fault": sum(r["false_alarm"] for r in results),
    }
    for field in FIELDS:
        hits = [r["fields"][field] for r in results if field in r["fields"]]
        out[f"{field}_accuracy"] = round(sum(hits) / len(hits), 4) if hits else None
        out[f"{field}_labels"] = len(hits)
    out["slowest_text_s"] = round(max((r["seconds"] for r in results), default=0.0), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="list every text explain gets wrong")
    parser.add_argument("--part", choices=PARTS, help="score only this part of the corpus")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    texts = sorted(CORPUS.glob("*.txt"))
    if args.smoke:  # the first text of each part, healthy or not, and the first healthy one: every scoring path
        args.verbose = True
        firsts: dict = {}
        for p in texts:
            meta = _label(p).get("meta", {})
            firsts.setdefault((meta.get("split", "dev"), bool(meta.get("healthy"))), p)
        texts = sorted(firsts.values())
    results = [score_text(p) for p in texts if args.part is None or _label(p).get("meta", {}).get("split") == args.part]
    report = {}
    for part in PARTS:
        mine = [r for r in results if r["part"] == part]
        if not mine:
            continue
        report[part] = summary = summarize(mine)
        summary["misses_studied"] = MISSES_STUDIED[part]
        if part in FIRST_UNSEEN_SCORE:
            summary["first_unseen_score"] = FIRST_UNSEEN_SCORE[part]
        fields = ", ".join(f"{f} {summary[f + '_accuracy']:.1%} of {summary[f + '_labels']}"
                           for f in FIELDS if summary[f + "_accuracy"] is not None)
        print(f"{PART_TITLES[part]}: {summary['texts']} texts: category {summary['category_accuracy']:.1%}, "
              f"top-1 {summary['top1_accuracy']:.1%}; fields: {fields}; "
              f"healthy called a fault above low: {summary['healthy_called_fault']} of {summary['healthy_texts']}"
              + ("" if not summary["misses_studied"] else "; misses studied, not a generalisation figure"))
        if part in FIRST_UNSEEN_SCORE:
            first = FIRST_UNSEEN_SCORE[part]
            print(f"    first score, before any rule saw it: category {first['category_right']} of {first['texts']} "
                  f"({first['category_accuracy']:.1%}), top-1 {first['top1_accuracy']:.1%} (commit {first['scored_at']})")
        if args.verbose:
            for r in mine:
                wrong = [f for f, ok in r["fields"].items() if not ok]
                if not r["category_ok"] or wrong:
                    print(f"    {r['name']}: want {r['want']}, got {r['got']}"
                          + (f", wrong fields {wrong}" if wrong else ""))
    report["earlier_heldout_rounds"] = list(EARLIER_ROUNDS)
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    import common

    common.main(main)
