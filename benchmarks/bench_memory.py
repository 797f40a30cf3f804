"""Memory of one training step of a BERT MLM under several numerics, side by side in one run.

Model: BertForMaskedLM, hidden 256, 4 layers, 4 heads, FFN 1024, vocab 4000, seq 128, batch 16, eager
attention (the issue's configuration). Two figures per row, each also as a ratio to fp32's:

* **saved activations**: the bytes of the tensors a ``torch.autograd.graph.saved_tensors_hooks`` pack hook
  sees during the forward (what autograd keeps for backward), each storage once, parameters excluded; for
  the Recipe rows, whose activation store's hooks stand in front of that one, what the store keeps
  (``ActivationStore.kept_bytes``: its fp16 copies and, once per storage, what it keeps as it is);
* **peak RSS**: the process's maximum resident memory over model, optimizer, forward and backward, each row
  in a fresh interpreter (``resource.getrusage``), so rows do not share an allocator's high-water mark;
* **step memory**: the peak RSS over two steps minus the resident memory just before the first forward
  (model, masters and an empty optimizer already there): what training adds — activations, gradients and the
  optimizer's moments, which exist from the first step's end, so the second step is the one every later step
  repeats (the other columns are of the first step alone);
* **peak RSS, freed memory returned**: the same row run again with glibc's mmap threshold fixed
  (:data:`RETURN_FREED`): freed tensors leave the process at once, so the peak follows the memory the step
  has in use rather than what the C allocator kept after freeing it (glibc only; elsewhere the variable is
  ignored and both columns measure the same).

Rows: fp32; bf16 ``torch.autocast``; the plans ``fp16``, ``fp8``, ``mxfp8`` and ``nvfp4`` through
``numscope.convert`` with ``compiled=False`` (the native quantizers, :mod:`numscope.formats.native`,
where they cover an operand, else eager; they keep an MX or NVFP4 wgrad input as element and scale
codes); the mxfp8 plan with ``compiled=True`` (``convert``'s default for block formats: torch.compile
builds what the native code does not cover, none here) and with ``low_memory=True``; the fp8 plan with
``storage="fp16"``; the paper's ``numscope.Recipe`` (fp16 model, fp32 masters and ops, fp16 activations,
dropout masks in bits, loss scaling), alone, with the fp8 plan, and with the fp8 plan and
:class:`numscope.train.AdamWFp8` (AdamW's moments in FP8 blocks, as torchao's ``AdamWFp8``) and with
:class:`numscope.train.AdamW4bit` (4-bit blocks, as torchao's ``AdamW4bit``);
``observed``, an FP32 step that ``numscope.observe`` samples with its default candidates (what
``numscope analyze`` runs on a sampled step). ``--size base`` takes BERT-base's shape instead (vocab 30522,
hidden 768, 12 layers, 12 heads, FFN 3072; seq 128, batch 8).
Run: ``python benchmarks/bench_memory.py [--rows a,b] [--size base]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import positive_int

ROWS = (
    "fp32",
    "bf16 autocast",
    "plan fp16",
    "plan fp8",
    "plan mxfp8",
    "plan mxfp8 + compiled",
    "plan mxfp8 + low memory",
    "plan nvfp4",
    "plan fp8 + fp16 storage",
    "Recipe fp16",
    "Recipe fp16 + plan fp8",
    "Recipe fp16 + plan fp8 + AdamWFp8",
    "Recipe fp16 + plan fp8 + AdamW4bit",
    "observed",
)
#: glibc's mmap threshold fixed (128 KiB, its initial value): every freed tensor of that size or more is
#: unmapped at once, so peak RSS follows the memory in use; by default glibc raises the threshold to the size
#: of each freed mapping (up to 32 MiB), and later tensors of that size come from the heap, which keeps freed
#: memory
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072"}
#: (vocabulary, hidden, layers, heads, FFN, batch) of each --size; sequences of 128 tokens
SIZES = {"default": (4000, 256, 4, 4, 1024, 16), "base": (30522, 768, 12, 12, 3072, 8)}


def run_row(row: str, size: str = "default") -> dict[str, float]:
    """One training step under ``row``'s numerics in this process: saved bytes and peak RSS."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    import numscope
    import numscope.train

    vocab, hidden, layers, heads, ffn, batch = SIZES[size]
    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=ffn,
            attn_implementation="eager",
        )
    )
    ids = torch.randint(5, vocab, (batch, 128), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    recipe = None
    context = torch.autocast("cpu", torch.bfloat16) if row == "bf16 autocast" else None
    if row.startswith("plan "):
        preset, _, option = row[5:].partition(" + ")
        numscope.convert(
            model,
            numscope.Plan.uniform(preset),
            storage="fp16" if option == "fp16 storage" else None,
            compiled=option == "compiled",
            low_memory=option == "low memory",
        )
    elif row.startswith("Recipe fp16"):
        plan = "fp8" if "plan fp8" in row else None
        recipe = numscope.Recipe(model, dtype=torch.float16, plan=plan, compiled=False)
        low_bit = row.rpartition(" + ")[2]
        if low_bit in ("AdamWFp8", "AdamW4bit"):
            optimizer = getattr(numscope.train, low_bit)(recipe.parameters(), lr=1e-4)
        else:
            optimizer = torch.optim.AdamW(recipe.parameters(), lr=1e-4)
    observer = numscope.observe(model, every=1).__enter__() if row == "observed" else None
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def step() -> None:
        if context is not None:
            with context:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        if recipe is not None:
            recipe.backward(loss)
            recipe.step(optimizer)
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # as the Recipe's step does
        if observer is not None:
            observer.step()

    before_mb = _resident_mb()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # the Recipe's own saved-tensor hooks stand in front of this one: they count what they keep
    kept = sum(seen.values()) if recipe is None else recipe.activations.kept_bytes  # type: ignore[union-attr]
    saved = kept / 2**20
    step()  # the second step runs with the optimizer's moments allocated, as every later one
    steady_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"saved_mb": saved, "peak_mb": peak_kib / 1024, "step_mb": steady_kib / 1024 - before_mb}


def _resident_mb() -> float:
    """The process's resident memory now, in MiB (Linux's /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per row (default: 1)")
    parser.add_argument(
        "--size", choices=tuple(SIZES), default="default", help="model shape (default: %(default)s)"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one row, in a child process
    args = parser.parse_args(argv)
    unknown = [row for row in args.rows.split(",") if row.strip() and row.strip() not in ROWS]
    if unknown:
        parser.error(f"argument --rows: unknown rows {unknown}; known: {', '.join(ROWS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.row is not None:
        print(json.dumps(run_row(args.row, args.size)))
        return
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    threads = str(args.threads)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads, "NUMSCOPE_FAST": "0"}
    results = {}
    for row in rows:
        results[row] = child(row, args.size, environment)
        # the same row once more with glibc's mmap threshold fixed: freed tensors return to the system
        returned = child(row, args.size, {**environment, **RETURN_FREED})
        results[row]["returned_peak_mb"] = returned["peak_mb"]
        results[row]["returned_step_mb"] = returned["step_mb"]
    base = results.get("fp32", next(iter(results.values())))
    vocab, hidden, layers, heads, ffn, batch = SIZES[args.size]
    print(
        f"BERT MLM vocab {vocab}, hidden {hidden}, {layers} layers, {heads} heads, FFN {ffn}, seq 128, batch "
        f"{batch}: one training step (forward, backward, AdamW)\n"
    )
    print(
        "| numerics | saved activations | vs fp32 | peak RSS | vs fp32 | step memory | vs fp32 "
        "| peak RSS, freed memory returned | vs fp32 | step memory, freed memory returned | vs fp32 |"
    )
    print("| --- " * 11 + "|")
    for row, result in results.items():
        cells = [row]
        for key in ("saved_mb", "peak_mb", "step_mb", "returned_peak_mb", "returned_step_mb"):
            cells += [f"{result[key]:.0f} MiB", f"{result[key] / base[key]:.2f}x"]
        print("| " + " | ".join(cells) + " |")


def child(row: str, size: str, environment: dict[str, str]) -> dict[str, float]:
    """One row in a fresh interpreter: its saved bytes and peak RSS."""
    done = subprocess.run(
        [sys.executable, __file__, "--row", row, "--size", size],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"row {row!r} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
