"""Sharded checkpoints of :class:`~memkern.optim.ShardedOptimizer` through
``torch.distributed.checkpoint`` (DCP): each rank writes the slices of the state it owns and
reads back the parts of the saved slices it owns at load, at any world size.

Format: a DCP checkpoint directory with

=================================  ========================================================
``memkern.header``                 a ``torch.save``'d dict (read with ``weights_only=True``):
                                   format, param groups (torch format), parameter shapes,
                                   state keys and step per parameter, loss scaler, skipped
                                   steps, the open window's counters and its item count
                                   summed over ranks
``state.<i>.<key>.<start>``        float32, elements ``[start, start + n)`` of parameter
                                   ``i``'s flattened state ``key`` (``exp_avg``, ...,
                                   ``master_param`` for 16-bit parameters), saved by the rank
                                   that owned them
``window.<i>.<start>``             the same for the open window's gradient, summed over ranks
``memkern-complete.json``          written last (see below)
=================================  ========================================================

Pieces are named in per-parameter coordinates, which do not depend on the world size or the
zero stage: a loading rank reads the metadata, finds the saved pieces that overlap the
slices it owns now, and reads only those. What a rank holds where comes from the optimizer's
:class:`~memkern.optim.state_io.StateIO`, which is all this module sees of the optimizer.

Atomicity: the checkpoint is written into ``<path>.incomplete`` (a stale one from an earlier
failed save is removed first); once every rank has written its part and DCP its metadata,
rank 0 writes the completion marker and renames the directory to ``path`` (a previous
checkpoint at ``path`` is moved aside first and deleted last). A save that dies at any point
leaves ``path`` as it was, or, between the two renames, no ``path`` at all (the old and new
checkpoints both complete on disk, under ``<path>.old`` and ``<path>.incomplete``); loading
requires the marker. Assumes, as DCP's file system storage does, that every rank sees the
same file system.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from memkern.optim.state_io import StateIO

FORMAT = "memkern-sharded-optimizer/1"
HEADER = "memkern.header"
MARKER = "memkern-complete.json"


def _barrier(state_io: StateIO) -> None:
    if state_io.world_size > 1:
        torch.distributed.barrier(group=state_io.process_group)


def _on_rank_0(state_io: StateIO, what: str, fn: Callable[[], None]) -> None:
    """Runs ``fn`` on rank 0 and raises its error on every rank (a barrier otherwise): a file
    system step that fails on rank 0 must not leave the other ranks waiting in a collective
    that rank 0 never reaches."""
    error = None
    if state_io.rank == 0:
        try:
            fn()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if state_io.world_size > 1:
        box = [error]
        torch.distributed.broadcast_object_list(
            box, src=torch.distributed.get_global_rank(state_io.process_group, 0),
            group=state_io.process_group)
        error = box[0]
    if error is not None:
        raise OSError(f"memkern.ShardedOptimizer.save_sharded: {what} failed on rank 0: {error}")


def _dcp_call(state_io: StateIO, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` (dcp.save or dcp.load) over the optimizer's process group; in one process
    without torch.distributed, without DCP's warning that it assumes exactly that."""
    with warnings.catch_warnings():
        if state_io.process_group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, process_group=state_io.process_group, **kwargs)


def _header(state_io: StateIO) -> dict[str, Any]:
    """Everything but the tensors; the same on every rank (collective: the item count)."""
    params = state_io.params()
    keys, steps = {}, {}
    if state_io.opt._state_ready:
        for i, p in enumerate(params):
            seg = state_io.segment_of(p)
            keys[i], steps[i] = list(seg.state), float(seg.step)
    return {
        "format": FORMAT,
        "world_size": state_io.world_size,
        # Optimizer.state_dict skipping the subclasses: the param groups only (no gathering).
        "param_groups": torch.optim.Optimizer.state_dict(state_io.opt)["param_groups"],
        "shapes": [tuple(p.shape) for p in params],
        "keys": keys,
        "steps": steps,
        "loss_scaler": state_io.scaler.state_dict(),
        "skipped_steps": int(state_io.skipped.item()),
        "window": state_io.window_state(),
    }


def save_sharded(state_io: StateIO, path: str | os.PathLike) -> None:
    """Writes the optimizer's state, as ``state_io`` locates it, to ``path`` (collective;
    :meth:`ShardedOptimizer.save_sharded` says what it guarantees)."""
    # Imported here: torch.distributed.checkpoint takes about a second to import.
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    staging = path + ".incomplete"

    def fresh_staging() -> None:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)

    _on_rank_0(state_io, f"creating {staging}", fresh_staging)
    header = _header(state_io)
    buffer = io.BytesIO()
    torch.save(header, buffer)
    tensors: dict[str, Any] = {HEADER: buffer.getvalue()}
    params = state_io.params()
    for i, p in enumerate(params):
        for key in header["keys"].get(i, []):
            for flat, start in state_io.state_pieces(p, key):
                tensors[f"state.{i}.{key}.{start}"] = flat
    if state_io.window.micro_batches:
        pieces = state_io.window_grad_pieces()
        for i, p in enumerate(params):
            for flat, start in pieces[id(p)]:
                tensors[f"window.{i}.{start}"] = flat
    _dcp_call(state_io, dcp.save, tensors, storage_writer=dcp.FileSystemWriter(staging))
    _barrier(state_io)  # every rank's data and DCP's metadata are written
    _on_rank_0(state_io, f"publishing {staging} as {path}",
               lambda: _publish(staging, path, header))


def _publish(staging: str, path: str, header: dict[str, Any]) -> None:
    """Marks ``staging`` complete and renames it to ``path``."""
    marker = os.path.join(staging, MARKER)
    with open(marker, "w") as fh:
        json.dump({"format": FORMAT, "world_size": header["world_size"]}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def load_sharded(state_io: StateIO, path: str | os.PathLike) -> None:
    """Reads the pieces of a checkpoint written by :func:`save_sharded` that this rank owns
    into the optimizer's state, as ``state_io`` locates it (collective)."""
    import torch.distributed.checkpoint as dcp

    name = "memkern.ShardedOptimizer.load_sharded"
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(os.path.join(path, MARKER)):
        state = "does not exist" if not os.path.exists(path) else "has no completion marker"
        raise FileNotFoundError(
            f"{name}: {path} {state}: it is not a complete memkern sharded checkpoint (a save "
            f"that was interrupted leaves its data in {path}.incomplete and never marks it "
            "complete); load an earlier checkpoint"
        )
    reader = dcp.FileSystemReader(path)
    loaded: dict[str, Any] = {HEADER: b""}
    _dcp_call(state_io, dcp.load, loaded, storage_reader=reader)
    header = torch.load(io.BytesIO(loaded[HEADER]), weights_only=True)
    if header.get("format") != FORMAT:
        raise ValueError(f"{name}: {path} has format {header.get('format')!r}, this version "
                         f"reads {FORMAT!r}")
    params = state_io.params()
    shapes = [tuple(p.shape) for p in params]
    if header["shapes"] != shapes:
        bad = next((i for i, (a, b) in enumerate(zip(header["shapes"], shapes)) if a != b),
                   min(len(shapes), len(header["shapes"])))
        raise ValueError(
            f"{name}: {path} was saved for {len(header['shapes'])} parameters, this optimizer has "
            f"{len(shapes)}; the first difference is parameter {bad} (saved "
            f"{header['shapes'][bad] if bad < len(header['shapes']) else None}, here "
            f"{shapes[bad] if bad < len(shapes) else None}): another model or parameter order"
        )
    opt = state_io.opt
    opt._adopt_param_groups(header["param_groups"], name)
    opt._init_state()

    # Where each saved tensor goes: (saved key, its start) -> [(target, target start)].
    saved = defaultdict(list)  # "state.<i>.<key>" / "window.<i>" -> [(start, numel)]
    for fqn, meta in reader.read_metadata().state_dict_metadata.items():
        if fqn != HEADER:
            prefix, start = fqn.rsplit(".", 1)
            saved[prefix].append((int(start), meta.size.numel()))
    wanted: list[tuple[str, list[tuple[torch.Tensor, int]]]] = []
    for i, p in enumerate(params):
        for key in header["keys"].get(i, []):
            pieces = state_io.state_pieces(p, key)
            if pieces is None:
                raise ValueError(f"{name}: saved state {key!r} of parameter {i} is not used by "
                                 "this optimizer (saved by another algorithm or option)")
            wanted.append((f"state.{i}.{key}", pieces))
    targets = state_io.window_grad_targets()
    if header["window"]["micro_batches"]:
        wanted += [(f"window.{i}", targets[id(p)]) for i, p in enumerate(params)]
    reads: dict[str, torch.Tensor] = {}
    copies = []
    for prefix, pieces in wanted:
        for target, start in pieces:
            covered = 0
            for saved_start, numel in saved[prefix]:
                a = max(start, saved_start)
                b = min(start + target.numel(), saved_start + numel)
                if a < b:
                    fqn = f"{prefix}.{saved_start}"
                    if fqn not in reads:
                        reads[fqn] = torch.empty(numel, dtype=target.dtype)
                    copies.append((target[a - start:b - start], fqn, a - saved_start))
                    covered += b - a
            if covered != target.numel():
                raise ValueError(f"{name}: {path} lacks elements of {prefix} (a corrupted "
                                 "checkpoint, or one of another model)")
    _dcp_call(state_io, dcp.load, reads, storage_reader=reader)
    for target, fqn, offset in copies:
        target.copy_(reads[fqn][offset:offset + target.numel()])
    steps = header["steps"]
    opt._set_steps({id(p): steps.get(i, 0.0) for i, p in enumerate(params)}, name)
    state_io.restore(header["loss_scaler"], header["skipped_steps"], header["window"])
