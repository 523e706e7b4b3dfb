"""Checks of kernels/oneshot_reduce.py against its plain-torch reference, poisoned outputs, on
any device (the interpreter: test_triton_interpreted.py; CUDA: tests/gpu). Its "ranks" are buffers
of one process, so the peers' partials and flags are written before each rank's launch.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.fused_ops_checks import assert_close
from tests.kernels.triton_interpreter import run_checks

POISON = float("nan")


def _partials(gen: torch.Generator, world: int, rows: int, hidden: int, device: str,
              scale: float = 3.0) -> list[torch.Tensor]:
    # Magnitudes that differ by rank, so the order of the adds shows in the low bits.
    return [(torch.randn(rows, hidden, generator=gen) * scale * (1 + 7 * r)).to(device)
            for r in range(world)]


def _poisoned(rows: int, hidden: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full((rows, hidden), POISON, dtype=dtype, device=device)


def _same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if torch.isnan(got).any() and not torch.isnan(want).any():
        raise AssertionError(f"{name}: {int(torch.isnan(got).sum())} elements never written")
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(f"{name}: differs from the reference bit for bit, first at {bad}")


def check_sum(device: str, worlds=(2, 3, 4, 8), rows=(1, 2, 3, 7, 16), hiddens=(48, 1030)):
    """all_reduce_sum (no barrier) equals the rank-ordered reference bit for bit at every world,
    row count and hidden size (1030: a row over two column tiles with a ragged end), and a row
    alone equals the row in the batch."""
    from lorad.workers.kernels.oneshot_reduce import all_reduce_sum, unsynced_peers
    from lorad.workers.kernels.oneshot_reduce_reference import rank_ordered_sum
    gen = torch.Generator().manual_seed(3)
    for world in worlds:
        for hidden in hiddens:
            for num_rows in rows:
                parts = _partials(gen, world, num_rows, hidden, device)
                where = f"all_reduce_sum world {world} rows {num_rows} hidden {hidden}"
                out = _poisoned(num_rows, hidden, torch.float32, device)
                got = all_reduce_sum(parts[0], unsynced_peers(parts), out)
                if got.data_ptr() != out.data_ptr():
                    raise AssertionError(f"{where}: not written into out")
                _same(where, got, rank_ordered_sum([p.cpu() for p in parts]))
                last = num_rows - 1
                alone = [p[last:].clone() for p in parts]
                _same(f"{where}: row {last} alone",
                      all_reduce_sum(alone[0], unsynced_peers(alone)), got[last:])


def check_add_rms_norm(device: str, dtype: torch.dtype = torch.bfloat16, worlds=(2, 3, 4, 8),
                       rows=(1, 5, 11), hidden: int = 48):
    """all_reduce_add_rms_norm equals fused_ops.add_rms_norm of the rank-ordered reference sum
    bit for bit (hidden and normed), with and without a residual, the residual updated in
    place; the torch add + RMSNorm within the kernels' tolerance; a row alone, the same bits."""
    from lorad.workers.kernels.fused_ops import add_rms_norm
    from lorad.workers.kernels.oneshot_reduce import all_reduce_add_rms_norm, unsynced_peers
    from lorad.workers.kernels.oneshot_reduce_reference import add_rms_norm as torch_add_norm
    from lorad.workers.kernels.oneshot_reduce_reference import rank_ordered_sum
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(hidden, generator=gen).to(dtype=dtype, device=device)
    eps = 1e-5
    for world in worlds:
        for num_rows in rows:
            parts = _partials(gen, world, num_rows, hidden, device)
            total = rank_ordered_sum(parts)
            for with_residual in (True, False):
                where = (f"all_reduce_add_rms_norm {dtype} world {world} rows {num_rows} "
                         f"residual {with_residual}")
                residual = (torch.randn(num_rows, hidden, generator=gen).to(dtype=dtype,
                                                                           device=device)
                            if with_residual else None)
                want_hidden, want_normed = add_rms_norm(
                    total, None if residual is None else residual.clone(), weight, eps)
                res_in = None if residual is None else residual.clone()
                normed = _poisoned(num_rows, hidden, dtype, device)
                got_hidden, got_normed = all_reduce_add_rms_norm(
                    parts[0], unsynced_peers(parts), res_in, weight, eps, normed)
                _same(f"{where} hidden", got_hidden, want_hidden)
                _same(f"{where} normed", got_normed, want_normed)
                if res_in is not None and got_hidden.data_ptr() != res_in.data_ptr():
                    raise AssertionError(f"{where}: the residual was not updated in place")
                torch_hidden, torch_normed = torch_add_norm(
                    total.cpu(), None if residual is None else residual.cpu(), weight.cpu(), eps)
                _same(f"{where} hidden (torch)", got_hidden, torch_hidden)
                assert_close(f"{where} normed (torch)", got_normed, torch_normed, dtype)
                alone = [p[-1:].clone() for p in parts]
                _, one_normed = all_reduce_add_rms_norm(
                    alone[0], unsynced_peers(alone),
                    None if residual is None else residual[-1:].clone(), weight, eps)
                _same(f"{where}: the last row alone", one_normed, got_normed[-1:])


def _synced_world(world: int, max_rows: int, max_hidden: int, num_programs: int, device: str):
    """Every rank's buffers in one process: (each rank's PeerBuffers, data, signals)."""
    from lorad.workers.kernels.oneshot_reduce import PeerBuffers
    data = [torch.full((2, max_rows, max_hidden), POISON, device=device) for _ in range(world)]
    signals = [torch.zeros(num_programs, world, dtype=torch.int32, device=device)
               for _ in range(world)]
    table = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64, device=device)
    signal_table = torch.tensor([s.data_ptr() for s in signals], dtype=torch.int64,
                                device=device)
    peers = [PeerBuffers(r, world, table, max_hidden, max_rows * max_hidden, max_rows,
                         max_hidden, num_programs, signal_table,
                         torch.zeros(num_programs, dtype=torch.int32, device=device))
             for r in range(world)]
    return peers, data, signals


def _as_peers_left_it(data, signals, parts, epoch: int) -> None:
    """What the other ranks would have done by epoch `epoch`: their partials in the epoch's
    half of their buffers, their flags published."""
    rows, hidden = parts[0].shape
    for r, part in enumerate(parts):
        data[r][epoch % 2, :rows, :hidden] = part
        signals[r].fill_(epoch)


def check_synced(device: str, worlds=(2, 4), rows=(3, 1, 6), hidden: int = 40,
                 num_programs: int = 4, dtype: torch.dtype = torch.bfloat16):
    """With the barrier: every rank's launch gives the reference's bits (so the same bits on
    every rank), call after call (the epochs alternate the halves, and a call of fewer rows than
    programs still meets its peers); each rank's counters reach the epoch; the fused variant
    too, and it agrees with the plain sum + fused_ops.add_rms_norm."""
    from lorad.workers.kernels.fused_ops import add_rms_norm
    from lorad.workers.kernels.oneshot_reduce import all_reduce_add_rms_norm, all_reduce_sum
    from lorad.workers.kernels.oneshot_reduce_reference import rank_ordered_sum
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(hidden, generator=gen).to(dtype=dtype, device=device)
    for world in worlds:
        peers, data, signals = _synced_world(world, max(rows), hidden, num_programs, device)
        epoch = 0
        for num_rows in rows:
            parts = _partials(gen, world, num_rows, hidden, device)
            want = rank_ordered_sum(parts)
            epoch += 1
            _as_peers_left_it(data, signals, parts, epoch)
            for r in range(world):
                got = all_reduce_sum(parts[r], peers[r],
                                     _poisoned(num_rows, hidden, torch.float32, device))
                _same(f"synced sum world {world} rank {r} epoch {epoch}", got, want)
            residual = torch.randn(num_rows, hidden, generator=gen).to(dtype=dtype, device=device)
            want_hidden, want_normed = add_rms_norm(want, residual.clone(), weight, 1e-5)
            epoch += 1
            _as_peers_left_it(data, signals, parts, epoch)
            for r in range(world):
                got_hidden, got_normed = all_reduce_add_rms_norm(
                    parts[r], peers[r], residual.clone(), weight, 1e-5,
                    _poisoned(num_rows, hidden, dtype, device))
                where = f"synced add + norm world {world} rank {r} epoch {epoch}"
                _same(f"{where} hidden", got_hidden, want_hidden)
                _same(f"{where} normed", got_normed, want_normed)
        for r in range(world):
            if not bool((peers[r].counters.cpu() == epoch).all()):
                raise AssertionError(f"world {world} rank {r}: counters "
                                     f"{peers[r].counters.tolist()}, expected {epoch}")


def check_copies_own_partial(device: str, world: int = 3, num_rows: int = 5, hidden: int = 24):
    """A synced launch writes this rank's partial into its own buffer (the half of the epoch)
    before the barrier, and publishes the epoch into every peer's flags at [program, rank]."""
    from lorad.workers.kernels.oneshot_reduce import all_reduce_sum
    gen = torch.Generator().manual_seed(13)
    # Buffers of at least num_rows rows (the GPU test sends 33; 8 made its partial not fit).
    peers, data, signals = _synced_world(world, max(8, num_rows), hidden, 2, device)
    parts = _partials(gen, world, num_rows, hidden, device)
    _as_peers_left_it(data, signals, parts, 1)
    rank = 1
    data[rank].fill_(POISON)
    for s in signals:
        s[:, rank] = 0  # this rank has published nothing yet
    all_reduce_sum(parts[rank], peers[rank])
    _same("the rank's own partial, half 1", data[rank][1, :num_rows, :hidden], parts[rank])
    for q, s in enumerate(signals):
        if not bool((s[:, rank].cpu() == 1).all()):
            raise AssertionError(f"rank {rank}'s flags in rank {q}: {s[:, rank].tolist()}")


CHECKS = {
    "sum": (check_sum, {}),
    "add_rms_norm_bf16": (check_add_rms_norm, dict(dtype=torch.bfloat16)),
    "add_rms_norm_fp32": (check_add_rms_norm, dict(dtype=torch.float32, worlds=(3,))),
    "synced": (check_synced, {}),
    "copies_own_partial": (check_copies_own_partial, {}),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
