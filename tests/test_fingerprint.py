"""Per-slice fingerprints are exact: every single-bit change and every swap is found, in its slice only.

The expected slices come from the test's own edit (which element it flipped or swapped), never from
gradlog; both the CPU path (integer matrix products, chunked numpy compare) and the accelerator path (int64
elementwise sums) are checked, and must give the same signatures.
"""

from __future__ import annotations

import pytest
import torch

from gradlog.measure import fingerprint as fp

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _flip(x: torch.Tensor, at: tuple[int, ...], bit: int) -> torch.Tensor:
    """A copy of `x` with one bit of one element's raw bits flipped."""
    y = x.clone()
    bits = y.view(_INT[y.element_size()])
    bits[at] = bits[at] ^ torch.tensor(1, dtype=bits.dtype).bitwise_left_shift(bit)
    return y


def _changed(first: fp.Fingerprint, y: torch.Tensor, generic: bool) -> fp.Changes:
    if generic:
        return fp.compare(first, fp.take(y, generic=True))
    ch = fp.changes_since(first, y)
    assert ch is not None
    return ch


def _where(t: torch.Tensor | None) -> list[int]:
    assert t is not None
    return t.contiguous().nonzero().flatten().tolist()


@pytest.mark.parametrize("generic", [False, True], ids=["cpu", "accelerator-path"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(5, 4), (4, 3, 1, 2), (9,)])
def test_every_single_bit_flip_of_every_element_is_found_in_its_row_and_column(
    dtype: torch.dtype, shape: tuple[int, ...], generic: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    first = fp.take(x, generic=generic)
    assert not bool(_changed(first, x.clone(), generic).any())
    for flat in range(x.numel()):
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))
        for bit in range(8 * x.element_size()):
            ch = _changed(first, _flip(x, at, bit), generic)
            assert bool(ch.any()), (at, bit)
            if x.dim() == 1:
                assert _where(ch.elems) == [at[0]], (at, bit)
            else:
                assert _where(ch.rows) == [at[0]], (at, bit)
                assert _where(ch.cols) == [at[1]], (at, bit)


@pytest.mark.parametrize("generic", [False, True], ids=["cpu", "accelerator-path"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_swapped_values_within_a_row_or_a_column_are_found(dtype: torch.dtype, generic: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 7, generator=gen).to(dtype)
    first = fp.take(x, generic=generic)
    for a in range(7):
        for b in range(a + 1, 7):
            y = x.clone()
            y[2, a], y[2, b] = x[2, b], x[2, a]  # a row's plain sum is unchanged: its weighted sum is not
            ch = _changed(first, y, generic)
            assert _where(ch.rows) == [2] and _where(ch.cols) == [a, b], (a, b)
    for a in range(6):
        for b in range(a + 1, 6):
            y = x.clone()
            y[a, 3], y[b, 3] = x[b, 3], x[a, 3]  # the same inside a column
            ch = _changed(first, y, generic)
            assert _where(ch.cols) == [3] and _where(ch.rows) == [a, b], (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_slabs_give_the_accelerator_paths_numbers_and_find_a_change_in_the_last_one(dtype: torch.dtype) -> None:
    # 3,000 rows of 400 values: several 1 MiB slabs of rows on the CPU path
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 400, generator=gen).to(dtype)
    cpu, generic = fp.take(x), fp.take(x, generic=True)
    assert cpu.rows is not None and cpu.cols is not None and generic.rows is not None and generic.cols is not None
    assert torch.equal(cpu.rows, generic.rows) and torch.equal(cpu.cols, generic.cols)
    y = _flip(x, (2999, 17), 0)
    ch = fp.changes_since(cpu, y)
    assert ch is not None and _where(ch.rows) == [2999] and _where(ch.cols) == [17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_1d_tensor_compared_in_chunks_finds_exactly_the_changed_elements(dtype: torch.dtype) -> None:
    n = 700_000  # above the one-op size: chunks of the xor compare, some uniform, one mixed
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen).to(dtype)
    first = fp.take(x)
    same = fp.changes_since(first, x.clone())
    assert same is not None and same.elems is not None
    assert not bool(same.any()) and same.elems.shape == (n,)
    moved = fp.changes_since(first, x + 1)
    assert moved is not None and moved.elems is not None
    assert bool(moved.any()) and bool(moved.elems.all()) and moved.elems.shape == (n,)
    picked = [0, 262_143, 400_001, n - 1]
    y = x.clone()
    for i in picked:
        y = _flip(y, (i,), 3)
    some = fp.changes_since(first, y)
    assert some is not None and _where(some.elems) == picked
    last = fp.changes_since(first, _flip(x, (n - 1,), 0))  # two unchanged chunks, then a mixed one
    assert last is not None and _where(last.elems) == [n - 1]
    assert not bool(fp.changes_since(first, x).any())  # type: ignore[union-attr]  # the scratch is reused


def _smaps_entry(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `addr`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
                continue
            if inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def assert_huge_page_eligible(addr: int) -> None:
    """On Linux with THP in "madvise" mode, the mapping holding `addr` must be marked THP-eligible (what the
    advice in `gradlog.measure.hostmem` asks for); elsewhere the test is skipped here."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[madvise]" not in mode:
        pytest.skip(f"THP mode is {mode.strip()!r}: the advice changes nothing there")
    fields = _smaps_entry(addr)
    assert fields.get("THPeligible") == "1", fields


def test_a_big_1d_tensor_keeps_exact_bits_in_memory_advised_for_huge_pages() -> None:
    """The kept copy of a big 1-D tensor is its exact bits, and on Linux with THP in "madvise" mode the
    kernel marks its mapping eligible for huge pages (what keeps fresh-memory page faults off a
    construction's cost); elsewhere only the values are checked."""
    n = 6_000_000  # 24 MB of fp32: above hostmem's threshold
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    first = fp.take(x)
    assert first.elems is not None
    assert torch.equal(first.elems.view(-1), x.view(torch.int32))
    assert first.elems.data_ptr() != x.data_ptr()
    y = _flip(x, (n // 2,), 30)
    ch = fp.changes_since(first, y)
    assert ch is not None and _where(ch.elems) == [n // 2]
    assert_huge_page_eligible(first.elems.data_ptr() + (4 << 20))


def test_take_all_gives_take_s_bits_and_sees_one_changed_value() -> None:
    """Same-shape small tensors are fingerprinted from one stack (a 5,000-layer model's construction); the
    result must be `take`'s, bit for bit, for every dtype and shape, mixed with tensors `take` handles alone."""
    torch.manual_seed(0)
    ts: list[torch.Tensor] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool, torch.complex64):
        for shape in [(32, 32), (7,), (3, 4, 5), (16, 1), (1, 16), (5, 3, 2, 2)]:
            for _ in range(3):
                x = torch.randn(shape) * 10
                ts.append((torch.complex(x, x + 1) if dtype.is_complex else x).to(dtype))
    ts += [torch.randn(300, 300), torch.randn(()), torch.zeros(0, 4), torch.randn(40000)]  # one of a kind, big
    batched = fp.take_all(ts)
    for t, got in zip(ts, batched):
        want = fp.take(t)
        assert got.shape == want.shape
        for part in ("rows", "cols", "elems"):
            a, b = getattr(got, part), getattr(want, part)
            assert (a is None) == (b is None), (t.shape, t.dtype, part)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), (t.shape, t.dtype, part)
    for t, first in zip(ts, batched):
        if t.numel() and t.dtype.is_floating_point and t.dim() >= 1:
            moved = t.clone()
            moved.view(-1)[t.numel() // 2] += 1.0
            assert bool(fp.changes_since(first, moved).any()), (t.shape, t.dtype)
            assert not bool(fp.changes_since(first, t).any()), (t.shape, t.dtype)


def test_changes_all_answers_as_changes_since_slice_for_slice() -> None:
    """close() compares small same-shape tensors from one stack; every slice's answer must be the one
    `changes_since` gives alone, and both must see exactly the test's own edits."""
    torch.manual_seed(1)
    ts: list[torch.Tensor] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.complex64):
        for shape in [(32, 32), (7,), (3, 4, 5), (16, 1), (1, 16)]:
            for _ in range(3):
                x = torch.randn(shape) * 10
                ts.append((torch.complex(x, x + 1) if dtype.is_complex else x).to(dtype))
    ts += [torch.randn(300, 300), torch.randn(()), torch.randn(40000)]
    firsts = [fp.take(t) for t in ts[: len(ts) // 2]] + fp.take_all(ts[len(ts) // 2 :])  # both kinds of first
    now: list[torch.Tensor] = []
    edited: list[tuple[int, ...] | None] = []
    for k, t in enumerate(ts):
        if k % 3 == 0 or t.dim() == 0:
            now.append(t.clone())
            edited.append(None)
            continue
        at = tuple(min(1, d - 1) for d in t.shape)
        now.append(_flip(t, at, 3))
        edited.append(at)
    batched = fp.changes_all(firsts, now)
    for t, first, n, got, at in zip(ts, firsts, now, batched, edited):
        want = fp.changes_since(first, n)
        assert got is not None and want is not None
        for part in ("rows", "cols", "elems"):
            a, b = getattr(got, part), getattr(want, part)
            assert (a is None) == (b is None), (t.shape, t.dtype, part)
            if a is not None:
                assert torch.equal(a.expand(b.shape), b), (t.shape, t.dtype, part)
        assert bool(got.any()) == (at is not None), (t.shape, t.dtype)
        if at is not None and got.rows is not None:
            assert _where(got.rows) == [at[0]] and _where(got.cols) == [at[1]], (t.shape, t.dtype)
        if at is not None and got.elems is not None:
            assert _where(got.elems) == [at[0]], (t.shape, t.dtype)
