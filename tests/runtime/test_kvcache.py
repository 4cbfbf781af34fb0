"""runtime.kvcache: rows packed at the front, the width in pages, and K/V landing where they belong."""

import numpy as np
import pytest

from runtime.kvcache import ArrayStorage, KVCache

L, NH, HD, PAGE = 2, 2, 3, 4


class Seq:
    def __init__(self, name):
        self.name, self.row = name, -1


def make(rows=4, capacity=16):
    storage = ArrayStorage(L, NH, HD, lambda shape: np.zeros(shape, np.float32))
    return KVCache(storage, rows, capacity, PAGE)


def fill(cache, rows, tokens, value):
    """Write ``tokens`` positions to cache rows ``rows`` (a block from rows.start), K = V = value + row."""
    k = len(rows)
    new = np.zeros((k, NH, tokens, HD), np.float32) + value + np.arange(k)[:, None, None, None]
    cache.reserve(rows.start, rows.stop, tokens)
    for layer in range(L):
        cache.write(layer, new, new, np.arange(k), rows.start)
    cache.advance(rows.start, rows.stop, np.ones((k, tokens), np.int64))


def key_of(cache, row, layer=0):
    return cache.storage.keys[layer][row, 0, 0, : cache.length[row]]  # (length,) of head 0, dim 0


def test_seat_promote_release_keep_the_rows_packed():
    cache = make()
    a, b, c = Seq("a"), Seq("b"), Seq("c")
    fill(cache, cache.seat([a, b]), 3, 10.0)  # a: 10s, b: 11s
    cache.promote()
    fill(cache, cache.seat([c]), 5, 20.0)  # c joins: 20s, not yet decoding
    assert (cache.decoding, cache.used, [s.row for s in (a, b, c)]) == (2, 3, [0, 1, 2])
    cache.release(a.row)  # a decoding row leaves: b fills its place, c the gap behind b
    assert (cache.decoding, cache.used, b.row, c.row) == (1, 2, 0, 1)
    assert cache.owners == [b, c, None, None] and a.row == -1
    np.testing.assert_array_equal(key_of(cache, b.row), [11.0] * 3)
    np.testing.assert_array_equal(key_of(cache, c.row), [20.0] * 5)
    assert cache.length.tolist() == [3, 5, 0, 0] and cache.valid[2:].sum() == 0
    assert cache.moves == 2


def test_release_of_the_last_row_moves_nothing():
    cache = make()
    a, b = Seq("a"), Seq("b")
    fill(cache, cache.seat([a, b]), 2, 1.0)
    cache.promote()
    cache.release(b.row)
    assert cache.moves == 0 and cache.used == 1 and a.row == 0


def test_width_grows_with_the_longest_row_and_shrinks_when_it_leaves():
    cache = make(capacity=16)
    a, b = Seq("a"), Seq("b")
    fill(cache, cache.seat([a]), 3, 1.0)
    assert cache.width == PAGE
    fill(cache, range(0, 1), 2, 2.0)  # 5 positions: a second page
    assert cache.width == 2 * PAGE and cache.storage.keys[0].shape == (4, NH, HD, 2 * PAGE)
    np.testing.assert_array_equal(key_of(cache, 0), [1, 1, 1, 2, 2])  # kept across the re-lay
    cache.promote()
    fill(cache, cache.seat([b]), 9, 3.0)  # b: 3 pages
    assert cache.width == 3 * PAGE
    cache.promote()
    cache.release(b.row)
    cache.reserve(0, cache.decoding, 1)  # the next step: a alone needs 6 positions
    assert cache.width == 2 * PAGE and cache.resizes == 3
    np.testing.assert_array_equal(key_of(cache, a.row), [1, 1, 1, 2, 2])


def test_mask_is_the_valid_past_then_the_new_columns():
    cache = make()
    a = Seq("a")
    rows = cache.seat([a])
    cache.reserve(0, 1, 3)
    cache.advance(0, 1, np.array([[0, 1, 1]]))  # a left-padded prompt
    mask = cache.mask(0, 1, np.ones((1, 1), np.int64))
    assert mask.tolist() == [[0, 1, 1, 0, 1]]  # width 4 (one page), then the new position
    assert rows == range(0, 1)


def test_refusals():
    cache = make(rows=2, capacity=8)
    cache.seat([Seq("a")])
    with pytest.raises(RuntimeError, match="already joining: promote"):
        cache.seat([Seq("b")])
    cache.promote()
    with pytest.raises(ValueError, match="2 rows do not fit the 1 free rows"):
        cache.seat([Seq("b"), Seq("c")])
    with pytest.raises(ValueError, match="rows would hold 9 positions, past the KV capacity 8"):
        cache.reserve(0, 1, 9)
    with pytest.raises(ValueError, match="row 1 is not in use"):
        cache.release(1)



def test_rows_holding_nothing_bind_one_page_of_zeros():
    """A prompt's first chunk reads no past: it binds one page of zeros, not the cache's width."""
    cache = make(capacity=16)
    a, b = Seq("a"), Seq("b")
    fill(cache, cache.seat([a]), 9, 1.0)  # a holds 9 positions: 3 pages
    cache.promote()
    rows = cache.seat([b])
    assert cache.bound(rows.start, rows.stop) == PAGE and cache.bound(0, 1) == 3 * PAGE
    key, value = cache.past(0, rows.start, rows.stop)
    assert key.shape == (1, NH, HD, PAGE) and value.shape == (1, NH, PAGE, HD) and not key.any()
    assert cache.mask(rows.start, rows.stop, np.ones((1, 2), np.int64)).tolist() == [[0] * PAGE + [1, 1]]
    fill(cache, rows, 2, 2.0)  # once it holds something, it binds the width like the others
    assert cache.bound(rows.start, rows.stop) == 3 * PAGE
    assert not cache.storage.zeros_flat.any()  # nothing ever writes the zeros


@pytest.mark.parametrize("rows", [1, 3, 7])  # at, under and over ROW_SLICES: both ways of writing
def test_a_write_lands_each_rows_new_positions_at_its_own_length(rows):
    from runtime.kvcache import ROW_SLICES

    assert 3 <= ROW_SLICES < 7
    storage = ArrayStorage(L, NH, HD, lambda shape: np.zeros(shape, np.float32))
    storage.allocate(8, 16, 16)
    rng = np.random.default_rng(rows)
    T = 2
    new_key, new_value = (rng.standard_normal((rows + 1, NH, T, HD)).astype(np.float32) for _ in range(2))
    src = np.arange(1, rows + 1)  # batch row 0 skipped the layer: not written
    dst = np.arange(rows) + 1
    positions = np.arange(rows) * 2 + 1
    storage.write(1, new_key, new_value, src, dst, positions)
    keys, values = np.zeros_like(storage.keys[1]), np.zeros_like(storage.values[1])
    for s, d, p in zip(src, dst, positions):
        keys[d, :, :, p:p + T] = new_key[s].transpose(0, 2, 1)
        values[d, :, p:p + T] = new_value[s]
    np.testing.assert_array_equal(storage.keys[1], keys)
    np.testing.assert_array_equal(storage.values[1], values)
    assert not storage.keys[0].any()  # other layers untouched


@pytest.mark.parametrize("transposed", [True, False])  # the plain graphs' K layout and the fused graphs'
@pytest.mark.parametrize("widths", [(4, 12, 8), (12, 4, 16)])  # grow then shrink, shrink then grow
def test_a_new_width_keeps_every_row_in_use(transposed, widths):
    """Host buffers are re-laid in place (no copy of the rows made first): the rows in use keep
    their positions [0, min(old, new)) in every layer, K and V."""
    rows, used, capacity = 5, 3, 16
    storage = ArrayStorage(L, NH, HD, lambda shape: np.zeros(shape, np.float32), transposed_keys=transposed)
    storage.allocate(rows, capacity, widths[0])
    rng = np.random.default_rng(7)
    for keys, values in zip(storage.keys, storage.values):
        keys[...] = rng.standard_normal(keys.shape)
        values[...] = rng.standard_normal(values.shape)
    positions = (lambda k: k) if not transposed else (lambda k: k.swapaxes(2, 3))  # (rows, nh, W, hd)
    held = [(positions(k)[:used].copy(), v[:used].copy()) for k, v in zip(storage.keys, storage.values)]
    before = storage.width
    for width in widths[1:]:
        storage.resize(width, used)
        keep = min(before, width)
        assert storage.width == width
        for (key, value), keys, values in zip(held, storage.keys, storage.values):
            assert keys.shape == ((rows, NH, HD, width) if transposed else (rows, NH, width, HD))
            np.testing.assert_array_equal(positions(keys)[:used, :, :keep], key[:, :, :keep])
            np.testing.assert_array_equal(values[:used, :, :keep], value[:, :, :keep])
        held = [(positions(k)[:used].copy(), v[:used].copy()) for k, v in zip(storage.keys, storage.values)]
        before = width


def test_a_fixed_storage_moves_a_rows_valid_positions_only():
    """A fixed storage's row spans the whole capacity (the torch backend's max_length): moving a
    row that holds a few positions copies those, and leaves the rest of the destination row alone."""
    storage = ArrayStorage(L, NH, HD, lambda shape: np.zeros(shape, np.float32), fixed=True)
    storage.allocate(3, 64, PAGE)
    new = np.arange(NH * 10 * HD, dtype=np.float32).reshape(1, NH, 10, HD)  # (B, nh, T, hd)
    for layer in range(L):
        storage.write(layer, new, new + 1, np.array([0]), np.array([2]), np.array([0]))
        storage.values[layer][0, :, 10:20] = -1  # what row 0 held past the moved positions
        storage.keys[layer][0, :, :, 10:20] = -1
    storage.move(2, 0, 10)
    for layer in range(L):
        np.testing.assert_array_equal(storage.keys[layer][0, :, :, :10], new[0].swapaxes(1, 2))
        np.testing.assert_array_equal(storage.values[layer][0, :, :10], new[0] + 1)
        assert (storage.values[layer][0, :, 10:20] == -1).all() and (storage.keys[layer][0, :, :, 10:20] == -1).all()
