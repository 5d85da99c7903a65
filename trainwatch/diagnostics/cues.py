"""The words of a failure's area, read when no message rule, stack or kernel line explains a text.

The rules know the messages software prints. Users paste more than that: a message of a
version no rule has seen, a line cut short, their own account of what happened ("the loss
becomes nan after 2k steps", "hostname could not be resolved by the store", "the scaler keeps
halving"). Such text still speaks its area's words. Each area here has cues, a regex and a
weight; a text's score for an area is the weight of the distinct cues it holds. The best area,
if it scores enough and clearly beats the next, is reported at `low` severity: words are
weaker evidence than a message, so a healthy log that happens to speak them is never called a
fault. Every finding keeps the lines that hold its cues, strongest first.
"""

from __future__ import annotations

import re
from itertools import islice

from trainwatch.diagnostics.findings import ERROR_CATEGORIES, FINDING_KEYS
from trainwatch.diagnostics.loss_health import judged_areas

_I = re.IGNORECASE


def _cue(pattern: str, weight: float, lines: int = 1) -> tuple[re.Pattern[str], float, int]:
    """A cue: found when `lines` lines (after chatter is dropped) match `pattern`."""
    return re.compile(pattern, _I), weight, lines


_NUM_BAD = r"(?:nan|inf|-?infinity)\b"
"""A value that is not finite, as loggers print it."""

CUES: dict[str, tuple[tuple[re.Pattern[str], float, int], ...]] = {
    "oom": (
        _cue(r"out\s*of\s*memory|\bOOM\b|RESOURCE_EXHAUSTED|memory\s*exhausted|显存不足|显存溢出|爆显存", 3),
        _cue(r"tried\s*to\s*allocate|cudaMalloc|failed\s*to\s*allocate|allocat\w*\s+\d+(?:\.\d+)?\s*[KMGT]i?B", 2),
        _cue(r"reserved\s*(?:in\s*total\s*)?by\s*PyTorch|max_split_size_mb|PYTORCH_CUDA_ALLOC_CONF|expandable_segments", 1.5),
        _cue(r"\bmemory\b", 0.5),
    ),
    "loss_nan": (
        _cue(r"\b(?:\w*_)?loss(?![\s_]*scal)\w*\b[^\n]{0,40}?(?:[=:]|\bis\b|\bbecomes?\b|\bwent\b|\bturns?\b|\bgoes\b|\bto\b)\s*\(?-?" + _NUM_BAD, 3),
        _cue(r"grad(?:ient)?[_ ]?norm[^\n]{0,20}?[=:]?\s*" + _NUM_BAD, 3),
        _cue(r"\bnan\b[^\n]{0,30}\bloss|non-?finite\s*loss|loss\s*(?:is\s*)?(?:nan|inf)"
             r"|loss(?![\s_]*scal)\w*\W{1,6}(?:tensor\(\s*)?" + _NUM_BAD + r"|(?:nan|inf)\b[^\n]{0,30}grad(?:ient)?[_ ]?norm", 3),
        _cue(r"(?:^|[\s:=|(\[,])-?(?:nan|inf)(?=$|[\s|),\]])", 2, lines=2),
        _cue(r"(?:(?:^|\s)-?nan(?=\s|$).*){3}", 3),
        _cue(r"\b(?:nan|inf)s?\b", 1),
        _cue(r"diverg\w*|explod\w*|blow\w*\s*up", 1),
        _cue(r"\b(?:nan|inf)\b[^\n]{0,60}(?:each|every|all)\s*(?:the\s*)?(?:steps?|iterations?|epochs?|batch\w*)"
             r"|(?:each|every|all)\s*(?:the\s*)?(?:steps?|iterations?|epochs?|batch\w*)[^\n]{0,60}\b(?:nan|inf)\b", 2),
        _cue(r"\bfp16\b|16-mixed|half\s*precision|\bautocast\b|\bamp\b|mixed\s*precision", 1),
        _cue(r"\bloss\b", 0.5),
    ),
    "loss_scale_collapse": (
        _cue(r"(?:reduc|decreas|lower|halv|drop|setting)\w*\s*(?:the\s*)?loss\s*scal|loss\s*scal\w*[^\n]{0,30}(?:minimum|\bmin\b)"
             r"|minimum\s*loss\s*scale", 3),
        _cue(r"(?:gradient\s*)?overflow[^\n]{0,40}skip|skipp\w*\s*(?:the\s*)?(?:optimizer\s*)?step", 2),
        _cue(r"loss[\s_]*scal\w*|grad[\s_]*scaler|\bscaler\b", 1.5),
        _cue(r"\boverflow\w*", 1),
    ),
    "heartbeat_timeout": (
        _cue(r"watchdog\s*got\s*stuck|heartbeat\s*monitor|TORCH_NCCL_HEARTBEAT\w*|\bstore\b[^\n]{0,30}(?:hostname|host\s*name)", 4),
        _cue(r"rendezvous|\bTCPStore\b|\bc10d\s*store|\bstore\b[^\n]{0,40}(?:timeout|timed\s*out|connect|refused)"
             r"|init_process_group[^\n]{0,60}(?:hang|stuck|timeout|timed\s*out)", 3),
        _cue(r"MASTER_ADDR|MASTER_PORT|master[_ ]addr|--master[_-]port|rdzv", 1.5),
        _cue(r"name\s*or\s*service\s*not\s*known|could\s*not\s*resolve|hostname|host\s*not\s*found|getaddrinfo"
             r"|address\s*already\s*in\s*use|connection\s*refused|connect\(\)|name\s*resolution|\bgai\s*error", 2),
        _cue(r"\[c10d\]", 1),
        _cue(r"\bheartbeat\b|socket\s*timeout|\bsocket\b", 1),
        _cue(r"failed\s*to\s*connect|client\s*socket|waiting\s*for\s*(?:all\s*)?(?:clients|workers|nodes)|clients\s*joined"
             r"|DistStoreError|address\s*already\s*in\s*use|EADDRINUSE|timed\s*out\s*connecting|failed\s*to\s*become\s*healthy"
             r"|(?:server|coordinator|service)\b[^\n]{0,40}(?:not\s*ready|unreachable|timed\s*out)", 3),
    ),
    "nccl_error": (
        _cue(r"NCCL\s*(?:error|WARN|failure)|ncclSystemError|ncclInternalError|ncclInvalidUsage"
             r"|ncclInvalidArgument|ncclRemoteError|ncclUnhandledCudaError|unhandled\s*(?:system|cuda)\s*error", 3),
        _cue(r"\bNCCL_(?:P2P|IB|SOCKET|SHM|NET|DEBUG)\w*|libnccl|ncclCommInit\w*|\bIB\b\s*(?:error|verbs)|\bibv_\w+", 1.5),
        _cue(r"\bnccl\b", 1),
        _cue(r"nccl[^\n]{0,80}(?:\bshm\b|shared\s*memory)|(?:\bshm\b|shared\s*memory)[^\n]{0,80}nccl", 3),
    ),
    "collective_timeout": (
        _cue(r"watchdog[^\n]{0,40}time|collective[^\n]{0,40}time\w*\s*out|WorkNCCL|Timed\s*out\s*waiting[^\n]{0,30}(?:recv|send)", 3),
        _cue(r"(?:all_?reduce|all_?gather|broadcast|reduce_?scatter|all_?to_?all)[^\n]{0,60}(?:time\w*\s*out|timeout)"
             r"|(?:time\w*\s*out|timeout|超时)[^\n]{0,60}(?:all_?reduce|all_?gather|broadcast|reduce_?scatter)"
             r"|(?:all_?reduce|all_?gather|broadcast|reduce_?scatter|nccl)[^\n]{0,60}超时", 3),
        _cue(r"NCCL_TIMEOUT|TORCH_NCCL_\w*TIMEOUT|\btimeout\s*=\s*timedelta", 1),
        _cue(r"timeout\s*at\s*NCCL\s*work|failed\s*or\s*timed\s*out|detected\s*by\s*watchdog|ProcessGroup\w*\s*timeout", 3),
    ),
    "collective_mismatch": (
        _cue(r"mismatch\w*[^\n]{0,40}(?:collective|rank|shape|size)|(?<!_)desync\w*|different\s*(?:shapes?|sizes?|numbers?\s*of)[^\n]{0,40}ranks?", 3),
        _cue(r"ranks?[^\n]{0,40}(?:different|out\s*of\s*order|not\s*call\w*)[^\n]{0,40}(?:collective|all_?reduce|all_?gather|broadcast|barrier)", 2),
    ),
    "cuda_error": (
        _cue(r"Assertion\s*`[^`]*`\s*failed|index\s*out\s*of\s*bounds|srcIndex\s*<|THCUNN|ClassNLLCriterion", 3),
        _cue(r"(?<!unhandled )CUDA\s*(?:error|runtime\s*error|driver\s*error)|cudaError\w*|CUBLAS_STATUS_(?!SUCCESS)\w+|CUDNN_STATUS_(?!SUCCESS)\w+|cuDNN\s*error"
             r"|device-side\s*assert|no\s*kernel\s*image|unspecified\s*launch\s*failure|CUDA_ERROR_\w+", 3),
        _cue(r"driver\s*version|compute\s*capability|\bsm_\d+|CUDA_LAUNCH_BLOCKING|nvcc|cuda\s*version", 1.5),
        _cue(r"\bcuda\b", 0.5),
    ),
    "illegal_memory_access": (
        _cue(r"illegal\s*(?:memory\s*)?(?:access|address)|misaligned\s*address|cudaErrorIllegal\w*|CUDA_ERROR_ILLEGAL\w*", 4),
    ),
    "child_failed": (
        _cue(r"ChildFailedError|exit\s*code\s*[:=]?\s*-?\d+|exitcode\s*[:=]?\s*-?\d+|terminated\s*with\s*(?:signal|exit)"
             r"|returned\s*non-zero\s*exit|killing\s*subprocess|process\s*\d+\s*terminated|non-?zero\s*(?:exit|status)"
             r"|(?:process|worker|actor)\b[^\n]{0,40}(?:terminated|died|exited)\s*unexpectedly|is\s*not\s*alive"
             r"|no\s*more\s*restarts", 3),
        _cue(r"\bSIG(?:KILL|SEGV|ABRT|BUS|TERM|FPE)\b|\bsignal\s*\d+|segmentation\s*fault|core\s*dumped|\bkilled\b", 1.5),
        _cue(r"mp\.spawn|torchrun|torch\.distributed\.(?:launch|run)|\bsrun\b|mpirun|deepspeed\s*launcher", 1),
    ),
    "dataloader_worker_killed": (
        _cue(r"DataLoader\s*worker[^\n]{0,40}(?:killed|exited|crash)|worker\s*\(pid[^\n]{0,30}(?:killed|exited)", 4),
        _cue(r"shared\s*memory|/dev/shm|\bshm\b|--shm-size|\bipc=host", 1.5),
        _cue(r"bus\s*error|SIGBUS", 2),
        _cue(r"num_workers|data\s*loader\s*worker|dataloader\s*worker", 1),
    ),
    "dataloader": (
        _cue(r"DataLoader\s*timed\s*out|timed\s*out\s*waiting\s*for\s*(?:the\s*)?(?:next\s*)?batch|_next_data|queue\.get", 3),
        _cue(r"data\s*loading|dataloader|data\s*loader|prefetch", 1),
    ),
    "cuda_sync": (
        _cue(r"cuda(?:Stream|Device|Event)Synchronize|torch\.cuda\.synchronize|cuStreamSynchronize", 3),
    ),
    "barrier": (
        _cue(r"(?:dist\.|monitored_)barrier|\bbarrier\s*\(|store\s*based\s*barrier", 2),
        _cue(r"\bbarrier\b", 1),
    ),
    "collective_wait": (
        _cue(r"\ball_?reduce\b|\ball_?gather\w*|\bbroadcast\b|\breduce_?scatter\w*|\ball_?to_?all\b|nccl\w*Kernel", 3),
    ),
    "checkpoint_io": (
        _cue(r"torch\.save|save_checkpoint|saving\s*(?:the\s*)?(?:model|checkpoint)|save_pretrained|checkpoint\w*\s*(?:save|writ)", 2),
    ),
    "compile_lock": (
        _cue(r"waiting\s*for\s*lock|lock\s*file|file\s*lock|acquir\w*\s*(?:the\s*)?lock|torch_extensions|\.lock\b|filelock|cache\s*lock|file_?baton", 3),
    ),
    "gc_collect": (
        _cue(r"gc\.collect|garbage\s*collect", 3),
    ),
    "xid": (
        _cue(r"\bXid\b|fallen\s*off\s*the\s*bus|NVRM", 3),
    ),
    "ecc": (
        _cue(r"\bECC\b|uncorrectable|double[\s-]bit|\bDBE\b|row[\s-]remap\w*|retired\s*pages?", 3),
    ),
}

NARROWER = {
    "illegal_memory_access": ("cuda_error",), "ecc": ("cuda_error", "xid"), "oom": ("cuda_error", "child_failed"),
    "collective_mismatch": ("collective_timeout", "nccl_error", "child_failed"),
    "dataloader_worker_killed": ("dataloader", "child_failed"), "heartbeat_timeout": ("collective_timeout",),
    "loss_scale_collapse": ("loss_nan",), "nccl_error": ("cuda_error",),
}
"""An area whose words, when a text speaks them, also name the wider area's: a text of the
narrower one is read as it, not as the wider ("CUDA error: an illegal memory access")."""

HANG_STACK = frozenset({"cuda_sync", "barrier", "checkpoint_io", "compile_lock", "gc_collect", "collective_wait"})
"""Areas that are a place a run waits, not an error: their cues count only in a text that says it waits."""
_WAITS = re.compile(r"\bstuck\b|\bhang|\bhung\b|\bfreez|\bfrozen\b|deadlock|no\s*progress|\bwaiting\s*(?:in|for|on)\b|acquir\w*\s*(?:the\s*)?lock"
                    r"|卡住|卡在|卡死|死锁", _I)
_CHATTER = re.compile(r"NCCL\s*INFO|^\s*(?:#|//)|site-packages/|\bwarnings\.warn\b"
                      r"|not\s*a\s*failure|(?:can|may)\s*be\s*(?:safely\s*)?ignored|\bharmless\b", _I)
"""Lines whose words are not the failure: NCCL set-up chatter, comments, file paths of frames,
and lines that say themselves they are no failure."""

STACK_RUNBOOKS = {"cuda_sync": "cuda-sync", "barrier": "barrier-hang", "checkpoint_io": "checkpoint-io",
                  "compile_lock": "cpp-extension-lock", "gc_collect": "gc-hang", "collective_wait": "collective-wait",
                  "xid": "gpu-xid"}
"""Runbooks of the areas that are not log error categories."""
_XID_NUMBER = re.compile(r"\bXid\b\D{0,40}?\b(\d{1,3})\b", _I)

MIN_SCORE = 3.0
"""The least score an area needs: one strong cue, or several weak ones that agree."""
MARGIN = 1.0
"""How much the best area must beat the next: a tie names no area."""
_MAX_LINE = 500
"""Characters of a line weighed: a failure's words come early in its line."""
_HEAD, _TAIL = 32_000, 96_000
"""Characters weighed from a text's start and from its end: a log's failure is near its end, a
pasted issue's near its start, and words are no evidence worth scanning megabytes for."""


def _lines(text: str) -> list[str]:
    if len(text) > _HEAD + _TAIL:
        text = text[:_HEAD] + "\n" + text[-_TAIL:]
    return [line[:_MAX_LINE] for line in text.splitlines() if not _CHATTER.search(line)]


def area_scores(text: str) -> dict[str, tuple[float, list[str]]]:
    """Area -> (score, lines holding its cues, strongest cue's line first)."""
    lines = _lines(text)
    waits = any(_WAITS.search(line) for line in lines)
    judged = judged_areas(lines)
    scores: dict[str, tuple[float, list[str]]] = {}
    for category, cues in CUES.items():
        if category in HANG_STACK and not waits or category in judged:
            continue
        total, evidence = 0.0, []
        for pattern, weight, needed in cues:
            hits = list(islice((line for line in lines if pattern.search(line)), needed))
            if len(hits) < needed:
                continue
            hit = hits[0]
            total += weight
            if hit.strip() and hit.strip() not in evidence:
                evidence.append(hit.strip())
        if total:
            scores[category] = (total, evidence)
    return scores


def cue_findings(text: str) -> list[dict]:
    """A low-severity finding for the area whose words a text speaks most, or []."""
    scores = area_scores(text)
    for narrow, wider in NARROWER.items():
        if scores.get(narrow, (0.0,))[0] >= MIN_SCORE:
            for area in wider:
                scores.pop(area, None)
    ranked = sorted(scores.items(), key=lambda kv: -kv[1][0])
    if not ranked:
        return []
    category, (score, evidence) = ranked[0]
    runner_up = ranked[1][1][0] if len(ranked) > 1 else 0.0
    if score < MIN_SCORE or score - runner_up < MARGIN:
        return []
    finding = dict.fromkeys(FINDING_KEYS)
    kind = "stack" if category in HANG_STACK else "xid" if category == "xid" else "error"
    runbook = STACK_RUNBOOKS.get(category) or ERROR_CATEGORIES[category][1]
    finding.update(kind=kind, category=category, severity="low", runbook=runbook,
                   evidence="\n".join(evidence[:3])[:400], source="cues", score=round(score, 1))
    if category == "xid":
        number = _XID_NUMBER.search(text)
        finding["xid"] = int(number.group(1)) if number else None
    return [finding]
