"""Log rules for the frameworks, schedulers and runtimes around PyTorch: JAX/XLA and its
coordination service, orbax, TensorFlow, Horovod, Ray and verl, PaddlePaddle, MXNet, Caffe2,
Ascend (HCCL, CANN), Slurm, Open MPI and UCX, custom-op builds, the kernel's process faults and
fairseq. Each is a message form as that software prints it, read into the same error
categories as torch's own (findings.ERROR_CATEGORIES). Appended to log_rules.RULES."""

from __future__ import annotations

import re

from trainwatch.diagnostics.line_rule import LineRule, nothing as _nothing, words as _words
from trainwatch.diagnostics.nccl_facts import NCCL_RETURN_CODES

def _kernel_event(m: re.Match[str]) -> dict:
    """A kernel-log event about a process; an Xid read from the same log already accounts for it."""
    return {"kernel_event": True}


FRAMEWORK_RULES: tuple[LineRule, ...] = (
    # -- collectives that timed out or disagree ------------------------------------
    # TensorFlow's collective ops; XLA's in-process rendezvous of GPU threads; Horovod's stall
    # inspector shutting down; Ray Train's NCCL watch.
    LineRule("tf-collective-timeout", "timed out", "collective_timeout", re.compile(
        _words("Collective has timed out")), _nothing),
    LineRule("xla-rendezvous-timeout", "rendezvous", "collective_timeout", re.compile(
        r"Expected\s*\d{1,9}\s*threads\s*to\s*join\s*the\s*rendezvous,\s*but\s*only\s*\d{1,9}\s*of\s*them\s*arrived"),
        _nothing),
    LineRule("horovod-stall-shutdown", "stalled", "collective_timeout", re.compile(
        r"One\s*or\s*more\s*rank\s*\(marked\s*by\s*\"!\"\)\s*is\s*stalled\s*for\s*longer\s*than\s*\d{1,9}\s*seconds"),
        _nothing),
    LineRule("ray-nccl-mismatch", "communicators", "collective_mismatch", re.compile(
        r"\d{1,9}\s*of\s*\d{1,9}\s*communicators\s*have\s*a\s*collective\s*mismatch"), _nothing),
    LineRule("ray-nccl-hang", "nccl hang", "collective_timeout", re.compile(_words("Possible NCCL hang detected!")),
             _nothing),
    # Ranks that called a collective with different shapes or ops (Horovod, Gloo), NCCL's socket
    # transport receiving more than it was sent, fairseq's check of the workers' gradients.
    LineRule("mismatched-collective", "mismatched", "collective_mismatch", re.compile(
        r"Mismatched\s*(?:\w{1,20}\s*tensor\s*shapes|operations|\w{1,20}\s*data\s*types?|\w{1,20}\s*CPU/GPU\s*device"
        r"\s*selection)\s*:\s*One\s*rank"), _nothing),
    LineRule("nccl-message-truncated", "truncated", "collective_mismatch", re.compile(
        r"NCCL\s*WARN.{0,80}?message\s*truncated\s*:\s*receiving\s*\d{1,18}\s*bytes\s*instead\s*of\s*\d{1,18}"), _nothing),
    LineRule("fairseq-inconsistent-grads", "inconsistent", "collective_mismatch", re.compile(
        _words("gradients are inconsistent between workers")), _nothing),
    # -- coordination: JAX's service, Horovod's and Open MPI's launchers --------------
    # JAX's coordination service: a process that never reached the start-up barrier.
    LineRule("jax-barrier-timeout", "deadline_exceeded", "heartbeat_timeout", re.compile(
        r"DEADLINE_EXCEEDED\s*:\s*Barrier\s*timed\s*out"), _nothing),
    LineRule("jax-coordination", "task", "heartbeat_timeout", re.compile(
        r"Task\s*\S{1,200}\s*heartbeat\s*timeout|Failed\s*to\s*connect\s*to\s*distributed\s*JAX\s*controller"
        r"|Failed\s*to\s*send\s*RPC\s*to\s*coordination\s*service|JAX\s*distributed\s*service\s*detected\s*fatal\s*errors"),
        _nothing),
    # ... and its agent giving up on the service, or a task failing to register with it.
    LineRule("xla-coordination-agent", "coordination", "heartbeat_timeout", re.compile(
        r"Coordination\s*service\s*agent\s*in\s*error\s*status|CoordinationService/(?:RegisterTask|Heartbeat)\b"
        r".{0,80}?(?:DEADLINE_EXCEEDED|Deadline\s*Exceeded|UNAVAILABLE)?"), _nothing),
    # NCCL's trace of an error code climbing out of its init or a group call (NCCL_DEBUG=INFO):
    # "init.cc:878 -> 2" is ncclSystemError surfacing, even where its WARN line was cut away (a
    # hint: dropped where the text names the failure).
    LineRule("nccl-error-trace", ".cc:", "nccl_error", re.compile(
        r"NCCL\s*INFO\s*(?:init|group)\.cc:\d{1,5}\s*->\s*(?P<code>[1-6])(?!\d)"),
        lambda m: {"nccl_code": NCCL_RETURN_CODES[int(m.group("code"))]}, role="hint"),
    # A custom op build of NVlabs' dnnlib that never printed "Done.": it waits on the build's lock.
    LineRule("dnnlib-plugin-stuck", "pytorch plugin", "compile_lock", re.compile(
        r"Setting\s*up\s*PyTorch\s*plugin\s*\"[\w.]{1,80}\"\.\.\.\s*$"), _nothing),
    LineRule("jax-tpu-init-slow", "tpu backend", "heartbeat_timeout", re.compile(
        r"TPU\s*backend\s*initialization\s*is\s*taking\s*more\s*than\s*[\d.]{1,8}\s*seconds"), _nothing),
    # Waits at the coordination service's or orbax's barriers: start-up lines (low) and failures.
    LineRule("coordination-barrier-wait", "barrier:", "barrier", re.compile(
        r"#\s*of\s*tasks\s*that\s*reached\s*the\s*barrier:|Waiting\s*at\s*barrier:\s*\w"), lambda m: {"severity": "low"}),
    LineRule("coordination-tasks-wait", "tasks to connect", "barrier", re.compile(
        r"Waiting\s*for\s*\d{1,6}/\d{1,6}\s*tasks\s*to\s*connect"), lambda m: {"severity": "low"}),
    # The coordination service losing a task: heartbeats stopped, a restarted task or leader,
    # a cluster that never registered, a key-value get that timed out.
    LineRule("coordination-task-lost", "task", "heartbeat_timeout", re.compile(
        r"tasks\s*are\s*unhealthy\s*\(stopped\s*sending\s*heartbeats\)|tried\s*to\s*connect\s*with\s*a\s*different\s*incarnation"
        r"|Leader\s*incarnation\s*ID\s*mismatch|cluster\s*registration\s*failed|Task\s*with\s*incarnation\s*id\s*\d{1,24}\s*is\s*not"
        r"\s*connected|GetKeyValue\(\)\s*timed\s*out\s*with\s*key|Polled\s*an\s*error\s*from\s*coordination\s*service"
        r"|The\s*tasks\s*have\s*crashed\.\s*Check\s*the\s*task\s*logs"), _nothing),
    LineRule("coordination-barrier-failed", "barrier", "barrier", re.compile(
        r"Timed\s*out\s*while\s*waiting\s*for\s*\w{1,80}\s*barrier|Shutdown\s*barrier\s*in\s*coordination\s*service\s*has"
        r"\s*failed|Barrier\s*\([\w:]{1,80}\)\s*is\s*invoked\s*by\s*the\s*task,\s*but\s*the\s*service"), _nothing),
    LineRule("jax-no-gpu", "unable to initialize backend", "cuda_error", re.compile(
        r"Unable\s*to\s*initialize\s*backend\s*'(?:cuda|rocm|gpu)':\s*\w"), _nothing),
    LineRule("cuda-dso-mismatch", "dso version", "cuda_error", re.compile(
        r"kernel\s*version\s*[\d.]{1,20}\s*does\s*not\s*match\s*DSO\s*version"), _nothing),
    LineRule("xla-remat-oom", "rematerialization", "oom", re.compile(
        r"Can't\s*reduce\s*memory\s*use\s*below\s*[\d.]{1,12}\s*\w{1,3}\s*\(\d{1,20}\s*bytes\)\s*by\s*rematerialization"), _nothing),
    LineRule("tf-allocator-oom-advice", "tf_gpu_allocator", "oom", re.compile(
        r"If\s*the\s*cause\s*is\s*memory\s*fragmentation\s*maybe\s*the\s*environment\s*variable\s*'TF_GPU_ALLOCATOR"), _nothing),
    LineRule("jax-devices-failed", "processfailureerror", "child_failed", re.compile(
        r"ProcessFailureError:\s*Devices\s*failed"), _nothing),
    LineRule("file-lock-not-acquired", "could not be acquired", "compile_lock", re.compile(
        r"The\s*file\s*lock\s*'[^']{1,300}'\s*could\s*not\s*be\s*acquired"), _nothing),
    # -- Ascend (HCCL, CANN, MindSpore): the same failures in that stack's words ------------
    LineRule("hccl-heartbeat-lost", "heartbeat lost", "heartbeat_timeout", re.compile(r"Heartbeat\s*Lost\s*Occurred"),
             _nothing),
    LineRule("hccl-socket-timeout", "ei0006", "heartbeat_timeout", re.compile(r"EI0006:\s*Getting\s*socket\s*times\s*out"),
             _nothing),
    LineRule("hccl-unique-id", "meta server", "heartbeat_timeout", re.compile(
        r"Failed\s*to\s*fetch\s*the\s*unique\s*id\s*of\s*the\s*collective\s*lib\s*from\s*the\s*meta\s*server"), _nothing),
    LineRule("store-dns-failed", "dns resolution", "heartbeat_timeout", re.compile(
        r"DNS\s*resolution\s*failed:.{0,40}Name\s*or\s*service\s*not\s*known"), _nothing),
    LineRule("hccl-init-failed", "hc", "nccl_error", re.compile(
        r"EJ0001:\s*Failed\s*to\s*initialize\s*the\s*HCCP\s*process|hcom\s*init\s*failed|HcclCommInit\w{0,20}\(.{0,200}\)\s*failed"),
        _nothing),
    LineRule("ascend-device-error", "fail", "cuda_error", re.compile(
        r"EE1001:.{0,80}Set\s*device\s*failed|EE9999\s*Task\s*execute\s*failed|Aicore\s*kernel\s*execute\s*failed"
        r"|aclrt\w{2,40}\(.{0,200}\)\s*failed\s*:\s*\d|SetDevice\s*for\s*id:\d{1,3}\s*failed"), _nothing),
    LineRule("ascend-driver-down", "hdc connect down", "cuda_error", re.compile(r"hdc\s*connect\s*down"), _nothing),
    LineRule("ascend-oom", "malloc device memory failed", "oom", re.compile(_words("Malloc device memory failed")), _nothing),
    LineRule("horovod-start-timeout", "tasks to start", "heartbeat_timeout", re.compile(
        _words("Timed out waiting for tasks to start")), _nothing),
    LineRule("horovod-slots-timeout", "slots", "heartbeat_timeout", re.compile(
        _words("Timed out waiting for minimum number of slots to become available")), _nothing),
    # torchelastic's etcd rendezvous before torch 1.9 ("timed out waiting for all 8 members to join").
    LineRule("etcd-members-join", "members to join", "heartbeat_timeout", re.compile(
        r"timed\s*out\s*waiting\s*for\s*all\s*\d{1,9}\s*members\s*to\s*join"), _nothing),
    # Gloo's TCP transport refused by its peer: the process at that address is gone or not listening.
    LineRule("gloo-connect-refused", "connection refused", "nccl_error", re.compile(
        r"gloo/transport/tcp/pair\.cc:\d{1,5}\]\s*connect\s*\[?[\w.:%-]{1,80}\]?:\d{1,5}:\s*Connection\s*refused"),
        _nothing),
    LineRule("orte-lost-daemon", "lost communication", "heartbeat_timeout", re.compile(
        _words("has lost communication with a remote daemon")), _nothing),
    LineRule("orte-path-lost", "lost to", "heartbeat_timeout", re.compile(
        _words("A critical communication path was lost to")), _nothing),
    LineRule("orte-daemons-not-started", "reliably start", "heartbeat_timeout", re.compile(
        _words("ORTE was unable to reliably start one or more daemons")), _nothing),
    # Horovod's launcher: hosts it cannot reach, its gloo store waiting for a rank's key.
    LineRule("horovod-ssh", "via ssh", "heartbeat_timeout", re.compile(_words("could not connect to some hosts via ssh")),
             _nothing),
    # Paddle's launcher polling peers' endpoints (one line is start-up; many, a peer that never
    # came: worth a look, so low), and Caffe2's store handlers timing out a key.
    LineRule("paddle-endpoints-not-ready", "not ready endpoints", "heartbeat_timeout", re.compile(
        r"not\s*ready\s*endpoints\s*:\s*\[?\s*'?(?P<peer>[\w.:-]{1,80})"),
        lambda m: {"peer": m.group("peer"), "severity": "low"}),
    LineRule("caffe2-store-wait-timeout", "wait timeout", "heartbeat_timeout", re.compile(
        r"Wait\s*timeout\s*(?:after\s*\d{1,9}\s*seconds\s*)?for\s*(?:name|key)\(s\)\s*:"), _nothing),
    # -- NCCL through other frameworks: ncclRemoteError's words wherever they are quoted --
    LineRule("nccl-remote-error-text", "remote process exited", "nccl_error", re.compile(
        _words("remote process exited or there was a network error")), _nothing),
    # -- CUDA set-up --------------------------------------------------------------------
    LineRule("nvrm-api-mismatch", "api mismatch", "cuda_error", re.compile(r"NVRM:\s*API\s*mismatch"), _nothing),
    LineRule("cudnn-version-mismatch", "cudnn", "cuda_error", re.compile(
        r"Loaded\s*runtime\s*CuDNN\s*library:\s*\S+\s*but\s*source\s*was\s*compiled\s*with"), _nothing),
    LineRule("jax-no-cuda", "cuda", "cuda_error", re.compile(
        r"CUDA\s*backend\s*failed\s*to\s*initialize|An\s*NVIDIA\s*GPU\s*may\s*be\s*present\s*on\s*this\s*machine,\s*"
        r"but\s*a\s*CUDA-enabled\s*jaxlib\s*is\s*not\s*installed"), _nothing),
    # The runtime's words from libraries that wrap it (TransformerEngine, NVML, flash-attention,
    # bitsandbytes), and DCGM's NVLink health.
    LineRule("wrapped-cuda-library-error", "error", "cuda_error", re.compile(
        r"\b(?:cuBLAS(?:Lt)?|cuDNN|NVRTC|CUDA\s*Driver)\s*Error\s*:|\b(?i:cutlass\s*error)\s*:|Failed\s*to\s*initialize\s*NVML:\s*Driver/library"
        r"|CUDA\s*SETUP\s*ERROR"), _nothing),
    LineRule("gpu-arch-unsupported", "supports", "cuda_error", re.compile(
        r"only\s*supports\s*(?:Ampere|Turing|Hopper|Volta)\s*GPUs\s*or\s*newer"), _nothing),
    LineRule("dcgm-nvlink", "nvlink", "cuda_error", re.compile(
        r"NvLink\s*link\s*\d{1,3}\s*is\s*currently\s*down|\d{1,9}\s*\w{0,40}\s*NvLink\s*errors\s*on\s*GPU"), _nothing),
    # NCCL refusing ranks built against different NCCL versions.
    LineRule("nccl-version-mismatch", "mismatched", "nccl_error", re.compile(
        _words("NCCL WARN Mismatched NCCL version detected")), _nothing),
    # nvidia-resiliency-ext's rank monitor: a rank that stopped sending heartbeats, a section
    # (a step, a checkpoint) open past its time-out.
    LineRule("nvrx-heartbeat", "heartbeat", "heartbeat_timeout", re.compile(
        r"Did\s*not\s*get\s*(?:subsequent|initial)\s*heartbeat\.\s*Waited\s*\d"), _nothing),
    LineRule("nvrx-section-timeout", "timeout is", "heartbeat_timeout", re.compile(
        r"Section\s*'[^']{1,80}'\s*has\s*been\s*open\s*for\s*[\d.]{1,12}\s*seconds\.\s*Timeout\s*is"), _nothing),
    # Ray-based trainers (verl) noticing a worker actor died; accelerate halving the batch size
    # after each out-of-memory until none is left.
    LineRule("ray-worker-not-alive", "not alive", "child_failed", re.compile(
        r"worker\s*Actor\([^)]{0,120}\)\s*is\s*not\s*alive"), _nothing),
    LineRule("accelerate-batch-size-zero", "executable batch size", "oom", re.compile(
        _words("No executable batch size found, reached zero")), _nothing),
    # MPI's and UCX's transports losing a peer (the MPI analogue of an NCCL network error).
    LineRule("mpi-transport", "mpi", "nccl_error", re.compile(
        r"An\s*MPI\s*communication\s*peer\s*process\s*has\s*unexpectedly\s*disconnected"
        r"|Open\s*MPI\s*failed\s*(?:to\s*TCP\s*connect\s*to\s*a\s*peer\s*MPI\s*process|an\s*OFI\s*Libfabric\s*library\s*call)"
        r"|\*\*\*\s*An\s*error\s*occurred\s*in\s*MPI_\w{2,40}"), _nothing),
    LineRule("ucx-transport", "ucx", "nccl_error", re.compile(
        r"UCX\s*ERROR\s*(?:Transport\s*retry\s*count\s*exceeded|connect\(.{0,120}?\)\s*failed)"), _nothing),
    # Custom CUDA ops (detectron2's, mmcv's deformable convolution) printing the CUDA error they got.
    LineRule("custom-op-cuda-error", "deformable_", "cuda_error", re.compile(
        r"error\s*in\s*(?:modulated_)?deformable_\w{1,40}\s*:\s*(?P<msg>\w[\w ]{2,80})"), _nothing),
    # A build of a C++/CUDA extension that failed (ninja, NVlabs' plugins, ColossalAI's loader).
    LineRule("extension-build-failed", "build", "other", re.compile(
        r"ninja:\s*build\s*stopped:\s*subcommand\s*failed|Failed\s*to\s*build\s*PyTorch\s*extension"
        r"|Error\s*building\s*extension\s*'[\w.]{1,80}'"), _nothing),
    LineRule("plugin-build-failed", "pytorch plugin", "other", re.compile(
        r"Setting\s*up\s*PyTorch\s*plugin\s*\"[\w.]{1,80}\"\.\.\.\s*Failed!"), _nothing),
    # filelock's debug log of a lock held by another process (triton's and DeepSpeed's caches).
    LineRule("filelock-waiting", "not acquired", "compile_lock", re.compile(
        r"Lock\s*\d{1,20}\s*not\s*acquired\s*on\s*\S{1,300}\.lock,\s*waiting"), _nothing),
    # -- memory and processes under a scheduler -----------------------------------------
    # TensorFlow's and XLA's BFC allocator, unless it says the caller survives it.
    LineRule("bfc-oom", "ran out of memory", "oom", re.compile(
        r"Allocator\s*\(\w{1,40}\)\s*ran\s*out\s*of\s*memory\s*trying\s*to\s*allocate"
        r"(?!.{0,200}?caller\s*indicates\s*that\s*this\s*is\s*not\s*a\s*failure)"), _nothing),
    LineRule("tf-init-oom", "status", "oom", re.compile(
        r"CUDA\s*runtime\s*implicit\s*initialization\s*on\s*GPU:\d{1,4}\s*failed\.\s*Status:\s*out\s*of\s*memory"), _nothing),
    LineRule("mxnet-alloc-oom", "memory allocation failed", "oom", re.compile(
        _words("Memory allocation failed out of memory")), _nothing),
    LineRule("slurm-oom", "error", "oom", re.compile(
        r"srun:\s*error:\s*\S+:\s*tasks?\s*[\d,\-]+:\s*Out\s*Of\s*Memory|Detected\s*\d{1,9}\s*oom[_-]kill\s*events?"),
        _nothing),
    LineRule("srun-task-exited", "exited with exit code", "child_failed", re.compile(
        r"srun:\s*error:\s*\S+:\s*tasks?\s*(?P<task>[\d,\-]+):\s*Exited\s*with\s*exit\s*code\s*(?P<exit>\d{1,4})"),
        # The task is a rank only where srun starts one task per rank (not under a per-node launcher).
        lambda m: {"exit_code": int(m.group("exit")), "task": m.group("task")}),
    LineRule("mpi-errors-fatal", "mpi_errors_are_fatal", "child_failed", re.compile(r"\*\*\*\s*MPI_ERRORS_ARE_FATAL"),
             _nothing),
    LineRule("orte-memory-limit", "memory limits", "oom", re.compile(_words("A process exceeded memory limits")), _nothing),
    # Horovod's gloo launcher after one worker failed; ColossalAI's launcher failing on a host.
    LineRule("horovod-terminating", "terminating remaining", "child_failed", re.compile(
        r"Terminating\s*remaining\s*workers\s*after\s*failure\s*of\s*Process\s*(?P<rank>\d{1,9})"),
        lambda m: {"rank": int(m.group("rank"))}),
    LineRule("colossalai-run-failed", "failed to run", "child_failed", re.compile(
        r"Error:\s*failed\s*to\s*run\s*torchrun\b.{0,600}?\bon\s*[\w.-]{1,80},\s*is\s*localhost"), _nothing),
    # The kernel's account of a process: a segfault, a general protection fault, a task stuck
    # in the kernel (I/O, a driver call) for minutes, a CPU locked up. Hints: beside an Xid or
    # an error that names the failure, they are its consequences.
    LineRule("kernel-segfault", "segfault", "other", re.compile(
        r"\bsegfault\s*at\s*[0-9a-f]{1,16}\s*ip\s*[0-9a-f]{1,16}"), _kernel_event, role="hint"),
    LineRule("kernel-general-protection", "general protection", "other", re.compile(
        r"traps:\s*\S{1,80}\s*general\s*protection"), _kernel_event, role="hint"),
    LineRule("kernel-hung-task", "blocked for more than", "other", re.compile(
        r"INFO:\s*task\s*\S{1,80}\s*blocked\s*for\s*more\s*than\s*\d{1,6}\s*seconds"), _kernel_event, role="hint"),
    LineRule("kernel-soft-lockup", "soft lockup", "other", re.compile(r"soft\s*lockup\s*-\s*CPU#\d"), _kernel_event,
             role="hint"),
    LineRule("mpi-abort", "mpi_abort", "child_failed", re.compile(
        r"MPI_ABORT\s*was\s*invoked\s*on\s*rank\s*(?P<rank>\d{1,9})"), lambda m: {"rank": int(m.group("rank"))}),
    LineRule("slurm-time-limit", "time limit", "other", re.compile(
        r"\*\*\*\s*(?:JOB|STEP)\s*\S+\s*ON\s*\S+\s*CANCELLED\s*AT\s*\S+\s*DUE\s*TO\s*TIME\s*LIMIT"), _nothing),
    LineRule("mpi-not-enough-slots", "not enough slots", "other", re.compile(
        _words("There are not enough slots available in the system")), _nothing),
    # A script that does not accept what its launcher passes ("error: unrecognized arguments:
    # --local-rank=0"), or not called with what it needs: a usage error, not a crash.
    LineRule("argparse-usage", "error:", "other", re.compile(
        r"error:\s*(?:unrecognized\s*arguments:|the\s*following\s*arguments\s*are\s*required:)"), _nothing),
    # Caffe and other glog users checking an NCCL call: "Check failed: result == ncclSuccess (2 vs. 0)".
    LineRule("glog-nccl-check", "ncclsuccess", "nccl_error", re.compile(
        r"Check\s*failed:\s*\w{1,40}\s*==\s*ncclSuccess\s*\(\s*(?P<code>\d{1,3})\s*vs\.\s*0\s*\)"),
        lambda m: {"nccl_code": int(m.group("code"))}),
    # -- data loaders: PaddlePaddle's --------------------------------------------------
    LineRule("paddle-dataloader-killed", "dataloader", "dataloader_worker_killed", re.compile(
        r"DataLoader\s*(?:process\s*\(pid\s*\d{1,12}\)\s*exited\s*(?:is\s*killed\s*by\s*signal|unexpectedly)"
        r"|\d{1,6}\s*workers?\s*exit\s*unexpectedly)"), _nothing),
    LineRule("paddle-dataloader-reader", "reader thread", "dataloader", re.compile(
        _words("DataLoader reader thread failed to read data")), _nothing),
)

ANCHOR_WORDS = (
    "timed out", "rendezvous", "stalled", "communicators", "nccl hang", "mismatched", "truncated", "inconsistent",
    "heartbeat", "coordination", "jax", "tasks to start", "lost communication", "remote process exited",
    "api mismatch", "cudnn", "cuda backend", "cuda-enabled", "memory", "oom_kill", "oom-kill", "exited with exit code",
    "mpi_abort", "time limit", "not enough slots", "dataloader", "reader thread", "deadline_exceeded", "error",
    "ncclsuccess", "not ready endpoints", "wait timeout", "supports", "nvlink", "mismatched", "not alive",
    "executable batch size", "timeout is", "setup error", "cutlass", ".cc:", "pytorch plugin", "slots",
    "members to join", "connection refused", "lost to", "reliably start", "via ssh", "mpi communication", "open mpi failed",
    "error occurred in mpi_", "ucx", "deformable_", "build stopped", "failed to build", "error building extension",
    "not acquired", "mpi_errors_are_fatal", "memory limits", "terminating remaining", "failed to run", "segfault",
    "general protection", "blocked for more than", "soft lockup", "tpu backend", "barrier:", "barrier in coordination",
    "barrier (", "waiting for async", "unable to initialize backend",
    "rematerialization", "tf_gpu_allocator", "processfailureerror", "could not be acquired", "times out", "heartbeat lost",
    "meta server", "dns resolution", "ei0006", "hccp", "hcom init", "hcclcomminit", "set device failed", "task execute failed",
    "kernel execute failed", "hdc connect down", "tasks to connect", "unhealthy", "incarnation", "registration failed",
    "getkeyvalue", "polled an error", "tasks have crashed", "dso version", "aclrt", "setdevice for id", "malloc device memory failed",
)
"""Words one of whose lower-cased forms every FRAMEWORK_RULES message holds (log_rules' pre-filter)."""
