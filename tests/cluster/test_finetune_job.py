"""Fine-tuning on the real local Slurm (issue 25): a 2-node x 2-rank FSDP x TP job starts from a
Hugging Face Llama directory made here by transformers (model.init_from), evaluates on a held-out
fraction, is preempted once (`scontrol requeue`), resumes from its own generation -- not from
init_from again -- and completes; `dslurm report` shows its eval loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_jobs import events, job_spec, submit, wait_for
from dslurm import slurm


def make_hf_dir(out: Path) -> Path:
    """A random Llama of the tiny preset's shape, saved by transformers (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="100KB")
    return out


@pytest.mark.timeout(600)
def test_finetune_resumes_from_its_own_generation_and_reports_eval(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    hf = make_hf_dir(tmp_path / "hf")
    spec = job_spec(tmp_path, "ft", steps=20, interval=5, sleep=0.3, model={"preset": "tiny", "init_from": str(hf)},
                    train={"eval_every": 5, "eval_batches": 2, "lr": 3e-4},
                    data={"val_fraction": 0.05})
    job = submit(cli, env, spec)
    run = tmp_path / "ft"
    wait_for(lambda: any(e["event"] == "ckpt_save" and e["step"] >= 5 for e in events(run)), 300,
             "the first generation")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)  # preemption: TERM to the batch shell
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED"

    inits = [(e["action"], e.get("step")) for e in events(run, "init_from")]
    assert inits[0] == ("loaded", None) and len(inits) == 2 and inits[1][0] == "resumed" and inits[1][1] >= 5, inits
    assert [e["cls"] for e in events(run, "ending")][-1] == "completed"
    assert len(events(run, "job_start")) == 2  # preempted once
    evals = [e for e in events(run, "eval") if e.get("loss") is not None]
    assert evals and evals[-1]["step"] == 20
    rep = cli("report", str(run), env=env)
    assert rep.returncode == 0, rep.stderr
    assert f"eval (held_out): loss {evals[-1]['loss']:.4f} ppl" in rep.stdout, rep.stdout
