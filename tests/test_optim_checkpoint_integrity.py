"""A bad sharded checkpoint is refused whole (one process; the W=3 launch of
test_optim_distributed refuses a corrupted one on every rank): truncated, bit-flipped
anywhere, of another model, of another optimizer configuration, of another format version.
Each refusal is one line naming the file and what does not match, and leaves every byte of
the model and the optimizer as it was. A save killed while publishing is finished by the next
load."""
import json
import os
import random
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import memkern as mk
from memkern.optim import checkpoint

FLIPS = 24
"""Random single-bit flips tried, over every file of a checkpoint."""
HEADER_FLIPS = 3
"""Random single-bit flips tried within the header item's bytes (a small part of a data file,
which the flips over whole files rarely hit)."""


class Net(torch.nn.Module):
    """A bfloat16 layer (its float32 master is saved) and float32 ones, odd sizes."""

    def __init__(self, hidden: int = 21) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(11, hidden).to(torch.bfloat16)
        self.fc2 = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x.bfloat16()).float())


def make(seed: int = 0, hidden: int = 21, **options):
    torch.manual_seed(seed)
    model = Net(hidden)
    options = {"optimizer": "adamw", "lr": 1e-2, "accumulation_steps": 2,
               "bucket_size_mb": 1e-3, **options}
    return model, mk.optim.ShardedOptimizer(model.parameters(), **options)


def train(model, opt, seed: int, micro_batches: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(micro_batches):
        x, y = torch.randn(6, 11, generator=g), torch.randn(6, 3, generator=g)
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def snapshot(model, opt) -> list[bytes]:
    """Every byte the model and the optimizer hold: parameters, gradients, flat state and
    8-bit codes, step counters, hyper-parameters, the window."""
    out = [p.detach().float().numpy().tobytes() for p in model.parameters()]
    out += [opt.grad_buffer.grad(p).float().numpy().tobytes() for p in model.parameters()]
    for seg in opt.segments:
        tensors = [seg.step, seg.weights, *seg.state.values()]
        tensors += [t for pair in seg.quantized_state.values() for t in pair]
        out += [t.detach().float().numpy().tobytes() for t in tensors]
    out.append(repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]))
    out.append(repr((opt.micro_batches, opt.loss_scale, opt.skipped_steps)))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved mid-window (3 micro-batches of 2-micro-batch windows)."""
    path = tmp_path_factory.mktemp("integrity") / "ckpt"
    model, opt = make()
    train(model, opt, 1, 3)
    opt.save_sharded(path)
    return path


@pytest.fixture
def target():
    """The optimizer a bad checkpoint is loaded into: trained, mid-window, and its bytes."""
    model, opt = make(seed=5)
    train(model, opt, 2, 5)
    return model, opt, snapshot(model, opt)


def refused(target, path, error, match: str) -> str:
    """Loads ``path`` into the target: raises ``error`` whose one-line message matches, and
    every byte of the model and the optimizer is unchanged."""
    model, opt, before = target
    with pytest.raises(error, match=match) as caught:
        opt.load_sharded(path)
    message = str(caught.value)
    assert "\n" not in message
    assert snapshot(model, opt) == before, f"changed by a refused load: {message}"
    return message


def copy_of(saved, tmp_path):
    dest = tmp_path / "bad"
    shutil.copytree(saved, dest)
    return dest


def test_a_good_checkpoint_loads(saved, target):
    model, opt, before = target
    opt.load_sharded(saved)
    assert snapshot(model, opt) != before
    assert opt.micro_batches == 1


def test_truncated_file_is_named(saved, target, tmp_path):
    bad = copy_of(saved, tmp_path)
    data = sorted(f for f in os.listdir(bad) if f.endswith(".distcp"))[0]
    size = os.path.getsize(bad / data)
    os.truncate(bad / data, size - 100)
    refused(target, bad, ValueError, f"{bad / data} is truncated: {size - 100} bytes")


def flip_seed() -> int:
    """The seed of the flips: fresh each run (the fixtures seed torch with fixed seeds), or
    MEMKERN_BITFLIP_SEED's to replay a run; printed either way."""
    seed = int(os.environ.get("MEMKERN_BITFLIP_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"bit flips: MEMKERN_BITFLIP_SEED={seed}")
    return seed


def header_item(path) -> tuple[str, int, int]:
    """The data file, offset and length of the checkpoint's header item (DCP's metadata)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items()
               if index.fqn == checkpoint.HEADER]
    return info.relative_path, info.offset, info.length


def test_every_random_bit_flip_is_refused(saved, target, tmp_path):
    """FLIPS single-bit flips at random offsets of random files (the data files, DCP's
    metadata, the marker), and HEADER_FLIPS within the header item, each in a fresh copy."""
    rng = random.Random(flip_seed())
    files = sorted(os.listdir(saved))
    header_file, start, length = header_item(saved)
    flips = [(files[n % len(files)], 0, None) for n in range(FLIPS)]
    flips += [(header_file, start, length)] * HEADER_FLIPS
    for n, (name, start, length) in enumerate(flips):
        bad = tmp_path / f"flip{n}"
        shutil.copytree(saved, bad)
        raw = bytearray((bad / name).read_bytes())
        offset = start + rng.randrange(len(raw) if length is None else length)
        bit = rng.randrange(8)
        raw[offset] ^= 1 << bit
        (bad / name).write_bytes(bytes(raw))
        message = refused(target, bad, ValueError, "memkern.ShardedOptimizer.load_sharded: ")
        where = f"{name}: byte {offset}, bit {bit}"
        assert str(bad / name) in message or name == checkpoint.MARKER, (where, message)
        if length is not None:
            assert f"({checkpoint.HEADER})" in message, (where, message)


def test_a_bit_flip_at_every_byte_of_the_marker_is_refused(saved, target, tmp_path):
    """The marker holds the checksums (and its own): a flip anywhere in it, even in a field
    the load does not use, is refused."""
    bad = copy_of(saved, tmp_path)
    raw = (saved / checkpoint.MARKER).read_bytes()
    rng = random.Random(int(torch.randint(2**31, ())))
    for offset in range(len(raw)):
        flipped = bytearray(raw)
        flipped[offset] ^= 1 << rng.randrange(8)
        (bad / checkpoint.MARKER).write_bytes(bytes(flipped))
        refused(target, bad, ValueError, f"{bad / checkpoint.MARKER}")


def test_another_model_is_named(tmp_path, target):
    model, opt = make(hidden=22)
    train(model, opt, 1, 2)
    opt.save_sharded(tmp_path / "other")
    refused(target, tmp_path / "other", ValueError,
            r"saved for another model: parameter 0 was saved as \(22, 11\) torch.bfloat16, "
            r"here it is \(21, 11\) torch.bfloat16$")


@pytest.mark.parametrize("options, match", [
    (dict(optimizer="sgd", momentum=0.9), "holds SGD state, this optimizer is AdamW"),
    (dict(state_precision="8bit"), "param group 0 was saved with state_precision='8bit'"),
])
def test_another_optimizer_configuration_is_named(tmp_path, target, options, match):
    model, opt = make(**options)
    train(model, opt, 1, 2)
    opt.save_sharded(tmp_path / "other")
    refused(target, tmp_path / "other", ValueError, match)


def test_another_param_group_split_is_named(tmp_path, target):
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = mk.optim.ShardedOptimizer([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    train(model, opt, 1, 2)
    opt.save_sharded(tmp_path / "other")
    refused(target, tmp_path / "other", ValueError, r"has param groups of sizes \[2, 2\]")


@pytest.mark.parametrize("fmt, version, match", [
    ("memkern-sharded-optimizer/3", "9.0.0", "says format 'memkern-sharded-optimizer/3' "
                                             r"\(memkern 9.0.0\), this memkern"),
    ("memkern-sharded-optimizer/1", None, "format 1 was never released"),
])
def test_another_format_version_is_named(saved, target, tmp_path, fmt, version, match):
    bad = copy_of(saved, tmp_path)
    marker = json.loads((bad / checkpoint.MARKER).read_text())
    marker["format"] = fmt
    if version is None:
        del marker["memkern_version"]
    else:
        marker["memkern_version"] = version
    (bad / checkpoint.MARKER).write_text(json.dumps(marker))
    message = refused(target, bad, ValueError, match)
    assert str(bad / checkpoint.MARKER) in message


def test_missing_marker_is_named(saved, target, tmp_path):
    bad = copy_of(saved, tmp_path)
    os.remove(bad / checkpoint.MARKER)
    refused(target, bad, FileNotFoundError, "has no completion marker")


class Killed(Exception):
    """Stands for SIGKILL in one process (tests/test_optim_kill_resume.py kills for real)."""


@pytest.mark.parametrize("killed", ["after marking", "between the renames"])
def test_save_killed_while_publishing_is_finished_by_the_next_load(tmp_path, monkeypatch,
                                                                   killed):
    """A save over an older checkpoint, killed after its marker was written: the new
    checkpoint is the last complete one; the next load publishes and loads it."""
    path = tmp_path / "ckpt"
    model, opt = make()
    train(model, opt, 1, 4)
    opt.save_sharded(path)
    train(model, opt, 1, 3)
    expected = snapshot(model, opt)
    rename = os.rename

    def dies(src, dst):
        """Killed at the publish's first rename (the old checkpoint moved aside) or just
        after it; DCP's own renames go through."""
        if str(dst) == f"{path}{checkpoint.OLD}":
            if killed == "between the renames":
                rename(src, dst)
            raise Killed
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", dies)
    with pytest.raises(Killed):
        opt.save_sharded(path)
    monkeypatch.setattr(checkpoint.os, "rename", rename)
    assert os.path.exists(path) == (killed == "after marking")
    assert checkpoint.is_complete(path)

    fresh_model, fresh = make(seed=7)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_sharded(path)
    assert snapshot(fresh_model, fresh) == expected
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
