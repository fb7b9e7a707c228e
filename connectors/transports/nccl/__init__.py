"""KV transfer over torch.distributed point-to-point: NCCL for CUDA pools, Gloo for CPU pools."""
