"""--all-reduce: the flag's checks, how a rank resolves it, and where TensorParallel and RMSNorm
route a sum when the one-shot path takes it; the buffers' layout. All on the CPU: the one-shot
path itself runs on CUDA (tests/gpu), its kernels under the interpreter (tests/kernels).
"""

from __future__ import annotations

import pytest
import torch

from lorad.config import ConfigError
from lorad.config.serve import ServeConfig
from lorad.workers.kernels.configs import OneshotConfig
from lorad.workers.layers import RMSNorm
from lorad.workers.parallel import TensorParallel, init_tensor_parallel
from lorad.workers.peer_reduce import buffer_layout, oneshot_problem, resolve_all_reduce

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a name only: nothing here touches a GPU


def serve(**flags) -> ServeConfig:
    return ServeConfig(model_dir="m", served_name="m", **flags)


def test_the_flag_defaults_to_nccl_and_reaches_the_workers():
    """nccl stays the default until the one-shot path has run on GPUs (docs/multi-gpu.md)."""
    assert serve().all_reduce == "nccl"
    from lorad.config.cli import parse_args
    assert parse_args(["--model", "/m"]).all_reduce == "nccl"
    assert serve(all_reduce="oneshot", parallel=2, device="cuda").all_reduce == "oneshot"
    from dataclasses import fields

    from lorad.config.serve import WorkerConfig
    assert "all_reduce" in {f.name for f in fields(WorkerConfig)}


@pytest.mark.parametrize("flags,words", [
    (dict(all_reduce="ring"), "--all-reduce must be one of auto, nccl, oneshot"),
    (dict(all_reduce="oneshot", parallel=2, device="cpu"), "needs CUDA"),
    (dict(all_reduce="oneshot", parallel=1), "--parallel 2 or more"),
    (dict(all_reduce="oneshot", parallel=2, dist_backend="gloo"), "--dist-backend nccl"),
])
def test_refusals_are_one_line_naming_the_flag(flags, words):
    with pytest.raises(ConfigError) as exc:
        serve(**flags)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_nccl_and_auto_are_accepted_anywhere():
    serve(all_reduce="nccl", device="cpu", parallel=3)
    serve(all_reduce="auto", device="cpu", parallel=3)


def test_a_rank_resolves_auto_to_oneshot_only_where_it_can_run():
    assert resolve_all_reduce("auto", CPU, 2, "gloo", 2) == "nccl"
    assert resolve_all_reduce("auto", CUDA, 1, "nccl", 1) == "nccl"
    assert resolve_all_reduce("auto", CUDA, 4, "gloo", 4) == "nccl"
    assert resolve_all_reduce("auto", CUDA, 4, "nccl", 2) == "nccl"  # two hosts of 2
    assert resolve_all_reduce("nccl", CUDA, 4, "nccl", 4) == "nccl"
    expected = "oneshot" if oneshot_problem(CUDA, 4, "nccl", 4) is None else "nccl"
    assert resolve_all_reduce("auto", CUDA, 4, "nccl", 4) == expected


@pytest.mark.parametrize("args,words", [
    ((CPU, 2, "gloo", 2), "needs CUDA, and the workers run on cpu"),
    ((CUDA, 1, "nccl", 1), "--parallel 2 or more, got 1"),
    ((CUDA, 2, "gloo", 2), "--dist-backend nccl, got gloo"),
    ((CUDA, 4, "nccl", 2), "several hosts"),
])
def test_oneshot_that_cannot_run_is_a_config_error(args, words):
    with pytest.raises(ConfigError) as exc:
        resolve_all_reduce("oneshot", *args)
    assert words in str(exc.value) and "--all-reduce nccl" in str(exc.value)


def test_world_one_on_the_cpu_refuses_oneshot_before_any_group():
    with pytest.raises(ConfigError, match="--all-reduce oneshot needs CUDA"):
        init_tensor_parallel(0, 1, "file:///nonexistent", "gloo", CPU, all_reduce="oneshot")
    assert init_tensor_parallel(0, 1, "file:///nonexistent", "gloo", CPU,
                                all_reduce="auto").oneshot is None


class FakeOneshot:
    """Takes every tensor of `rows` rows; records what it was given."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.calls: list[str] = []

    def applies(self, x: torch.Tensor) -> bool:
        return x.shape[0] == self.rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x * 2


def test_tensor_parallel_sends_the_tensors_oneshot_takes_to_it():
    oneshot = FakeOneshot(rows=3)
    tp = TensorParallel(0, 2, CPU, oneshot=oneshot)
    x = torch.randn(3, 8)
    assert torch.equal(tp.all_reduce(x), x * 2) and oneshot.calls == ["all_reduce"]
    # At world 1 nothing is reduced, whatever is set.
    assert TensorParallel(0, 1, CPU, oneshot=oneshot).all_reduce(x) is x


def test_reduce_add_and_norm_off_the_kernel_path_is_the_two_steps():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(16, 1e-5, torch.float32, CPU)
    norm.weight.data.copy_(torch.randn(16, generator=gen))
    partial = torch.randn(3, 16, generator=gen)
    residual = torch.randn(3, 16, generator=gen)
    oneshot = FakeOneshot(rows=3)
    tp = TensorParallel(0, 2, CPU, oneshot=oneshot)
    got = norm.reduce_add_and_norm(partial, residual.clone(), tp)
    want = norm.add_and_norm(partial * 2, residual.clone())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # The CPU is never the kernel path: the fused kernel is not asked for.
    assert oneshot.calls == ["all_reduce"]


def test_buffer_layout_puts_the_partials_after_aligned_flags():
    config = OneshotConfig(max_rows=64, max_hidden=8192, num_programs=32)
    flag_bytes, num_elements = buffer_layout(config, 8)
    assert flag_bytes == 1024 and flag_bytes % 256 == 0  # 32 programs x 8 ranks x 4 bytes
    assert num_elements == 256 + 2 * 64 * 8192
    assert buffer_layout(OneshotConfig(num_programs=3), 3)[0] == 256


def test_the_benchmark_runs_world_one_once_and_each_world_under_each_all_reduce():
    from benchmarks.bench_multi_gpu import runs_of
    assert runs_of([1, 2, 4], ["nccl", "oneshot"]) == [
        ("nccl", 1), ("nccl", 2), ("oneshot", 2), ("nccl", 4), ("oneshot", 4)]
    assert runs_of([2], ["oneshot"]) == [("oneshot", 2)]
