"""``LossScaler``: dynamic loss scaling with ``torch.amp.GradScaler``'s rules, on the device.

Rules (one :meth:`LossScaler.update` per optimizer step, i.e. per accumulation window):

* overflow (``found_inf`` non-zero): the step is skipped by whoever applies it; the growth
  tracker restarts, and the scale is multiplied by ``backoff_factor``, but never below
  ``min_scale``. With ``hysteresis = h > 1`` the first ``h - 1`` overflows only use up an
  allowance and leave the scale as it is (Megatron-LM's rule); the allowance refills when the
  scale grows.
* ``growth_interval`` overflow-free updates in a row: the scale is multiplied by
  ``growth_factor`` (kept only if the result is finite) and the tracker restarts.

With ``min_scale`` below the scale's reach and ``hysteresis=1`` the trajectory is
``torch.amp.GradScaler``'s exactly: same float64 products rounded to float32, same tracker.

Nothing here reads a device value on the host in the step loop. The one thing the host must
learn, overflow that continues while the scale cannot go lower, reaches it through a
one-element host mirror: on CPU the tensor itself; on CUDA a copy to pinned memory whose
event is checked (never waited for) at the next update, so there the warning (or error) comes
one update late, or later if the device runs further behind.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from memkern import ops
from memkern._fake import is_fake


@runtime_checkable
class FlatGradients(Protocol):
    """What :meth:`LossScaler.unscale_` reads of a :class:`~memkern.GradBuffer`: its flat
    buffers (``buckets``, each with its ``grads``) and their ``device``. A protocol, so that
    this module (which ``memkern.optim`` imports) does not import ``memkern.optim``."""

    buckets: list
    device: torch.device


class _HostMirror:
    """The value of a one-element int32 device tensor as the host last saw it, without waiting.

    :meth:`poll` returns the newest value that has reached the host since the previous poll,
    or None when the copy in flight has not landed yet (CUDA); then it starts the next copy.
    A fake tensor (:mod:`memkern._fake`) has no value: its poll is always None.
    """

    def __init__(self, src: torch.Tensor) -> None:
        self._src = src
        self._cuda = src.device.type == "cuda"
        self._numpy = None
        if is_fake(src):
            return
        if src.device.type == "cpu":
            self._host = src  # already host memory: read in place
        else:
            self._host = torch.zeros_like(src, device="cpu")
            if self._cuda:
                self._host = self._host.pin_memory()
                self._event = torch.cuda.Event()
        self._numpy = self._host.view(-1).numpy()  # read through numpy: no tensor op
        self._in_flight = False

    def poll(self) -> int | None:
        if self._numpy is None:
            return None
        if self._host is self._src:
            return int(self._numpy[0])
        if not self._cuda:  # another device: a plain (waiting) copy
            self._host.copy_(self._src)
            return int(self._numpy[0])
        value = None
        if self._in_flight:
            if not self._event.query():
                return None
            value = int(self._numpy[0])
        self._host.copy_(self._src, non_blocking=True)
        self._event.record()
        self._in_flight = True
        return value


class LossScaler:
    """Dynamic loss scaling for float16/bfloat16 training, with the state on the device.

    Args:
        init_scale: the first scale.
        growth_factor: > 1; applied after ``growth_interval`` overflow-free updates.
        backoff_factor: in (0, 1); applied on overflow.
        growth_interval: overflow-free updates between growths (>= 1).
        min_scale: the scale never backs off below this (> 0, <= ``init_scale``).
        hysteresis: overflows tolerated before the scale backs off (>= 1; 1 is torch's rule).
        enabled: False makes :meth:`scale` the identity, :meth:`unscale_` only return a zero
            ``found_inf`` and :meth:`update` a no-op, as ``GradScaler(enabled=False)`` does.
        dynamic: False keeps the scale at ``init_scale`` for good (a static loss scale);
            overflowed steps are still reported through ``found_inf`` and warned about.
        on_min_scale_overflow: ``"warn"`` (default) or ``"raise"``: what happens when steps
            keep overflowing while the scale is at ``min_scale`` (or static) and cannot back
            off. ``"warn"`` issues a RuntimeWarning with the count of consecutive skipped
            steps, the first time and again each time the count has doubled; ``"raise"``
            raises RuntimeError (on CUDA one update after the fact: see the module docstring).

    Device state (float32 scale, int32 trackers) is created on the device of the first tensor
    it meets (:meth:`scale`'s loss or :meth:`unscale_`'s gradients).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, hysteresis: int = 1, enabled: bool = True, *,
                 dynamic: bool = True, on_min_scale_overflow: str = "warn") -> None:
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale)
                and init_scale > 0):
            raise ValueError(f"memkern.LossScaler: init_scale must be a finite number > 0, got "
                             f"{init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"memkern.LossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"memkern.LossScaler: backoff_factor must be in (0, 1), got "
                             f"{backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"memkern.LossScaler: growth_interval must be an int >= 1, got "
                             f"{growth_interval!r}")
        if not 0.0 < min_scale <= init_scale:
            raise ValueError(f"memkern.LossScaler: min_scale must be in (0, init_scale="
                             f"{init_scale}], got {min_scale}")
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"memkern.LossScaler: hysteresis must be an int >= 1, got "
                             f"{hysteresis!r}")
        if on_min_scale_overflow not in ("warn", "raise"):
            raise ValueError(f"memkern.LossScaler: on_min_scale_overflow must be 'warn' or "
                             f"'raise', got {on_min_scale_overflow!r}")
        self.enabled = bool(enabled)
        self.dynamic = bool(dynamic)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.on_min_scale_overflow = on_min_scale_overflow
        # Host copies of the initial values: used until the device state exists, and by
        # load_state_dict before it does.
        self._init = {"scale": float(init_scale), "growth_tracker": 0,
                      "hysteresis_left": hysteresis, "consecutive_skips": 0}
        self._t: dict[str, torch.Tensor] | None = None
        self._mirror: _HostMirror | None = None
        self._warned_at = 0

    # ----------------------------------------------------------------------------- device state
    def _state(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The device tensors, created on ``device`` on first use."""
        if self._t is None:
            i = self._init
            self._t = {
                "scale": torch.full((), i["scale"], dtype=torch.float32, device=device),
                "growth_tracker": torch.full((), i["growth_tracker"], dtype=torch.int32,
                                             device=device),
                "hysteresis_left": torch.full((), i["hysteresis_left"], dtype=torch.int32,
                                              device=device),
                "consecutive_skips": torch.full((), i["consecutive_skips"], dtype=torch.int32,
                                                device=device),
                # consecutive_skips when the last update overflowed with the scale at its floor,
                # else 0: the one number the host watches.
                "skips_at_floor": torch.zeros((), dtype=torch.int32, device=device),
            }
            self._mirror = _HostMirror(self._t["skips_at_floor"])
        return self._t

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The current scale: a 0-dim float32 tensor on the device (no host sync)."""
        return self._state(device)["scale"]

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        """1 / scale as a 0-dim float32 device tensor; the reciprocal is taken in float64, as
        GradScaler does (ones where scaling is disabled)."""
        if not self.enabled:
            return torch.ones((), dtype=torch.float32, device=device)
        return self.scale_tensor(device).double().reciprocal().float()

    # ------------------------------------------------------------------------------ the API
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (``loss`` unchanged when disabled); no host sync."""
        if not self.enabled:
            return loss
        scale = self.scale_tensor(loss.device)
        return loss * scale.to(loss.device, non_blocking=True)

    def unscale_(self, grads: FlatGradients | Iterable[torch.Tensor]) -> torch.Tensor:
        """Divides the gradients by the scale in place; returns ``found_inf``.

        ``grads``: a :class:`~memkern.GradBuffer` (one ``memkern.ops.unscale_`` kernel per flat
        buffer) or tensors (torch's fused foreach kernel, one call per dtype). ``found_inf`` is
        a new 0-dim float32 tensor on the gradients' device, 1.0 if any gradient held an
        inf/NaN before unscaling, else 0.0. Nothing is read on the host.
        """
        flat_buffers = isinstance(grads, FlatGradients)
        if flat_buffers:
            flats = [b.grads for b in grads.buckets]
            device = grads.device
        else:
            flats = list(grads)
            if not flats:
                raise ValueError("memkern.LossScaler.unscale_: grads is empty")
            device = flats[0].device
            for g in flats:
                if g.layout != torch.strided or g.device != device:
                    raise ValueError(
                        "memkern.LossScaler.unscale_: grads must be dense tensors on one device; "
                        f"got a {g.layout} tensor on {g.device} next to {device}"
                    )
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if not self.enabled:
            return found_inf
        inv_scale = self.inv_scale(device)
        if flat_buffers:
            for flat in flats:
                ops.unscale_(flat, found_inf, inv_scale)
        else:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in flats:
                by_dtype.setdefault(g.dtype, []).append(g)
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """Adjusts the scale after one optimizer step (one accumulation window).

        ``found_inf``: one-element tensor on the scale's device, non-zero when that step's
        gradients overflowed. Runs as a few device ops, no host sync.
        """
        if not self.enabled:
            return
        t = self._state(found_inf.device)
        found = found_inf.reshape(()) != 0
        scale = t["scale"]
        at_floor = found if not self.dynamic else found & (scale <= self.min_scale)
        consecutive = torch.where(found, t["consecutive_skips"] + 1, 0)
        t["skips_at_floor"].copy_(torch.where(at_floor, consecutive, 0))
        t["consecutive_skips"].copy_(consecutive)
        if self.dynamic:
            hysteresis_left = torch.where(found, (t["hysteresis_left"] - 1).clamp_min(0),
                                          t["hysteresis_left"])
            back_off = found & (hysteresis_left == 0)
            tracker = torch.where(found, 0, t["growth_tracker"] + 1)
            grow = tracker >= self.growth_interval
            # GradScaler's products are float64 rounded to float32; match them bit for bit.
            scale64 = scale.double()
            backed_off = (scale64 * self.backoff_factor).float().clamp_min(self.min_scale)
            grown = (scale64 * self.growth_factor).float()
            grown = torch.where(torch.isfinite(grown), grown, scale)
            scale.copy_(torch.where(back_off, backed_off, torch.where(grow, grown, scale)))
            t["growth_tracker"].copy_(torch.where(grow, 0, tracker))
            t["hysteresis_left"].copy_(torch.where(grow, self.hysteresis, hysteresis_left))
        if not (found_inf.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._report_floor_overflow()  # a host read: never inside a CUDA graph capture

    def _report_floor_overflow(self) -> None:
        count = self._mirror.poll()
        if count is None:
            return
        if count == 0:
            self._warned_at = 0
            return
        where = (f"the loss scale is already at min_scale={self.min_scale:g} and cannot back off "
                 "further" if self.dynamic else
                 f"the loss scale is static ({self._init['scale']:g})")
        message = (f"memkern.LossScaler: gradients held inf/NaN in {count} consecutive steps, all "
                   f"skipped, and {where}: the model produces non-finite gradients at this "
                   "scale. Check the loss, the learning rate and the input data"
                   + (", or lower min_scale" if self.dynamic else "") + ".")
        if self.on_min_scale_overflow == "raise":
            raise RuntimeError(message)
        if count >= 2 * self._warned_at:
            self._warned_at = count
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reads the device: syncs."""
        if not self.enabled:
            return 1.0
        if self._t is None:
            return self._init["scale"]
        return float(self._t["scale"].item())

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ``min_scale``, ``hysteresis``,
        ``dynamic``, ``_hysteresis_tracker`` and ``_consecutive_skips``; empty when disabled.
        Reads the device (not for the step loop)."""
        if not self.enabled:
            return {}
        values = (self._init if self._t is None else
                  {k: v.item() for k, v in self._t.items()})
        return {
            "scale": float(values["scale"]),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(values["growth_tracker"]),
            "min_scale": self.min_scale,
            "hysteresis": self.hysteresis,
            "dynamic": self.dynamic,
            "_hysteresis_tracker": int(values["hysteresis_left"]),
            "_consecutive_skips": int(values["consecutive_skips"]),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output, or a ``torch.amp.GradScaler`` state dict (the
        memkern-only settings then keep their current values)."""
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "memkern.LossScaler.load_state_dict: the state dict is empty (saved from a "
                "disabled scaler?)"
            )
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self.min_scale = float(state_dict.get("min_scale", self.min_scale))
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self.dynamic = bool(state_dict.get("dynamic", self.dynamic))
        self._init = {
            "scale": float(state_dict["scale"]),
            "growth_tracker": int(state_dict["_growth_tracker"]),
            "hysteresis_left": int(state_dict.get("_hysteresis_tracker", self.hysteresis)),
            "consecutive_skips": int(state_dict.get("_consecutive_skips", 0)),
        }
        if self._t is not None:
            for key, value in self._init.items():
                self._t[key].fill_(value)
            self._t["skips_at_floor"].zero_()
        self._warned_at = 0

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (f"LossScaler({kind}, enabled={self.enabled}, growth_factor={self.growth_factor}, "
                f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
                f"min_scale={self.min_scale}, hysteresis={self.hysteresis})")
