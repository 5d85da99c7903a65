"""Log rules for torch's own messages outside the store, NCCL and CUDA families of log_rules.py:
DDP's checks that every rank built the same model, CUDA initialisation as torch reports it,
the monitored barrier's failures, and the elastic agent's exit barrier. Taken from torch's
source across its 1.x and 2.x releases. Appended to log_rules.RULES, before the process rules."""

from __future__ import annotations

import re

from trainwatch.diagnostics.line_rule import LineRule, nothing as _nothing, words as _words

TORCH_RULES: tuple[LineRule, ...] = (
    # -- ranks that built different models: a desync before the first collective ---------
    LineRule("ddp-model-mismatch", "ddp expects same model", "collective_mismatch", re.compile(
        r"DDP\s*expects\s*same\s*model\s*across\s*all\s*ranks,\s*but\s*Rank\s*(?P<rank>\d{1,9})\s*has\s*\d{1,12}\s*params"),
        lambda m: {"rank": int(m.group("rank"))}),
    LineRule("ddp-param-size-mismatch", "appears not to match", "collective_mismatch", re.compile(
        r"in\s*this\s*process\s*with\s*sizes\s*\[[\d,\s]{0,80}\]\s*appears\s*not\s*to\s*match\s*sizes\s*of\s*the\s*same"
        r"\s*param\s*in\s*process\s*\d"), _nothing),
    # -- CUDA as torch finds it at start-up ---------------------------------------------
    LineRule("torch-cuda-init", "cuda", "cuda_error", re.compile(
        r"CUDA\s*initialization:\s*CUDA\s*unknown\s*error|Cannot\s*re-initialize\s*CUDA\s*in\s*forked\s*subprocess"
        r"|with\s*CUDA\s*capability\s*sm_\d{2,3}\s*is\s*not\s*compatible\s*with\s*the\s*current\s*PyTorch\s*installation"
        r"|Attempting\s*to\s*deserialize\s*object\s*on\s*a\s*CUDA\s*device\s*but\s*torch\.cuda\.is_available\(\)\s*is\s*False"),
        _nothing),
    LineRule("lightning-no-gpus", "gpus requested", "cuda_error", re.compile(
        _words("GPUs requested but none are available")), _nothing),
    # -- barriers that name who did not come ----------------------------------------------
    # monitored_barrier's other failures (log_rules reads "Ranks N failed to pass"): a rank
    # that timed out in it, and one that reached it but lost the rank it waited for.
    LineRule("monitored-barrier-timeout", "monitoredbarrier", "collective_timeout", re.compile(
        r"Rank\s*(?P<rank>\d{1,9})\s*timed\s*out\s*in\s*monitoredBarrier\s*after\s*\d{1,12}\s*ms"),
        lambda m: {"reported_by": int(m.group("rank"))}),
    LineRule("monitored-barrier-peer-error", "monitoredbarrier", "collective_timeout", re.compile(
        r"successfully\s*reached\s*monitoredBarrier,\s*but\s*received\s*errors\s*while\s*waiting\s*for\s*send/recv"
        r"\s*from\s*rank\s*(?P<rank>\d{1,9})"), lambda m: {"rank": int(m.group("rank")), "ranks": [int(m.group("rank"))]}),
    # The elastic agent waiting at its exit barrier for the other nodes' agents to finish.
    LineRule("elastic-exit-barrier", "exit barrier", "barrier", re.compile(
        _words("Error waiting on exit barrier")), _nothing),
)

ANCHOR_WORDS = (  # words one of which every TORCH_RULES message holds (log_rules' pre-filter)"ddp expects same model", "appears not to match", "cuda", "monitoredbarrier", "exit barrier",
                "gpus requested", "exit with status code", "deadlock detected", "pin memory thread")
"""... and the process rules' newer needles (that module has no anchor table of its own)."""
