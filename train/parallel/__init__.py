"""One module per parallelism, applied in torchtitan's order: TP(+SP, loss parallel) ->
activation checkpointing -> compile -> FSDP2/HSDP -> pipeline (each stage built from the
full model). `train.parallel.build.parallelize` strings them together."""
