"""The block-wise 8-bit optimizer-state format every backend shares (constants only, no
``triton`` import, so :mod:`memkern.ops` can read them): the map is defined and justified in
:mod:`memkern.ops.adamw8bit`; the backends' shared helpers of the format
(:mod:`memkern.kernels.quantize8bit`, csrc/cpu/state8bit.h, csrc/cuda/kernels/state8bit.cuh)
use these numbers, the C++ ones from csrc/math/state8bit.h, checked at import to be these."""
from memkern._extension import check_same_in_cpp

QBLOCK = 256
"""Elements per quantization block (one float32 absmax each, per moment; why 256:
:mod:`memkern.ops.adamw8bit`); the flat layout's alignment
(:data:`memkern.optim.grad_buffer.ALIGN`), so blocks never span two parameters or two ZeRO
shards."""
SIGNED_CODES, SIGNED_POWER = 127, 2
"""First moment: int8 codes ``c``, value ``sign(c) * (|c| / 127) ** 2 * absmax``."""
UNSIGNED_CODES, UNSIGNED_POWER = 255, 4
"""Second moment: uint8 codes ``c``, value ``(c / 255) ** 4 * absmax``."""


check_same_in_cpp(__name__, {"STATE8BIT_QBLOCK": QBLOCK, "STATE8BIT_SIGNED_CODES": SIGNED_CODES,
                             "STATE8BIT_UNSIGNED_CODES": UNSIGNED_CODES,
                             "STATE8BIT_SIGNED_POWER": SIGNED_POWER,
                             "STATE8BIT_UNSIGNED_POWER": UNSIGNED_POWER})


def num_blocks(n: int) -> int:
    """Quantization blocks (absmax entries) of an ``n``-element buffer."""
    return -(-n // QBLOCK)
