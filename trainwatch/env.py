"""The environment-variable contract between `trainwatch launch`, the node
sidecar and the ranks, declared once.

The launcher sets these for every worker (torchelastic passes its own
environment on) and for the sidecar; ranks and tools read them through the
names below, never through string literals of their own.
"""

from __future__ import annotations

HOME = "TRAINWATCH_HOME"
"""Root of trainwatch's state (default ~/.trainwatch, mode 0700): jobs/<job>/ lives there.
Users set it; the launcher passes its resolved path on to every process of the job."""

JOB = "TRAINWATCH_JOB"
"""The job name. Set by the launcher for ranks; py-spy and signals only ever target
processes whose environment carries this job's name."""

NODE_SCOPE = "TRAINWATCH_NODE_SCOPE"
"""Set for a multi-node job: this node's name. The node's own state (job.json,
telemetry.json, the launch lock, control/) lives under jobs/<job>/nodes/<node>/,
so nodes sharing one TRAINWATCH_HOME never read or take each other's records."""

SLOTS = "TRAINWATCH_SLOTS"
"""Path of the node's shared-memory slot segment; a rank attaches to slot LOCAL_RANK.
Unset: `trainwatch.init()` returns a handle on a private, unread slot."""

INJECT = "TRAINWATCH_INJECT"
"""JSON list of `--inject` fault specs (trainwatch.inject.spec); each rank arms the
ones naming its rank, on the first run of the worker group only."""

CKPT_DIR = "TRAINWATCH_CKPT_DIR"
"""Default checkpoint directory of the integrated trainer (periodic and emergency
checkpoints): jobs/<job>/checkpoints unless the user set it."""

NAN_POLICY = "TRAINWATCH_NAN_POLICY"
"""`launch --nan-policy`: 'fail' (default: a run whose loss goes NaN/inf stops, rolls back
and never ends as succeeded) or 'alert' (trains on; incidents only)."""

TARGETS_DIR = "TRAINWATCH_TARGETS_DIR"
"""Where `launch` lists its exporter for Prometheus file_sd (default $TRAINWATCH_HOME/targets)."""

HISTORY_MAX_BYTES = "TRAINWATCH_HISTORY_MAX_BYTES"
"""Cap of a node's history file for `trainwatch report` (default 8 MiB)."""

# torch's own variables the launcher sets (if unset) for the job.
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
"""PyTorch flight recorder entries per rank: collective sequence numbers per process group."""
FRESH_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""A fresh rendezvous store per restart: with a shared one, a restarted gloo group
reads the previous attempt's addresses and fails to connect (torch 2.13)."""
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchelastic in every worker: restarts this node's agent counted against its budget."""
GENERATION = "TRAINWATCH_GENERATION"
"""The worker group's generation, one more at every re-rendezvous whatever caused it
(a restart here, or another node's: torchelastic does not count those), so every
node of a job agrees on it. Ranks fall back to RESTART_COUNT without it."""

RUN = "TRAINWATCH_RUN"
"""The run's id (one per `trainwatch launch`): records in the job's control files carry it,
and a run only acts on its own."""

LAUNCHER_PID = "TRAINWATCH_LAUNCHER_PID"
"""The launcher's pid: ranks and the sidecar stop when their parent is no longer it."""

PARENT_PID = "TRAINWATCH_PARENT_PID"
"""Set in a worker forked by the warm-start zygote: its parent (the zygote, which
dies with the launcher); ranks stop when their parent is no longer it."""

STORE_BIND = "TRAINWATCH_STORE_BIND"
"""Address rank 0's TCPStore listens on (the launcher sets 127.0.0.1 for a single-node
job): the worker group's store is not reachable from the machine's other addresses."""

JOB_SECRET = "TRAINWATCH_JOB_SECRET"
"""The job's secret (16+ bytes, the same on every node; or `launch --job-secret-file`):
trainwatch's records in a multi-node job's rendezvous store are sealed with it
(trainwatch.jobstore.RecordSeal). The launcher keeps it from the ranks' environment."""
