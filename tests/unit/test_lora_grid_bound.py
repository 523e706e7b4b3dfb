"""lora_tiles.most_items bounds the work items the LoRA kernels make (their grids' cap with
TileConfig.grid_by_items): the items counted as the shrink's and the expand's loops count them,
for every tile count up to the bound's, over shapes of the 8B model and odd ones."""

import itertools

from lorad.workers.kernels.lora_tiles import most_items


def group_size(num_pieces: int, most: int, target: int) -> int:
    """lora_common.group_size's arithmetic (a triton function), on Python ints."""
    if target == 0:
        return 1
    return max(min(num_pieces // max(target, 1), most), 1)


def shrink_items(num_tiles: int, num_blocks: int, num_chunks: int, target: int) -> int:
    """lora_shrink._shrink_kernel's num_items."""
    group = group_size(num_tiles * num_blocks * num_chunks, num_chunks, target)
    return num_tiles * num_blocks * -(-num_chunks // group)


def expand_items(num_tiles: int, table_blocks: tuple[int, ...], target: int) -> int:
    """lora_expand._expand_kernel's items: num_tiles * items_per_tile."""
    num_blocks = sum(table_blocks)
    group = group_size(num_tiles * num_blocks, num_blocks, target)
    return num_tiles * sum(-(-blocks // group) for blocks in table_blocks)


TARGETS = (0, 1, 7, 264, 396, 528)


def test_bounds_the_shrinks_items() -> None:
    tight = 0
    for target, blocks, chunks in itertools.product(TARGETS, (1, 3, 4), (1, 3, 8, 28)):
        for max_tiles in (1, 2, 5, 64, 300):
            bound = most_items(target, max_tiles, blocks * chunks, blocks)
            most = max(shrink_items(n, blocks, chunks, target) for n in range(max_tiles + 1))
            assert most <= bound, (target, blocks, chunks, max_tiles)
            tight += most > 2 * target and target > 0  # the runs term is needed
    assert tight, "no case needed more than 2 * target items: the bound was not put to the test"


def test_bounds_the_expands_items() -> None:
    tight = 0
    for target, tables in itertools.product(TARGETS, ((32,), (32, 8, 8), (112, 112), (1, 1, 1),
                                                      (3, 250))):
        for max_tiles in (1, 2, 5, 64, 300):
            bound = most_items(target, max_tiles, sum(tables), len(tables))
            most = max(expand_items(n, tables, target) for n in range(max_tiles + 1))
            assert most <= bound, (target, tables, max_tiles)
            tight += most > 2 * target and target > 0
    assert tight, "no case needed more than 2 * target items: the bound was not put to the test"


def test_caps_the_grid_of_a_prompt_step() -> None:
    """A 512-row prompt step of one adapter (32 tiles) on gate/up's expand at an H100's 528
    target items: 1,120 programs at most instead of 32 x 224 blocks."""
    assert most_items(528, 32, 224, 2) == 1120
    assert most_items(0, 32, 224, 2) == 32 * 224
