"""cpu_threads: which CPU products batch.product_rows pads at more than one thread, measured."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
