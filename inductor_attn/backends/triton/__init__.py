"""Our own Triton attention kernels, one module per kernel family (dense, split-K decode, ...)."""
