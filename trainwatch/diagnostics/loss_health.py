"""Loss health in training logs: NaN gradient norms and a loss scale falling step after step.

Training frameworks print the numbers trainwatch's live detectors watch
(detectors/loss.py, detectors/training.py) in their own log lines:

- Megatron / Megatron-DeepSpeed: `... | lm loss: 2.3E+00 | loss scale: 1.0 | grad norm: nan | ...`,
  and `Rank 11: found NaN in local grad norm in backward pass ...` when it aborts;
- HF Trainer: `{'loss': 0.0, 'grad_norm': nan, 'learning_rate': ...}`;
- mmcv / Lightning / plain loops: `loss: nan`, `grad_norm=nan`;
- DeepSpeed: `[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32`
  and `Current loss scale already at minimum`;
- apex / GradScaler wrappers: `Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0`.

`loss_health_findings` reads the series these lines form and reports the
same incident kinds as the live detectors, with their runbooks:

- `loss_nan` (critical) when the loss or the gradient norm is not finite and
  stays so (two values or more, or the last value printed), or when the
  framework itself aborts on a NaN; one non-finite value that a finite one
  follows is a step the scaler skipped, reported as `low`;
- `loss_scale_collapse` when the dynamic loss scale falls at least twice in a
  row and ends at or below COLLAPSE_SCALE, far under where fp16 training
  settles (a scale calibrating down from 2^16 or 2^32 in the first steps is
  healthy and reported as nothing); `high` once the scale is below 1 or at
  the scaler's minimum.

Every finding keeps the lines it was read from as evidence. Pure functions of the text.
"""

from __future__ import annotations

import math
import re

from trainwatch.diagnostics.findings import error_finding

COLLAPSE_SCALE = 128.0
"""A loss scale at or below this after falling step after step is a collapse: fp16 training
normally settles between 2^10 and 2^16, and calibration from 2^16 or 2^32 stops well above it."""
_FAIRSEQ_CUT = re.compile(r"setting\s*loss\s*scale\s*to", re.I)
MIN_FALLS = 2
"""Consecutive reductions (without a rise between them) that make a trend, not a single overflow."""
_MAX_EVIDENCE_LINES = 3

_NUM = r"(?P<value>[-+]?(?:nan|inf(?:inity)?|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))"
_END = r"(?!\w|\.\w)"
"""After a value: not more of a word or number; a full stop ending the sentence is fine."""
# "grad norm: nan", "grad_norm: nan", "'grad_norm': nan", "grad_norm=nan", "grad-norm nan"
_GRAD_NORM = re.compile(r"(?i)\bgrad[\s_-]?norm['\"]?\s*(?:[:=]\s*)?" + _NUM + _END)
# "loss: nan", "'loss': nan", "lm loss: nan", "loss=nan", "train_loss: nan", a loss term ("loss_net: nan"),
# a table cell ("| loss | nan |"), a bare pair ("Loss nan   LearningRate") or a bracketed name
# ("[Loss] nan"); never the loss scale.
_LOSS = re.compile(r"(?i)(?<![\w-])(?:lm |train |total |(?:[a-z][a-z0-9]{0,15}[_/]){1,3})?loss(?:es)?(?!_?scal)(?:_[a-z0-9]{1,20})?['\"\]]?"
                   r"(?:\s*[:=|]\s*|\s+)\[?" + _NUM + _END)  # Paddle prints a loss as a list: "loss: [nan]"
_ABORT_NAN = re.compile(
    r"(?i)(?:Rank\s*(?P<rank>\d{1,9})\s*:\s*)?found\s*(?:NaN|Inf)\s*in\s*local\s*(?:grad\s*norm|forward\s*loss)"
    r"|Bad\s*grad_?norm\s*detected\s*\(grad_?norm\s*=\s*nan\)"
    r"|(?:loss|grad(?:ient)?[\s_]norm)\s*is\s*(?:NaN|inf(?:inite)?\b|not\s*finite|non-finite)"
    # YOLOv5's trainer: "WARNING: non-finite loss, ending training".
    r"|non-finite\s*loss,?\s*ending\s*training"
    # mmengine's check-loss hook, fairseq's NaN detector, TensorFlow's check_numerics,
    # PaddlePaddle's FLAGS_check_nan_inf.
    r"|loss\s*become\s*infinite\s*or\s*NaN|NaN\s*detected\s*in\s*(?:output|grad)|Tensor\s*had\s*(?:NaN|Inf)\s*values"
    r"|There\s*are\s*NAN\s*or\s*INF"
    # PyTorch's own clip_grad_norm_ on a non-finite total norm: the warning, and the error
    # error_if_nonfinite=True raises instead.
    r"|Non-finite\s*norm\s*encountered\s*in\s*torch\.nn\.utils\.clip_grad_norm_?"
    r"|for\s*gradients\s*from\s*`?parameters`?\s*is\s*non-finite"
    # detectron2's trainer, and autograd's anomaly mode naming the op whose gradient went NaN.
    r"|Loss\s*became\s*infinite\s*or\s*NaN|Predicted\s*boxes\s*or\s*scores\s*contain\s*Inf/NaN|\bNaN\s*loss\s*(?:detected|encountered|found)"
    # JAX's jax_debug_nans: "FloatingPointError: invalid value (nan) encountered in mul"
    r"|invalid\s*value\s*\(nan\)\s*encountered\s*in"
    r"|Function\s*'\w{1,80}'\s*returned\s*nan\s*values\s*in\s*its\s*\d+(?:st|nd|rd|th)\s*output"
    # Megatron(-FSDP)'s and NeMo's gradient checks: "Detected NaN or Inf in wgrad", "detected inf
    # or nan values in gradients! Setting gradients to zero."
    r"|detected\s*(?:NaN\s*or\s*Inf|inf\s*or\s*nan)\s*(?:values\s*)?in\s*(?:the\s*)?(?:w?grad\w*|gradients?)"
    # Lightning's finite checks, fairseq's gradient check.
    r"|Detected\s*nan\s*and/or\s*inf\s*values\s*in|gradients\s*are\s*Nan/Inf"
    # JAX's debug_nans and checkify, optax's line search that cannot step.
    r"|Invalid\s*nan\s*value\s*encountered\s*in\s*the\s*output\s*of\s*a\s*jax|nan\s*generated\s*by\s*primitive"
    r"|Cannot\s*even\s*make\s*a\s*step\s*without\s*getting\s*Inf\s*or\s*Nan")
# DeepSpeed: "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32"
_DS_OVERFLOW = re.compile(
    r"(?i:OVERFLOW!|fp16\s*dynamic\s*loss\s*scale\s*overflow!)\s*Rank\s*(?P<rank>\d{1,9})\s*Skipping\s*step\.\s*Attempted\s*loss\s*scale:\s*"
    r"(?P<before>[\d.eE+]+)\s*,\s*reducing\s*to\s*(?P<after>[\d.eE+]+)")
# apex amp: "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0";
# fairseq: "| WARNING: overflow detected, setting loss scale to: 0.25"
_APEX_OVERFLOW = re.compile(r"(?i)(?:reducing|downscale|overflow\s*detected,\s*(?:ignoring\s*gradient,\s*)?setting)"
                            r"\s*loss\s*scale\s*to:?\s*"
                            r"(?P<after>\d[\d.eE+-]*)")
# The scale as a logged value, step after step: "loss_scale : 3.7e-09", "| loss_scale 0.500 |",
# "'loss_scale': 1024.0": a series that falls and falls is the same collapse.
_SCALE_VALUE = re.compile(r"(?i)\bloss[\s_-]?scale['\"]?\s*(?:[:=|]\s*)?(?P<value>\d[\d.]*(?:[eE][-+]?\d+)?)" + _END)
# The scaler's floor, or an overflow monitor giving up ("Skipped 50 iterations in a row due to
# Overflow", GPT-NeoX and Megatron forks): the scale cannot get low enough.
_SCALE_MINIMUM = re.compile(r"(?i)(?:current\s*)?loss\s*scale\s*already\s*at\s*minimum|"
                            r"minimum\s*loss\s*scale\s*reached|"
                            r"skipped\s*\d{1,9}\s*iterations\s*in\s*a\s*row\s*due\s*to\s*overflow")
# A running-average meter gone NaN, whatever it measures ("Stage0-heatmaps: nan (nan)",
# "Loss nan (nan)"): the value and the mean of all values so far are both non-finite.
_METER_NAN = re.compile(r"(?i)(?<![\w-])[a-z][\w-]{0,40}:?\s+(?:nan|inf)\s*\(\s*(?:nan|inf)\s*\)")
# A bare "step value" pair, the whole line ("76980 nan"): a loss logged with no name at all.
_BARE_PAIR = re.compile(r"(?i)^\s*\d{1,12}\s+" + _NUM + r"\s*$")
_RANK_PREFIX = re.compile(r"\[rank(\d{1,9})\]")
_NEEDLES = ("nan", "inf", "loss", "norm", "overflow")
# TensorBoard refusing a scalar it was asked to log: a value gone NaN/inf, the loss in practice,
# but not said which: read only where nothing else in the text speaks of the loss's health.
_LOGGED_NAN = re.compile(r"NaN\s*or\s*Inf\s*found\s*in\s*input\s*tensor")


def _value(text: str) -> float | None:
    try:
        return float(text)
    except (ValueError, OverflowError):
        return None


def _evidence(lines: list[str]) -> str:
    """The first and last lines of a series (a long series would drown the report)."""
    picked = lines if len(lines) <= _MAX_EVIDENCE_LINES else [lines[0], lines[-1]]
    return "\n".join(line.strip()[:400] for line in picked)


def _series(lines: list[str]) -> tuple[list[tuple[float, str]], list[tuple[str, str, int | None]],
                                       list[tuple[float, float | None, str, int | None]], list[str], bool]:
    """(metric values, abort lines, scale reductions, scale-at-minimum lines, whether the
    reductions are only read from logged scale values), in log order."""
    metrics: list[tuple[float, str]] = []
    aborts: list[tuple[str, str, int | None]] = []
    reductions: list[tuple[float, float | None, str, int | None]] = []
    minimum: list[str] = []
    printed: list[tuple[float, str]] = []  # the loss scale logged as a value
    falls: list[tuple[float, float | None, str, int | None]] = []  # ... and where it fell
    for line in lines:
        lower = line.lower()
        if not any(needle in lower for needle in _NEEDLES):
            continue
        prefix = _RANK_PREFIX.search(line)
        line_rank = int(prefix.group(1)) if prefix else None
        if m := _ABORT_NAN.search(line):
            rank = int(m.group("rank")) if m.group("rank") else line_rank
            aborts.append((line, m.group(0), rank))
        if m := _DS_OVERFLOW.search(line):
            reductions.append((_value(m.group("after")) or 0.0, _value(m.group("before")), line,
                               int(m.group("rank"))))
        elif m := _APEX_OVERFLOW.search(line):
            reductions.append((_value(m.group("after")) or 0.0, None, line, line_rank))
        elif (m := _SCALE_VALUE.search(line)) and (scale := _value(m.group("value"))) is not None:
            if printed and scale < printed[-1][0]:
                falls.append((scale, printed[-1][0], line, line_rank))
            printed.append((scale, line))
        if _SCALE_MINIMUM.search(line):
            minimum.append(line)
        # One value per line: a line with both prints the grad norm next to the loss it came from,
        # and a line of loss terms (mmdet's loss_cls, loss_bbox, loss) is NaN if any term is.
        found = [m for m in (_GRAD_NORM.search(line), *_LOSS.finditer(line)) if m is not None]
        values = [v for m in found if (v := _value(m.group("value"))) is not None]
        if not values and (m := _BARE_PAIR.match(line)) and (v := _value(m.group("value"))) is not None:
            values = [v]
        if ("nan" in lower or "inf" in lower) and all(map(math.isfinite, values)) and _METER_NAN.search(line):
            values = [math.nan]
        if values:
            metrics.append((next((v for v in values if not math.isfinite(v)), values[0]), line))
    # A scaler that says when it reduces the scale says it best; else the logged values tell.
    return metrics, aborts, reductions or falls, minimum, not reductions and bool(falls)


def _nan_findings(metrics: list[tuple[float, str]], aborts: list[tuple[str, str, int | None]]) -> list[dict]:
    """loss_nan from a framework's own abort, or from the printed loss / grad-norm series."""
    if aborts:
        line, said, rank = aborts[0]
        finding = error_finding("loss_nan", _evidence([a[0] for a in aborts]))
        finding.update(rank=rank, ranks=sorted({a[2] for a in aborts if a[2] is not None}) or None,
                       reason=said.strip(), source="framework_abort")
        return [finding]
    bad = [(v, line) for v, line in metrics if not math.isfinite(v)]
    if not bad:
        return []
    last_bad = max(i for i, (v, _) in enumerate(metrics) if not math.isfinite(v))
    recovered = any(math.isfinite(v) for v, _ in metrics[last_bad + 1:])
    finding = error_finding("loss_nan", _evidence([line for _, line in bad]))
    finding.update(non_finite_values=len(bad), values_read=len(metrics), recovered=recovered)
    if recovered and len(bad) == 1:
        # One skipped step (an fp16 overflow the scaler handled) with finite values after it.
        finding["severity"] = "low"
    return [finding]


def _scale_findings(reductions: list[tuple[float, float | None, str, int | None]],
                    minimum: list[str]) -> list[dict]:
    """loss_scale_collapse from a run of loss-scale reductions ending low, or the scaler's floor."""
    if not reductions and not minimum:
        return []
    # The latest run of reductions in a row: a reduction whose "before" is higher than the
    # previous "after" means the scale grew again in between and a new run starts.
    run: list[tuple[float, float | None, str, int | None]] = []
    for reduction in reductions:
        if run and reduction[1] is not None and reduction[1] > run[-1][0]:
            run = []
        run.append(reduction)
    final = run[-1][0] if run else None
    # A scale cut below 1 has collapsed even when one line shows it: the gradients overflow
    # fp16 unscaled, so that scale was reached by many halvings, none of which recovered.
    # A scaler that "reduces" a scale of 1 or less to no less is at its floor (DeepSpeed's
    # min_loss_scale: "Attempted loss scale: 1, reducing to 1"); above that, the same words
    # are its hysteresis holding the scale for a few overflows.
    minimum = minimum + [r[2] for r in run if r[1] is not None and r[0] >= r[1] and r[1] <= 1.0]
    # fairseq's scaler ("setting loss scale to") has its floor at 1e-4 and some of its models
    # settle at 2^2 to 2^6 (wav2vec): only a scale below 1 has collapsed there.
    settles_low = bool(run) and all(_FAIRSEQ_CUT.search(r[2]) for r in run)
    collapsed = bool(minimum) or (final is not None and (final <= 1.0 or (len(run) >= MIN_FALLS and not settles_low
                                                                           and final <= COLLAPSE_SCALE)))
    if not collapsed:
        return []
    lines = [r[2] for r in run] + minimum
    finding = error_finding("loss_scale_collapse", _evidence(lines))
    ranks = sorted({r[3] for r in run if r[3] is not None})
    finding.update(rank=ranks[0] if len(ranks) == 1 else None, ranks=ranks or None,
                   loss_scale=final, reductions=len(run), at_minimum=bool(minimum))
    if minimum or (final is not None and final <= 1.0):
        finding["severity"] = "high"
    return [finding]


def loss_health_findings(lines: list[str]) -> list[dict]:
    """loss_nan and loss_scale_collapse findings (kind "error") read from log lines."""
    metrics, aborts, reductions, minimum, logged_only = _series(lines)
    nan = _nan_findings(metrics, aborts)
    if nan and nan[0]["severity"] != "low" and logged_only:
        # The logged scale falls beside a loss gone non-finite: the scaler reacting to it, one story.
        reductions = []
    findings = nan + _scale_findings(reductions, minimum)
    if not findings and (logged := [line for line in lines if "found in input tensor" in line
                                    and _LOGGED_NAN.search(line)]):
        finding = error_finding("loss_nan", _evidence(logged))
        finding.update(source="tensorboard", non_finite_values=len(logged))
        findings = [finding]
    for finding in findings:
        finding["_role"] = "finding"
    return findings


def judged_areas(lines: list[str]) -> set[str]:
    """The loss-health categories whose values these lines print, found healthy or not: a
    reader that has weighed the numbers is not overruled by the words around them. A scaler cut
    again and again (ROUTINE_CUTS or more) stays open to them even while its scale is large."""
    metrics, _, reductions, minimum, _ = _series(lines)
    printed_scale = any(_SCALE_VALUE.search(line) or _DS_OVERFLOW.search(line) or _APEX_OVERFLOW.search(line)
                        for line in lines if "scal" in line.lower())
    return ({"loss_nan"} if metrics else set()) | (
        {"loss_scale_collapse"} if minimum or (printed_scale and len(reductions) < ROUTINE_CUTS) else set())


ROUTINE_CUTS = 5
"""Scale cuts a calibrating scaler makes in a log excerpt without anyone worrying."""
