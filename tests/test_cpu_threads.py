"""The C++ CPU kernels run on torch's intra-op threads, and what they compute does not depend
on how many there are.

``at::parallel_for`` is a header template: code that calls it runs serially unless it is
compiled with OpenMP (setup.py adds ``-fopenmp`` when torch uses OpenMP). The second test runs
every CPU kernel at 1 and at 3 threads on buffers of several parallel tasks (an odd length, so
the last task is partial), on finite gradients and on gradients with inf/NaN in the first,
later and last tasks, and compares the outputs bit for bit:
a kernel whose result depended on the split — a reduction summed per thread, a flag or a block
written by two tasks — would differ.
"""
import pytest
import torch

import memkern

pytestmark = pytest.mark.skipif(not memkern.compiled.has_cpu,
                                reason="the C++ CPU kernels are not built")

# Several tasks of the kernels' grain (flat_math.h kGrain = 2**15 elements), and a partial one.
N = 5 * 2**15 + 77


def test_cpu_kernels_are_compiled_to_use_torchs_threads():
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch does not run its CPU threads on OpenMP")
    assert memkern.compiled.has_openmp, (
        "memkern._C was compiled without OpenMP: its CPU kernels run on one thread")


# Non-finite gradients in the first task, in two later ones and in the partial last 8-bit block
# of the partial last task.
POISON = {17: float("inf"), 2**15 + 3: float("nan"), 3 * 2**15 + 301: float("-inf"),
          N - 5: float("nan")}


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    finite = torch.randn(N, generator=gen) * 1e-2
    poisoned = finite.clone()
    poisoned[list(POISON)] = torch.tensor(list(POISON.values()))
    return {"master": torch.randn(N, generator=gen), "finite": finite, "poisoned": poisoned}


def _run_all(seed: int) -> dict[str, torch.Tensor]:
    """Every CPU kernel on finite and on poisoned gradients, float32 and bfloat16: three steps
    of each optimizer (the state carries the NaN blocks into the next steps), and unscale_,
    l2_norm and dropout."""
    x = _inputs(seed)
    out = {}
    ops = torch.ops.memkern
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01)
    blocks = memkern.ops.adamw8bit.num_blocks(N)
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("finite", "poisoned"):
            grads, name = x[kind].to(dtype), f"{dtype} {kind}"
            master, m, v = x["master"].clone(), torch.zeros(N), torch.zeros(N)
            params, step = torch.empty(N, dtype=torch.bfloat16), torch.zeros(1)
            for _ in range(3):
                ops.adamw_step_(master, m, v, grads, params, step, None, None, *hyper)
            out[f"adamw {name}"] = torch.cat([master, m, v, params.float()])

            master = x["master"].clone()
            m8, m_absmax = torch.zeros(N, dtype=torch.int8), torch.zeros(blocks)
            v8, v_absmax = torch.zeros(N, dtype=torch.uint8), torch.zeros(blocks)
            step = torch.zeros(1)
            for _ in range(3):
                ops.adamw8bit_step_(master, m8, m_absmax, v8, v_absmax, grads, params, step,
                                    None, None, *hyper)
            out[f"adamw8bit {name}"] = torch.cat(
                [master, m8.float(), m_absmax, v8.float(), v_absmax, params.float()])

            master, buf, step = x["master"].clone(), torch.zeros(N), torch.zeros(1)
            for _ in range(3):
                ops.sgd_step_(master, buf, grads, params, step, None, None, 1e-2, 0.9, 0.0,
                              0.01, True)
            out[f"sgd {name}"] = torch.cat([master, buf, params.float()])

            master, step = x["master"].clone(), torch.zeros(1)
            buf8, buf_absmax = torch.zeros(N, dtype=torch.int8), torch.zeros(blocks)
            for _ in range(3):
                ops.sgd8bit_step_(master, buf8, buf_absmax, grads, params, step, None, None,
                                  1e-2, 0.9, 0.0, 0.01, False)
            out[f"sgd8bit {name}"] = torch.cat([master, buf8.float(), buf_absmax,
                                                params.float()])

            scaled, found_inf = grads.clone(), torch.zeros(1)
            ops.unscale_(scaled, found_inf, torch.tensor([0.37]))
            out[f"unscale {name}"] = torch.cat([scaled.float(), found_inf])
            out[f"l2_norm {name}"] = ops.l2_norm(grads).reshape(1)
            out[f"dropout {name}"] = ops.dropout(
                grads, torch.tensor(1234567, dtype=torch.int64), 0.3).float()
    return out


def test_every_cpu_kernel_gives_the_same_bits_at_any_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_all(seed=7)
        torch.set_num_threads(3)
        three = _run_all(seed=7)
    finally:
        torch.set_num_threads(threads)
    assert one.keys() == three.keys()
    for name in one:  # as int32 bits: NaN == NaN
        assert torch.equal(one[name].view(torch.int32), three[name].view(torch.int32)), name
