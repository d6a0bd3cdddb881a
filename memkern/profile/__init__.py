"""memkern.profile: memory accounting — bytes saved for backward, allocation peaks, and the
planner, which measures a training step's device memory on fake tensors."""
from memkern.profile.allocations import AllocationStats, allocation_stats, peak_allocated_bytes
from memkern.profile.memory import (
                                    Measurement,
                                    MemoryBreakdown,
                                    measure,
                                    memory_breakdown,
                                    reachable_bytes,
)
from memkern.profile.plan import Moment, StepPlan, TrainingSetup, on_host, plan_training_step
from memkern.profile.plan_report import format_plan
from memkern.profile.saved import SavedTensorsRecorder, note_saved, recording, saved_bytes
from memkern.profile.workloads import hf_config, hf_workload

__all__ = ["Moment", "StepPlan", "TrainingSetup", "hf_config", "hf_workload",
           "on_host", "plan_training_step", "AllocationStats", "MemoryBreakdown", "Measurement",
           "measure", "memory_breakdown", "reachable_bytes", "SavedTensorsRecorder",
           "allocation_stats", "note_saved", "peak_allocated_bytes", "recording", "saved_bytes",
           "format_plan"]
