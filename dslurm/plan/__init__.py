"""`dslurm plan`: the arithmetic of a distributed run, as pure functions.

- `memory`      persistent state (byte layout, ZeRO-1/2/3, FSDP) and activations from shapes
- `comms`       ring all-reduce / reduce-scatter / all-gather volumes and link time
- `pipeline`    bubble (p-1)/(m+p-1), tensor-parallel shard shapes
- `mfu`         PaLM model FLOPs per token, MFU
- `reliability` job MTBF, checkpoint interval (loss budget, Young/Daly), save fraction
- `layout`      memory per GPU of a layout; `choose` proposes or validates one
- `simulate`    Monte Carlo goodput under GPU failures, best checkpoint interval
- `inputs`      planner inputs from site/job YAML; `cli` the command

Nothing here imports torch; numpy and rich load only inside the functions that need them.
Invalid inputs raise `dslurm.errors.UserError` naming the field and the value.
"""
