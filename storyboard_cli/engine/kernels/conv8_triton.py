"""The Triton kernel of engine/kernels/conv8.py, a module of its own as geglu_triton.py is (Triton imported only where an
FP8 artifact is exported on a GPU; the kernel's names module globals, which inductor copies into the package)."""

import triton
import triton.language as tl


@triton.jit
def conv_fp8_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, xs_ptr, bias_ptr, M, H, W, C, P, Q, N,
                    R: tl.constexpr, S: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """An implicit-GEMM convolution: out[m, n] = x_scale w_scale[n] sum_{r, s, c} x[img, p STRIDE - PAD + r,
    q STRIDE - PAD + s, c] w[n, r, s, c] (+ bias[n]), m = (img, p, q); x NHWC [imgs, H, W, C] and w [N, R, S, C] in
    FP8, out NHWC [imgs, P, Q, N]. C a multiple of BLOCK_K; the positions outside the image read as zeros (the
    padding), the rows past M and the channels past N masked."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    img = rm // (P * Q)
    pq = rm % (P * Q)
    p = pq // Q
    q = pq % Q
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for rs in range(R * S):
        r = rs // S
        s = rs % S
        h = p * STRIDE - PAD + r
        w = q * STRIDE - PAD + s
        ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        x_row = ((img * H + h) * W + w).to(tl.int64) * C
        w_row = (rn.to(tl.int64) * (R * S) + rs) * C
        for c0 in range(0, C, BLOCK_K):
            a = tl.load(x_ptr + x_row[:, None] + (c0 + rk)[None, :], ok[:, None], other=0.0)  # (pointer, mask)
            b = tl.load(w_ptr + w_row[:, None] + (c0 + rk)[None, :], n_ok[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
    scale = tl.load(ws_ptr + rn, n_ok, other=0.0) * tl.load(xs_ptr)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), m_ok[:, None] & n_ok[None, :])  # (pointer, value, mask)
