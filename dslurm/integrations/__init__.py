"""`dslurm.integrations`: a library's own trainer on the whole chain, with one import and one call.

    import dslurm.integrations.hf as dh          # transformers.Trainer (and TRL's trainers on it)
    dh.run(trainer)                               # in place of trainer.train()

    import dslurm.integrations.lightning as dl   # lightning.pytorch or pytorch_lightning
    dl.run(trainer, model, train_dataloaders=loader)   # in place of trainer.fit(model, ...)

Thin adapters over `dslurm.runtime` (chain: the part they share): the library's own checkpoint
(HF's `checkpoint-N` folder, Lightning's `.ckpt`) is written under `generations/.incoming` and
committed inside a dslurm generation (manifest, crc32s, verify, then the pointer); a start resumes
from the verified pointer; USR2/TERM/`dslurm ctl stop` are agreed by all ranks at a step boundary,
then a save and exit 75/143; the library's log hooks feed the ledger. docs/integrations.md.
`accelerate` loops need no adapter: `dslurm.runtime.Checkpoint` takes an Accelerator's prepared
objects as they are.

In-job modules: each imports its library (and torch) when the script imports it; nothing here is
imported by `import dslurm`.
"""
