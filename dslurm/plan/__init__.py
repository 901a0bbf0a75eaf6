"""`dslurm plan`: the arithmetic of a distributed run, as pure functions.

- `memory`      persistent state (byte layout, ZeRO-1/2/3, FSDP) and activations from shapes
- `comms`       ring all-reduce / reduce-scatter / all-gather volumes, link time, nccl-tests busbw
- `pipeline`    bubble and in-flight activations per schedule (GPipe, 1F1B, Interleaved1F1B),
                tensor-parallel shard shapes
- `traffic`     the collectives of one step per parallel dimension, their links and times
- `mfu`         PaLM model FLOPs per token, recomputation's extra FLOPs, MFU, tokens/s <-> MFU
- `reliability` job MTBF, checkpoint interval (loss budget, Young/Daly), save fraction
- `layout`      memory per GPU of a layout; `choose` proposes or validates one
- `simulate`    Monte Carlo goodput under GPU failures, best checkpoint interval; `recovery_sim`
                the cost of each failure per mechanism (requeue, spare, shrink) and the spares;
                `run_inputs` its cost inputs from a run's ledger; `sim_cli` `plan simulate`
- `inputs`      planner inputs from site/job YAML; `cli` the command; `show` its rich output

Nothing here imports torch; numpy and rich load only inside the functions that need them.
Invalid inputs raise `dslurm.errors.UserError` naming the field and the value.
"""
