"""numscope inside your own training loop: observe FP32 steps, recommend a plan, train under it.

    python examples/train_loop.py    # a tiny BERT on a toy masked-token task; writes plan.yaml here

The same as ``numscope analyze`` → ``recommend`` → ``train``, in plain PyTorch: (1) a few FP32 steps run
under ``numscope.observe``, which measures every operand of every GEMM in the candidate formats; (2)
``numscope.recommend`` turns that analysis into a per-operand plan (each choice with its reason); (3)
``numscope.convert`` makes every GEMM follow the plan (FP32 master weights and accumulation), and
``numscope.LossScaler`` (``torch.amp.GradScaler``'s interface) scales the loss dynamically.
"""

import torch
from transformers import BertConfig, BertForMaskedLM

import numscope

VOCAB, MASK_ID = 512, 4
torch.manual_seed(0)
model = BertForMaskedLM(
    BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        attn_implementation="eager",
    )
)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)


def batch(step: int) -> dict[str, torch.Tensor]:
    """One of 4 fixed batches in turn; 15% of the tokens masked, the loss only on those."""
    generator = torch.Generator().manual_seed(step % 4)
    ids = torch.randint(MASK_ID + 1, VOCAB, (16, 32), generator=generator)
    masked = torch.rand(ids.shape, generator=generator) < 0.15
    return {"input_ids": ids.masked_fill(masked, MASK_ID), "labels": ids.masked_fill(~masked, -100)}


with numscope.observe(model, candidates=["bf16", "fp8_e4m3", "mxfp4_e2m1"], every=4) as observer:
    for step in range(4):  # 1. FP32 steps; the first is measured
        model(**batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        observer.step()
plan = numscope.recommend(observer.analysis())  # 2. a format per operand, with its reason
plan.save("plan.yaml")
numscope.convert(model, plan)  # 3. train under the plan, with dynamic loss scaling
scaler = numscope.LossScaler(init_scale=2.0**12)
for step in range(4, 24):
    loss = model(**batch(step)).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    print(
        f"step {step:2d}  loss {loss.item():.3f}  scale {scaler.get_scale():g}  skips {scaler.skipped_steps}"
    )
