"""Hangs described in words. An issue often says where a run is stuck instead of pasting a
stack ("training gets stuck at `data = queue.get(block=True)`", "卡住在
torch.cuda.current_stream().synchronize()"). When a text holds nothing else that explains it,
a sentence that says the run hangs and names where is read as that stack category, at
`medium` severity: a user's words are weaker evidence than a stack."""

from __future__ import annotations

import re

from trainwatch.diagnostics.findings import FINDING_KEYS

_HANG = re.compile(r"(?i)\bstuck\b|\bhang(?:s|ing)?\b|\bhung\b|\bfreez(?:e|es|ing)\b|\bfrozen\b|\bdeadlock(?:s|ed)?\b"
                   r"|卡住|卡在|卡死")
_HEDGED = re.compile(r"(?i)\b(?:might|may|could|can|would|avoid\w*|prevent\w*|potential\w*|risk\w*|even|if)\b[^.]{0,40}$")
"""Words before a hang word that make it a warning about what could happen, not a report."""
_WINDOW = 160
"""Characters either side of the hang word where the place it names is looked for."""
PLACES = (
    # detectron2's (and its descendants') comm.synchronize() is a barrier across ranks, not a CUDA wait.
    ("barrier", "barrier-hang", re.compile(r"(?i)\b(?:monitored_)?barrier\b|\bcomm\.synchronize\s*\(")),
    ("cuda_sync", "cuda-sync", re.compile(
        r"cuda(?:Stream|Device|Event)Synchronize|(?<!comm\.)\bsynchronize\s*\(\s*\)|torch\.cuda\.synchronize"
        r"|\.item\s*\(\s*\)")),
    ("dataloader", "dataloader-stall", re.compile(
        r"(?i)queue\.get\s*\(|\bdata\s*loader\b|\bdataloader\b|next\s*\(\s*iter|_next_data|\bdata\s*loading\b")),
    ("checkpoint_io", "checkpoint-io", re.compile(r"(?i)torch\.save\s*\(|save_checkpoint|\bsaving\s*(?:the\s*)?checkpoint")),
    ("collective_wait", "collective-wait", re.compile(
        r"(?i)\ball_?reduce\b|\ball_?gather\w*|\bbroadcast\b|\breduce_scatter\b|\bnccl\s*kernel")),
)


_MAX_MENTIONS = 64
"""Hang words looked at per text: a sentence that names its place comes early, and a text
made of nothing but the word must not cost a scan per repetition."""


def prose_hang(text: str) -> list[dict]:
    """A `stack` finding for the first sentence that says the run hangs and where; [] without one."""
    seen = 0
    for line in text.splitlines():
        for hang in _HANG.finditer(line):
            seen += 1
            if seen > _MAX_MENTIONS:
                return []
            if _HEDGED.search(line, max(0, hang.start() - 60), hang.start()):
                continue
            lo, hi = max(0, hang.start() - _WINDOW), hang.end() + _WINDOW
            near = []
            for category, runbook, pattern in PLACES:
                for m in pattern.finditer(line, lo, hi):
                    near.append((abs(m.start() - hang.start()), category, runbook, m.group(0)))
            if near:
                _, category, runbook, place = min(near)
                finding = dict.fromkeys(FINDING_KEYS)
                finding.update(kind="stack", category=category, severity="medium", runbook=runbook,
                               evidence=line.strip()[:400], source="prose", place=place)
                return [finding]
    return []
