from torchtitan.distributed.parallel_dims import ParallelDims, init_distributed

__all__ = ["ParallelDims", "init_distributed"]
