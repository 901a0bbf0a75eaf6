"""What the library adapters refuse, and the names they read in a generation (pure: attributes
and paths only; no library, no torch). Each problem is one sentence naming the setting, its value
and the fix; the adapters raise them as one exit-2 UserError before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dslurm import checkpoint as ck
from dslurm.errors import UserError


def hf_problems(args: Any, train_kwargs: dict[str, Any]) -> list[str]:
    """The TrainingArguments (and `run` keywords) dslurm cannot run on the chain, each with its fix
    (pure: reads attributes only). Empty: all good."""
    out = []
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if "resume_from_checkpoint" in train_kwargs:
        out.append("run(trainer, resume_from_checkpoint=...): dslurm resumes from the run's verified pointer. "
                   "Fix: drop the argument")
    if getattr(args, "save_only_model", False):
        out.append("TrainingArguments.save_only_model=True: its checkpoints lack the optimizer, scheduler and RNG "
                   "states, so no resume continues the run. Fix: save_only_model=False")
    if getattr(args, "save_on_each_node", False):
        out.append("TrainingArguments.save_on_each_node=True: dslurm commits one copy in the run directory. "
                   "Fix: save_on_each_node=False")
    if getattr(args, "load_best_model_at_end", False):
        out.append("TrainingArguments.load_best_model_at_end=True: the best checkpoint is a dslurm generation, "
                   "not a folder HF can find. Fix: load_best_model_at_end=False (`dslurm ckpt list` names them)")
    if strategy == "best" and str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
        out.append("TrainingArguments.save_strategy='best' with eval_strategy='no' never saves. Fix: "
                   "save_strategy='steps' (or 'no': the job's checkpoint.interval), or evaluate")
    return out


def hf_saves_itself(args: Any) -> bool:
    """Does the script's own save schedule save within this run? `save_strategy="no"`, or "steps"
    with `save_steps` past `max_steps` (HF's default 500 in a shorter run): no, and the job's
    checkpoint.interval decides the periodic saves instead (pure)."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "steps" and args.max_steps > 0 and args.save_steps >= 1:
        return bool(args.save_steps <= args.max_steps)
    return strategy != "no"


def lightning_problems(trainer: Any, fit_kwargs: dict[str, Any]) -> list[str]:
    """What dslurm cannot run on the chain, each with its fix (pure: reads attributes only)."""
    out = []
    if fit_kwargs.get("ckpt_path") is not None:
        out.append("run(..., ckpt_path=...): dslurm resumes from the run's verified pointer. Fix: drop ckpt_path")
    if getattr(trainer, "accumulate_grad_batches", 1) != 1:
        out.append(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): a stop between the "
                   "batches of one step would lose their gradients. Fix: accumulate_grad_batches=1 (a larger "
                   "batch per process)")
    if getattr(trainer, "max_steps", -1) in (None, -1) and getattr(trainer, "max_epochs", None) in (None, -1):
        out.append("Trainer(max_steps=-1, max_epochs=-1) never ends. Fix: set max_steps or max_epochs")
    return out


def library_folder(gen: Path, library: str) -> Path:
    """The library's own checkpoint folder inside a committed generation (`files/`). Raises
    UserError when the generation holds none (saved by another kind of entry)."""
    folder = gen / ck.FILES
    if not folder.is_dir():
        raise UserError(f"{gen}: this generation holds no {library} checkpoint ({ck.FILES}/), so a {library} "
                        "run cannot resume from it. Fix: point checkpoint.run_dir at this script's own run "
                        "directory, or start a new one")
    return folder


def world_change_error(library: str, saved: int, now: int, gen: Path, why: str) -> UserError:
    """The exit-2 refusal of a resume with another number of processes (pure)."""
    return UserError(f"{gen}: saved by {saved} processes, resumed by {now}: {library}'s resume cannot "
                     f"continue it exactly ({why}). Fix: resubmit with {saved} processes in all (nodes x "
                     "procs_per_node), or start a new checkpoint.run_dir")
