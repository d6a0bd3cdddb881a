"""The training front end: flat gradient buffer, fused optimizers, the sharded front end."""
from memkern.optim.fused_adamw import FusedAdamW
from memkern.optim.fused_sgd import FusedSGD
from memkern.optim.grad_buffer import GradBuffer
from memkern.optim.sharded import ShardedOptimizer

__all__ = ["FusedAdamW", "FusedSGD", "GradBuffer", "ShardedOptimizer"]
