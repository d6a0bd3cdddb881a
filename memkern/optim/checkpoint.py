"""Sharded checkpoints of :class:`~memkern.optim.ShardedOptimizer` through
``torch.distributed.checkpoint`` (DCP): each rank writes the slices of the state it owns and
reads back the parts of the saved slices it owns at load, at any world size.

Format (``memkern-sharded-optimizer/2``): a DCP checkpoint directory with

=================================  ========================================================
``memkern.header``                 a ``torch.save``'d dict (read with ``weights_only=True``):
                                   format, memkern version, the algorithm, param groups
                                   (torch format), parameter shapes and dtypes, state keys
                                   and step per parameter, loss scaler, skipped steps, the
                                   open window's counters, its item count and its passes
                                   that reached no parameter, summed over ranks
``state.<i>.<key>.<start>``        float32, elements ``[start, start + n)`` of parameter
                                   ``i``'s flattened state ``key`` (``exp_avg``, ...,
                                   ``master_param`` for 16-bit parameters), saved by the rank
                                   that owned them
``window.<i>.<start>``             the same for the open window's gradient, summed over ranks
``memkern-complete.json``          written last (see below): the format, the memkern version,
                                   the CRC-32 of DCP's ``.metadata`` file and of every item's
                                   bytes in the data files (file, offset, length), and of
                                   its own other fields
=================================  ========================================================

Pieces are named in per-parameter coordinates, which do not depend on the world size or the
zero stage: a loading rank reads the metadata, finds the saved pieces that overlap the
slices it owns now, and reads only those. This module sees the optimizer only through the
:class:`~memkern.optim.state_io.StateIO` the optimizer builds over its parts: what a rank holds
where, and the loss scaler, accumulation window and step counts the header records.

Atomicity: the checkpoint is written into ``<path>.incomplete`` (a stale one from an earlier
failed save is removed first); once every rank has written its part and DCP its metadata, the
ranks checksum the written bytes (each a 1/W share of the items), and rank 0 writes the
completion marker and renames the directory to ``path`` (a previous checkpoint at ``path`` is
moved to ``<path>.old`` first and deleted last). A save killed at any point leaves ``path`` as
it was, or a marked ``<path>.incomplete``: the newest complete checkpoint, which
:func:`is_complete` counts and :func:`load_sharded` (or the next save) publishes first. Loading
requires the marker. Assumes, as DCP's file system storage does, that every rank sees the same
file system.

Integrity: before anything of the optimizer or the model is changed, a load checks every
byte against the marker's CRCs (each rank a 1/W share, the ranks then agree), then the header
against this optimizer (format, parameter shapes and dtypes, algorithm, param groups, state
precision, state keys); a mismatch raises the same one-line error on every rank, naming the
file and what does not match, and leaves the optimizer and the model as they were.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import memkern
from memkern.optim.state_io import StateIO

FORMAT = "memkern-sharded-optimizer/2"
HEADER = "memkern.header"
MARKER = "memkern-complete.json"
METADATA = ".metadata"
"""DCP's metadata file (``torch.distributed.checkpoint.filesystem``'s name for it)."""
STAGING, OLD = ".incomplete", ".old"
"""Suffixes of the directory a save writes, and of the checkpoint it replaces while
publishing."""
_CHUNK = 1 << 24


def _barrier(state_io: StateIO) -> None:
    if state_io.world_size > 1:
        torch.distributed.barrier(group=state_io.process_group)


def _on_rank_0(state_io: StateIO, name: str, what: str, fn: Callable[[], None]) -> None:
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
        raise OSError(f"{name}: {what} failed on rank 0: {error}")


def _agree(state_io: StateIO, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on every rank; if it raised ValueError or OSError on any rank, raises the
    first rank's error on every rank (so that no rank goes on to change its state, or into a
    collective the others never reach). Returns ``fn``'s result."""
    result, error = None, None
    try:
        result = fn()
    except (ValueError, OSError) as e:
        error = e
    if state_io.world_size > 1:
        errors: list[Exception | None] = [None] * state_io.world_size
        torch.distributed.all_gather_object(errors, error, group=state_io.process_group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return result


def _dcp_call(state_io: StateIO, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` (dcp.save or dcp.load) over the optimizer's process group; in one process
    without torch.distributed, without DCP's warning that it assumes exactly that."""
    with warnings.catch_warnings():
        if state_io.process_group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, process_group=state_io.process_group, **kwargs)


# ------------------------------------------------------------------------------ checksums
def _crc32(name: str, file: str, offset: int = 0, length: int | None = None) -> int:
    """CRC-32 of ``length`` bytes of ``file`` from ``offset`` (None: to its end); a missing
    or short file raises ValueError naming it."""
    if not os.path.isfile(file):
        raise ValueError(f"{name}: {file} is missing")
    size = os.path.getsize(file)
    if length is None:
        length = size - offset
    if offset + length > size:
        raise ValueError(f"{name}: {file} is truncated: {size} bytes, the checkpoint's data "
                         f"reach byte {offset + length}")
    crc = 0
    with open(file, "rb") as fh:
        fh.seek(offset)
        left = length
        while left:
            chunk = fh.read(min(left, _CHUNK))
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def _item_key(info: Any) -> str:
    """The marker's key of one stored item: ``<file>:<offset>:<length>``."""
    return f"{info.relative_path}:{info.offset}:{info.length}"


def _my_items(state_io: StateIO, metadata: Any) -> dict[str, tuple[str, Any]]:
    """This rank's 1/W share of the stored items: key -> (the item's name, its storage)."""
    items = sorted(((_item_key(info), index.fqn, info)
                    for index, info in metadata.storage_data.items()), key=lambda t: t[0])
    return {key: (fqn, info) for n, (key, fqn, info) in enumerate(items)
            if n % state_io.world_size == state_io.rank}


def _checksums(state_io: StateIO, directory: str, name: str) -> dict[str, int]:
    """CRC-32 of every stored item's bytes, each rank reading its share (collective)."""
    import torch.distributed.checkpoint as dcp

    def mine() -> dict[str, int]:
        metadata = dcp.FileSystemReader(directory).read_metadata()
        return {key: _crc32(name, os.path.join(directory, info.relative_path), info.offset,
                            info.length)
                for key, (_, info) in _my_items(state_io, metadata).items()}

    crcs = _agree(state_io, mine)
    if state_io.world_size > 1:
        shares: list[dict[str, int] | None] = [None] * state_io.world_size
        torch.distributed.all_gather_object(shares, crcs, group=state_io.process_group)
        crcs = {k: v for share in shares for k, v in share.items()}
    return crcs


# --------------------------------------------------------------------------------- publish
def _marker_crc(marker: dict[str, Any]) -> int:
    """The CRC-32 of the marker's fields but its own (sorted JSON)."""
    fields = {k: v for k, v in marker.items() if k != "marker_crc32"}
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def _publish(staging: str, path: str, marker: dict[str, Any]) -> None:
    """Marks ``staging`` complete and publishes it as ``path``."""
    with open(os.path.join(staging, MARKER), "w") as fh:
        json.dump({**marker, "marker_crc32": _marker_crc(marker)}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _finish_publish(staging, path)


def _finish_publish(staging: str, path: str) -> None:
    """Renames the marked ``staging`` to ``path``, the checkpoint there (if any) moved aside
    first and deleted last; safe to run again after being killed at any point."""
    old = path + OLD
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(staging, path)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    """Makes a rename in ``directory`` durable (where the platform can open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _recover(path: str) -> None:
    """Finishes a publish that was killed midway: a marked ``<path>.incomplete`` is the newest
    complete checkpoint (whether ``path`` was already moved aside or not)."""
    staging = path + STAGING
    if os.path.exists(os.path.join(staging, MARKER)):
        _finish_publish(staging, path)
    elif os.path.exists(path):
        shutil.rmtree(path + OLD, ignore_errors=True)


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint, or a save to ``path`` was killed after
    its checkpoint was complete (:meth:`ShardedOptimizer.load_sharded` then finishes
    publishing it): what a resuming script asks before loading."""
    path = os.path.abspath(os.fspath(path))
    return any(os.path.exists(os.path.join(d, MARKER)) for d in (path, path + STAGING))


# ------------------------------------------------------------------------------------ save
def _header(state_io: StateIO) -> dict[str, Any]:
    """Everything but the tensors; the same on every rank (collective: the item count)."""
    params = state_io.params()
    keys, steps = {}, {}
    if state_io.state_ready:
        for i, p in enumerate(params):
            seg = state_io.segment_of(p)
            keys[i], steps[i] = list(seg.state), float(seg.step)
    return {
        "format": FORMAT,
        "memkern_version": memkern.__version__,
        "world_size": state_io.world_size,
        "algorithm": state_io.algorithm_name,
        "param_groups": state_io.param_groups(),
        "shapes": [tuple(p.shape) for p in params],
        "dtypes": [str(p.dtype) for p in params],
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

    name = "memkern.ShardedOptimizer.save_sharded"
    path = os.path.abspath(os.fspath(path))
    staging = path + STAGING

    def fresh_staging() -> None:
        _recover(path)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)

    _on_rank_0(state_io, name, f"creating {staging}", fresh_staging)
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
    crcs = _checksums(state_io, staging, name)

    def publish() -> None:
        _publish(staging, path, {
            "format": FORMAT, "memkern_version": memkern.__version__,
            "world_size": state_io.world_size,
            "metadata_crc32": _crc32(name, os.path.join(staging, METADATA)), "crc32": crcs})

    _on_rank_0(state_io, name, f"publishing {staging} as {path}", publish)


# ------------------------------------------------------------------------------------ load
def _read_marker(name: str, path: str) -> dict[str, Any]:
    """The completion marker, its format checked."""
    file = os.path.join(path, MARKER)
    try:
        with open(file) as fh:
            marker = json.load(fh)
        fmt, version = marker.get("format"), marker.get("memkern_version", "before 0.1.0")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{name}: {file} is not a memkern completion marker ({e}): a "
                         "corrupted checkpoint") from None
    if fmt != FORMAT:
        raise ValueError(
            f"{name}: {file} says format {fmt!r} (memkern {version}), this memkern "
            f"{memkern.__version__} reads {FORMAT!r} only"
            + (": format 1 was never released and has no checksums; resume from a checkpoint "
               "written by this version" if fmt == "memkern-sharded-optimizer/1" else "")
        )
    crcs = marker.get("crc32")
    if not (isinstance(marker.get("metadata_crc32"), int) and isinstance(crcs, dict)
            and all(isinstance(v, int) for v in crcs.values())
            and marker.get("marker_crc32") == _marker_crc(marker)):
        raise ValueError(f"{name}: {file} does not match its own CRC-32 or lacks the "
                         "checkpoint's checksums: a corrupted checkpoint")
    return marker


def _verify(state_io: StateIO, name: str, path: str, reader: Any) -> Any:
    """Checks the marker, DCP's metadata file and this rank's share of the stored items
    against their CRCs; returns the metadata."""
    marker = _read_marker(name, path)
    metadata_file = os.path.join(path, METADATA)
    crc = _crc32(name, metadata_file)
    if crc != marker["metadata_crc32"]:
        raise ValueError(f"{name}: {metadata_file} is corrupted: its CRC-32 is {crc:08x}, the "
                         f"checkpoint recorded {marker['metadata_crc32']:08x}")
    metadata = reader.read_metadata()
    stored = {_item_key(info) for info in metadata.storage_data.values()}
    recorded = marker["crc32"]
    if stored != set(recorded):
        differ = sorted(stored ^ set(recorded))[0]
        raise ValueError(f"{name}: {metadata_file} and {os.path.join(path, MARKER)} disagree "
                         f"on the stored items (first: {differ}): a corrupted checkpoint")
    for key, (fqn, info) in _my_items(state_io, metadata).items():
        file = os.path.join(path, info.relative_path)
        crc = _crc32(name, file, info.offset, info.length)
        if crc != recorded[key]:
            raise ValueError(
                f"{name}: {file} is corrupted: bytes [{info.offset}, "
                f"{info.offset + info.length}) ({fqn}) have CRC-32 {crc:08x}, the checkpoint "
                f"recorded {recorded[key]:08x}")
    return metadata


def _check_header(state_io: StateIO, name: str, path: str, header: dict[str, Any]) -> None:
    """Raises ValueError naming ``path`` and the first thing of the saved optimizer that does
    not match this one."""
    params = state_io.params()
    here = [(tuple(p.shape), str(p.dtype)) for p in params]
    saved = list(zip(header["shapes"], header["dtypes"]))
    if saved != here:
        bad = next((i for i, (a, b) in enumerate(zip(saved, here)) if a != b),
                   min(len(saved), len(here)))

        def show(entries: list[tuple[Any, str]]) -> str:
            return (f"{entries[bad][0]} {entries[bad][1]}" if bad < len(entries) else "none")
        counts = (f"{len(saved)} parameters, this optimizer has {len(here)}; "
                  if len(saved) != len(here) else "")
        raise ValueError(
            f"{name}: {path} was saved for another model: {counts}parameter {bad} was saved "
            f"as {show(saved)}, here it is {show(here)}")
    algorithm = state_io.algorithm_name
    if header["algorithm"] != algorithm:
        raise ValueError(f"{name}: {path} holds {header['algorithm']} state, this optimizer is "
                         f"{algorithm}; build it with the saved algorithm to load it")
    state_io.check_param_groups(header["param_groups"], name, f"{path} ")
    group_of = [group for group in header["param_groups"] for _ in group["params"]]
    for i, keys in header["keys"].items():
        expected = state_io.state_keys(group_of[i])
        if params[i].dtype != torch.float32:
            expected.add("master_param")
        if set(keys) != expected:
            raise ValueError(
                f"{name}: {path} holds state {sorted(keys)} for parameter {i}, this optimizer "
                f"with the saved hyper-parameters keeps {sorted(expected)}: saved by another "
                "optimizer configuration")


def load_sharded(state_io: StateIO, path: str | os.PathLike) -> None:
    """Reads the pieces of a checkpoint written by :func:`save_sharded` that this rank owns
    into the optimizer's state, as ``state_io`` locates it (collective). Everything is
    checked (the module docstring says what) before anything is changed."""
    import torch.distributed.checkpoint as dcp

    name = "memkern.ShardedOptimizer.load_sharded"
    path = os.path.abspath(os.fspath(path))
    _on_rank_0(state_io, name, f"finishing the interrupted publish of {path}",
               lambda: _recover(path))
    if not os.path.exists(os.path.join(path, MARKER)):
        state = "does not exist" if not os.path.exists(path) else "has no completion marker"
        raise FileNotFoundError(
            f"{name}: {path} {state}: it is not a complete memkern sharded checkpoint (a save "
            f"that was interrupted leaves its data in {path}{STAGING} and never marks it "
            "complete); load an earlier checkpoint"
        )
    reader = dcp.FileSystemReader(path)
    metadata = _agree(state_io, lambda: _verify(state_io, name, path, reader))
    loaded: dict[str, Any] = {HEADER: b""}
    _dcp_call(state_io, dcp.load, loaded, storage_reader=reader)
    header = torch.load(io.BytesIO(loaded[HEADER]), weights_only=True)
    _agree(state_io, lambda: _check_header(state_io, name, path, header))

    # Checked: from here on the optimizer changes.
    params = state_io.params()
    state_io.adopt_param_groups(header["param_groups"], name)

    # Where each saved tensor goes: (saved key, its start) -> [(target, target start)].
    saved = defaultdict(list)  # "state.<i>.<key>" / "window.<i>" -> [(start, numel)]
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn != HEADER:
            prefix, start = fqn.rsplit(".", 1)
            saved[prefix].append((int(start), meta.size.numel()))
    wanted: list[tuple[str, list[tuple[torch.Tensor, int]]]] = []
    for i, p in enumerate(params):
        for key in header["keys"].get(i, []):
            wanted.append((f"state.{i}.{key}", state_io.state_pieces(p, key)))
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
    state_io.set_steps({id(p): steps.get(i, 0.0) for i, p in enumerate(params)}, name)
    state_io.restore(header["loss_scaler"], header["skipped_steps"], header["window"])
