"""The Triton kernels of engine/kernels/geglu.py, a module of their own: importing Triton costs a process time it
would not use where no FP8 artifact is built, and inductor compiles a user's kernel into a package from its source
together with the jit functions and constants it names as module globals (it follows no closure)."""

import triton
import triton.language as tl

K_SQRT_HALF = tl.constexpr(0.7071067811865476)  # GELU's erf form: erf(g / sqrt(2))
K_FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A program's (row tile, column tile): GROUP_M row tiles at a time down each column tile (the weight's
    tiles stay in L2 across the group)."""
    n_tiles = N // BLOCK_N
    first_m = (pid // (GROUP_M * n_tiles)) * GROUP_M
    size_m = min((M + BLOCK_M - 1) // BLOCK_M - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * n_tiles)) % size_m, (pid % (GROUP_M * n_tiles)) // size_m


@triton.jit
def geglu_epilogue(acc_h, acc_g, b_ptr, xs_ptr, ws_ptr, os_ptr, off_n, N, QUANT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """An output tile from its h and g accumulators: the operands' scales, the bias of its h columns (from off_n)
    and of the g columns N further, h * gelu(g) (erf form), and with QUANT the output's scale, saturated at the FP8
    range."""
    s = tl.load(xs_ptr) * tl.load(ws_ptr)
    h = acc_h * s
    g = acc_g * s
    if HAS_BIAS:
        rn = off_n + tl.arange(0, BLOCK_N)
        h += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        g += tl.load(b_ptr + N + rn).to(tl.float32)[None, :]
    y = h * (0.5 * g * (1.0 + tl.math.erf(g * K_SQRT_HALF)))
    if QUANT:
        y = tl.minimum(tl.maximum(y / tl.load(os_ptr), -K_FP8_MAX), K_FP8_MAX)
    return y


@triton.jit
def geglu_tile(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K, pid_m, pid_n, QUANT: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile (pid_m, pid_n), with pointer tiles: x [M, K], W [2N, K] row-major (the Linear's weight),
    out [M, N]; K a multiple of BLOCK_K, N of BLOCK_N, the rows past M masked."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    a_ptrs = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    h_ptrs = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N], K-major
    g_ptrs = h_ptrs + N * K
    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, m_ok[:, None], other=0.0)  # (pointer, mask): the rows past M read as 0
        acc_h = tl.dot(a, tl.load(h_ptrs), acc_h)
        acc_g = tl.dot(a, tl.load(g_ptrs), acc_g)
        a_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    y = geglu_epilogue(acc_h, acc_g, b_ptr, xs_ptr, ws_ptr, os_ptr, pid_n * BLOCK_N, N, QUANT, HAS_BIAS, BLOCK_N)
    out = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), m_ok[:, None])  # (pointer, value, mask)


@triton.jit
def geglu_gemm_persistent_kernel(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K,
                                 QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[m, n] = h * gelu(g), h = s (x W[n]^T) + b[n], g = s (x W[N + n]^T) + b[N + n], s = x_scale w_scale
    (QUANT: / out_scale, saturated, FP8), on a persistent grid: each program takes every num_programs-th tile in
    the grouped order, so no wave of programs ends part-full, and the grid does not depend on M."""
    tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        pid_m, pid_n = tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        geglu_tile(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K, pid_m, pid_n, QUANT, HAS_BIAS,
                   BLOCK_M, BLOCK_N, BLOCK_K)
