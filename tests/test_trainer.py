"""The integrated trainer: schedule, data, model, command line, and real 2-rank gloo runs."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainwatch.trainer import config as cfgmod
from trainwatch.trainer.__main__ import build_parser
from trainwatch.checkpoint import find_latest, load_checkpoint, save_checkpoint
from trainwatch.trainer.config import MODEL_PRESETS, TrainConfig, UsageError, resolve
from trainwatch.trainer.data import get_batch, load_corpus
from trainwatch.trainer.model import GPT, VOCAB_SIZE
from trainwatch.trainer.train import FP8_ERROR, lr_at

TINY = ["--model-size", "tiny", "--log-interval", "10"]
RUN_TIMEOUT_S = 180


def clean_env() -> dict[str, str]:
    """The test's environment without anything that would attach runs to a real job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_trainer(*args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    """Run the trainer as one plain process (nproc=0) or under torchrun with nproc ranks."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "trainwatch.trainer", *args]
    else:
        cmd = [sys.executable, "-m", "trainwatch.trainer", *args]
    return subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def final_state(ckpt_dir: Path, step: int) -> dict:
    info = find_latest(ckpt_dir)
    assert info is not None and info.step == step, f"no checkpoint at step {step} in {ckpt_dir}"
    return load_checkpoint(info)


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


def done_line(proc: subprocess.CompletedProcess) -> re.Match:
    match = re.search(r"done: steps (\d+)-(\d+) \| first loss ([\d.]+) \| final loss ([\d.]+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return match


# ---- pure parts ---------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = resolve(TrainConfig(max_steps=100, lr=1e-3))
    lrs = [lr_at(s, cfg) for s in range(1, 101)]
    assert cfg.warmup_steps == 10
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])), "cosine must not rise"
    assert lrs[-1] == pytest.approx(1e-4)  # min_lr_ratio 0.1
    split = resolve(TrainConfig(max_steps=50, schedule_steps=100, lr=1e-3))
    assert [lr_at(s, split) for s in range(1, 51)] == lrs[:50]


def test_batch_is_a_pure_function_of_seed_step_rank() -> None:
    corpus = load_corpus()
    assert corpus.dtype == torch.uint8 and 10_000 < corpus.numel() < 400_000

    def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(corpus, seed=seed, step=step, rank=rank, batch_size=4, seq_len=32)

    x, y = batch(1, 5, 0)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(batch(1, 5, 0)[0], x)
    for other in (batch(1, 6, 0), batch(1, 5, 1), batch(2, 5, 0)):
        assert not torch.equal(other[0], x)


def test_tiny_model_shape_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["tiny"])
    assert 150_000 < model.num_params() < 300_000
    assert model.head.weight is model.wte.weight
    x, y = torch.randint(0, VOCAB_SIZE, (2, 2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, VOCAB_SIZE)
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.3  # near uniform at init


def test_cli_flags_cover_every_config_field() -> None:
    parser = build_parser()
    dests = {a.dest for a in parser._actions if a.dest not in ("help", "check")}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    defaults = vars(parser.parse_args([]))
    defaults.pop("check")
    assert TrainConfig(**defaults) == TrainConfig()
    from trainwatch.flags import field_docs

    docs = field_docs(TrainConfig)
    assert set(docs) == dests, "every config field needs a one-line docstring"
    text = parser.format_help()
    assert "--max-steps" in text and "10% of" in text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_steps": 0}, "--max-steps must be a positive integer"),
        ({"model_size": "huge"}, "--model-size must be one of"),
        ({"model_size": "tiny", "seq_len": 4096}, "--seq-len must be at most 128"),
        ({"lr": float("nan")}, "--lr must be a finite number"),
        ({"keep": 0}, "--keep must be a positive integer"),
    ],
)
def test_resolve_rejects_bad_values(overrides: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve(TrainConfig(**overrides))


def test_ckpt_dir_defaults_to_environment() -> None:
    assert resolve(TrainConfig(), environ={}).ckpt_dir is None
    assert resolve(TrainConfig(), environ={cfgmod.CKPT_DIR_ENV: "/x"}).ckpt_dir == "/x"
    assert resolve(TrainConfig(ckpt_dir="/y"), environ={cfgmod.CKPT_DIR_ENV: "/x"}).ckpt_dir == "/y"


# ---- bad input from the command line: one line, exit 2, nothing lost ----------------


def assert_usage_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unwritable_ckpt_dir_exits_2(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("keep me")
    for bad in (file, file / "sub"):
        proc = run_trainer(*TINY, "--max-steps", "2", "--ckpt-dir", str(bad))
        assert_usage_error(proc, "--ckpt-dir must be a writable directory")
    assert file.read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-steps", "abc"], "--max-steps"),
        (["--max-steps", "-3"], "--max-steps must be a positive integer"),
        (["--lr", "fast"], "--lr"),
        (["--precision", "fp4"], "--precision"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_numbers_and_flags_exit_2(args: list[str], fragment: str) -> None:
    assert_usage_error(run_trainer(*args), fragment)


def test_fp8_without_gpu_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the fp8 refusal is for machines without one")
    proc = run_trainer(*TINY, "--precision", "fp8", "--max-steps", "1")
    assert_usage_error(proc, FP8_ERROR)


def test_corrupt_explicit_resume_exits_2_and_keeps_files(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, {"step": 3, "model": {}})
    state_file = path / "state.pt"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    proc = run_trainer(*TINY, "--max-steps", "5", "--resume", str(path), "--ckpt-dir", str(tmp_path))
    assert_usage_error(proc, "corrupt")
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert_usage_error(run_trainer(*TINY, "--resume", str(tmp_path / "missing")), "does not exist")


# ---- real 2-rank gloo runs -------------------------------------------------------------

STEPS = 40
HALF = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Four torchrun jobs shared by the tests below: two straight 40-step runs with
    the same seed, and one run split into 20 steps + resume to 40."""
    root = tmp_path_factory.mktemp("runs")
    common = [*TINY, "--seed", "11", "--ckpt-interval", str(HALF)]
    out = {}
    for name, extra in [
        ("straight", ["--max-steps", str(STEPS)]),
        ("again", ["--max-steps", str(STEPS)]),
        ("part1", ["--max-steps", str(HALF), "--schedule-steps", str(STEPS)]),
        ("part2", ["--max-steps", str(STEPS)]),
    ]:
        ckpt_dir = root / ("split" if name.startswith("part") else name)
        proc = run_trainer(*common, *extra, "--ckpt-dir", str(ckpt_dir), nproc=2)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
        out[name] = (ckpt_dir, proc)
    return out


@pytest.mark.slow
def test_resumed_run_matches_straight_run_bit_for_bit(runs) -> None:
    straight = final_state(runs["straight"][0], STEPS)
    resumed = final_state(runs["part2"][0], STEPS)
    part2_out = runs["part2"][1].stdout
    assert f"resumed from {runs['part2'][0] / 'step-00000020'} (step 20)" in part2_out
    assert done_line(runs["part2"][1]).group(1, 2) == ("21", str(STEPS))
    assert_same_tensors(straight["model"], resumed["model"], "model weights")
    for (ka, a), (kb, b) in zip(straight["optimizer"]["state"].items(), resumed["optimizer"]["state"].items()):
        assert ka == kb
        assert_same_tensors(a, b, f"optimizer state {ka}")


@pytest.mark.slow
def test_same_seed_gives_identical_weights(runs) -> None:
    a = final_state(runs["straight"][0], STEPS)
    b = final_state(runs["again"][0], STEPS)
    assert_same_tensors(a["model"], b["model"], "model weights")


@pytest.mark.slow
def test_loss_falls_and_rank0_alone_logs(runs) -> None:
    proc = runs["straight"][1]
    match = done_line(proc)
    first, final = float(match.group(3)), float(match.group(4))
    assert first == pytest.approx(math.log(VOCAB_SIZE), abs=0.3)
    assert final < 0.7 * first, proc.stdout
    assert proc.stdout.count("done:") == 1, "only rank 0 prints"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == STEPS // 10
    assert re.fullmatch(r"step 10/40 \| loss [\d.]+ \| lr [\d.]+e-\d+ \| step [\d.]+s \| \d+ tok/s", lines[0])


@pytest.mark.slow
def test_checkpoint_contents_and_retention(runs) -> None:
    ckpt_dir = runs["straight"][0]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000020", "step-00000040"]
    state = final_state(ckpt_dir, STEPS)
    assert state["step"] == STEPS and state["seed"] == 11 and state["world_size"] == 2
    assert state["config"]["model_size"] == "tiny"
    assert isinstance(state["rng"]["torch_cpu"], torch.Tensor)
    assert set(state["optimizer"]) == {"state", "param_groups"}


@pytest.mark.slow
def test_resume_past_max_steps_has_nothing_to_do(runs) -> None:
    proc = run_trainer(*TINY, "--max-steps", str(STEPS), "--ckpt-dir", str(runs["straight"][0]))
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout


def test_auto_resume_falls_back_past_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    first = run_trainer(*TINY, "--max-steps", "4", "--ckpt-interval", "4", "--ckpt-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    # A newer checkpoint that verifies but holds another model's weights.
    foreign = save_checkpoint(tmp_path, 50, {"step": 50, "model": {"w": torch.zeros(3)}, "optimizer": {}}, keep=None)
    proc = run_trainer(*TINY, "--max-steps", "6", "--ckpt-interval", "100", "--ckpt-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"skipping checkpoint {foreign}" in proc.stderr and "another model" in proc.stderr
    assert done_line(proc).group(1) == "5", proc.stdout  # resumed after step 4, not from scratch
    explicit = run_trainer(*TINY, "--max-steps", "6", "--resume", str(foreign))
    assert_usage_error(explicit, "saved for another model")
    assert (foreign / "state.pt").is_file()  # nothing already written is lost


def test_resume_accepts_the_state_file_inside_a_checkpoint(tmp_path: Path) -> None:
    first = run_trainer(*TINY, "--max-steps", "3", "--ckpt-interval", "3", "--ckpt-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    state_file = tmp_path / "step-00000003" / "state.pt"
    check = run_trainer(*TINY, "--max-steps", "5", "--resume", str(state_file), "--check")
    assert check.returncode == 0, check.stderr
    proc = run_trainer(*TINY, "--max-steps", "5", "--resume", str(state_file))
    assert proc.returncode == 0, proc.stderr
    assert done_line(proc).group(1) == "4"


def test_launch_refuses_a_checkpoint_of_another_model_before_starting_ranks(tmp_path: Path) -> None:
    """Checksums pass, the weights do not fit: one line and exit 2 from the launcher,
    instead of every rank failing and being restarted into the same error."""
    foreign = save_checkpoint(tmp_path / "ck", 9, {"step": 9, "model": {"w": torch.zeros(3)}, "optimizer": {}})
    env = clean_env()
    env["TRAINWATCH_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([str(Path(sys.executable).parent / "trainwatch"), "launch", "--job", "misfit",
                           "--nproc-per-node", "1", "-m", "trainwatch.trainer", *TINY, "--resume", str(foreign)],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert_usage_error(proc, "saved for another model")
    assert not (tmp_path / "home" / "jobs" / "misfit" / "job.json").exists()  # no rank was started


def test_a_collective_broken_by_a_dead_peer_is_one_line_not_a_traceback() -> None:
    from trainwatch.trainer.__main__ import peer_lost

    assert peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41346."))
    assert not peer_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))


def _agree_worker(rank: int, root: str, steps: list, result: str) -> None:
    import json as json_

    import torch.distributed as dist_

    from trainwatch.checkpoint import CheckpointError
    from trainwatch.trainer.resume import Resume, agree

    dist_.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    mine = steps[rank]
    ckpt_dir = Path(root) / f"node{rank}"
    available = {s: str(save_checkpoint(ckpt_dir, s, {"step": s, "model": {}}, keep=None)) for s in mine}
    resume = Resume({"step": max(mine)}, available[max(mine)], max(mine), available) if mine else Resume()
    cfg = resolve(TrainConfig(model_size="tiny", ckpt_dir=str(ckpt_dir)))
    try:
        out = agree(resume, cfg, lambda msg: None)
        answer = {"step": out.step if out.state is not None else None, "where": out.where}
    except CheckpointError as e:
        answer = {"error": str(e)}
    Path(result.format(rank=rank)).write_text(json_.dumps(answer))
    dist_.destroy_process_group()


@pytest.mark.parametrize("steps, expected", [
    ([[10, 20, 30], [10, 20]], 30),  # node 1 never got step 30: it receives it from rank 0
    ([[10, 20], [10, 20]], 20),
    ([[], []], None),  # a fresh start everywhere
    ([[30], []], 30),  # a new node with an empty --ckpt-dir: it receives step 30, never diverges
    ([[], [40, 50]], 50),
])
def test_every_rank_resumes_from_the_newest_step_any_of_them_holds(tmp_path: Path, steps, expected) -> None:
    import torch.multiprocessing as mp

    result = str(tmp_path / "r{rank}.json")
    mp.spawn(_agree_worker, args=(str(tmp_path), steps, result), nprocs=2, join=True)
    import json as json_

    answers = [json_.loads(Path(result.format(rank=r)).read_text()) for r in range(2)]
    assert [a["step"] for a in answers] == [expected, expected], answers
    for rank, (mine, a) in enumerate(zip(steps, answers)):
        if expected is None:
            continue
        # A rank that held the step loads its own copy; one that did not saved the copy it received.
        name = f"step-{expected:08d}" if expected in mine else f"step-{expected:08d}-emergency-r{rank}"
        assert a["where"].endswith(name), answers
        assert (tmp_path / f"node{rank}" / Path(a["where"]).name).is_dir()


def test_a_rank_line_reaches_the_shared_log_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks share the agent's stdout; unbuffered, print() writes text and newline apart,
    so two ranks' lines ran together mid-line (seen in a 2-node rejoin)."""
    from trainwatch.lines import print_line

    class Chunks:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out, err = Chunks(), Chunks()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    print_line("node n1: rank 3 had no checkpoint of step 40")
    print_line("error: lost contact with another rank", stderr=True)
    assert out.writes == ["node n1: rank 3 had no checkpoint of step 40\n"]
    assert err.writes == ["error: lost contact with another rank\n"]
