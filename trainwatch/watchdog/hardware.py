"""GPU hardware health in the sidecar: NVML samples and Xid events, the kernel
log (NVRM Xid lines), and the `xid`/`ecc` fault injections.

Two independent sources on purpose: NVML's event API can miss an Xid the
driver only logs, and the kernel log is read-only for us and may be absent.
Without a GPU or driver this says so once and stays out of the way.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainwatch.diagnostics import kernel_log, xid
from trainwatch.watchdog.aggregates import JOB_LABEL
from trainwatch.watchdog.incident import Incident
from trainwatch.watchdog.nvml import NO_GPU_MESSAGE, NvmlPoller, XidEventWatcher, map_gpus_to_local_ranks

log = logging.getLogger("trainwatch.sidecar")

SAMPLE_INTERVAL_S = 1.0
"""Seconds between NVML samples (metrics and ECC counters)."""
INCIDENT_SEVERITIES = ("high", "critical")
"""Xid severities that raise an incident; lower ones are metrics only."""


# What the driver itself prints for common codes, so an injected line reads
# (and parses) like the real thing.
class KernelLogSource:
    """Follows a kernel log from now on: a file (tests, or a forwarded syslog) or /dev/kmsg."""

    def __init__(self, path: str):
        self.path = path
        self._buf = ""
        self._kmsg = path == "/dev/kmsg"
        flags = os.O_RDONLY | (os.O_NONBLOCK if self._kmsg else 0)
        self.fd = os.open(path, flags)
        # From now on: old Xids are history, not incidents of this job.
        os.lseek(self.fd, 0, os.SEEK_END)

    @classmethod
    def open(cls, path: str | None) -> "KernelLogSource | None":
        candidates = [path] if path else ["/dev/kmsg"]
        for p in candidates:
            try:
                return cls(p)
            except OSError as e:
                if path:
                    log.warning("trainwatch: cannot read kernel log %s (%s)", p, e.strerror)
        return None

    def read_lines(self) -> list[str]:
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:  # /dev/kmsg: EPIPE when records were overwritten; keep going
                continue
            if not chunk:
                break
            if self._kmsg:  # one record per read
                lines.append(chunk.decode("utf-8", "replace").rstrip("\n"))
                continue
            self._buf += chunk.decode("utf-8", "replace")
        if not self._kmsg and "\n" in self._buf:
            *complete, self._buf = self._buf.split("\n")
            lines.extend(complete)
        return lines

    def close(self) -> None:
        os.close(self.fd)


class HardwareMonitor:
    def __init__(self, *, nproc: int, kernel_log_path: str | None, nvml: Any = None, injected: Any = None,
                 out=None, clock=time.monotonic):
        self.clock = clock
        self.out = out
        # Injected faults (`--inject xid/ecc`) bring their own fake GPUs and play
        # the driver's part; production code only ever sees an NVML and a log.
        self.injected = injected
        if nvml is None and injected is not None:
            nvml = injected.nvml
        self.poller = NvmlPoller(nvml)
        self.enabled = self.poller.start()
        if not self.enabled:
            print(f"[trainwatch] {NO_GPU_MESSAGE}", flush=True)
        self.samples: list = []
        self._last_sample = -1e9
        self.gpu_of_local_rank: dict[int, int] = {}
        self.events: "queue.Queue" = queue.Queue()
        self.watcher = None
        if self.enabled:
            self.samples = self.poller.sample()
            self.gpu_of_local_rank = map_gpus_to_local_ranks(self.samples, os.environ.get("CUDA_VISIBLE_DEVICES"), nproc)
            self.watcher = XidEventWatcher(self.poller, self.events.put)
            self.watcher.start()
        self.kernel = KernelLogSource.open(kernel_log_path)
        self.xid_counts: dict[tuple[int, int, str], int] = {}
        """(gpu, xid code, severity) -> events, for trainwatch_gpu_xid_errors_total."""
        self.ecc_seen: dict[int, int] = {}

    @classmethod
    def for_job(cls, config: Any, nproc: int) -> HardwareMonitor:
        """The monitor of a job's node (a SidecarConfig): NVML and the kernel log;
        injected Xid/ECC faults come in as a fake GPU."""
        from trainwatch.inject.hardware import InjectedHardwareFaults

        injected = None
        if config.faults:
            injected = InjectedHardwareFaults(config.faults, nproc=nproc, kernel_log_path=config.kernel_log)
        return cls(nproc=nproc, kernel_log_path=config.kernel_log, injected=injected)

    # ---- mapping -------------------------------------------------------------

    def _gpu_of_pci(self, pci: str | None) -> int | None:
        key = kernel_log.pci_key(pci) if pci else None
        for s in self.samples:
            if key and kernel_log.pci_key(s.pci_bus_id) == key:
                return s.index
        return None

    def _rank_of_gpu(self, gpu: int | None, table) -> tuple[int | None, int | None]:
        if gpu is None:
            return None, None
        local = next((lr for lr, g in self.gpu_of_local_rank.items() if g == gpu), None)
        if local is None or table is None:
            return None, local
        rows = table[table["local_rank"] == local]
        return (int(rows["rank"][0]) if len(rows) else None), local

    # ---- per tick ----------------------------------------------------------------

    def poll_incidents(self, sidecar: Any) -> list[Incident]:
        table = sidecar.last_table
        if self.injected is not None:
            self.injected.apply(table, self)
        found: list[Incident] = []
        now = self.clock()
        if self.enabled and now - self._last_sample >= SAMPLE_INTERVAL_S:
            self._last_sample = now
            try:
                self.samples = self.poller.sample()
            except Exception:
                log.exception("trainwatch: NVML sample failed")
            found.extend(self._ecc_incidents(table, now))
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            found.extend(self._xid_incidents([event], table, now, source="nvml"))
        if self.kernel is not None:
            lines = self.kernel.read_lines()
            if lines:
                events = kernel_log.parse_kernel_log("\n".join(lines))
                found.extend(self._xid_incidents(events, table, now, source="kernel log"))
        return found

    def _xid_incidents(self, events: list, table, now: float, source: str) -> list[Incident]:
        out = []
        if not events:
            return out
        summary = kernel_log.summarize(events) if len(events) > 1 else None
        for e in events:
            if e.code is None:
                continue
            gpu = self._gpu_of_pci(e.pci)
            info = xid.sxid_info(e.code, e.text) if e.is_sxid else xid.lookup(e.code)
            severity = e.severity or info.severity
            if gpu is not None:
                key = (gpu, e.code, severity)
                self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
            if severity not in INCIDENT_SEVERITIES:
                continue
            if summary is not None and summary.most_severe is not None and e is not summary.most_severe:
                continue  # a burst: one incident for its most severe event, naming the root cause
            rank, local = self._rank_of_gpu(gpu, table)
            kind = "ecc" if e.code in xid.ECC_CODES and not e.is_sxid else "xid"
            root = summary.root_cause.code if summary is not None and summary.root_cause is not None else e.code
            where = f"GPU {gpu}" if gpu is not None else f"PCI {e.pci or '?'}"
            who = f"rank {rank}" if rank is not None else "no rank mapped"
            out.append(
                Incident(
                    kind=kind,
                    culprit_ranks=[rank] if rank is not None else [],
                    victims=[],
                    summary=f"Xid {e.code} ({info.name}) on {where} ({who}): {info.meaning}; action: {e.action or info.action}",
                    severity=severity,
                    category=kind,
                    evidence={
                        "xid": e.code, "gpu": gpu, "pci": e.pci, "local_rank": local, "meaning": info.meaning,
                        "action": e.action or info.action, "root_cause": root, "line": e.text, "source": source,
                        "recovery_action": getattr(e, "recovery_action", None),
                    },
                    key=f"{kind}:{gpu}:{e.code}:{e.text}",
                    detected_mono=now,
                )
            )
        return out

    def _ecc_incidents(self, table, now: float) -> list[Incident]:
        out = []
        for s in self.samples:
            count = (s.ecc_volatile_uncorrected or 0)
            prev = self.ecc_seen.get(s.index, count if s.index in self.ecc_seen else 0)
            self.ecc_seen[s.index] = count
            if count > prev:
                rank, local = self._rank_of_gpu(s.index, table)
                who = f"rank {rank}" if rank is not None else "no rank mapped"
                out.append(
                    Incident(
                        kind="ecc",
                        culprit_ranks=[rank] if rank is not None else [],
                        victims=[],
                        summary=f"uncorrectable ECC error on GPU {s.index} ({who}): {count - prev} new, "
                        f"{count} since driver load; action: drain_node if it repeats, else reset_gpu",
                        category="ecc",
                        evidence={"gpu": s.index, "pci": s.pci_bus_id, "local_rank": local, "uncorrected": count,
                                  "new": count - prev, "xid": None, "meaning": "uncorrectable ECC error",
                                  "action": "reset_gpu"},
                        key=f"ecc:{s.index}:{count}",
                        detected_mono=now,
                    )
                )
        return out

    def snapshot(self) -> dict:
        """The last sample of every GPU's utilisation and memory, for telemetry.json
        (what `trainwatch diagnose` reads)."""
        rank_of = {g: lr for lr, g in self.gpu_of_local_rank.items()}
        return {"nvml": self.enabled, "simulated": self.injected is not None,
                "samples": [{"gpu": s.index, "local_rank": rank_of.get(s.index), "utilization_pct": s.utilization_pct,
                             "memory_used_bytes": s.memory_used_bytes, "memory_total_bytes": s.memory_total_bytes}
                            for s in self.samples]}

    # ---- metrics ------------------------------------------------------------------

    def metrics(self, job: str, node: str) -> Iterator:
        # UUID as DCGM exporter spells it, so these series join with its series.
        labels = [JOB_LABEL, "node", "gpu", "rank", "UUID"]
        fams = {
            "util": GaugeMetricFamily("trainwatch_gpu_utilization_ratio", "GPU busy fraction (0-1).", labels=labels),
            "mem": GaugeMetricFamily("trainwatch_gpu_memory_used_bytes", "GPU memory in use.", labels=labels),
            "memt": GaugeMetricFamily("trainwatch_gpu_memory_total_bytes", "GPU memory installed.", labels=labels),
            "temp": GaugeMetricFamily("trainwatch_gpu_temperature_celsius", "GPU temperature.", labels=labels),
            "power": GaugeMetricFamily("trainwatch_gpu_power_watts", "GPU board power draw.", labels=labels),
            "clock": GaugeMetricFamily("trainwatch_gpu_sm_clock_hertz", "GPU SM clock.", labels=labels),
        }
        throttle = GaugeMetricFamily("trainwatch_gpu_throttle", "Active clock throttle reasons (1 = active).",
                                     labels=labels + ["reason"])
        ecc = CounterMetricFamily("trainwatch_gpu_ecc_errors", "ECC errors since driver load.", labels=labels + ["type"])
        # The per-GPU total exists from 0, so increase() counts the first Xid;
        # the per-code series appear with their first event and carry the
        # table's severity, which the alerts page on.
        xids = CounterMetricFamily("trainwatch_gpu_xid_errors", "Xid errors seen by trainwatch.", labels=labels)
        by_code = CounterMetricFamily("trainwatch_gpu_xid_code_errors", "Xid errors seen by trainwatch, by code and severity.",
                                      labels=labels + ["xid", "severity"])
        rank_of = {g: lr for lr, g in self.gpu_of_local_rank.items()}
        for s in self.samples:
            lv = [job, node, str(s.index), str(rank_of.get(s.index, "")), s.uuid or ""]
            for key, value in (("util", None if s.utilization_pct is None else s.utilization_pct / 100.0),
                               ("mem", s.memory_used_bytes), ("memt", s.memory_total_bytes),
                               ("temp", s.temperature_c), ("power", s.power_w),
                               ("clock", None if s.sm_clock_mhz is None else s.sm_clock_mhz * 1e6)):
                if value is not None:
                    fams[key].add_metric(lv, float(value))
            for reason in s.throttle_reasons or ():
                throttle.add_metric(lv + [reason], 1.0)
            if s.ecc_volatile_corrected is not None:
                ecc.add_metric(lv + ["corrected"], float(s.ecc_volatile_corrected))
            if s.ecc_volatile_uncorrected is not None:
                ecc.add_metric(lv + ["uncorrected"], float(s.ecc_volatile_uncorrected))
            total = 0
            for (gpu, code, severity), n in sorted(self.xid_counts.items()):
                if gpu == s.index:
                    by_code.add_metric(lv + [str(code), severity], float(n))
                    total += n
            xids.add_metric(lv, float(total))
        yield from fams.values()
        yield throttle
        yield ecc
        yield xids
        yield by_code

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.poller.shutdown()
        if self.kernel is not None:
            self.kernel.close()
