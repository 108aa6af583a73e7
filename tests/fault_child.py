"""Training processes for tests/test_nothing_lost.py to signal, kill or fork.

python tests/fault_child.py sigterm LOG_DIR [WRITER]   trains forever, printing "logged N" after each gl.log(N)
python tests/fault_child.py chained LOG_DIR            the same, with the program's own SIGTERM handler (exits 7)
python tests/fault_child.py crash LOG_DIR RUNS WRITER  forks RUNS trainings, kills each with SIGKILL at a random
                                                       moment; each writes the steps log() returned for to
                                                       <dir>/logged (one line per step)
python tests/fault_child.py fork LOG_DIR               a logger, then os.fork(): the child logs and exits
python tests/fault_child.py leak RUNS                  replaces a 16 MB parameter RUNS times; prints RSS (kB) and
                                                       glibc's heap bytes in use after each replacement
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from typing import Any

import torch
from catalogue import frozen_tail
from torch import nn

import gradlog


def writer_of(name: str, log_dir: str) -> list[gradlog.Writer]:
    if name == "wandb":
        return [gradlog.WandbWriter(log_dir=log_dir, mode="offline", project="faults")]
    return [gradlog.TensorBoardWriter(log_dir)]


def train(log_dir: str, writer: str, steps: int | None = None, progress: str | None = None) -> None:
    model, opt = frozen_tail()
    gl = gradlog.GradLogger(
        model,
        opt,
        every=2,
        histograms=gradlog.HistogramOptions(every=4),
        writer=gradlog.Output(writer=writer_of(writer, log_dir), provisional_every=0),
    )
    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if progress else None
    step = 0
    while steps is None or step < steps:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        if fd is not None:
            os.write(fd, f"{step}\n".encode())  # unbuffered: on disk before the next step starts
        else:
            print(f"logged {step}", flush=True)
        step += 1
        time.sleep(float(os.environ.get("FAULT_STEP_S", "0.002")))  # the rest of a training step
    gl.close()


def crash(root: str, runs: int, writer: str) -> None:
    rng = random.Random(int(os.environ.get("FAULT_SEED", "0")))
    # imported once here, not in every forked run (the first optimizer step imports torch._dynamo: seconds)
    model, opt = frozen_tail()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if writer == "wandb":
        import wandb  # noqa: F401
    else:
        import gradlog.writers.tb_format
        import gradlog.writers.tfrecord  # noqa: F401
    for i in range(runs):
        run_dir = os.path.join(root, f"run{i:02d}")
        os.makedirs(run_dir)
        progress = os.path.join(run_dir, "logged")
        pid = os.fork()
        if pid == 0:
            try:
                train(os.path.join(run_dir, "tb") if writer == "tensorboard" else run_dir, writer, progress=progress)
            finally:
                os._exit(1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the first histogram step (4) is logged: a provisional table
            if os.path.exists(progress) and len(open(progress).read().split()) >= 5:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print("done", flush=True)


class SignalsItself(gradlog.MemoryWriter):
    """Sends SIGTERM to its own process from inside a writer call, i.e. from inside gl.log()."""

    def log_scalars(self, scalars: object, step: int) -> None:
        super().log_scalars(scalars, step)  # type: ignore[arg-type]
        if step == 6 and "weights/grad_norm/0.weight" in scalars:  # once (close() writes its counts at step 6 too)
            os.kill(os.getpid(), signal.SIGTERM)
            print(f"writer call for step {step} finished", flush=True)


def inside(log_dir: str) -> None:
    """The signal arrives inside log(): gradlog finishes that call, then closes and re-raises."""
    model, opt = frozen_tail()
    gl = gradlog.GradLogger(model, opt, writer=[SignalsItself(), gradlog.TensorBoardWriter(log_dir)], every=2)
    for step in range(100):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        print(f"logged {step}", flush=True)


def chained(log_dir: str) -> None:
    def mine(signum: int, frame: object) -> None:
        print("own handler ran", flush=True)
        sys.exit(7)

    signal.signal(signal.SIGTERM, mine)
    train(log_dir, "tensorboard")


def fork(log_dir: str) -> None:
    model, opt = frozen_tail()
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=log_dir, every=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    gl.log(0)
    pid = os.fork()
    if pid == 0:
        start = time.monotonic()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        gl.log(1)  # inert: the parent owns the run
        print(f"child logged in {time.monotonic() - start:.1f} s", flush=True)
        sys.exit(0)  # atexit runs: no second table
    _, status = os.waitpid(pid, 0)
    print(f"child exit {os.waitstatus_to_exitcode(status)}", flush=True)
    gl.close()


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _glibc() -> Any:
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2  # noqa: B018 (glibc >= 2.33)
    except (OSError, AttributeError):
        return None
    return libc


def heap_in_use() -> int:
    """Bytes of glibc's main heap held by live allocations (mallinfo2().uordblks), -1 without glibc: what
    is alive, as opposed to RSS, which also counts freed chunks glibc has not given back."""
    import ctypes

    libc = _glibc()
    if libc is None:
        return -1

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        ] + [("keepcost", ctypes.c_size_t)]

    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().uordblks)


def leak(runs: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2))  # 16 MB weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, histograms=False, print_report=False)
    x = torch.randn(2, 2048)
    for i in range(runs):
        model[0].weight = nn.Parameter(torch.randn(2048, 2048) * 0.01)  # replaced, e.g. by a re-initialisation
        opt.param_groups[0]["params"][0] = model[0].weight
        opt.state.clear()
        model(x).sum().backward()
        opt.step()
        gl.log(i)
        opt.zero_grad(set_to_none=True)
        print(f"rss {i} {rss_kb()} {heap_in_use()}", flush=True)
    gl.close()
    print(f"rss closed {rss_kb()}", flush=True)
    libc = _glibc()
    if libc is not None:  # what glibc keeps but nothing uses: returned to the OS here
        libc.malloc_trim(0)
        print(f"rss trimmed {rss_kb()}", flush=True)
    ref = __import__("weakref").ref(model[0].weight)
    gl2 = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    del model, opt
    import gc

    gc.collect()
    print(f"model gone: weight freed {ref() is None}, logger closed {gl2.closed}", flush=True)


def dist_sigterm(log_dir: str) -> None:
    """One rank of `torchrun --nproc_per_node 2` (gloo, DDP): trains until torchrun forwards a SIGTERM."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = frozen_tail()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.005)
    gl = gradlog.GradLogger(
        ddp, opt, writer="tensorboard", log_dir=log_dir, every=2, histograms=gradlog.HistogramOptions(every=4)
    )
    step = 0
    while True:
        ddp(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        if rank == 0:
            print(f"logged {step}", flush=True)
        step += 1
        time.sleep(0.01)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "sigterm":
        train(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "tensorboard")
    elif mode == "inside":
        inside(sys.argv[2])
    elif mode == "chained":
        chained(sys.argv[2])
    elif mode == "crash":
        crash(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif mode == "fork":
        fork(sys.argv[2])
    elif mode == "dist_sigterm":
        dist_sigterm(sys.argv[2])
    elif mode == "leak":
        leak(int(sys.argv[2]))
