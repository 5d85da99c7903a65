"""Frame rules: the building blocks the hang catalog (catalog.py) is written in.

A `FrameRule` names one frame (a regex on its function, one on its file); the
rule sets below name the frames of collectives, barriers, checkpoint code and
the data loader wherever they appear, and USER_CODE names the user's own
files. The catalog combines them into patterns; collective_ops.py reuses
DIST_FILE to tell a distributed `gather` from DataParallel's.

Everything here is pure: regex strings and a frozen dataclass.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from trainwatch.diagnostics.stacks import Frame


@functools.cache
def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@dataclass(frozen=True, slots=True)
class FrameRule:
    """A frame that must appear somewhere in the stack (both regexes on the same frame)."""

    function: str | None = None
    """Regex searched in the frame's function name; None accepts any function."""
    file: str | None = None
    """Regex searched in the frame's file or library; None accepts any file."""

    def matches(self, frame: Frame) -> bool:
        """True if this frame satisfies both regexes."""
        if self.function is not None and not _rx(self.function).search(frame.function):
            return False
        # Windows tracebacks use backslashes; the regexes are written with '/'.
        return self.file is None or bool(_rx(self.file).search(frame.file.replace("\\", "/")))


# Files of torch.distributed and the frameworks that wrap it; collective_ops.py uses it too.
DIST_FILE = r"(?:^|/)(?:torch/distributed/|deepspeed/comm/|megatron/|colossalai/)|_functional_collectives"
# Names that are collectives wherever they appear.
_STRONG_OP = (r"(?i)(?:^|[.:])_?(?:all_?reduce|all_?gather|reduce_?scatter|all_?to_?all)\w*"
              r"(?:$|\(|::\w+(?:$|\())")  # a function, or a method of a collective's class (AllgatherPlugin::enqueue)
# Names that are collectives only inside torch.distributed and friends (DataParallel has a `gather` too).
_WEAK_OP = (r"(?:^|[.:])_?(?:broadcast\w*|reduce|gather\w*|scatter\w*|send|recv|isend|irecv|"
            r"batch_isend_irecv)(?:$|\()")

COLLECTIVE_RULES = (
    FrameRule(function=_STRONG_OP),
    FrameRule(function=_WEAK_OP, file=DIST_FILE),
    FrameRule(function=r"(?:^|[.:])(?:_wait_for_work|wait_tensor|_wait_all|wait)$",
              file=r"(?:^|/)torch/distributed/(?!elastic/)"),
    FrameRule(function=r"^c10d::(?:\w+::)*\w*Work\w*::wait"),
    # Native c10d frames, except the watchdog/heartbeat threads every NCCL process has.
    FrameRule(function=r"^c10d::ProcessGroup\w*::(?!.*(?:[Ww]atchdog|[Hh]eartbeat|[Mm]onitor))"),
    FrameRule(function=r"^gloo::"),
    FrameRule(function=r"^nccl[A-Z]\w*"),
)
BARRIER_RULES = (
    FrameRule(function=r"(?:^|[.:])_?(?:monitored_barrier|barrier)(?:$|\()"),
)
CHECKPOINT_RULES = (
    FrameRule(file=r"(?:^|/)torch/distributed/checkpoint/"),
    FrameRule(file=r"(?:^|/)dist_checkpointing/"),
    FrameRule(file=r"(?:^|/)torch/serialization\.py$"),
    FrameRule(function=r"(?i)(?:^|[._])(?:save|load)_(?:checkpoint|state_dict|sharded\w*|model|pretrained|state)$"),
    FrameRule(function=r"(?i)(?:^|[._])(?:save|load)_?ckpt\w*$"),
)
DATALOADER_RULES = (
    FrameRule(function=r"(?:^|[.])(?:__next__|_next_data|_get_data|_try_get_data)$",
              file=r"(?:^|/)torch/utils/data/dataloader\.py$"),
    FrameRule(function=r"(?:^|[.])fetch$", file=r"(?:^|/)torch/utils/data/_utils/fetch\.py$"),
)
DATA_MODULE_RULE = FrameRule(file=r"(?i)(?:^|/)[\w.-]*data_?loader[\w.-]*\.py$")
"""A module named for a data loader, any project's ("torch_dataloader.py", "data_loader.py")."""
# A DataLoader worker process (torch's and torchdata's): its main function, and a wait on
# the multiprocessing queue that carries it indices (`index_queue.get`) inside worker code.
_WORKER_FILE = r"(?:^|/)(?:torch/utils/data/_utils/worker\.py|torchdata/(?:\w+/)*worker\.py)$"
DATALOADER_WORKER_RULES = (
    FrameRule(function=r"(?:^|[.])_worker_loop$", file=r"(?:^|/)(?:torch/utils/data/|torchdata/)|(?:^|/)worker\.py$"),
    FrameRule(file=_WORKER_FILE),
)
QUEUE_WAIT_RULES = (
    FrameRule(function=r"(?:^|[.])(?:get|_poll|poll|wait|recv\w*|_recv\w*)$",
              file=r"(?:^|/)multiprocessing/(?:queues|connection|synchronize)\.py$"),
)
_LIBRARIES = (
    "torch", "deepspeed", "megatron", "transformers", "accelerate", "triton", "numpy", "apex",
    "lightning", "pytorch_lightning", "nemo", "vllm", "sglang", "zmq", "tqdm", "ray", "threading",
    "queue", "selectors", "socket", "subprocess", "asyncio", "concurrent", "multiprocessing", "ssl",
    "http", "urllib", "logging", "json", "pickle", "copy", "importlib", "runpy", "contextlib",
    "functools", "typing", "weakref", "time", "os", "posixpath", "_weakrefset", "codecs", "io",
    "zipfile", "tempfile", "shutil", "signal", "traceback", "inspect", "enum", "abc", "collections",
    "dataclasses", "re", "warnings", "gc", "filelock", "safetensors", "huggingface_hub",
)
# User code: a .py file that is not installed, not the standard library and not a known framework.
USER_CODE = (r"^(?!<)(?!.*(?:site-packages|dist-packages|/lib/python\d))"
             r"(?!(?:.*/)?(?:" + "|".join(_LIBRARIES) + r")(?:/|\.py$)).*\.py$")
