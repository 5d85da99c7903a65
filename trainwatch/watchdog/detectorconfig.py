"""The detectors' settings: every threshold of every detector, one typed
config each, gathered in `DetectorsConfig` (a section of the sidecar's
`SidecarConfig`). They live apart from the detectors' code so the launcher,
which generates its watchdog flags from them, imports no detector (nor numpy's
work of a tick); each detector module takes its config from here. Where each
numeric setting may lie is one table beside SidecarConfig (`config.RANGES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwatch.diagnostics.culprit import FLOOR_S, HEARTBEAT_STALE_S, K


@dataclass(kw_only=True, slots=True)
class ExitConfig:
    """Settings of the exit detector."""

    teardown_signals: tuple[str, ...] = ("SIGTERM", "SIGKILL")
    """Signals the launcher uses to stop surviving ranks after a failure (signal names)."""
    collateral_s: float = 30.0
    """After a failure, exits by a teardown signal within this time are its consequences (s)."""


@dataclass(kw_only=True, slots=True)
class ProcessStateConfig:
    """Settings of the process-state detector."""

    confirm_s: float = 0.3
    """A rank must be seen stopped or a zombie for this long before it is reported: a
    worker that ends normally is reaped within the agent's 0.1 s poll (s)."""


LEARNT_PHASES = ("data", "forward", "optimizer", "compute", "checkpoint", "eval")
"""Phases whose length can be learnt: not init (warm-up has its own allowance) and
not the phases that wait on peers (how long a wait lasts is another rank's doing)."""


@dataclass(kw_only=True, slots=True)
class HangConfig:
    """Thresholds of the hang detector."""

    floor_s: float = FLOOR_S
    """Minimum time without progress before a rank counts as hung (s)."""
    k: float = K
    """A rank is hung after k x the p99 of its recent step times, when longer than floor_s (factor)."""
    history: int = 50
    """Recent step times kept per rank for that p99 (steps)."""
    warmup_s: float = 120.0
    """Allowance before a rank's first completed step: compilation, autotuning, first collectives (s)."""
    slow_phase_s: float = 60.0
    """Allowance while the rank itself is in an init, checkpoint or eval phase (s)."""
    busy_s: float = 300.0
    """Allowance for a rank outside any phase marker that keeps computing (CPU time advancing,
    heartbeat alive) while no peer waits for it (s)."""
    busy_grace_s: float = 15.0
    """How long a rank its peers wait on may keep computing (CPU time advancing, no I/O) before a hang
    called by the steady job's threshold alone restarts the job: an evaluation or a metric on one rank
    passes, a rank spinning in a loop is restarted then (while its I/O moves: the slow-phase allowance) (s)."""
    active_cpu: float = 0.2
    """CPU use, in cores, at or above which a rank counts as working (fraction of a core)."""
    active_io_bytes_s: float = 1e6
    """I/O rate at or above which a rank counts as working, e.g. writing a checkpoint (bytes/s)."""
    heartbeat_stale_s: float = HEARTBEAT_STALE_S
    """Heartbeat age meaning the rank holds the GIL or is stopped; the sampler beats every 0.2 s (s)."""
    learn_phases: tuple[str, ...] = ("checkpoint", "eval")
    """Phases whose hang threshold is learnt from how long they last, kept in the job's thresholds.json
    (phase names among data, forward, optimizer, compute, checkpoint, eval; empty: none). The step
    phases are opt-in: an epoch's first batch (DataLoader workers starting) is far longer than the
    others and looks idle, which a learnt data threshold would take for a hang."""
    phase_factor: float = 3.0
    """A rank not visibly working is hung after phase_factor x the learnt p99 length of its phase, when
    longer than floor_s and shorter than its fixed threshold (factor)."""
    phase_min_samples: int = 10
    """Times a phase must be seen ending before its learnt threshold replaces the fixed one (count)."""
    phase_history: int = 64
    """Recent lengths kept per rank and phase for that p99 (count)."""
    steady_floor_s: float = 1.5
    """Least time without progress after which a rank of a steady job (every training step so far short and
    regular) is hung while its peers wait on it: max(this, k x the job's step p99, 2 x its longest step),
    in force only under floor_s (s; 0 turns it off)."""
    steady_min_steps: int = 20
    """Training steps every rank must complete before the job's steady threshold applies (steps)."""
    other_work_late_s: float = 1.0
    """Forward-only progress (a no_grad block, not a batch fetch) this long after a step began, and
    3 x the rank's median step, makes the step other work (a rollout): kept out of the step history (s)."""

    def __post_init__(self) -> None:
        phases = self.learn_phases
        bad = [p for p in phases if not isinstance(p, str) or p not in LEARNT_PHASES] \
            if isinstance(phases, (tuple, list)) else [phases]
        if bad:
            raise ValueError(f"--hang-learn-phases must name phases among {', '.join(LEARNT_PHASES)}; "
                             f"got {', '.join(map(repr, bad))}")


@dataclass(kw_only=True, slots=True)
class CollectiveMismatchConfig:
    """Settings of the collective mismatch detector."""

    live_counts: bool = True
    """Compare end-of-step collective counts across ranks; turn off when ranks legitimately
    issue different collectives on the default group (e.g. some pipeline schedules) (flag)."""
    persist_steps: int = 3
    """Consecutive compared steps the same ranks must disagree in the same direction (steps)."""
    stall_s: float = 4.0
    """Time without a completed step before parked ranks' sequence numbers are compared (s); a
    steady job's own hang threshold (the hang detector's `threshold_steady`) instead when shorter."""
    stall_factor: float = 4.0
    """...and at least this multiple of the rank's last step time, so long steps are not stalls (factor)."""
    settle_s: float = 1.5
    """Sequence numbers must be unchanged this long before they are compared (s)."""
    settle_rounds: int = 3
    """...and re-read unchanged by this many later sampler rounds of the rank (heartbeats), so a
    snapshot its sampler took before it moved on (a starved sampler thread) is never compared (rounds)."""
    round_min_s: float = 0.3
    """Of a rank that publishes no CPU time: heartbeats closer than this may be one sample seen twice
    (the multi-node aggregator rebases a node's times with a fresh offset on every summary): they
    count as one round (s). A rank's CPU time tells a new sample from a re-read one at once."""
    heartbeat_stale_s: float = 2.0
    """A rank whose heartbeat is older holds the GIL or is stopped; it is hung, not desynced (s)."""


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """Thresholds of the straggler detector."""

    window: int = 10
    """Recent steps over which each rank's compute is compared with its peers' at the same steps (steps)."""
    min_steps: int = 5
    """Steps a rank needs in its window, each with a peer's compute at the same step, before it is compared (steps)."""
    ratio: float = 1.5
    """Minimum slowdown: the rank's compute / its peers' median at the same step, median over the window (factor)."""
    z: float = 3.0
    """Minimum median excess over the peers (compute time, or lateness at collectives), in robust
    standard deviations of the jitter (the ranks' median MAD of their excess over the window)
    (sigmas): under CPU contention the scheduler slows ranks by turns, the jitter grows and so
    does the margin."""
    persist: int = 5
    """Consecutive evaluations (one per new group step; for arrival order, one per newly compared
    collective) a rank must be slow before it is reported."""
    persist_s: float = 2.0
    """Minimum wall-clock time the `persist` slow evaluations must span (s): on fast steps they
    take a fraction of a second, shorter than a scheduler's imbalance between ranks lasts."""
    min_excess_s: float = 0.05
    """Minimum absolute extra compute per step over the peers' median (s): on small,
    fast steps OS scheduling noise alone reaches 1.5x, and costs nothing."""
    arrivals: bool = True
    """Use collective arrival order (the flight recorder's per-collective times) where ranks publish
    it, before compute time; off: compute time only (flag)."""
    arrival_window: int = 10
    """Recent collectives of the default group, each reached by at least two ranks, over which
    each rank's arrival is compared with its peers' at the same collective (collectives)."""
    arrival_min_collectives: int = 5
    """Collectives a rank needs in that window, each with a peer's arrival, before it is judged (collectives)."""
    arrival_min_lateness_s: float = 0.05
    """Minimum median lateness: the rank's arrival minus its peers' median arrival at the same
    collective, median over the window (s)."""
    arrival_last_fraction: float = 0.6
    """Minimum fraction of the rank's compared collectives at which it arrived last of all (0-1)."""


LOSS_HEALTH_MODES = ("auto", "off", "nan-only", "full")


@dataclass(kw_only=True, slots=True)
class LossHealthConfig:
    """Thresholds of the loss health detector."""

    history: int = 50
    """Recent finite values per rank forming its baseline (steps)."""
    min_steps: int = 20
    """Values a rank needs before spikes and explosions are judged; early steps are honestly wild (steps)."""
    spike_mad_k: float = 6.0
    """A spike exceeds the baseline median by more than this many median absolute deviations (MADs)."""
    spike_factor: float = 2.0
    """...and is more than this multiple of the baseline median, far above normal 10-20% noise (factor)."""
    grad_norm_floor: float = 100.0
    """Grad norms up to this are never an explosion (healthy range is about 0.1-10) (norm)."""
    grad_norm_factor: float = 10.0
    """An explosion exceeds this multiple of the rank's median grad norm (factor)."""
    health: str = "auto"
    """Which loss rules apply: off, nan-only (NaN/Inf only), full (also spikes, exploding grads and
    the loss trend), or auto: full for a loss declared with tw.step() or by the integrated trainer,
    nan-only for an unmodified script's (whatever backward() ran on) (mode)."""

    def __post_init__(self) -> None:
        if self.health not in LOSS_HEALTH_MODES:
            raise ValueError(f"--loss-health must be one of {', '.join(LOSS_HEALTH_MODES)}; got {self.health!r}")


@dataclass(kw_only=True, slots=True)
class TrainingHealthConfig:
    """Thresholds of the training health detector (gradients, learning rate, loss scale)."""

    dead_grad_steps: int = 5
    """Steps in a row with a gradient norm of exactly 0 (or every gradient element zero) that make dead gradients (steps)."""
    vanishing_frac: float = 0.5
    """Fraction of gradient elements exactly zero above which gradients are vanishing; healthy is under 0.05 (fraction)."""
    vanishing_steps: int = 50
    """...held for this many steps in a row (steps)."""
    lr_grace_steps: int = 10
    """Steps at the start of training where a learning rate of 0 is an honest warmup start (steps)."""
    lr_zero_steps: int = 20
    """A learning rate of exactly 0 for this many steps past the grace steps is stuck (steps)."""
    lr_max_ratio: float = 10.0
    """After a warmup, a learning rate exactly at its peak for more than this multiple of the warmup's length
    is stuck at its maximum (low severity: constant and warmup-stable-decay schedules look the same); 0 turns
    this check off (factor)."""
    lr_max_min_steps: int = 1000
    """...and for at least this many steps (steps)."""
    scale_halvings: int = 6
    """A loss scale that fell by 2^this within scale_window_steps and stayed down has collapsed (halvings)."""
    scale_window_steps: int = 200
    """Steps over which the loss scale's fall is measured (steps)."""
    scale_grace_steps: int = 100
    """First steps of a process in which GradScaler calibrates down from its initial scale; they set no
    reference for a fall (steps)."""
    scale_floor: float = 1.0
    """A loss scale below this, after being at or above it, has collapsed whatever the window (scale)."""


@dataclass(kw_only=True, slots=True)
class LossTrendConfig:
    """Thresholds of the loss trend detector."""

    window_steps: int = 500
    """Steps a rising trend is measured over; the first judgement needs most of one window (steps)."""
    points: int = 16
    """Buckets a window is summarised in, each the mean loss of window/points steps (points per rank)."""
    rise_frac: float = 0.2
    """A fitted rise of at least this fraction of the loss's level over the window is a rising loss (fraction)."""
    min_tau: float = 0.4
    """...when the points agree: Kendall's tau of the window at least this (0-1)."""
    plateau_window_steps: int = 2000
    """Steps without improvement that make a plateau; 0 turns plateau detection off (steps)."""
    plateau_frac: float = 0.005
    """A plateau improves the loss by less than this fraction of its level over its window (fraction)."""
    max_ranks_per_tick: int = 64
    """Most ranks whose trend is fitted in one tick; the others wait for the next tick (ranks)."""


@dataclass(kw_only=True, slots=True)
class StepTimeConfig:
    """Thresholds of the step time spike detector."""

    history: int = 32
    """Recent steps per rank forming its usual step and phase times (samples)."""
    min_samples: int = 20
    """Samples a rank needs before its steps are judged; the first steps are honestly slow (samples)."""
    factor: float = 3.0
    """A spike takes at least this multiple of the rank's median step time (factor)."""
    min_excess_s: float = 1.0
    """...and at least this many seconds more (s)."""
    hold_s: float = 60.0
    """A spike episode lasts this long after its last slow step, so recurring slow steps are one incident (s)."""
    stall_grace_s: float = 3.0
    """Spikes of ranks that only waited are held back this long for a culprit or an honest pause to explain them (s)."""
    stall_alerts: bool = True
    """Report spikes where every slow rank only waited (a communication stall or a slow rank elsewhere)."""
    node_grace_s: float = 1.0
    """Culprits are held this long so every rank of their node is judged: a node whose ranks all
    slowed at once is one node-level observation, not a rank alert (s)."""
    stall_min_excess_s: float = 5.0
    """...when they waited at least this many seconds more than usual: shorter waits with no culprit are
    routine on a busy host (s)."""


@dataclass(kw_only=True, slots=True)
class DetectorsConfig:
    """Configuration of every registered detector."""

    exits: ExitConfig = field(default_factory=ExitConfig)
    """Crash detection from rank exits."""
    process_state: ProcessStateConfig = field(default_factory=ProcessStateConfig)
    """Stopped and zombie rank processes, from the kernel's process state."""
    hang: HangConfig = field(default_factory=HangConfig)
    """Hang detection from step progress and heartbeats."""
    collective_mismatch: CollectiveMismatchConfig = field(default_factory=CollectiveMismatchConfig)
    """Collective desync detection from collective counts and sequence numbers."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Straggler detection from per-rank compute time."""
    loss_health: LossHealthConfig = field(default_factory=LossHealthConfig)
    """NaN, loss spike and grad explosion detection."""
    training_health: TrainingHealthConfig = field(default_factory=TrainingHealthConfig)
    """Dead and vanishing gradients, a stuck learning rate, a collapsing fp16 loss scale."""
    loss_trend: LossTrendConfig = field(default_factory=LossTrendConfig)
    """A rising loss or a loss plateau, from a robust fit over a long window."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """Step time spikes, attributed to a phase and split into culprits and ranks that waited."""
    disabled: tuple[str, ...] = ()
    """Detector names to leave out (names as in REGISTRY)."""

