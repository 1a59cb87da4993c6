"""State-pool ops: dvllm's custom kernels (csrc/) against the pure-torch references in
dvllm.ops that define them, on the CPU and, where there is one, a CUDA GPU.

Outputs and pools are poisoned first (NaN, or random values the op must leave alone), so
an element left unwritten, written wrongly or written where it should not be fails the
comparison.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing

from dvllm import _extension, ops
from dvllm.ops import AX, CH, CLIP, CN, MAX_HISTORY, NUM_COEFFS

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_NUMELS = [16, 64, 256]
ROWS = [1, 3, 17]
# numel per block size: whole blocks, a ragged last block, less than one block.
NUMELS = {"whole": lambda b: 3 * b, "ragged": lambda b: 2 * b + 7, "sub-block": lambda b: b - 5}
# scatter_update tolerance: both sides compute in float32, then round to the pool dtype
# (a fused multiply-add on the GPU may move a result by one unit in the last place).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-4), torch.bfloat16: (1e-2, 1e-3)}


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_pool(num_blocks: int, block_numel: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_blocks, block_numel, generator=gen).to(dtype=dtype, device=device)


def distinct_tables(count: int, rows: int, cols: int, num_blocks: int, gen: torch.Generator,
                    device: str) -> list[torch.Tensor]:
    """`count` [rows, cols] tables whose blocks are all distinct, in shuffled order."""
    ids = torch.randperm(num_blocks, generator=gen)[: count * rows * cols].to(torch.int32)
    return [t.reshape(rows, cols).to(device) for t in ids.chunk(count)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        assert _extension.custom_ops_available("cuda"), "CUDA torch with nvcc, but the CUDA kernels did not build"
    return request.param


def test_extension_built() -> None:
    """CI must exercise the C++ kernels: a build failure fails here instead of falling back."""
    if os.environ.get(_extension.ENV_VAR) == "0":
        pytest.skip(f"{_extension.ENV_VAR}=0 disables the custom ops")
    assert _extension.custom_ops_available(), "dvllm's custom ops did not build; see the warning logged above"
    assert _extension.custom_ops_available("cpu")
    assert not _extension.custom_ops_available("meta")


def test_a_build_lock_left_by_an_interrupted_build_is_cleared(tmp_path) -> None:
    """A killed build leaves torch's lock file; a later process must not wait on it forever."""
    from dvllm._extension import STALE_BUILD_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    now = os.stat(lock).st_mtime
    assert not clear_stale_lock(tmp_path, now=now + 60) and lock.exists()  # a build may be running
    assert clear_stale_lock(tmp_path, now=now + STALE_BUILD_LOCK_S + 1) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # none left


def test_references_match_definition() -> None:
    """The references themselves: element i of row r is pool[table[r, i // B], i % B]."""
    gen = torch.Generator().manual_seed(0)
    pool, table, numel = make_pool(9, 4, torch.float32, "cpu", gen), torch.tensor([[7, 2, 2], [0, 8, 5]]).int(), 10
    dense = ops.gather_blocks_ref(pool, table, numel)
    for r in range(2):
        for i in range(numel):
            assert dense[r, i] == pool[table[r, i // 4], i % 4]
    target = pool.clone()
    ops.scatter_blocks_ref(-dense[:1], target, table[:1])
    for i in range(numel):
        assert target[table[0, i // 4], i % 4] == -dense[0, i]
    assert target[5, 2:].eq(pool[5, 2:]).all() and target[1].eq(pool[1]).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("numel_kind", NUMELS)
@pytest.mark.parametrize("block_numel", BLOCK_NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_blocks(device: str, dtype: torch.dtype, block_numel: int, numel_kind: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + block_numel)
    numel = NUMELS[numel_kind](block_numel)
    nb, num_blocks = ceil_div(numel, block_numel), 5 * rows + 4
    pool = make_pool(num_blocks, block_numel, dtype, device, gen)
    # Random ids drawn with replacement: rows share blocks, and may repeat one within a row.
    table = torch.randint(0, num_blocks, (rows, nb), generator=gen, dtype=torch.int32)
    if rows > 1:
        table[-1] = table[0]  # two rows reading the same state, as a shared prompt embedding
    table = table.to(device)
    expected = ops.gather_blocks_ref(pool, table, numel)

    out = torch.full((rows, numel), float("nan"), dtype=dtype, device=device)
    assert ops.gather_blocks(pool, table, numel, out=out) is out
    exact(out, expected)
    exact(ops.gather_blocks(pool, table, numel), expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("numel_kind", NUMELS)
@pytest.mark.parametrize("block_numel", BLOCK_NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_blocks(device: str, dtype: torch.dtype, block_numel: int, numel_kind: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + block_numel + 1)
    numel = NUMELS[numel_kind](block_numel)
    nb = ceil_div(numel, block_numel)
    num_blocks = 2 * rows * nb + 3  # unaddressed blocks must stay as they were
    pool = make_pool(num_blocks, block_numel, dtype, device, gen)
    (table,) = distinct_tables(1, rows, nb, num_blocks, gen, device)
    src = torch.randn(rows, numel, generator=gen).to(device)  # float32: the wrapper casts to pool.dtype
    expected = pool.clone()
    ops.scatter_blocks_ref(src, expected, table)
    ops.scatter_blocks(src, pool, table)
    exact(pool, expected)
    exact(ops.gather_blocks(pool, table, numel), src.to(dtype))  # round trip


# (history, noise dtype, model_output dtype, clip): every value of each factor appears at least once.
UPDATE_VARIANTS = {
    "plain": (None, None, "float32", False),
    "mixed-history+noise+clip": ("mixed", "float32", "pool", True),
    "history+pool-noise": ("all", "pool", "float32", False),
    "no-history-rows+clip": ("none", None, "pool", True),
    "history-slots": ("slots", "float32", "float32", False),
}


def update_case(device: str, dtype: torch.dtype, block_numel: int, numel: int, rows: int, variant: str,
                gen: torch.Generator):
    """A pool, its tables and the inputs of one scatter_update call."""
    history, noise_dtype, mo_dtype, clip = UPDATE_VARIANTS[variant]
    nb = ceil_div(numel, block_numel)
    slots = MAX_HISTORY if history == "slots" else 1
    pool = make_pool((1 + slots) * rows * nb + 5, block_numel, dtype, device, gen)
    latent_table, *history_slots = distinct_tables(1 + slots, rows, nb, pool.shape[0], gen, device)
    history_table = history_slots[0] if slots == 1 else torch.stack(history_slots, dim=1)
    if history in ("mixed", "none"):  # -1 rows keep no history
        no_history = torch.arange(rows) % 2 == 1 if history == "mixed" else torch.ones(rows, dtype=torch.bool)
        history_table[no_history.to(device)] = -1
    if history == "slots":  # row r keeps r % (MAX_HISTORY + 1) slots, the rest -1: a batch of several samplers
        for r in range(rows):
            history_table[r, r % (MAX_HISTORY + 1):] = -1
    as_dtype = {"float32": torch.float32, "pool": dtype}
    model_output = torch.randn(rows, numel, generator=gen).to(device=device, dtype=as_dtype[mo_dtype])
    coeffs = torch.randn(rows, NUM_COEFFS, generator=gen)
    coeffs[:, CLIP] = torch.where(torch.arange(rows) % 3 == 1, float("inf"), 0.5)  # rows 1, 4, ... do not clip
    noise = None if noise_dtype is None else torch.randn(rows, numel, generator=gen).to(device, as_dtype[noise_dtype])
    history_table = None if history is None else history_table
    return pool, latent_table, model_output, coeffs.to(device), history_table, noise, clip


@pytest.mark.parametrize("variant", UPDATE_VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("numel_kind", NUMELS)
@pytest.mark.parametrize("block_numel", BLOCK_NUMELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_update(device: str, dtype: torch.dtype, block_numel: int, numel_kind: str, rows: int,
                        variant: str) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + block_numel + 2)
    pool, *args = update_case(device, dtype, block_numel, NUMELS[numel_kind](block_numel), rows, variant, gen)
    expected = pool.clone()
    ops.scatter_update_ref(expected, *args)
    ops.scatter_update(pool, *args)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(pool, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_update_matches_sampler_update(device: str, dtype: torch.dtype) -> None:
    """gather -> sampler_update (the dense update the samplers are tested with) -> compare."""
    gen = torch.Generator().manual_seed(3)
    rows, shape, block_numel = 5, (4, 6, 6), 40  # 144 elements: 4 blocks, the last one ragged
    numel = shape[0] * shape[1] * shape[2]
    pool, latent_table, mo, coeffs, history_table, noise, clip = update_case(
        device, dtype, block_numel, numel, rows, "mixed-history+noise+clip", gen)
    coeffs[:, AX] *= 4  # push some x0 past the clip bound
    has_history = history_table[:, 0] >= 0
    sample = ops.gather_blocks(pool, latent_table, numel)
    history = ops.gather_blocks(pool, history_table.clamp(min=0), numel).float() * has_history[:, None]

    prev, x0 = ops.sampler_update(sample.view(rows, *shape), mo.view(rows, *shape), coeffs,
                                  [history.view(rows, *shape)], noise.view(rows, *shape), clip)
    ops.scatter_update(pool, latent_table, mo, coeffs, history_table, noise, clip)

    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(ops.gather_blocks(pool, latent_table, numel), prev.view(rows, numel).to(dtype),
                               rtol=rtol, atol=atol)
    torch.testing.assert_close(ops.gather_blocks(pool, history_table[has_history], numel),
                               x0.view(rows, numel)[has_history].to(dtype), rtol=rtol, atol=atol)
    assert (x0.abs() <= 0.5).any() and (x0.abs() > 0.5).any()  # the case did clip some rows, not all


def check_every_op(device: str, dtype: torch.dtype, block_numel: int, numel: int, rows: int, seed: int) -> None:
    """gather, scatter and the fused update of one case, each against its reference."""
    gen = torch.Generator().manual_seed(seed)
    pool, latent_table, *rest = update_case(device, dtype, block_numel, numel, rows, "mixed-history+noise+clip", gen)
    exact(ops.gather_blocks(pool, latent_table, numel), ops.gather_blocks_ref(pool, latent_table, numel))
    src, expected = torch.randn(rows, numel, generator=gen).to(device, dtype), pool.clone()
    ops.scatter_blocks_ref(src, expected, latent_table)
    ops.scatter_blocks(src, pool, latent_table)
    exact(pool, expected)
    ops.scatter_update_ref(expected, latent_table, *rest)
    ops.scatter_update(pool, latent_table, *rest)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(pool, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_threads(device: str, dtype: torch.dtype) -> None:
    """Enough segments that the CPU kernels split the work across threads (about 16K elements a task)."""
    check_every_op(device, dtype, block_numel=256, numel=9000, rows=5, seed=6)  # 36 segments a row


@pytest.mark.parametrize("block_numel, numel, rows", [
    (4096, 2 * 4096 + 100, 3),  # production block sizes: a CUDA block strides over thousands of elements
    (65536, 65536 + 1000, 2),
    (16, 40, 70_000),  # more rows than a CUDA grid's y dimension (65535): rows stride over the grid
    (16, 16 * 70_000 + 3, 1),  # more blocks a row than its x dimension (65535): blocks stride too
], ids=["4096", "65536", "rows>65535", "blocks>65535"])
def test_production_sizes(device: str, block_numel: int, numel: int, rows: int) -> None:
    check_every_op(device, torch.float16, block_numel, numel, rows, seed=block_numel + rows)


def test_scatter_update_history_read_before_write(device: str) -> None:
    """prev uses the old history, and the new history is x0: check one element by hand."""
    pool = torch.tensor([[1.0, 2.0], [10.0, 20.0]], device=device)
    coeffs = torch.zeros(1, NUM_COEFFS, device=device)
    coeffs[0, AX], coeffs[0, CH], coeffs[0, CN] = 3.0, 1.0, 0.5
    latent_table, history_table = (torch.tensor([[i]], dtype=torch.int32, device=device) for i in (0, 1))
    ops.scatter_update(pool, latent_table, torch.zeros(1, 2, device=device), coeffs, history_table,
                       noise=torch.tensor([[2.0, 4.0]], device=device))
    exact(pool, torch.tensor([[11.0, 22.0], [3.0, 6.0]], device=device))


@pytest.mark.parametrize("op", ["gather", "scatter", "update"])
def test_empty_batches(device: str, op: str) -> None:
    pool = torch.randn(4, 16, device=device)
    before = pool.clone()
    empty_table = torch.zeros(0, 2, dtype=torch.int32, device=device)
    if op == "gather":
        assert ops.gather_blocks(pool, empty_table, 20).shape == (0, 20)
    elif op == "scatter":
        ops.scatter_blocks(torch.zeros(0, 20, device=device), pool, empty_table)
    else:
        coeffs = torch.zeros(0, NUM_COEFFS, device=device)
        ops.scatter_update(pool, empty_table, torch.zeros(0, 20, device=device), coeffs)
    exact(pool, before)


def test_wrappers_reject_bad_input() -> None:
    pool, table = torch.zeros(8, 16), torch.zeros(2, 2, dtype=torch.int32)
    mo, coeffs = torch.zeros(2, 20), torch.zeros(2, NUM_COEFFS)
    bad = [
        (lambda: ops.gather_blocks(pool, table.long(), 20), "must be int32"),
        (lambda: ops.gather_blocks(pool, table, 40), r"shape \[R, 3\]"),
        (lambda: ops.gather_blocks(pool.double(), table, 20), "float32, float16 or bfloat16"),
        (lambda: ops.gather_blocks(pool.t(), table, 20), "contiguous"),
        (lambda: ops.gather_blocks(pool, table, 20, out=torch.zeros(2, 20, dtype=torch.float16)), "out must be"),
        (lambda: ops.gather_blocks(pool, table, 20, out=torch.zeros(20, 2).t()), "out must be contiguous"),
        (lambda: ops.scatter_blocks(torch.zeros(3, 20), pool, table), r"src must have shape \(2, 20\)"),
        (lambda: ops.scatter_update(pool, table, mo.double(), coeffs), "model_output must be"),
        (lambda: ops.scatter_update(pool, table, mo, coeffs[:, :7]), rf"coeffs must have shape \(2, {NUM_COEFFS}\)"),
        (lambda: ops.scatter_update(pool, table, mo, coeffs.half()), "coeffs must be torch.float32"),
        (lambda: ops.scatter_update(pool, table, mo, coeffs, table[:1]), "history_table has 1 rows"),
        (lambda: ops.scatter_update(pool, table, mo, coeffs, noise=mo[:, :10]), "noise must have shape"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


def custom_ops_on(device: str):
    if not _extension.custom_ops_available(device):
        pytest.skip("custom ops not built (test_extension_built says why)")
    return torch.ops.dvllm


def _raise_in_a_process_of_its_own(*case: str) -> None:
    """tests/kernel_raises.py's case in a fresh interpreter: a crash while raising (seen once on an H200) fails
    this test, naming the signal, and the suite goes on."""
    script = os.path.join(os.path.dirname(__file__), "kernel_raises.py")
    done = subprocess.run([sys.executable, script, *case], capture_output=True, text=True, timeout=300)
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    assert done.returncode == 0, f"kernel_raises.py {' '.join(case)}: {how}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "raised as expected" in done.stdout


@pytest.mark.slow
def test_kernels_check_their_arguments(device: str) -> None:
    """Called directly, the ops check what the wrappers would (RuntimeError from TORCH_CHECK)."""
    custom_ops_on(device)
    _raise_in_a_process_of_its_own("arguments", device)


@pytest.mark.slow
def test_cpu_kernels_check_block_ids() -> None:
    custom_ops_on("cpu")
    _raise_in_a_process_of_its_own("block_ids")


def test_opcheck(device: str) -> None:
    """Schemas (Tensor(a!) on what is written), fake kernels and functionalization."""
    custom_ops = custom_ops_on(device)
    gen = torch.Generator().manual_seed(4)
    pool, latent_table, mo, coeffs, history_table, noise, clip = update_case(
        device, torch.float16, 16, 40, 3, "mixed-history+noise+clip", gen)
    out = torch.empty(3, 40, dtype=torch.float16, device=device)
    for op, args in [
        (custom_ops.gather_blocks.default, (out, pool, latent_table)),
        (custom_ops.scatter_blocks.default, (out, pool, latent_table)),
        (custom_ops.scatter_update.default, (pool, latent_table, mo, coeffs, history_table[:, None], noise, clip)),
    ]:
        torch.library.opcheck(op, args)


def test_torch_compile_fullgraph(device: str) -> None:
    """The wrappers trace without graph breaks and call the custom ops (fake kernels) when built."""
    gen = torch.Generator().manual_seed(5)
    pool, latent_table, mo, coeffs, history_table, noise, clip = update_case(
        device, torch.float32, 16, 40, 3, "history-slots", gen)

    def step(pool, latent_table, mo, coeffs, history_table, noise):
        sample = ops.gather_blocks(pool, latent_table, 40)
        ops.scatter_update(pool, latent_table, mo * 2, coeffs, history_table, noise, clip)
        return sample + 1

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    expected_pool = pool.clone()
    expected = step(expected_pool, latent_table, mo, coeffs, history_table, noise)
    exact(compiled(pool, latent_table, mo, coeffs, history_table, noise), expected)
    exact(pool, expected_pool)
    graph = str(counter.graphs[0].graph)
    assert ("dvllm.scatter_update" in graph) == _extension.custom_ops_available(device), graph


def test_dispatch_uses_reference_when_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(ops, "custom_ops_available", lambda device=None: False)
    calls = []

    def spy(name: str):
        original = getattr(ops, name)

        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return call

    for name in ("gather_blocks_ref", "scatter_blocks_ref", "scatter_update_ref"):
        monkeypatch.setattr(ops, name, spy(name))
    pool, table = torch.randn(8, 16), torch.tensor([[3, 1], [0, 6]], dtype=torch.int32)
    ops.gather_blocks(pool, table, 20)
    ops.scatter_blocks(torch.randn(2, 20), pool, table)
    ops.scatter_update(pool, table, torch.randn(2, 20), torch.randn(2, NUM_COEFFS))
    assert calls == ["gather_blocks_ref", "scatter_blocks_ref", "scatter_update_ref"]


def test_env_var_disables_the_build(monkeypatch) -> None:
    """DVLLM_USE_CUSTOM_OPS=0: the (uncached) loader builds nothing and reports no devices."""
    monkeypatch.setenv(_extension.ENV_VAR, "0")
    assert _extension._load.__wrapped__().kernels == ()


@pytest.mark.slow
def test_env_var_end_to_end() -> None:
    """In a fresh process with DVLLM_USE_CUSTOM_OPS=0 the library is never loaded, and the ops still work."""
    code = (
        "import torch\n"
        "from dvllm import ops\n"
        "from dvllm._extension import custom_ops_available\n"
        "pool, table = torch.randn(8, 16), torch.tensor([[3, 1], [0, 6]], dtype=torch.int32)\n"
        "assert ops.gather_blocks(pool, table, 20).equal(ops.gather_blocks_ref(pool, table, 20))\n"
        "assert not custom_ops_available()\n"
        "assert not hasattr(torch.ops.dvllm, 'gather_blocks')\n"
    )
    env = {**os.environ, _extension.ENV_VAR: "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_the_coefficient_layout_has_one_definition_and_no_import_cycle():
    """dvllm/sampler_coeffs.py defines the layout; the kernels include the header generated from it and
    hard-code none; dvllm/_extension.py (which builds them) does not import dvllm.ops (which calls it)."""
    import ast
    from pathlib import Path

    from dvllm import ops
    from dvllm.sampler_coeffs import Coeff, c_header

    root = Path(__file__).resolve().parents[1]
    assert (ops.AX, ops.CLIP, ops.CN, ops.NUM_COEFFS) == (Coeff.AX, Coeff.CLIP, Coeff.CN, len(Coeff))
    assert ("enum Coeff : int { AX = 0, AM = 1, CLIP = 2, CS = 3, CM = 4, CX = 5, CH = 6, CN = 7, CH1 = 8, CH2 = 9, "
            "NUM_COEFFS = 10 };") in c_header()
    assert "enum : int { MAX_HISTORY = 3 };" in c_header()
    for source in ("state_ops.cpp", "state_ops_cuda.cu"):
        text = (root / "csrc" / source).read_text()
        assert '#include "dvllm_coeffs.h"' in text and "enum Coeff" not in text and "AX = " not in text
    tree = ast.parse((root / "dvllm" / "_extension.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "dvllm.ops" not in modules
