"""Character-level training data that every Python install carries: the standard library's
own ``.py`` files, read in sorted order so every machine sees the same text.

Tokens are bytes (vocabulary 256). Batches are random windows drawn with a seeded generator.
"""
from __future__ import annotations

import os
import sysconfig

import torch

VOCAB = 256


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's sources, as a uint8 tensor."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                data = fh.read(max_bytes - size)
            chunks.append(data)
            size += len(data)
            if size >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    if size == 0:
        raise RuntimeError(f"no Python sources found under {root} for the default corpus")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def available_host_bytes() -> int:
    """Host memory available to this process now (``MemAvailable`` where Linux reports it)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Batches:
    """Random ``[batch, seq]`` input windows and their next-byte targets (int64)."""

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if corpus.numel() <= seq + 1:
            raise ValueError(f"the corpus has {corpus.numel()} bytes, too few for seq={seq}")
        # The windows are gathered on the host: ask before allocating, so an impossible batch
        # is a MemoryError here rather than the kernel's OOM killer ending the process
        # silently (seen on a 128 GiB GPU machine with --batch 1000000000).
        needed = 3 * batch * (seq + 1) * 8  # offsets, gathered window, its int64 copy
        available = available_host_bytes()
        if needed > available:
            raise MemoryError(
                f"out of memory: {batch} windows of {seq + 1} tokens need {needed / 2**30:.1f} "
                f"GiB of host memory, {available / 2**30:.1f} GiB are available")
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.corpus.numel() - self.seq - 1, (self.batch,),
                               generator=self.generator)
        offsets = starts[:, None] + torch.arange(self.seq + 1)
        window = self.corpus[offsets].long().to(self.device)
        return window[:, :-1], window[:, 1:]
