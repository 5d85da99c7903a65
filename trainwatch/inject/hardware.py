"""Injected GPU faults (`--inject xid:code=79`, `--inject ecc`): a fake NVML for
the hardware monitor to poll, and NVRM Xid lines written into the kernel-log
file the monitor follows (never the machine's real kernel log). The monitor
finds them exactly as it would find the real thing."""

from __future__ import annotations

import logging
import time

from trainwatch.diagnostics import xid
from trainwatch.inject.fake_nvml import FakeNvml
from trainwatch.inject.faults import mark_fired
from trainwatch.inject.spec import HARDWARE_KINDS, FaultSpec

log = logging.getLogger("trainwatch.sidecar")

DRIVER_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1c_2e000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 0.",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    74: "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL).",
}


class InjectedHardwareFaults:
    """Hardware faults armed for one node's sidecar."""

    def __init__(self, faults: list[dict], *, nproc: int, kernel_log_path: str | None):
        self.faults = [f for f in faults if f.get("kind") in HARDWARE_KINDS]
        self.fired: set[int] = set()
        self.kernel_log_path = kernel_log_path
        self.nvml = FakeNvml(gpu_count=max(1, nproc))
        for gpu in self.nvml.gpus:
            gpu.throttle_mask = 0x1  # what an idle GPU reports: the ranks compute on the CPU

    def apply(self, table, monitor) -> None:
        """Fire the faults whose step the culprit rank has reached."""
        if not self.faults or table is None or not len(table):
            return
        for i, f in enumerate(self.faults):
            if i in self.fired:
                continue
            rows = table[table["rank"] == f.get("rank", 1)]
            if not len(rows) or int(rows["step"][0]) + 1 < f.get("step", 5):
                continue
            self.fired.add(i)
            mark_fired(FaultSpec(f["kind"], f.get("rank", 1), f.get("step", 5), dict(f.get("params", {}))),
                       f.get("rank", 1), int(rows["step"][0]) + 1)
            local = int(rows["local_rank"][0])
            gpu = monitor.gpu_of_local_rank.get(local, local)
            if f["kind"] == "ecc":
                self.nvml.inject_ecc(gpu, uncorrected=1)
            elif f["kind"] == "xid":
                self._append_xid_line(monitor, gpu, int(f.get("params", {}).get("code", 79)), int(rows["pid"][0]))

    def _append_xid_line(self, monitor, gpu: int, code: int, pid: int) -> None:
        if not self.kernel_log_path:
            log.warning("trainwatch: xid injection needs a kernel-log file (--kernel-log); skipped")
            return
        pci = next((s.pci_bus_id for s in monitor.samples if s.index == gpu), f"0000:{0x3b + gpu * 0x10:02x}:00.0")
        bus = pci.rsplit(".", 1)[0]
        ts = time.monotonic()
        text = DRIVER_TEXT.get(code) or xid.lookup(code).meaning
        line = f"[{ts:12.6f}] NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name=python, {text}\n"
        with open(self.kernel_log_path, "a") as f:
            f.write(line)
