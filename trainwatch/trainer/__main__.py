"""`python -m trainwatch.trainer [flags]`: the integrated trainer's command line.

Flags are generated from TrainConfig's fields (max_steps -> --max-steps). A bad
flag, an unusable --ckpt-dir or a bad checkpoint prints one `error: ...` line
and exits 2; nothing already on disk is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NoReturn, Sequence

from trainwatch.checkpoint import CheckpointError, ensure_writable, load_checkpoint
from trainwatch.flags import field_docs, flag
from trainwatch.lines import print_line
from trainwatch.trainer.config import (DEVICES, MODEL_PRESETS, NAN_POLICIES, PRECISIONS, NonFiniteLoss, TrainConfig,
                                       UsageError, resolve)

EXIT_USAGE = 2
EXIT_NONFINITE = 1
"""A run stopped by a NaN/inf loss (--nan-policy fail): a failure like an uncaught exception."""
_CHOICES = {"device": DEVICES, "precision": PRECISIONS, "model_size": tuple(MODEL_PRESETS), "nan_policy": NAN_POLICIES}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage block: the message already names the flag to fix.
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _value_type(annotation: str) -> type:
    if "int" in annotation:
        return int
    if "float" in annotation:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m trainwatch.trainer",
        description="Train a small byte-level GPT on the built-in corpus (CPU or GPU, one or many ranks).",
        allow_abbrev=False,
    )
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if str(f.type) == "bool":
            parser.add_argument(f"--{flag(f.name)}", dest=f.name, action="store_true", help=help_text)
            continue
        kind = _value_type(str(f.type))
        default = f.default
        if default is not None:
            help_text += f" (default: {default})"
        parser.add_argument(
            f"--{flag(f.name)}",
            dest=f.name,
            type=kind,
            default=default,
            choices=_CHOICES.get(f.name),
            metavar=None if f.name in _CHOICES else f.name.upper(),
            help=help_text,
        )
    parser.add_argument("--check", action="store_true",
                        help="Check the flags, the checkpoint to resume from and --ckpt-dir, then exit without "
                        "training (trainwatch launch runs this once before starting any rank).")
    return parser


def check(cfg: TrainConfig) -> None:
    """What `--check` verifies: a resolvable config, a --resume checkpoint that
    verifies and fits this model, a writable --ckpt-dir. Raises UsageError /
    CheckpointError. The same code resumes, so what passes here loads there."""
    if cfg.resume not in ("auto", "never"):
        try:
            from trainwatch.trainer.resume import misfit  # torch: only when there is a checkpoint to check

            problem = misfit(load_checkpoint(cfg.resume), cfg)
        except (CheckpointError, OSError) as e:
            raise UsageError(f"--resume {cfg.resume}: {e}; pass a valid checkpoint, or --resume auto") from None
        if problem:
            raise UsageError(f"--resume {cfg.resume}: {problem}, or --resume auto / never")
    if cfg.ckpt_dir:
        ensure_writable(cfg.ckpt_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    check_only = args.pop("check")
    cfg = TrainConfig(**args)
    try:
        cfg = resolve(cfg)
        if check_only:
            check(cfg)
            return 0
        # Imported after parsing so --help, --check and flag errors answer without loading torch.
        from trainwatch.trainer.train import train

        train(cfg)
    except (UsageError, CheckpointError) as e:
        print_line(f"error: {e}", stderr=True)
        return EXIT_USAGE
    except NonFiniteLoss as e:
        print_line(f"error: {e}", stderr=True)
        import trainwatch

        # The same message at the same step after the rollback: the agent stops restarting.
        trainwatch.init().record_failure(type(e).__name__, str(e), None)
        return EXIT_NONFINITE
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        line = (str(e).splitlines() or [""])[0][:160]
        print_line(f"error: lost contact with another rank ({line}); the rank that failed first says why (its own "
                   "error, here or in its node's log)", stderr=True)
        import trainwatch

        # Recorded as a lost peer: the watchdog makes this rank a victim, not a culprit.
        trainwatch.init().record_failure(type(e).__name__, line, None)
        return EXIT_PEER_LOST
    return 0


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted",
             "NCCL Error 6", "remote process exited or there was a network error")
EXIT_PEER_LOST = 1


def peer_lost(e: BaseException) -> bool:
    """A collective that failed because another rank died: a consequence, not a cause
    (one line, no traceback: the rank that died first explains)."""
    return any(marker in str(e) for marker in PEER_LOST)


if __name__ == "__main__":
    sys.exit(main())
