"""memkern.profile: memory accounting — bytes saved for backward, allocation peaks."""
from memkern.profile.allocations import AllocationStats, allocation_stats, peak_allocated_bytes
from memkern.profile.memory import (MemoryBreakdown, Measurement, measure, memory_breakdown,
                                    reachable_bytes)
from memkern.profile.saved import SavedTensorsRecorder, note_saved, recording, saved_bytes

__all__ = ["AllocationStats", "MemoryBreakdown", "Measurement", "measure", "memory_breakdown", "reachable_bytes", "SavedTensorsRecorder", "allocation_stats", "note_saved",
           "peak_allocated_bytes", "recording", "saved_bytes"]
