"""The hang-pattern catalog: table integrity, one positive case per pattern, priorities."""

from __future__ import annotations

import re

import pytest

from trainwatch.diagnostics import catalog
from trainwatch.diagnostics.catalog import (
    CATEGORIES,
    PATTERNS,
    classify,
    interesting_thread,
    match_stack,
    match_thread,
    pattern_by_id,
)
from trainwatch.diagnostics.collective_ops import collective_op
from trainwatch.diagnostics.runbooks import runbook_path
from trainwatch.diagnostics.stacks import Frame, ProcessStack, ThreadStack


def thread(*frames, name="MainThread", active=None, exception=None):
    return ThreadStack("1", name, tuple(Frame(*f) for f in frames), active, None, exception)


def process(*threads):
    return ProcessStack(1, 0, None, tuple(threads))


def pattern_of(*frames, **kw):
    match = match_thread(thread(*frames, **kw))
    return match.pattern.id if match else None


# --- the table -------------------------------------------------------------------------

def test_table_integrity():
    ids = [p.id for p in PATTERNS]
    assert len(ids) == len(set(ids))
    for p in PATTERNS:
        assert p.category in CATEGORIES, p.id
        assert p.title and p.meaning, p.id
        assert p.signatures and all(sig.all_of for sig in p.signatures), p.id
        for sig in p.signatures:
            for rule in sig.all_of:
                for rx in (rule.function, rule.file):
                    if rx is not None:
                        re.compile(rx)
        assert runbook_path(p.runbook).is_file(), p.runbook
    assert PATTERNS[-1].id == "compute-spin"  # the catch-all comes last


def test_every_stack_category_has_a_pattern():
    assert {p.category for p in PATTERNS} == set(CATEGORIES)


def test_pattern_by_id():
    assert pattern_by_id("barrier").category == "barrier"
    assert catalog.get("barrier") is pattern_by_id("barrier")
    assert catalog.get("nope") is None and catalog.get(None) is None
    with pytest.raises(ValueError, match="known: gc-collect"):
        pattern_by_id("nope")


# --- one stack per pattern ---------------------------------------------------------------

C10D = "torch/distributed/distributed_c10d.py"
STEP = ("train_step", "train.py", 40)

POSITIVE = [
    ("gc-collect", [("gc_collect_main", "libpython3.11.so"), ("Trainer.step", "train.py", 3)]),
    ("gc-collect", [("<gc>", "gc"), STEP]),
    ("gc-collect", [("on_train_batch_end", "nemo/lightning/pytorch/callbacks/garbage_collection.py", 54), STEP]),
    ("gc-collect", [("_gc_callback", "project/gc_callbacks.py", 9), STEP]),
    ("moe-all-to-all", [("all_to_all_single", C10D, 3900), ("token_dispatch", "megatron/core/transformer/moe/token_dispatcher.py", 320)]),
    ("moe-all-to-all", [("forward", "deepspeed/moe/sharded_moe.py", 99), STEP]),
    ("checkpoint-collective", [("all_gather", C10D, 3000), ("local_step", "torch/distributed/checkpoint/state_dict_loader.py", 211)]),
    ("checkpoint-collective", [("_all_gather_base", C10D, 3100), ("load_checkpoint", "megatron/training/checkpointing.py", 700)]),
    ("nccl-comm-init", [("_store_based_barrier", C10D, 400), ("init_process_group", C10D, 1200), STEP]),
    ("nccl-comm-init", [("c10d::ProcessGroupNCCL::getNCCLComm(std::string const&)", "libtorch_cuda.so")]),
    ("nccl-comm-init", [("new_group", C10D, 4000), STEP]),
    ("barrier", [("barrier", C10D, 2477), ("save_model", "train.py", 9)]),
    ("barrier", [("monitored_barrier", C10D, 3700), STEP]),
    ("dataloader-worker-death", [("_shutdown_workers", "torch/utils/data/dataloader.py", 1400), STEP]),
    ("dataloader-worker-death", [("handler", "torch/utils/data/_utils/signal_handling.py", 66),
                                 ("_try_get_data", "torch/utils/data/dataloader.py", 1132)]),
    ("dataloader-stall", [("__next__", "torch/utils/data/dataloader.py", 630), STEP]),
    ("dataloader-stall", [("_BaseDataLoaderIter.__next__", "torch/utils/data/dataloader.py", 630), STEP]),
    ("checkpoint-io", [("write_record", "torch/serialization.py", 640), ("save", "torch/serialization.py", 423)]),
    ("checkpoint-io", [("write", "zipfile.py", 1700), ("save_pretrained", "transformers/modeling_utils.py", 2000)]),
    ("checkpoint-io", [("write_data", "torch/distributed/checkpoint/filesystem.py", 600), STEP]),
    ("collective-wait", [("all_reduce", C10D, 2501), STEP]),
    ("collective-wait", [("broadcast", C10D, 1191), STEP]),
    ("collective-wait", [("wait", "torch/distributed/distributed_c10d.py", 300), STEP]),
    ("collective-wait", [("c10d::ProcessGroupGloo::RecvWork::wait", "libtorch_cpu.so")]),
    ("collective-wait", [("ncclGroupEnd", "libnccl.so.2")]),
    # a method of a collective's class in native code (an inference engine's all-gather plugin)
    ("collective-wait", [("cudaStreamQuery", "libplugin.so"), ("trt::plugins::AllgatherPlugin::enqueue", "libplugin.so")]),
    ("cuda-synchronize", [("synchronize", "torch/cuda/__init__.py", 803), STEP]),
    ("cuda-synchronize", [("synchronize", "torch/cuda/__init__.py", 1219),
                          ("synchronize", "deepspeed/accelerator/cuda_accelerator.py", 89),
                          ("allreduce_gradients", "deepspeed/runtime/engine.py", 2904)]),
    ("cuda-device-wait", [("cuEventSynchronize", "libcuda.so.1"),
                          ("_to_list", "vllm/v1/worker/gpu_model_runner.py", 10)]),
    ("cuda-device-wait", [("??", "/lib64/libcuda.so.1"), ("??", "/lib64/libcudart.so.12")]),
    ("cuda-device-wait", [("_value", "jax/_src/array.py", 642), ("__float__", "jax/_src/array.py", 300),
                          ("main", "train.py", 392)]),
    ("cuda-device-wait", [("cuMemcpyDtoH_v2", "libcuda.so.1"),
                          ("at::native::_to_copy(at::Tensor const&)", "libtorch_cpu.so")]),
    ("triton-compile", [("compile", "triton/compiler/compiler.py", 280), STEP]),
    ("triton-compile", [("acquire", "filelock/_api.py", 300), ("load", "torch/_inductor/codecache.py", 90)]),
    ("cpp-extension-lock", [("wait", "torch/utils/file_baton.py", 42), ("_jit_compile", "torch/utils/cpp_extension.py", 1522)]),
    ("autograd-collective", [("_engine_run_backward", "torch/autograd/graph.py", 769), ("backward", "torch/_tensor.py", 521)]),
    ("autograd-collective", [("c10d::Reducer::autograd_hook(unsigned long)", "libtorch_cpu.so")]),
    ("autograd-collective", [("_post_backward_hook", "torch/distributed/fsdp/_runtime_utils.py", 700)]),
    ("dataloader-worker", [("get", "multiprocessing/queues.py", 113),
                           ("_worker_loop", "torch/utils/data/_utils/worker.py", 309),
                           ("_bootstrap", "multiprocessing/process.py", 314)]),
    ("dataloader-worker", [("poll", "libc.so.6"), ("_poll", "multiprocessing/connection.py", 424),
                           ("get", "multiprocessing/queues.py", 113),
                           ("worker_main", "torchdata/nodes/worker.py", 40)]),
    ("dataloader-worker", [("__getitem__", "my_dataset.py", 88),
                           ("_worker_loop", "torchdata/stateful_dataloader/worker.py", 240)]),
    ("compute-spin", [("while_loop_forever", "train.py", 12), ("main", "train.py", 30)]),
]


@pytest.mark.parametrize("expected, frames", POSITIVE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(POSITIVE)])
def test_each_pattern_matches_its_stack(expected, frames):
    assert pattern_of(*frames) == expected


def test_every_pattern_has_a_positive_case():
    assert {p for p, _ in POSITIVE} == {p.id for p in PATTERNS}


def test_windows_paths_match():
    assert pattern_of(("_try_get_data", r"D:\env\lib\site-packages\torch\utils\data\dataloader.py", 1024),
                      ("train", r"C:\job\train.py", 3)) == "dataloader-stall"


def test_worker_death_from_traceback_exception():
    frames = [("get", "queue.py", 180), ("_try_get_data", "torch/utils/data/dataloader.py", 1132)]
    assert pattern_of(*frames, exception="ConnectionResetError: [Errno 104] Connection reset by peer") \
        == "dataloader-worker-death"
    assert pattern_of(*frames) == "dataloader-stall"


# --- priorities: specific beats generic -------------------------------------------------------

@pytest.mark.parametrize("frames, expected", [
    # A GC pass triggered inside a collective call is a GC pause, not a collective wait.
    ([("gc_collect_main", "libpython3.11.so"), ("all_reduce", C10D, 2501), STEP], "gc-collect"),
    # all_gather under checkpoint code is resharding; without it, a plain collective.
    ([("all_gather", C10D, 3000), ("save_checkpoint", "trainer.py", 10)], "checkpoint-collective"),
    ([("all_gather", C10D, 3000), STEP], "collective-wait"),
    # Activation checkpointing is not checkpoint I/O.
    ([("all_gather", C10D, 3000), ("recompute", "torch/utils/checkpoint.py", 400)], "collective-wait"),
    # MoE dispatch beats the generic collective.
    ([("all_to_all_single", C10D, 3900), ("dispatch", "model.py", 3)], "moe-all-to-all"),
    # Barrier beats generic; a barrier inside init is init.
    ([("barrier", C10D, 2477), ("all_reduce", C10D, 2501)], "barrier"),
    ([("barrier", C10D, 2477), ("new_group", C10D, 4000)], "nccl-comm-init"),
    # A rank saving while peers wait in the barrier around the save.
    ([("barrier", C10D, 2477), ("save_checkpoint", "trainer.py", 10)], "barrier"),
    ([("write_record", "torch/serialization.py", 640), ("save_checkpoint", "trainer.py", 10)], "checkpoint-io"),
    # Worker death beats the plain data wait it happens in.
    ([("_shutdown_workers", "torch/utils/data/dataloader.py", 1400),
      ("__next__", "torch/utils/data/dataloader.py", 630)], "dataloader-worker-death"),
    # The collective a sync waits for is the better explanation.
    ([("cudaStreamSynchronize", "libcudart.so"), ("all_reduce", C10D, 2501)], "collective-wait"),
    # A sync inside Inductor's precompile is a sync, not a compile lock.
    ([("synchronize", "torch/cuda/__init__.py", 803),
      ("_precompile_config", "torch/_inductor/runtime/triton_heuristics.py", 422)], "cuda-synchronize"),
    # Generic collective beats "backward is running".
    ([("all_reduce", C10D, 2501), ("backward", "torch/autograd/__init__.py", 266)], "collective-wait"),
    # A Python-level synchronize is a device wait even under gradient-reduction frames that name a
    # collective (DeepSpeed allreduce_gradients, Megatron reduce_gradients/_reduce...).
    ([("synchronize", "torch/cuda/__init__.py", 1219), ("allreduce_gradients", "deepspeed/runtime/engine.py", 2904),
      ("backward", "deepspeed/runtime/engine.py", 3240)], "cuda-synchronize"),
    ([("synchronize", "torch/cuda/__init__.py", 1219),
      ("_allreduce_layernorm_grads", "megatron/core/distributed/finalize_model_grads.py", 120),
      ("finalize_model_grads", "megatron/core/distributed/finalize_model_grads.py", 260)], "cuda-synchronize"),
    # ... and so is native code inside that synchronize (py-spy --native).
    ([("cudaDeviceSynchronize", "libcudart.so"), ("synchronize", "torch/cuda/__init__.py", 1219),
      ("all_reduce", C10D, 2501)], "cuda-synchronize"),
    # But a synchronize deeper than the innermost Python frame belongs to that frame.
    ([("cuStreamSynchronize", "libcuda.so.1"), ("all_reduce", C10D, 2501),
      ("synchronize", "torch/cuda/__init__.py", 1219)], "collective-wait"),
    # A thread inside the CUDA driver under a collective waits for the collective.
    ([("??", "/lib64/libcuda.so.1"), ("c10d::ProcessGroupNCCL::WorkNCCL::wait()", "libtorch_cuda.so")],
     "collective-wait"),
])
def test_priority(frames, expected):
    assert pattern_of(*frames) == expected


@pytest.mark.parametrize("frames, kw", [
    # The elastic agent's wait and DataParallel's gather are not collectives.
    ([("wait", "torch/distributed/elastic/multiprocessing/api.py", 500)], {}),
    ([("gather", "torch/nn/parallel/scatter_gather.py", 100), ("forward", "torch/nn/parallel/data_parallel.py", 190)], {}),
    # Every NCCL process has a watchdog thread; it is not a wait.
    ([("c10d::ProcessGroupNCCL::Watchdog::run()", "libtorch_cuda.so")], {}),
    ([("c10d::ProcessGroupNCCL::WorkNCCL::isCompleted()", "libtorch_cuda.so"),
      ("c10d::ProcessGroupNCCL::ncclCommWatchdog()", "libtorch_cuda.so")], {}),
    # An idle pin-memory thread is normal.
    ([("select", "selectors.py", 415), ("get", "multiprocessing/queues.py", 113),
      ("_pin_memory_loop", "torch/utils/data/_utils/pin_memory.py", 50)], {}),
    # Busy user code only when the thread is not idle and did not raise.
    ([("main", "train.py", 3)], {"active": False}),
    ([("main", "train.py", 3)], {"exception": "ValueError: x"}),
    ([("wait", "threading.py", 320), ("main", "train.py", 3)], {}),
    ([("forward", "torch/nn/modules/linear.py", 116)], {}),
])
def test_no_pattern(frames, kw):
    assert pattern_of(*frames, **kw) is None


# --- process-level: thread choice, classify, evidence ---------------------------------------

def test_non_main_collective_thread_beats_idle_main_thread():
    main = thread(("wait", "threading.py", 320), ("join", "threading.py", 1100), active=False)
    comm = thread(("all_gather_into_tensor", C10D, 2709), name="Thread-7", active=True)
    chosen, match = interesting_thread(process(main, comm))
    assert chosen is comm and match.pattern.id == "collective-wait"
    assert classify(process(main, comm)) == "collective_wait"


def test_more_specific_pattern_wins_across_threads():
    autograd_main = thread(("backward", "torch/autograd/__init__.py", 266), active=False)
    collective = thread(("all_gather_into_tensor", C10D, 2709), name=None, active=True)
    assert match_stack(process(autograd_main, collective)).thread is collective


def test_unmatched_process_prefers_main_then_busy_threads():
    main = thread(("select", "selectors.py", 415), active=False)
    other = thread(("poll", "zmq/sugar/poll.py", 106), name="io", active=False)
    assert interesting_thread(process(other, main)) == (main, None)
    assert classify(process(other, main)) == "other"
    assert interesting_thread(ProcessStack(1, 0, None, ())) == (None, None)


def test_evidence_is_the_innermost_revealing_frame():
    match = match_thread(thread(("gloo::transport::tcp::UnboundBuffer::waitRecv", "libtorch_cpu.so"),
                                ("c10d::ProcessGroupGloo::RecvWork::wait", "libtorch_cpu.so")))
    assert match.frame.function == "gloo::transport::tcp::UnboundBuffer::waitRecv"


@pytest.mark.parametrize("frame, op", [
    (("all_reduce", C10D, 1), "all_reduce"),
    (("_all_gather_base", C10D, 1), "all_gather"),
    (("all_gather_into_tensor", "deepspeed/comm/torch.py", 1), "all_gather_into_tensor"),
    (("reduce_scatter_tensor", C10D, 1), "reduce_scatter_tensor"),
    (("c10d::ProcessGroupNCCL::allreduce_impl(at::Tensor&)", "libtorch_cuda.so"), "all_reduce"),
    (("c10d::ProcessGroupGloo::RecvWork::wait", "libtorch_cpu.so"), "recv"),
    (("alltoall_base", "x.py", 1), "all_to_all"),
    (("monitored_barrier", C10D, 1), "monitored_barrier"),
    (("broadcast", C10D, 1), "broadcast"),
    (("broadcast", "numpy/lib/stride_tricks.py", 1), None),      # weak names need distributed context
    (("c10d::ProcessGroupNCCL::broadcastUniqueNCCLID(ncclUniqueId*)", "libtorch_cuda.so"), None),
    (("reduced_sum", "train.py", 1), None),
    # DDP's reducer waits on a bucket's all-reduce without naming it.
    (("c10d::Reducer::finalize_backward", "libtorch_cpu.so"), "all_reduce"),
    (("c10d::Reducer::autograd_hook(unsigned long)", "libtorch_cpu.so"), "all_reduce"),
])
def test_collective_op(frame, op):
    assert collective_op(thread(frame)) == op


def test_user_code_regex():
    user = re.compile(catalog.USER_CODE)
    assert user.search("train.py") and user.search("src/my_project/model.py")
    assert user.search("src/model_back/scripts/fine_tune_accelerate.py")
    for lib in ("threading.py", "torch/nn/modules/module.py", "/x/site-packages/foo/bar.py",
                "/usr/lib/python3.11/queue.py", "<frozen runpy>", "libc.so.6"):
        assert not user.search(lib), lib


def test_ddp_reducer_wait_in_an_autograd_thread_names_the_all_reduce():
    """py-spy --native: the autograd worker waits on the work DDP's reducer launched."""
    worker = thread(("pthread_cond_wait@@GLIBC_2.3.2", "libpthread.so.0"),
                    ("c10d::ProcessGroupNCCL::WorkNCCL::wait", "libtorch_cuda.so"),
                    ("c10d::Reducer::finalize_backward", "libtorch_cpu.so"),
                    ("torch::autograd::Engine::thread_main", "libtorch_cpu.so"), name=None, active=False)
    main = thread(("pthread_cond_wait", "libpthread.so.0"), ("torch::autograd::Engine::execute", "libtorch_cpu.so"),
                  ("backward", "torch/autograd/__init__.py", 267), active=False)
    chosen, match = interesting_thread(process(main, worker))
    assert chosen is worker and match.pattern.category == "collective_wait"
    assert collective_op(chosen) == "all_reduce"


def test_an_unnamed_driver_frame_is_evidence_only_when_nothing_is_named():
    match = match_thread(thread(("??", "/lib64/libcuda.so.1"), ("cuMemcpyDtoH_v2", "/lib64/libcuda.so.1")))
    assert match.frame == Frame("cuMemcpyDtoH_v2", "/lib64/libcuda.so.1")
    match = match_thread(thread(("??", "/lib64/libcuda.so.1"), ("??", "/lib64/libcuda.so.1")))
    assert match.pattern.id == "cuda-device-wait" and match.frame.file == "/lib64/libcuda.so.1"



# --- DataLoader worker processes -----------------------------------------------------------

def test_a_worker_process_waiting_on_its_index_queue_is_the_data_pipeline():
    # py-spy --native of a fork-started worker: the parent's frames stay below the fork.
    idle = thread(("poll", "libc.so.6"), ("select", "selectors.py", 415),
                  ("wait", "multiprocessing/connection.py", 1136), ("get", "multiprocessing/queues.py", 113),
                  ("_worker_loop", "torch/utils/data/_utils/worker.py", 309),
                  ("_launch", "multiprocessing/popen_fork.py", 71), ("__iter__", "torch/utils/data/dataloader.py", 491),
                  ("evaluate", "train.py", 77), active=False)
    assert classify(process(idle)) == "dataloader"
    assert match_thread(idle).frame.function == "_worker_loop"


def test_a_training_thread_anywhere_else_beats_a_worker_loop():
    worker = thread(("get", "multiprocessing/queues.py", 113), ("_worker_loop", "torch/utils/data/_utils/worker.py", 309),
                    name="Thread-2", active=False)
    main = thread(("all_reduce", C10D, 2501), STEP)
    assert match_stack(process(worker, main)).pattern.id == "collective-wait"


def test_a_queue_wait_outside_data_workers_is_not_the_data_pipeline():
    assert pattern_of(("get", "multiprocessing/queues.py", 113), ("run", "my_producer.py", 20), active=False) is None
    # "_worker_loop" of something that is no data loader (a thread pool of one's own) neither.
    assert pattern_of(("_worker_loop", "serving/pool.py", 9), active=False) is None
