"""The "Will it fit?" guide's example (docs/guide/fit.md): the peak of a GPT-2 small training
step at any batch size, from five steps (the fifth confirms the answer).

GPT-2 small (built from a config: nothing is downloaded), sequence length 512, AdamW. Then
the largest batch that fits, checkpointing advice for a batch that does not, and the
sequence length as a second axis with eager attention.
"""

import sys
import warnings

import torch

if not torch.cuda.is_available():
    sys.exit("fit.py: this example needs a CUDA GPU")
try:
    import transformers
except ImportError:
    sys.exit("fit.py: this example needs transformers: pip install 'cudamem[transformers]'")

import cudamem
from cudamem.fit.memory_plan import NotLinearError

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
torch.manual_seed(0)


def build(attn: str = "sdpa"):
    config = transformers.GPT2Config(use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model = model.cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


model, opt = build()


def step(n: int, length: int = 512) -> None:
    """One training step at batch size n: data, forward, backward, optimizer."""
    ids = torch.randint(0, 50257, (n, length), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


plan = cudamem.plan(step, sizes=(4, 8), model=model, optimizer=opt)
print("=== plan ===")
print(plan)

print("=== predict ===")
print(plan.predict(64))
print(plan.predict(128))
print("largest batch, 5 % margin:", plan.largest(margin=0.05))
print("largest batch, 10 % margin:", plan.largest(margin=0.10))
print("largest batch, no margin (a step ran there):", plan.largest(margin=0))
total = torch.cuda.get_device_properties(0).total_memory
print(plan.largest_for(int(0.4 * total), margin=0))  # under set_per_process_memory_fraction(0.4)
print(plan.largest_for(2 * total, card=True))  # a card twice this one's size

print("=== checkpointing ===")
print(plan.checkpointing(plan.largest(margin=0) * 3 // 2))  # half again: it does not fit

del model, opt, plan
model, opt = build(attn="eager")
print("=== lengths ===")
by_length = cudamem.plan(step, sizes=(4, 8), lengths=(128, 256))
print(by_length)
try:
    print(by_length.predict(8, 1024))
    print("largest batch at length 1024:", by_length.largest(length=1024))
except NotLinearError as refusal:  # the check landed off the fit: no extrapolation
    print(refusal)
