"""The cross-entropy rows op's per-row statistics: the bits of its ``outputs`` and the row of
its ``[3, n]`` ``stats`` each one is written to (contracts: :mod:`memkern.ops.cross_entropy`).
Shared by the Triton kernels (:mod:`memkern.kernels.cross_entropy`), the ops and the C++
kernels (csrc/cuda/kernels/cross_entropy_math.h, whose values ``_C`` exports and this module
checks). Imports no Triton, so that the ops can read it.
"""
from __future__ import annotations

from memkern._extension import check_same_in_cpp

ROW_ENTROPY, ROW_IS_TOP1, ROW_MEAN_LOGIT = 1, 2, 4
"""Bits of the rows op's ``outputs``: the per-row statistics it writes into ``stats``."""
ENTROPY_ROW, IS_TOP1_ROW, MEAN_LOGIT_ROW = 0, 1, 2
"""The row of ``stats`` each statistic is written to."""

check_same_in_cpp(__name__, {"CE_ROW_ENTROPY": ROW_ENTROPY, "CE_ROW_IS_TOP1": ROW_IS_TOP1,
                             "CE_ROW_MEAN_LOGIT": ROW_MEAN_LOGIT, "CE_ENTROPY_ROW": ENTROPY_ROW,
                             "CE_IS_TOP1_ROW": IS_TOP1_ROW, "CE_MEAN_LOGIT_ROW": MEAN_LOGIT_ROW})
