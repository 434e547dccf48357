"""Benchmark suite: ckptstore against torch.save, safetensors, tensordict memmap, TorchRL
``ReplayBuffer.dumps`` and ``torchrl.checkpoint.Checkpoint``, and torch.distributed.checkpoint.

Run ``python -m benchmarks.run --help``; see benchmarks/README.md.
"""
