"""Run by tests/test_integrations_accelerate.py under ``accelerate launch``: a memkern
optimizer prepared by accelerate, with ``accelerator.accumulate`` deciding the windows, against
a plain torch loop on the same batches; then ``accelerator.backward`` refused with one error."""
import copy
import sys

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import memkern as mk

VOCAB, SEQ, WINDOW, BATCHES = 128, 24, 3, 8  # windows of 3, 3 and 2 (the end of the loader)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(int(sys.argv[1]))
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB,
                                       n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCHES * 2, SEQ))
    loader = torch.utils.data.DataLoader(ids, batch_size=2)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=WINDOW)
    mk.patch(model)
    opt = mk.optim.ShardedOptimizer(model.parameters(), "sgd", lr=0.5, max_grad_norm=1.0)
    model, prepared, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            opt.backward(model(input_ids=batch, labels=batch).loss)
            prepared.step()  # accelerate calls opt.step() at each window's end only
            prepared.zero_grad()

    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for window in ids.split(2 * WINDOW):
        micro_batches = window.split(2)
        for batch in micro_batches:
            (reference(input_ids=batch, labels=batch).loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch_opt.step()
        torch_opt.zero_grad()
    worst = max(((p - q).norm() / q.norm()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert worst < 1e-5, f"memkern under accelerate differs from torch by {worst:.2e}"

    batch = ids[:2]
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    try:
        prepared.step()
    except RuntimeError as exc:
        print(f"refused: {exc}")
    else:
        raise AssertionError("accelerator.backward + step was not refused")
    print(f"OK {worst:.2e}")


if __name__ == "__main__":
    main()
