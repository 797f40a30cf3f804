"""Shared test helpers: a real 2-process ``torchrun`` that cannot outlive its test; the real corpus and a
small tokenizer trained on a slice of it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# Quantizers run eagerly in the tests (the same bits; compiling each configuration costs seconds):
# convert's compiled="auto" defers to NUMSCOPE_FAST when it is set. tests/formats/test_formats_fast.py
# checks the compiled path against the eager one, and tests/test_convert.py the "auto" choice itself.
os.environ.setdefault("NUMSCOPE_FAST", "0")

from tokenizers import Tokenizer

from numscope.distributed import loopback_interface
from numscope.run.corpus import load_corpus, split_corpus
from numscope.run.tokenizer import TokenizerInfo, load_or_train_tokenizer


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so killing
    torchrun's process group leaves them running, holding its output open)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process: subprocess.Popen) -> None:
    below = _descendants(process.pid) if sys.platform == "linux" else []
    process.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_torchrun(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300, nproc: int = 2
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node nproc <args>`` on 127.0.0.1, gloo on loopback.

    Output goes to files, not pipes, and a run past ``timeout`` seconds fails the test after every process
    of it (workers included) is killed; CI never waits on a stuck rank.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        *args,
    ]
    environment = {
        **(os.environ if env is None else env),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "GLOO_SOCKET_IFNAME": loopback_interface() or "lo",
    }
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            process = subprocess.Popen(command, env=environment, stdout=stdout, stderr=stderr, text=True)
            start = time.monotonic()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(process)
                waited = time.monotonic() - start
                pytest.fail(
                    f"torchrun {' '.join(args)} did not finish in {timeout:.0f}s ({waited:.0f}s):\n"
                    f"{out.read_text()[-2000:]}\n{err.read_text()[-3000:]}"
                )
        return subprocess.CompletedProcess(command, process.returncode, out.read_text(), err.read_text())


@pytest.fixture
def torchrun() -> Callable[..., subprocess.CompletedProcess[str]]:
    """:func:`run_torchrun`, for tests in any folder."""
    return run_torchrun


# ------------------------------------------------------------------ the real corpus and a small tokenizer
SMALL_VOCAB = 1000


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return load_corpus()


@pytest.fixture(scope="session")
def small_train(corpus: list[str]) -> list[str]:
    train, _ = split_corpus(corpus)
    return train[:300]


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("numscope-cache")


@pytest.fixture(scope="session")
def small_vocab_size() -> int:
    return SMALL_VOCAB


@pytest.fixture(scope="session")
def small_tokenizer(small_train: list[str], small_cache: Path) -> Tokenizer:
    return load_or_train_tokenizer(small_train, SMALL_VOCAB, cache_dir=small_cache)


@pytest.fixture(scope="session")
def small_info(small_tokenizer: Tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(small_tokenizer)
