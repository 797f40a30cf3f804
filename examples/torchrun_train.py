"""Train a tiny BERT masked LM under DDP or FSDP2 with numscope's ``fp8`` plan, loss scaler and observer.

    torchrun --nproc-per-node 2 examples/torchrun_train.py            # DDP, gloo on CPU
    torchrun --nproc-per-node 2 examples/torchrun_train.py --fsdp2 --param-dtype bf16 --steps 50
    torchrun --nproc-per-node 2 examples/torchrun_train.py --analysis runs/analysis

Every rank builds the same model from a config (no download), converts it with
``numscope.Plan.uniform("fp8")`` and trains on its slice of each batch. Per-tensor amax is all-reduced
across ranks by default, so every rank quantizes exactly as one process would on the whole batch; the
loss scaler all-reduces its found-inf flag, so all ranks skip the same steps. ``--fsdp2`` shards every
encoder layer and the root with ``fully_shard`` (``--param-dtype bf16``: FSDP2 all-gathers weights in
bf16). ``--analysis DIR`` observes the high-precision operands every 5th step; each sampled step is merged
across ranks at ``step()`` and rank 0 writes the analysis once. Rank 0 prints the loss. Runs as a single
process too (``python examples/torchrun_train.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import numscope
from numscope import distributed
from numscope.run.model import make_bert_mlm

VOCAB, SEQUENCE = 256, 32


def synthetic_batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: random tokens, 15% masked, one of 4 batches in turn (so the loss can
    fall by memorising them); the same on every rank."""
    generator = torch.Generator().manual_seed(step % 4)
    input_ids = torch.randint(4, VOCAB, (rows, SEQUENCE), generator=generator)
    masked = torch.rand((rows, SEQUENCE), generator=generator) < 0.15
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": torch.where(masked, torch.full_like(input_ids, 3), input_ids), "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fsdp2", action="store_true", help="fully_shard instead of DDP")
    parser.add_argument(
        "--param-dtype", choices=("fp32", "bf16"), default="fp32", help="FSDP2's all-gather dtype"
    )
    parser.add_argument(
        "--analysis", metavar="DIR", help="observe every 5th step; rank 0 writes the analysis"
    )
    args = parser.parse_args()

    if "RANK" in os.environ:
        if not torch.cuda.is_available():
            distributed.use_loopback_on_one_node()  # one machine: gloo over loopback
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # the group goes after train() has returned, with its DDP wrapper: one that outlives the group can hang
    # the exit (see numscope.distributed.destroy_process_group)
    with distributed.destroyed_on_exit():
        train(args)


def train(args: argparse.Namespace) -> None:
    """Build, convert, wrap and train the model; every object that holds the process group dies with this
    frame."""
    rank, world = distributed.rank(), distributed.world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not divide over {world} ranks")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = make_bert_mlm(
        VOCAB, hidden=64, layers=2, heads=2, intermediate=128, max_position=SEQUENCE, dropout=0.0
    ).to(device)
    example = {"input_ids": synthetic_batch(0, 2)["input_ids"].to(device)}
    observer = None
    if args.analysis:  # attach before convert, so the observer sees the high-precision operands
        observer = numscope.observe(model, ["bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3"], every=5).attach()
    numscope.convert(model, numscope.Plan.uniform("fp8"), example_inputs=example)
    trained = model
    if world > 1:
        trained = shard(model, args.param_dtype) if args.fsdp2 else DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = numscope.LossScaler(init_scale=2.0**12).track(model)
    rows = args.batch // world
    for step in range(args.steps):
        whole = synthetic_batch(step, args.batch)
        batch = {name: value[rank * rows : (rank + 1) * rows].to(device) for name, value in whole.items()}
        logits = trained(input_ids=batch["input_ids"]).logits.float()  # bf16 under --param-dtype bf16
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if observer is not None:
            observer.step()  # a collective on sampled steps: every rank calls it
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        if distributed.is_rank_zero():
            print(
                f"step {step:3d}  loss {float(reported) / world:.4f}  scale {scaler.get_scale():g}  "
                f"skipped {scaler.skipped_steps}"
            )
    if observer is not None:
        written = distributed.save_analysis(observer.analysis(), args.analysis)
        if written is not None:
            print(f"analysis merged over {world} ranks, written once: {written}")
    if not args.fsdp2:
        divergence = distributed.parameter_divergence(model)  # a collective: every rank calls it
        if distributed.is_rank_zero():
            print(f"largest parameter difference between ranks: {divergence:g}")
    if world > 1:
        dist.barrier()  # no rank tears down gloo while a peer still finishes the last collective


def shard(model: nn.Module, param_dtype: str) -> nn.Module:
    """``model`` under FSDP2: each encoder layer and the root ``fully_shard``-ed over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (distributed.world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if param_dtype == "bf16" else None, reduce_dtype=torch.float32
    )
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


if __name__ == "__main__":
    main()
