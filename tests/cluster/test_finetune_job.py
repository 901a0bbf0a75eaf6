"""Fine-tuning on the real local Slurm (issues 25, 35), with the example a user copies,
examples/jobs/finetune-llama32-instruct.yaml: a 2-node x 2-rank FSDP x TP job starts from a
Llama-3.2-shaped Hugging Face directory made here by transformers (rope_type llama3, tied
embeddings; the shape read from its config.json), on chat data tokenized with `dslurm data tokenize
--instruct` (completion-only loss, packed examples), evaluates on a held-out fraction, is preempted
once (`scontrol requeue`), resumes from its own generation -- not from init_from again -- and
completes; `dslurm report` shows its eval loss, and `dslurm ckpt export --hf` gives a directory
transformers' LlamaForCausalLM loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster_jobs import ROOT, events, submit, wait_for
from dslurm import slurm
from testkit import chat_tokenizer, conversations

EXAMPLE = "examples/jobs/finetune-llama32-instruct.yaml"


def make_hf_dir(out: Path) -> Path:
    """A random tiny Llama 3.2 (scaled RoPE, tied embeddings), saved by transformers (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16})
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="100KB")
    return out


@pytest.mark.timeout(600)
def test_finetune_example_resumes_from_its_own_generation_and_reports_eval(slurm_cluster, cli, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = slurm_cluster.env()
    hf = make_hf_dir(tmp_path / "hf")
    chat_tokenizer(tmp_path / "tok")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(120)))
    tok = cli("data", "tokenize", str(tmp_path / "chat.jsonl"), "--tokenizer", str(tmp_path / "tok"),
              "--out", str(tmp_path / "data"), "--instruct", "--seq-len", "64", env=env)
    assert tok.returncode == 0, tok.stderr
    run = tmp_path / "ft"
    sets = [f"model.init_from={hf}", "model.seq_len=64", f"data.path={tmp_path / 'data'}", "data.val_fraction=0.05",
            f"checkpoint.run_dir={run}", "checkpoint.interval=5", "train.steps=20", "train.global_batch=8",
            "train.step_sleep_s=0.3", "train.log_every=1", "train.eval_every=5", "train.eval_batches=2",
            "train.lr=3e-4", "train.warmup_steps=2", "preflight.enabled=false", "time=00:10:00"]
    job = submit(cli, env, str(ROOT / EXAMPLE), *[a for s in sets for a in ("--set", s)])
    wait_for(lambda: any(e["event"] == "ckpt_save" and e["step"] >= 5 for e in events(run)), 300,
             "the first generation")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)  # preemption: TERM to the batch shell
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED"

    inits = [(e["action"], e.get("step")) for e in events(run, "init_from")]
    assert inits[0] == ("loaded", None) and len(inits) == 2 and inits[1][0] == "resumed" and inits[1][1] >= 5, inits
    assert events(run, "init_from")[0]["tensors"] == 2 + 2 * 9  # tied: no lm_head of its own
    assert [e["cls"] for e in events(run, "ending")][-1] == "completed"
    assert len(events(run, "job_start")) == 2  # preempted once
    evals = [e for e in events(run, "eval") if e.get("loss") is not None]
    assert evals and evals[-1]["step"] == 20
    rep = cli("report", str(run), env=env)
    assert rep.returncode == 0, rep.stderr
    assert f"eval (held_out): loss {evals[-1]['loss']:.4f} ppl" in rep.stdout, rep.stdout

    out = tmp_path / "export"
    assert cli("ckpt", "export", str(run), "--hf", "-o", str(out), env=env).returncode == 0
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_type"] == "llama3"
