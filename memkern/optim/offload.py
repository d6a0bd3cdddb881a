"""``offload="cpu"``: the optimizer step of :class:`~memkern.optim.ShardedOptimizer` runs on the
CPU, with the float32 master weights, the optimizer state and the step counters in host
memory, updated by the C++ CPU kernel (``memkern.ops.adamw_step_`` / ``sgd_step_`` on CPU
tensors).

When the model is on the CPU already there is nothing to move: the segments read the
gradients and update the weights in place, and only the placement of the state differs from
``offload=None`` (host memory either way). When the model is on a GPU, :class:`HostOffload`
keeps pinned host copies of this rank's slices of the gradients and weights, and a step is::

    side stream:  wait for the reduced gradients | D2H grads 0 | D2H grads 1 | ...
    host:                        wait grads 0 | CPU step 0 | wait grads 1 | CPU step 1 | ...
    side stream:                                H2D weights 0 |            H2D weights 1 | ...
    current stream waits for the side stream (then the all-gather and the next forward)

so copies overlap the CPU steps of other segments. The host has to wait for the gradients it
steps on: offloading trades that one wait per segment (and PCIe traffic of
``2 (grads) + 2 (weights)`` bytes per parameter for 16-bit models) for 12 bytes per parameter
of GPU memory. Memory per rank on the GPU is then the weights and the gradients and
nothing else: 4 bytes per parameter for 16-bit with stage 1, 2 + 2/W with stage 2.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from memkern.optim.flat_state import Segment


class HostOffload:
    """Pinned host copies of device slices, and the pipelined step over them.

    Args:
        device_views: per segment, ``(grads, weights)``: this rank's slices of the reduced
            gradients and of the model weights on the GPU (1-D, same length).

    ``grads[i]`` and ``weights[i]`` are the host tensors segment ``i`` is built on: pinned,
    of the device tensors' dtypes. For float32 parameters ``weights[i]`` is the master itself
    (the kernel updates it in place); for 16-bit ones the kernel rewrites it from the master.
    """

    def __init__(self, device_views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.device_views = device_views
        self.grads = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                      for g, _ in device_views]
        self.weights = [torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
                        for _, w in device_views]
        device = device_views[0][1].device
        self.stream = torch.cuda.Stream(device)
        # grad_multiplier and found_inf, as the CPU kernel reads them.
        self.scalars = torch.empty(2, dtype=torch.float32, pin_memory=True)
        self.pull_weights()

    def pull_weights(self) -> None:
        """The device weights into the host copies (waits): before the masters are made from
        them at the first step or load, so weights loaded into the model since count."""
        for (_, device_w), host_w in zip(self.device_views, self.weights):
            host_w.copy_(device_w)

    def step(self, segments: list[Segment],
             update: Callable[[Segment, torch.Tensor, torch.Tensor], None],
             grad_multiplier: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Runs ``update(segment, grad_multiplier, found_inf)`` on the CPU for every segment,
        with the gradients copied in before and the weights copied out after each."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)  # the reduced gradients and the multiplier are ready
        arrived = []
        with torch.cuda.stream(self.stream):
            self.scalars.copy_(torch.stack([grad_multiplier.reshape(()).float(),
                                            found_inf.reshape(()).float()]), non_blocking=True)
            for (device_g, _), host_g in zip(self.device_views, self.grads):
                host_g.copy_(device_g, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                arrived.append(event)
        multiplier, inf = self.scalars[0:1], self.scalars[1:2]
        for seg, event, (_, device_w), host_w in zip(segments, arrived, self.device_views,
                                                     self.weights):
            # Also orders this step's writes to host_w after the previous step's H2D copy of
            # it, which came earlier on the same stream.
            event.synchronize()
            update(seg, multiplier, inf)
            with torch.cuda.stream(self.stream):
                device_w.copy_(host_w, non_blocking=True)
        current.wait_stream(self.stream)
