// Reductions and row-wise kernels: sum/mean/max over any axes, softmax and
// log-softmax (and their gradients), layer norm (and gradient), losses, and
// the routing of ReduceMax's gradient.
//
// The sum/mean/max reductions are written once over the element type T
// (dtype.cuh: read through f32, accumulated in f32, the result rounded
// once at the store) and instantiated by FOR_FLOATS: `name` for float,
// `name_f16`, `name_bf16`. The other kernels are float only.

#define MAXR 8
#define NEG_INF (-__int_as_float(0x7f800000))

// M(type, suffix) once per element type; the float entry keeps the plain name.
#define FOR_FLOATS(M) M(float, ) M(f16, _f16) M(bf16, _bf16)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Output element o -> base offset through (odims, ostr); reduced element r ->
// extra offset through (rdims, rstr).
struct Red {
    int orank;
    int odims[MAXR];
    int ostr[MAXR];
    int rrank;
    int rdims[MAXR];
    int rstr[MAXR];
};

__device__ __forceinline__ int red_base(const Red& r, int o) {
    int off = 0;
    for (int d = r.orank - 1; d >= 0; --d) {
        int k = o % r.odims[d];
        o /= r.odims[d];
        off += k * r.ostr[d];
    }
    return off;
}

__device__ __forceinline__ int red_off(const Red& r, int j) {
    int off = 0;
    for (int d = r.rrank - 1; d >= 0; --d) {
        int k = j % r.rdims[d];
        j /= r.rdims[d];
        off += k * r.rstr[d];
    }
    return off;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Block-wide reduction (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result.
__device__ float block_reduce(float v, int is_max) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    float t = lane < nw ? sh[lane] : (is_max ? NEG_INF : 0.0f);
    t = is_max ? warp_max(t) : warp_sum(t);
    return t;
}

// One warp per output. op 0: sum * scale; op 1: max.
template <typename T>
__device__ void reduce_warp_t(T* out, const T* in, int n_out, int n_red, Red r, int op, float scale) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n_out) return;
    int base = red_base(r, warp);
    float acc = op ? NEG_INF : 0.0f;
    for (int j = lane; j < n_red; j += 32) {
        float v = load(in + base + red_off(r, j));
        acc = op ? fmaxf(acc, v) : acc + v;
    }
    acc = op ? warp_max(acc) : warp_sum(acc);
    if (lane == 0) store(out + warp, op ? acc : acc * scale);
}
#define REDUCE_WARP(T, S) \
    extern "C" __global__ void reduce_warp##S(T* out, const T* in, int n_out, int n_red, Red r, int op, \
                                              float scale) { \
        reduce_warp_t<T>(out, in, n_out, n_red, r, op, scale); \
    }
FOR_FLOATS(REDUCE_WARP)

// Over the leading axes of a row-major [n_red, n_out] tensor: out[c] combines
// in[r * n_out + c] over r (a bias gradient: dy [rows, features] summed to
// [features]). A block takes 8 neighbouring columns: each warp reads 4 rows
// of them at a time (four full 32-byte sectors for f32), blockDim.y warps
// stride over the rows, so a 2,304-feature gradient keeps 288 blocks busy
// rather than 72. The 128 partial results of a column are combined in
// shared memory in a fixed order (deterministic, no atomics).
template <typename T>
__device__ void reduce_cols_t(T* out, const T* in, int n_out, int n_red, int op, float scale) {
    __shared__ float part[32][33];
    int col = threadIdx.x & 7, sub = threadIdx.x >> 3;
    int c = blockIdx.x * 8 + col;
    float acc = op ? NEG_INF : 0.0f;
    if (c < n_out) {
        const T* p = in + c;
        int step = blockDim.y * 4;
        #pragma unroll 4
        for (int r = threadIdx.y * 4 + sub; r < n_red; r += step) {
            float v = load(p + (long long)r * n_out);
            acc = op ? fmaxf(acc, v) : acc + v;
        }
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && threadIdx.x < 8 && c < n_out) {
        float s = part[0][col];
        for (int k = 0; k < blockDim.y; k++) {
            for (int q = (k == 0 ? 1 : 0); q < 4; q++) {
                float v = part[k][q * 8 + col];
                s = op ? fmaxf(s, v) : s + v;
            }
        }
        store(out + c, op ? s : s * scale);
    }
}
#define REDUCE_COLS(T, S) \
    extern "C" __global__ void reduce_cols##S(T* out, const T* in, int n_out, int n_red, int op, float scale) { \
        reduce_cols_t<T>(out, in, n_out, n_red, op, scale); \
    }
FOR_FLOATS(REDUCE_COLS)

// One block per output, for long reductions.
template <typename T>
__device__ void reduce_block_t(T* out, const T* in, int n_out, int n_red, Red r, int op, float scale) {
    int o = blockIdx.x;
    if (o >= n_out) return;
    int base = red_base(r, o);
    float acc = op ? NEG_INF : 0.0f;
    for (int j = threadIdx.x; j < n_red; j += blockDim.x) {
        float v = load(in + base + red_off(r, j));
        acc = op ? fmaxf(acc, v) : acc + v;
    }
    acc = block_reduce(acc, op);
    if (threadIdx.x == 0) store(out + o, op ? acc : acc * scale);
}
#define REDUCE_BLOCK(T, S) \
    extern "C" __global__ void reduce_block##S(T* out, const T* in, int n_out, int n_red, Red r, int op, \
                                               float scale) { \
        reduce_block_t<T>(out, in, n_out, n_red, r, op, scale); \
    }
FOR_FLOATS(REDUCE_BLOCK)

// dx (zeroed) gets dy at the first position of each group where x == y.
extern "C" __global__ void reduce_max_grad(float* dx, const float* x, const float* y, const float* dy,
                                           int n_out, int n_red, Red r) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n_out) return;
    int base = red_base(r, warp);
    float target = y[warp];
    int first = 0x7fffffff;
    for (int j = lane; j < n_red; j += 32) {
        if (x[base + red_off(r, j)] == target) { first = j; break; }
    }
    for (int o = 16; o > 0; o >>= 1) first = imin(first, __shfl_xor_sync(0xffffffff, first, o));
    if (lane == 0 && first != 0x7fffffff) dx[base + red_off(r, first)] = dy[warp];
}

// Rows of a [outer, D, inner] tensor: row q has elements at
// (q / inner) * D * inner + q % inner + j * inner. One warp per row.
__device__ __forceinline__ int row_base(int q, int D, int inner) {
    return (q / inner) * D * inner + (q % inner);
}

extern "C" __global__ void softmax(float* y, const float* x, int rows, int D, int inner, int log_mode) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    int b = row_base(q, D, inner);
    float mx = NEG_INF;
    for (int j = lane; j < D; j += 32) mx = fmaxf(mx, x[b + j * inner]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = lane; j < D; j += 32) s += expf(x[b + j * inner] - mx);
    s = warp_sum(s);
    if (log_mode) {
        float ls = logf(s);
        for (int j = lane; j < D; j += 32) y[b + j * inner] = x[b + j * inner] - mx - ls;
    } else {
        float inv = 1.0f / s;
        for (int j = lane; j < D; j += 32) y[b + j * inner] = expf(x[b + j * inner] - mx) * inv;
    }
}

// softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy).
extern "C" __global__ void softmax_grad(float* dx, const float* y, const float* dy, int rows, int D, int inner, int log_mode) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    int b = row_base(q, D, inner);
    float s = 0.0f;
    for (int j = lane; j < D; j += 32) {
        int k = b + j * inner;
        s += log_mode ? dy[k] : dy[k] * y[k];
    }
    s = warp_sum(s);
    for (int j = lane; j < D; j += 32) {
        int k = b + j * inner;
        dx[k] = log_mode ? dy[k] - expf(y[k]) * s : y[k] * (dy[k] - s);
    }
}

// softmax_mixed's input element j of the row at b: as the ops before the
// softmax left it.
__device__ __forceinline__ float smx_in(const void* x, int xdt, const void* mask, long long b, long long mb, int j,
                                        int has_scale, float scale) {
    float v = load_dt(x, b + j, xdt);
    if (has_scale) v = round_dt(v * scale, xdt);
    if (mask) v = round_dt(v + load_dt(mask, mb + j, xdt), xdt);
    return v;
}

// Softmax over the last axis with what mixed precision puts around it
// (fuse/softmax.rs), one warp per row of D contiguous values: the input is
// read in its own type xdt, optionally scaled (x * scale, rounded to xdt as
// the Scale op stores it) and a mask added (rounded to xdt as the Add
// stores it; the mask broadcast over the leading axes: row q's indices over
// l0 x l1 x l2, the last fastest, times the mask's row strides m0..m2),
// then widened to f32 (the Cast: exact). The f32 result goes to y32 when
// it is non-null and, rounded, to yh of type hdt (the Cast after it) when
// that is non-null; with nan_zero, y32 is the output of Where(IsNan(y), 0,
// y) after it and every NaN is written as 0. Every step is the unfused ops'
// arithmetic.
extern "C" __global__ void softmax_mixed(float* y32, void* yh, int hdt, const void* x, int xdt, const void* mask,
                                         int has_scale, float scale, int l1, int l2, int m0, int m1, int m2,
                                         int rows, int D, int nan_zero) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    long long b = (long long)q * D;
    long long mb = 0;
    if (mask) {
        int i2 = q % l2, r = q / l2;
        int i1 = r % l1, i0 = r / l1;
        mb = ((long long)i0 * m0 + (long long)i1 * m1 + (long long)i2 * m2) * D;
    }
    float mx = NEG_INF;
    for (int j = lane; j < D; j += 32) mx = fmaxf(mx, smx_in(x, xdt, mask, b, mb, j, has_scale, scale));
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = lane; j < D; j += 32) s += expf(smx_in(x, xdt, mask, b, mb, j, has_scale, scale) - mx);
    s = warp_sum(s);
    float inv = 1.0f / s;
    for (int j = lane; j < D; j += 32) {
        float v = expf(smx_in(x, xdt, mask, b, mb, j, has_scale, scale) - mx) * inv;
        if (nan_zero && isnan(v)) v = 0.0f;
        if (y32) y32[b + j] = v;
        if (yh) store_dt(yh, b + j, v, hdt);
    }
}

// Softmax's gradient over the last axis, dx = y * (dy - sum(dy * y)), with
// dy read in its own type dydt (the Cast before it: exact) and dx stored as
// type dxdt (the Cast after it), then optionally scaled and stored again
// (the Scale after that, post_scale, rounded to dxdt).
extern "C" __global__ void softmax_grad_mixed(void* dx, int dxdt, int has_post, float post_scale, const float* y,
                                              const void* dy, int dydt, int rows, int D) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    long long b = (long long)q * D;
    float s = 0.0f;
    for (int j = lane; j < D; j += 32) s += load_dt(dy, b + j, dydt) * y[b + j];
    s = warp_sum(s);
    for (int j = lane; j < D; j += 32) {
        float v = y[b + j] * (load_dt(dy, b + j, dydt) - s);
        if (has_post) v = round_dt(v, dxdt) * post_scale;
        store_dt(dx, b + j, v, dxdt);
    }
}

// A row's mean and 1/sqrt(biased variance + eps), by one warp (every lane
// gets both); the mean through `mean`.
__device__ __forceinline__ float row_stats(const float* xr, int D, float eps, int lane, float* mean) {
    float s = 0.0f;
    for (int j = lane; j < D; j += 32) s += xr[j];
    float m = warp_sum(s) / D;
    float v = 0.0f;
    for (int j = lane; j < D; j += 32) { float d = xr[j] - m; v += d * d; }
    *mean = m;
    return rsqrtf(warp_sum(v) / D + eps);
}

// A row's dx from its sums s1 = mean(dy·g) and s2 = mean(dy·g·x̂), by one warp.
__device__ __forceinline__ void layernorm_dx_row(float* dx, const float* xr, const float* g, const float* dyr, int D,
                                                 float mean, float inv, float s1, float s2, int lane) {
    for (int j = lane; j < D; j += 32) {
        float xh = (xr[j] - mean) * inv;
        dx[j] = inv * (dyr[j] * g[j] - s1 - xh * s2);
    }
}

// One warp per row of D contiguous values; biased variance as PyTorch.
extern "C" __global__ void layernorm(float* y, const float* x, const float* g, const float* bt, int rows, int D, float eps) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    const float* xr = x + (long long)q * D;
    float* yr = y + (long long)q * D;
    float mean;
    float inv = row_stats(xr, D, eps, lane, &mean);
    for (int j = lane; j < D; j += 32) yr[j] = (xr[j] - mean) * inv * g[j] + bt[j];
}

// One row's layer-norm gradient by one warp: dx, and dgamma/dbeta terms
// added into pg/pb (stride 1).
__device__ __forceinline__ void layernorm_grad_row(float* dx, float* pg, float* pb, const float* xr, const float* g,
                                                   const float* dyr, int D, float eps, int lane) {
    float mean;
    float inv = row_stats(xr, D, eps, lane, &mean);
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = lane; j < D; j += 32) {
        float xh = (xr[j] - mean) * inv;
        float gd = dyr[j] * g[j];
        s1 += gd;
        s2 += gd * xh;
        atomicAdd(&pg[j], dyr[j] * xh);
        atomicAdd(&pb[j], dyr[j]);
    }
    s1 = warp_sum(s1) / D;
    s2 = warp_sum(s2) / D;
    layernorm_dx_row(dx, xr, g, dyr, D, mean, inv, s1, s2, lane);
}

// dx per row, one warp per row (the block's warps stride over the rows);
// dgamma and dbeta (zeroed first) are summed per block in shared memory
// (2·D floats of dynamic shared memory), then added once per block: the
// rows' atomics contend only within a block.
extern "C" __global__ void layernorm_grad(float* dx, float* dg, float* db, const float* x, const float* g,
                                          const float* dy, int rows, int D, float eps) {
    extern __shared__ float acc[];
    for (int j = threadIdx.x; j < 2 * D; j += blockDim.x) acc[j] = 0.0f;
    __syncthreads();
    int lane = threadIdx.x & 31;
    int per_block = blockDim.x >> 5;
    for (int q = blockIdx.x * per_block + (threadIdx.x >> 5); q < rows; q += gridDim.x * per_block) {
        long long o = (long long)q * D;
        layernorm_grad_row(dx + o, acc, acc + D, x + o, g, dy + o, D, eps, lane);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        atomicAdd(&dg[j], acc[j]);
        atomicAdd(&db[j], acc[D + j]);
    }
}

// layernorm_grad for rows of at most 32·LN_REG values (D ≤ 1024): each
// lane keeps its columns' dgamma and dbeta terms in registers over every
// row its warp does, then adds them into the block's shared sums once (one
// shared atomic per column and warp, where layernorm_grad has one per
// element), and the block adds those into dg and db once.
#define LN_REG 32
extern "C" __global__ void layernorm_grad_reg(float* dx, float* dg, float* db, const float* x, const float* g,
                                              const float* dy, int rows, int D, float eps) {
    extern __shared__ float acc[];
    for (int j = threadIdx.x; j < 2 * D; j += blockDim.x) acc[j] = 0.0f;
    __syncthreads();
    int lane = threadIdx.x & 31;
    int per_block = blockDim.x >> 5;
    float pg[LN_REG], pb[LN_REG];
#pragma unroll
    for (int t = 0; t < LN_REG; ++t) { pg[t] = 0.0f; pb[t] = 0.0f; }
    for (int q = blockIdx.x * per_block + (threadIdx.x >> 5); q < rows; q += gridDim.x * per_block) {
        long long o = (long long)q * D;
        const float* xr = x + o;
        const float* dyr = dy + o;
        float mean;
        float inv = row_stats(xr, D, eps, lane, &mean);
        float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int t = 0; t < LN_REG; ++t) {
            int j = lane + 32 * t;
            if (j < D) {
                float xh = (xr[j] - mean) * inv;
                float gd = dyr[j] * g[j];
                s1 += gd;
                s2 += gd * xh;
                pg[t] += dyr[j] * xh;
                pb[t] += dyr[j];
            }
        }
        s1 = warp_sum(s1) / D;
        s2 = warp_sum(s2) / D;
        layernorm_dx_row(dx + o, xr, g, dyr, D, mean, inv, s1, s2, lane);
    }
#pragma unroll
    for (int t = 0; t < LN_REG; ++t) {
        int j = lane + 32 * t;
        if (j < D) {
            atomicAdd(&acc[j], pg[t]);
            atomicAdd(&acc[D + j], pb[t]);
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        atomicAdd(&dg[j], acc[j]);
        atomicAdd(&db[j], acc[D + j]);
    }
}

// layernorm_grad for rows too long for shared memory: each row's dgamma
// and dbeta terms go straight to global memory.
extern "C" __global__ void layernorm_grad_wide(float* dx, float* dg, float* db, const float* x, const float* g,
                                               const float* dy, int rows, int D, float eps) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (q >= rows) return;
    long long o = (long long)q * D;
    layernorm_grad_row(dx + o, dg, db, x + o, g, dy + o, D, eps, threadIdx.x & 31);
}

// Per-row loss lse(x) - x[label] (NaN for a label out of range), one warp per
// row, summed into out[0] (zeroed first) times `scale`.
extern "C" __global__ void cross_entropy(float* out, const float* logits, const long long* labels, int N, int C, float scale) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= N) return;
    const float* xr = logits + (long long)q * C;
    float mx = NEG_INF;
    for (int j = lane; j < C; j += 32) mx = fmaxf(mx, xr[j]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = lane; j < C; j += 32) s += expf(xr[j] - mx);
    s = warp_sum(s);
    if (lane == 0) {
        long long l = labels[q];
        float loss = (l >= 0 && l < C) ? (logf(s) + mx - xr[l]) : __int_as_float(0x7fc00000);
        atomicAdd(out, loss * scale);
    }
}

extern "C" __global__ void cross_entropy_grad(float* dx, const float* logits, const long long* labels, const float* dloss,
                                              int N, int C) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= N) return;
    const float* xr = logits + (long long)q * C;
    float mx = NEG_INF;
    for (int j = lane; j < C; j += 32) mx = fmaxf(mx, xr[j]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = lane; j < C; j += 32) s += expf(xr[j] - mx);
    s = warp_sum(s);
    float k = dloss[0] / N;
    long long l = labels[q];
    for (int j = lane; j < C; j += 32) {
        float p = expf(xr[j] - mx) / s;
        dx[(long long)q * C + j] = (p - (j == l ? 1.0f : 0.0f)) * k;
    }
}

// out[0] = mean((p - t)^2); one block.
extern "C" __global__ void mse_loss(float* out, const float* p, const float* t, int n) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float d = p[i] - t[i]; acc += d * d; }
    acc = block_reduce(acc, 0);
    if (threadIdx.x == 0) out[0] = acc / n;
}
