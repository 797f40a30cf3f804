"""The rank process of the distributed tests, and :func:`launch`, which starts and reaps a world of them.

``launch(scenario, tmp_path)`` starts ``world_size`` copies of this file as separate Python processes on
localhost (gloo on CPU, a free loopback port, ``OMP_NUM_THREADS=1``), waits for them with a timeout, kills
every one that is left on failure, and returns what each rank saved (``torch.save`` of a dict). Each rank
initialises the default process group, runs one scenario function from :data:`SCENARIOS` and always
destroys the group. Shared model and data builders live here too, so that the tests' single-process
references run the very same code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TIMEOUT_S = 180.0  # a hang fails the test; a world of 2 ranks takes up to ~75 s on 2 busy cores
VOCAB = 64
SEQUENCE = 8


# -- shared builders ---------------------------------------------------------------------------------
def tiny_bert(seed: int = 0) -> nn.Module:
    """A tiny BERT MLM (hidden 32, 2 layers, no dropout) built from a config: deterministic given ``seed``."""
    from numscope.run.model import make_bert_mlm

    return make_bert_mlm(
        VOCAB, hidden=32, layers=2, heads=2, intermediate=64, max_position=SEQUENCE, dropout=0.0, seed=seed
    )


def mlm_batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    """A deterministic batch of ``rows`` sequences for ``step``: token ids and labels (-100 on unmasked)."""
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(1, VOCAB, (rows, SEQUENCE), generator=generator)
    masked = torch.rand((rows, SEQUENCE), generator=generator) < 0.3
    masked[:, 0] = True
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": torch.where(masked, torch.full_like(input_ids, 3), input_ids), "labels": labels}


def shard(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of a batch (the rows DDP's sampler would give it)."""
    rows = batch["input_ids"].shape[0] // world_size
    return {name: value[rank * rows : (rank + 1) * rows] for name, value in batch.items()}


def mean_mlm_loss(model: nn.Module, batch: dict[str, torch.Tensor], total_labels: int) -> torch.Tensor:
    """The MLM loss summed over this batch's labelled tokens and divided by ``total_labels``.

    With ``total_labels`` the label count of the *global* batch, the sum over ranks of this loss is the
    global mean loss; so DDP's averaging over ranks (times the world size) gives one process's gradient.
    The loss is computed in fp32 whatever dtype the logits come in (bf16 under FSDP2's ``param_dtype``).
    """
    logits = model(input_ids=batch["input_ids"]).logits.float()
    return (
        nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100, reduction="sum"
        )
        / total_labels
    )


def convert_fp8(model: nn.Module, reduce_amax: bool = True) -> nn.Module:
    """``model`` converted with the ``fp8`` plan; ``reduce_amax=False`` turns off every amax reduction."""
    import numscope
    from numscope.plan import Plan, SiteSpec

    plan = Plan.uniform("fp8")
    if not reduce_amax:
        plan = _without_amax_reduction(plan, SiteSpec)
    example = mlm_batch(0, 2)["input_ids"]
    return numscope.convert(model, plan, example_inputs={"input_ids": example})


def _without_amax_reduction(plan: Any, site_spec: type) -> Any:
    from dataclasses import replace

    def local(spec: Any) -> Any:
        operands = {}
        for key, operand in spec.operands.items():
            scaling = operand.effective_scaling()
            if scaling is not None:
                operand = replace(operand, scaling=scaling.replace(reduce_amax=False))
            operands[key] = operand
        return site_spec(operands=operands, accumulate=spec.accumulate)

    return plan.with_default(local(plan.default))


# -- scenarios (run on every rank, the default process group initialised) ----------------------------
def scenario_loss_scaler(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """One step of a small model where only rank 1 sees an overflow: plain, DDP, FSDP2, with and without the
    found-inf reduction; counts the collectives of `unscale_`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel

    from numscope.train.loss_scaler import LossScaler, all_reduce_max_if_distributed

    out: dict[str, Any] = {}
    for case in ("plain", "plain_no_reduce", "ddp", "fsdp2", "fsdp2_no_reduce"):
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        if case == "ddp":
            model = DistributedDataParallel(model)
        if case.startswith("fsdp2"):
            fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        reduce = None if case.endswith("no_reduce") else all_reduce_max_if_distributed
        scaler = LossScaler(init_scale=2.0**8, found_inf_reduce=reduce).track(model)
        before = [_full(p).detach().clone() for p in model.parameters()]
        inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        if case == "ddp" and rank == 1:
            inputs[0, 0] = float("inf")  # the overflow arises in rank 1's forward; DDP all-reduces it
        scaler.scale(model(inputs).square().mean()).backward()
        if case != "ddp" and rank == 1:
            # a rank-local overflow: plain gradients are never reduced; under FSDP2 it lands in rank 1's shard
            # after the reduce-scatter, so rank 0's shard of the same gradient stays finite
            grad = next(model.parameters()).grad
            (grad.to_local() if case.startswith("fsdp2") else grad)[0, 0] = float("inf")
        with CommDebugMode() as collectives:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        after = [_full(p) for p in model.parameters()]
        out[case] = {
            "changed": any(not torch.equal(b, p) for b, p in zip(before, after, strict=True)),
            "skipped_steps": scaler.skipped_steps,
            "scale": scaler.get_scale(),
            "overflow": scaler.last_overflow,
            "collectives": {str(op): count for op, count in collectives.get_comm_counts().items()},
        }
    return out


def _full(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter as one plain tensor (FSDP2's sharded DTensor gathered: a collective)."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def scenario_collectives(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """fp8 tensors over gloo: the raw collective's error, then all_gather/broadcast through uint8 views."""
    from numscope import distributed

    local = torch.tensor([1.0 + rank, -0.5, 448.0], dtype=torch.float8_e4m3fn)
    try:
        raw = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(raw, local)
        raw_error = None
    except (RuntimeError, TypeError, ValueError) as error:
        raw_error = f"{type(error).__name__}: {error}"
    gathered = distributed.all_gather_tensor(local)
    broadcast = distributed.broadcast_tensor_(
        torch.tensor([float(rank + 2)] * 2, dtype=torch.float8_e5m2), src=1
    )
    return {
        "raw_error": raw_error,
        "gathered": gathered.view(torch.uint8),
        "gathered_dtype": str(gathered.dtype),
        "broadcast": broadcast.float(),
        "rank": distributed.rank(),
        "world_size": distributed.world_size(),
    }


def scenario_amax(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """Current scaling, delayed scaling and low-precision all-gathers of one tensor split over ranks."""
    import numscope
    from numscope import distributed

    whole = whole_tensor()
    part = whole.chunk(world_size)[rank]
    delayed = numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4))
    delayed_results = [numscope.quantize(part * (step + 1), "fp8_e4m3", scaling=delayed) for step in range(3)]
    gathers = {
        name: distributed.all_gather_quantized(part, fmt, scaling=scaling)
        for name, (fmt, scaling) in GATHER_CASES.items()
    }
    # rank 0's share of a batch is empty (a masked-only head without a masked token): it must take part
    # in every amax reduction rank 1 issues, or rank 1 waits for ever
    mine = part[:0] if rank == 0 else part
    empty_delayed = numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4))
    empty_share = {
        "tensor": numscope.quantize(mine, "fp8_e4m3", scaling="tensor"),
        "nvfp4": numscope.quantize(mine, "nvfp4"),
        "delayed": [
            numscope.quantize(mine * (step + 1), "fp8_e4m3", scaling=empty_delayed) for step in range(2)
        ],
        "delayed_history": empty_delayed.amax_history.clone(),
        "column": numscope.quantize(mine, "int8", scaling="column"),
    }
    from numscope.formats.fast import set_fast

    set_fast(True)  # the compiled path takes its column amax over the ranks too
    try:
        column_fast = numscope.quantize(part, "int8", scaling="column")
    finally:
        set_fast(False)
    return {
        "column_reduced": numscope.quantize(part, "int8", scaling="column"),
        "column_fast": column_fast,
        "column_local": numscope.quantize(
            part, "int8", scaling=numscope.Scaling("column", reduce_amax=False)
        ),
        "empty_share": empty_share,
        "reduced": numscope.quantize(part, "fp8_e4m3", scaling="tensor"),
        "local": numscope.quantize(part, "fp8_e4m3", scaling=numscope.Scaling("tensor", reduce_amax=False)),
        "nvfp4_reduced": numscope.quantize(part, "nvfp4"),
        "nvfp4_local": numscope.quantize(part, "nvfp4", scaling=numscope.Scaling("block", reduce_amax=False)),
        "delayed": delayed_results,
        "delayed_history": delayed.amax_history.clone(),
        "gathers": gathers,
    }


STEPS = 3
ROWS = 8  # the global batch: each of 2 ranks gets 4 sequences
LR = 0.5


def train_fp8(
    model: nn.Module,
    steps: int,
    rank: int,
    world_size: int,
    fixed_batch: bool = False,
) -> dict[str, Any]:
    """SGD with a LossScaler on the global batch of :func:`mlm_batch` split over ranks; losses are global.

    One process (``world_size`` 1, no process group) trains on the whole batch; under DDP or FSDP2 each
    rank trains on its shard, and its loss is multiplied by the world size so that the averaged gradient
    is the whole batch's. The returned losses are the whole batch's mean loss at each step.
    """
    from numscope.train.loss_scaler import LossScaler, all_reduce_max_if_distributed

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = LossScaler(init_scale=2.0**10, found_inf_reduce=all_reduce_max_if_distributed)
    losses = []
    for step in range(steps):
        batch = mlm_batch(0 if fixed_batch else step, ROWS)
        total = int((batch["labels"] != -100).sum())
        local = shard(batch, rank, world_size)
        loss = mean_mlm_loss(model, local, total)
        scaler.scale(loss * world_size).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(global_loss)
        losses.append(float(global_loss))
    return {"losses": losses, "skipped_steps": scaler.skipped_steps}


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a plain full tensor (FSDP2's DTensor shards gathered)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def run_ddp(
    rank: int, world_size: int, steps: int, reduce_amax: bool = True, fixed_batch: bool = False
) -> dict[str, Any]:
    """The fp8-converted tiny BERT under DDP (amax reduction as asked)."""
    from torch.nn.parallel import DistributedDataParallel

    from numscope import distributed

    model = convert_fp8(tiny_bert(), reduce_amax=reduce_amax)
    result = train_fp8(DistributedDataParallel(model), steps, rank, world_size, fixed_batch)
    result["parameters"] = full_parameters(model)
    result["divergence"] = distributed.parameter_divergence(model)
    return result


def run_fsdp2(
    rank: int, world_size: int, steps: int, fixed_batch: bool = False, param_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The fp8-converted tiny BERT (amax reduced, the default) with every encoder layer and the root under
    ``fully_shard``; ``param_dtype`` is FSDP2's ``MixedPrecisionPolicy`` all-gather and compute dtype (None:
    fp32). Records the dtype of a weight as its GEMM receives it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = convert_fp8(tiny_bert())
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen: list[torch.dtype] = []
    query = model.bert.encoder.layer[0].attention.self.query
    hook = query.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    result = train_fp8(model, steps, rank, world_size, fixed_batch)
    hook.remove()
    result["parameters"] = full_parameters(model)
    result["weight_dtypes"] = [str(dtype) for dtype in seen]
    return result


TRAIN_STEPS = 6  # the FSDP2-versus-DDP runs: a fixed batch, so the loss must fall


def scenario_bert(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every tiny-BERT run of the tests in one world (each rank imports transformers once)."""
    return {
        "ddp": run_ddp(rank, world_size, STEPS),
        "ddp_local_amax": run_ddp(rank, world_size, STEPS, reduce_amax=False),
        "ddp_fixed": run_ddp(rank, world_size, TRAIN_STEPS, fixed_batch=True),
        "fsdp2_fixed": run_fsdp2(rank, world_size, TRAIN_STEPS, fixed_batch=True),
        "fsdp2_bf16": run_fsdp2(rank, world_size, TRAIN_STEPS, fixed_batch=True, param_dtype=torch.bfloat16),
    }


OBSERVED_CANDIDATES = ("bf16", "fp8_e4m3", "fp8_e5m2")
OBSERVED_STEPS = 3
OBSERVED_EVERY = 2  # steps 0 and 2 are sampled (and merged across ranks at step()); step 1 is not


def observed_analysis(rank: int, world_size: int, reduce_ranks: bool = True) -> tuple[Any, nn.Module, list]:
    """An observer's analysis of the (unconverted) tiny BERT, 3 forward/backward passes on this rank's rows.

    The loss is the global batch's mean (local sum / global label count), so every activation and
    gradient row equals the one a single process computes on the whole batch; tensors are measured whole.
    No backward errors (their row samples differ from one process's anyway; see :func:`observed_mlp`).
    Also returns the collectives each ``observer.step()`` issued (op name → count).
    """
    from torch.distributed.tensor.debug import CommDebugMode

    import numscope

    model = tiny_bert()
    per_step = []
    with numscope.observe(
        model,
        OBSERVED_CANDIDATES,
        every=OBSERVED_EVERY,
        max_elements=1 << 20,
        backward_error=False,
        reduce_ranks=reduce_ranks,
    ) as observer:
        for step in range(OBSERVED_STEPS):
            batch = mlm_batch(step, ROWS)
            total = int((batch["labels"] != -100).sum())
            mean_mlm_loss(model, shard(batch, rank, world_size), total).backward()
            model.zero_grad(set_to_none=True)
            with CommDebugMode() as collectives:
                observer.step()
            per_step.append({str(op): count for op, count in collectives.get_comm_counts().items()})
    return observer.analysis(), model, per_step


def observed_mlp(rank: int, reduce_ranks: bool) -> Any:
    """An observer's analysis, backward errors included, of one forward/backward of a small MLP on this
    rank's own data."""
    import numscope

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    with numscope.observe(model, OBSERVED_CANDIDATES, be_rows=4, reduce_ranks=reduce_ranks) as observer:
        model(inputs).square().mean().backward()
        observer.step()
    return observer.analysis()


def scenario_observer(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """Each rank observes its rows. Merged at step() (the default) and saved once by rank 0; and, observed
    without the step-time merge, merged afterwards with merge_analysis."""
    import numscope
    from numscope import distributed

    analysis, _, collectives = observed_analysis(rank, world_size)
    written = distributed.save_analysis(analysis, args["analysis_directory"])
    local, model, _ = observed_analysis(rank, world_size, reduce_ranks=False)
    replicated = distributed.parameter_operands(numscope.sites(model))
    return {
        "analysis": analysis.to_dict(),
        "collectives": collectives,
        "written": None if written is None else str(written),
        "plan": numscope.recommend(analysis, max_be_ratio=None).to_dict(),
        "merged_afterwards": distributed.merge_analysis(local, replicated=replicated).to_dict(),
        "mlp": observed_mlp(rank, reduce_ranks=True).to_dict(),
        "mlp_local": observed_mlp(rank, reduce_ranks=False).to_dict(),
    }


def scenario_moved_weight(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """An fp8-converted MLP whose second weight, on rank 1 only, moves to new memory between forward and
    backward with its values and version kept: what FSDP2 does to every unsharded parameter (it frees the
    storage after forward and all-gathers into a new one for backward), with an address each rank's
    allocator picks. Every rank must still issue the same amax all-reduces."""
    import numscope

    torch.manual_seed(0)
    model = numscope.convert(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), numscope.Plan.uniform("fp8")
    )
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    loss = model(inputs).square().mean()
    weight = model[2].weight  # the first layer computes no dgrad (its input needs no gradient)
    address = weight.data_ptr()
    if rank == 1:
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
            weight.set_(weight.detach().clone())
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"moved": weight.data_ptr() != address, "grads": grads, "all_grads": gather_stacked(grads)}


def gather_stacked(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order (one all-gather)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.stack(parts)


def whole_tensor() -> torch.Tensor:
    """A (8, 64) tensor whose two halves have very different amax (so local scales would differ)."""
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    values[4:] *= 37.0
    return values


GATHER_CASES: dict[str, tuple[str, Any]] = {
    "fp8_e4m3/tensor": ("fp8_e4m3", "tensor"),
    "fp8_e5m2/row": ("fp8_e5m2", "row"),
    "mxfp8_e4m3": ("mxfp8_e4m3", None),
    "nvfp4": ("nvfp4", None),
}


ADAPTIVE_STEPS = 8
ADAPTIVE_QUIET = (2, 3)  # steps whose loss is multiplied by 1e-6: every unscaled E5M2 gradient underflows


def run_adaptive(rank: int, world_size: int, fsdp2: bool = False) -> dict[str, Any]:
    """The tiny BERT under unscaled E5M2 gradients with adaptive precision (a decision after every step,
    re-plans with patience 1), DDP over the ranks (or FSDP2: every encoder layer and the root sharded); the
    loss of :data:`ADAPTIVE_QUIET` steps scaled down so that the guard trips. Returns this rank's
    decisions."""
    import numscope
    from numscope.plan import Plan
    from numscope.train.adaptive import Adapter, AdaptiveConfig, observer_for

    model = tiny_bert()
    plan = Plan.named("e5m2_grads")
    config = AdaptiveConfig(
        every=1, replan_every=4, patience=1, clear_after=2, candidates=("bf16", "fp8_e4m3", "fp8_e5m2")
    )
    observer = observer_for(model, plan, config).attach()
    numscope.convert(model, plan)
    adapter = Adapter(model, plan, config, observer)
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(ADAPTIVE_STEPS):
        batch = mlm_batch(step, ROWS)
        total = int((batch["labels"] != -100).sum())
        loss = mean_mlm_loss(trained, shard(batch, rank, world_size), total) * world_size
        (loss * (1e-6 if step in ADAPTIVE_QUIET else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        observer.step()
        adapter.after_step(step)
    return {
        "history": [change.row() for change in adapter.history],
        "plan": numscope.convert.converted_plan(model).to_dict(),
        "bits": adapter.average_bits(ADAPTIVE_STEPS),
    }


def scenario_adaptive(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ddp": run_adaptive(rank, world_size), "fsdp2": run_adaptive(rank, world_size, fsdp2=True)}


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], dict[str, Any]]] = {
    "loss_scaler": scenario_loss_scaler,
    "collectives": scenario_collectives,
    "amax": scenario_amax,
    "bert": scenario_bert,
    "moved_weight": scenario_moved_weight,
    "observer": scenario_observer,
    "adaptive": scenario_adaptive,
}


# -- launching -----------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(
    scenario: str, directory: Path, world_size: int = 2, timeout: float = TIMEOUT_S, **args: Any
) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world_size`` local ranks and return each rank's saved result, in rank order.

    Raises ``RuntimeError`` with every rank's stderr tail when a rank fails or the world outlives
    ``timeout`` seconds; no rank process survives this function.
    """
    from numscope.distributed import loopback_interface

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    processes: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1",
                "GLOO_SOCKET_IFNAME": loopback_interface() or "lo",
            }
            log = directory / f"rank{rank}.log"
            with log.open("wb") as handle:
                process = subprocess.Popen(
                    [sys.executable, __file__, scenario, str(directory), json.dumps(args)],
                    env=env,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
            processes.append((process, log))
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process, _ in processes):
            crashed = any(process.returncode not in (None, 0) for process, _ in processes)
            if crashed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = [
            (rank, process.returncode)
            for rank, (process, _) in enumerate(processes)
            if process.returncode != 0
        ]
        if failed:
            tails = "\n".join(
                f"--- rank {rank} (exit {process.returncode}):\n{log.read_text()[-3000:]}"
                for rank, (process, log) in enumerate(processes)
            )
            reason = "timed out" if time.monotonic() > deadline else "failed"
            raise RuntimeError(f"scenario {scenario!r} {reason}: ranks {failed}\n{tails}")
    finally:
        for process, _ in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def main(argv: list[str]) -> None:
    scenario, directory, raw_args = argv
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from numscope import distributed

    with distributed.destroyed_on_exit():  # no DDP of a scenario outlives the group, failed or not
        result = SCENARIOS[scenario](rank, world_size, json.loads(raw_args))
        dist.barrier()
    torch.save(result, Path(directory) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
