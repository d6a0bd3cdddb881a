"""Run by tests/test_profile_plan_ranks.py under ``torchrun``: for each workload, each rank
trains a small Llama built by :func:`memkern.profile.hf_workload` (with its ``sharding``) on
real tensors (gloo on the CPU) and measures what it holds and its step's peak: the persistent
storages (parameters, gradients, optimizer state: each storage once) when the measured step
starts, plus the peak of the profiler's allocation trace during that step
(``memkern.profile.allocation_stats``). Rank 0 writes its figures to ``--result`` as JSON.

The step is measured ``STEPS`` times and the least peak kept: gloo frees its full-size copy
inside an all-gather on its worker thread, and when that thread runs late (a loaded machine)
the copy overlaps the caller's next temporary, adding up to one more full-size buffer to that
step's peak (seen 1 step in 3 with two busy loops beside the ranks: 14970921 B instead of
13857896 B for ZeRO-1). The plan counts the ordered case, which every step reaches when the
worker keeps up.
"""
import argparse
import json

import torch
import torch.distributed as dist

from memkern.profile import allocation_stats, hf_config, hf_workload, memory_breakdown

STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="JSON: hf_config's overrides")
    parser.add_argument("--workloads", required=True,
                        help="JSON: a list of hf_workload's keyword arguments")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    measured = []
    for workload in json.loads(args.workloads):
        workload["dtype"] = getattr(torch, workload["dtype"])
        setup = hf_workload(hf_config("llama", json.loads(args.config)), **workload)()
        setup.step()  # the optimizer's state exists from here on, as in the plan's measured step
        held = memory_breakdown(setup.model, setup.optimizer).total
        step_peak = min(allocation_stats(setup.step).peak for _ in range(STEPS))
        measured.append({"held": held, "step_peak": step_peak})
        del setup
    if dist.get_rank() == 0:
        with open(args.result, "w") as fh:
            json.dump(measured, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
