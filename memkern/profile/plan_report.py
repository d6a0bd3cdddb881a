"""A :class:`~memkern.profile.plan.StepPlan` as a table, and as a stacked bar chart."""
from __future__ import annotations

import textwrap
from collections.abc import Sequence

from memkern.output import table, width
from memkern.plot import stacked_bars
from memkern.profile.plan import CATEGORIES, Moment, StepPlan

MIB = 1 << 20
SHORT = {"parameters": "params", "gradients": "grads", "master weights": "master",
         "optimizer state": "opt state", "saved for backward": "saved",
         "kept from forward": "kept", "transient": "temp"}
"""The categories' column headers in the tables (:data:`LEGEND` spells them out)."""
LEGEND = "; ".join(f"{short}: {cat}" for cat, short in SHORT.items())
TOP = 6
"""Entries listed under each category of a moment, largest first."""
SHOWN = MIB // 20
"""Categories and entries under 0.05 MiB are not listed (they would print as 0.0)."""


def _mib(n: float) -> str:
    return f"{n / MIB:9.1f}"


def _moment_lines(title: str, m: Moment) -> list[str]:
    lines = [f"{title}: {m.allocated / MIB:.1f} MiB in {m.phase}, at {m.op} ({m.where})"]
    for cat in CATEGORIES:
        if m.by_category[cat] < SHOWN:
            continue
        lines.append(f"  {cat:<20} {_mib(m.by_category[cat])} MiB")
        entries = m.saved_by_module if cat == "saved for backward" else m.by_op.get(cat, {})
        shown = [(name, n) for name, n in entries.items() if n >= SHOWN][:TOP]
        for name, n in shown:
            lines.append(f"      {_mib(n)}  {name}")
        if len(entries) > len(shown):
            rest = sum(entries.values()) - sum(n for _, n in shown)
            lines.append(f"      {_mib(rest)}  ({len(entries) - len(shown)} more)")
    return lines


def format_plan(plan: StepPlan) -> str:
    """The plan's peak, its second-highest moment and each phase's peak, taken apart."""
    lines = [f"memkern plan: {plan.description} on {plan.device}",
             f"peak {plan.peak.allocated / MIB:.1f} MiB (run peak {plan.run_peak / MIB:.1f}, "
             f"reserved {plan.reserved / MIB:.1f}); "
             f"step starts at {plan.step_start / MIB:.1f} MiB; planned in {plan.seconds:.1f} s", ""]
    lines += _moment_lines("peak", plan.peak)
    second = plan.second
    if second is not None:
        lines += [""] + _moment_lines("second-highest moment", second)
    lines += _host_lines(plan)
    lines += ["", "each phase's peak, MiB", table(
        ["phase", "peak", *(SHORT[c] for c in CATEGORIES)],
        [[phase, f"{m.allocated / MIB:.1f}", *(f"{m.by_category[c] / MIB:.1f}" for c in CATEGORIES)]
         for phase, m in plan.phase_peaks.items()]), legend()]
    return "\n".join(lines)


def _host_lines(plan: StepPlan) -> list[str]:
    """The host memory the step's offloading holds, by what it holds (none: no lines)."""
    if not plan.host_peak:
        return []
    lines = ["", f"host memory: peak {plan.host_peak / MIB:.1f} MiB, of which pinned "
             f"{plan.host_pinned / MIB:.1f} MiB (pinned blocks: requests rounded up to a power "
             "of two)"]
    lines += [f"  {what:<20} {_mib(n)} MiB" for what, n in plan.host_by_category.items()]
    return lines


def legend() -> str:
    """:data:`LEGEND`, wrapped to the output's width."""
    return textwrap.fill(LEGEND, width=min(width(), 100))


COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")


def plan_chart(plans: Sequence[StepPlan], names: Sequence[str], path: str, title: str) -> None:
    """Stacked bars (MiB) of each plan's peak by category, as the benchmark's ``--plot`` draws."""
    stacked_bars(names, [(cat, [p.peak.by_category[cat] / MIB for p in plans], color)
                         for cat, color in zip(CATEGORIES, COLORS)],
                 [p.peak.allocated / MIB for p in plans], "planned peak", path, title)
