"""Across processes: 2 and 4 processes on this machine (`jax.distributed`, host CPU devices, JAX's default gloo
collectives) form one mesh of 4 devices, score a data set data-parallel and generate from a batch of prompts
(tests/multiprocess_run.py, the program every process runs); the log-probabilities and the new ids (greedy and
seeded) are one unsharded process's, bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 25 s on 2 cores: 7 processes that each start JAX and compile

SCRIPT = Path(__file__).with_name("multiprocess_run.py")
DEVICES = 4  # the mesh's data axis: 2 processes of 2 devices, 4 of 1
TIMEOUT = 90  # seconds for all the processes of one run (about 5 s for 2 processes, 15 s for 4, on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, folder: Path) -> dict:
    """Runs the script as `processes` processes (1: one process, the model unsharded) and returns process 0's JSON.
    A process that fails, or a run past TIMEOUT, ends them all and fails the test with their stderr."""
    # XLA's products in every run: sharded weights never take the native ones, so the unsharded reference must not
    # (the native products agree with XLA's to f32 rounding, not bit for bit)
    env = os.environ | {"JAX_PLATFORMS": "cpu", "LLAMA_JAX_CACHE": "off", "LLAMA_JAX_NATIVE": "off"}
    out = folder / f"scores-{processes}.json"
    env.pop("XLA_FLAGS", None)  # the device count is --cpu-devices
    args = [sys.executable, str(SCRIPT), "--out", str(out)]
    if processes > 1:
        args += ["--coordinator", f"127.0.0.1:{free_port()}", "--processes", str(processes)]
        args += ["--cpu-devices", str(DEVICES // processes)]
    logs = [folder / f"stderr-{processes}-{i}.txt" for i in range(processes)]
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + TIMEOUT
    try:
        for i, log in enumerate(logs):
            with log.open("w") as stderr:
                command = [*args, "--process-id", str(i)]
                procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env))
        # until all have exited, one has failed, or time is up
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:  # no process outlives the run: the others would wait for a failed one in their collectives
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failed = sorted((p.returncode < 0, i) for i, p in enumerate(procs) if p.returncode)  # the killed ones last
    late = f" (killed after {TIMEOUT} s)" if time.monotonic() > deadline else ""
    assert not failed, f"{processes} processes{late}:\n" + "\n".join(
        f"--- process {i} {'killed' if killed else f'exited with {procs[i].returncode}'}, its stderr:\n"
        + logs[i].read_text()[-3000:]
        for killed, i in failed
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return launch(1, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_data_parallel_give_one_process_log_probabilities_and_tokens(processes, one_process, tmp_path):
    """N processes of 4 / N host devices form one mesh over all 4 and split each batch's rows over it: every
    log-probability and every generated id (greedy, and the seeded sampler's) equals the single process's bit for
    bit (each row is computed whole on one device, by the same batch-invariant program, and only gathered across
    processes: the decode loop's tokens too, a chunk at a time)."""
    run = launch(processes, tmp_path)
    assert (run["processes"], run["devices"]) == (processes, DEVICES)
    assert (one_process["processes"], one_process["devices"]) == (1, 1)
    assert run["logprobs"] == one_process["logprobs"]  # JSON floats round-trip the float32 values exactly
    assert run["greedy"] == one_process["greedy"]
    assert run["greedy_ids"] == one_process["greedy_ids"] and len(run["greedy_ids"]) == 8
    assert run["seeded_ids"] == one_process["seeded_ids"] != run["greedy_ids"]
