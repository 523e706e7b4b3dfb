"""cpu_threads: the CPU path's products at more than one thread (column blocks, and which row
counts batch.product_rows pads), measured against one thread's bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorad.workers import cpu_threads
from lorad.workers.batch import product_rows
from lorad.workers.cpu_threads import differing_counts, measure_padding, padding_for


def test_padded_products_keep_one_threads_bits_at_two_threads():
    """Whatever this CPU's MKL splits (this project's: 9, 10 and 11 rows), the padded counts
    give every row one thread's bits; torch's thread count is restored."""
    before = torch.get_num_threads()
    assert differing_counts(2, lambda n: padding_for(2).get(n, n)) == []
    assert torch.get_num_threads() == before
    unpadded = differing_counts(2, lambda n: n)
    assert sorted(padding_for(2)) == unpadded
    torch.set_num_threads(2)
    try:
        assert all(product_rows(n) == padding_for(2)[n] for n in unpadded)
        assert product_rows(3) == 8 and product_rows(64) == padding_for(2).get(64, 64)
    finally:
        torch.set_num_threads(1)
    assert product_rows(10) == 10  # one thread pads nothing past MIN_ROWS
    torch.set_num_threads(before)


def test_a_count_that_differs_is_padded_to_the_next_that_does_not():
    def splits(x, weight):  # another order of sums at 13 and 14 rows, on threads only
        if x.shape[0] in (13, 14) and torch.get_num_threads() > 1:
            return F.linear(x[:, :256], weight[:, :256]) + F.linear(x[:, 256:], weight[:, 256:])
        return F.linear(x, weight)

    assert differing_counts(4, lambda n: n, splits) == [13, 14]
    assert measure_padding(4, splits) == {13: 15, 14: 15}
    assert measure_padding(1, splits) == {}
    assert padding_for(1) == {}


def test_linear_keeps_one_threads_bits_at_any_thread_count():
    """cpu_threads.linear, the CPU path's product, on rows padded as batch.product_rows pads a
    step: every row has one thread's bits at 2, 3 and 4 threads, for weights split into column
    blocks (where this CPU keeps their bits) and for those too narrow to split."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(72, 96, generator=gen)
    before = torch.get_num_threads()
    try:
        for out_features in (48, 96, 384, 1000):
            weight = torch.randn(out_features, 96, generator=gen)
            torch.set_num_threads(1)
            reference = torch.cat([F.linear(x[i:i + 8], weight) for i in range(0, 72, 8)])
            for threads in (2, 3, 4):
                torch.set_num_threads(threads)
                for num_rows in range(8, 65):
                    padded = x[:product_rows(num_rows)]
                    got = cpu_threads.linear(padded, weight)[:num_rows]
                    assert torch.equal(got, reference[:num_rows]), (out_features, threads, num_rows)
    finally:
        torch.set_num_threads(before)


def test_column_blocks_are_the_product_and_the_check_finds_other_sums():
    gen = torch.Generator().manual_seed(8)
    x, weight = torch.randn(8, 32, generator=gen), torch.randn(64, 32, generator=gen)
    assert torch.allclose(cpu_threads.column_blocks(x, weight, 4), x @ weight.T, atol=1e-5)

    def other_order(x, weight):  # a split whose sums run in another order: the check sees it
        return F.linear(x[:, :256], weight[:, :256]) + F.linear(x[:, 256:], weight[:, 256:])

    assert differing_counts(2, lambda n: n, other_order) != []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one thread: F.linear itself
        assert torch.equal(cpu_threads.linear(x, weight), F.linear(x, weight))
    finally:
        torch.set_num_threads(before)
