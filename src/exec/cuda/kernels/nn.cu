// Neural-network kernels on NCHW tensors: pooling (and gradients), global
// average pooling, embedding (and gradient), training-mode batch norm.

#define GRID_LOOP(i, n) \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += blockDim.x * gridDim.x)
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

struct Pool {
    int N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw;
};

// Padding counts as -inf; the first maximum wins.
extern "C" __global__ void maxpool(float* y, const float* x, Pool p) {
    int n = p.N * p.C * p.OH * p.OW;
    GRID_LOOP(i, n) {
        int ow = i % p.OW, oh = (i / p.OW) % p.OH, nc = i / (p.OW * p.OH);
        const float* xp = x + (long long)nc * p.H * p.W;
        float m = NEG_INF;
        for (int a = 0; a < p.kh; ++a) {
            int h = oh * p.sh - p.ph + a;
            if (h < 0 || h >= p.H) continue;
            for (int b = 0; b < p.kw; ++b) {
                int w = ow * p.sw - p.pw + b;
                if (w < 0 || w >= p.W) continue;
                m = fmaxf(m, xp[h * p.W + w]);
            }
        }
        y[i] = m;
    }
}

// dx zeroed first; dy goes to the first maximum of each window.
extern "C" __global__ void maxpool_grad(float* dx, const float* x, const float* dy, Pool p) {
    int n = p.N * p.C * p.OH * p.OW;
    GRID_LOOP(i, n) {
        int ow = i % p.OW, oh = (i / p.OW) % p.OH, nc = i / (p.OW * p.OH);
        const float* xp = x + (long long)nc * p.H * p.W;
        float m = NEG_INF;
        int at = -1;
        for (int a = 0; a < p.kh; ++a) {
            int h = oh * p.sh - p.ph + a;
            if (h < 0 || h >= p.H) continue;
            for (int b = 0; b < p.kw; ++b) {
                int w = ow * p.sw - p.pw + b;
                if (w < 0 || w >= p.W) continue;
                float v = xp[h * p.W + w];
                if (at < 0 || v > m) { m = v; at = h * p.W + w; }
            }
        }
        if (at >= 0) atomicAdd(&dx[(long long)nc * p.H * p.W + at], dy[i]);
    }
}

__device__ __forceinline__ int avg_count(const Pool& p, int oh, int ow, int include_pad) {
    int h0 = oh * p.sh - p.ph, w0 = ow * p.sw - p.pw;
    int h1 = imin(h0 + p.kh, p.H + p.ph), w1 = imin(w0 + p.kw, p.W + p.pw);
    if (include_pad) return (h1 - h0) * (w1 - w0);
    h0 = imax(h0, 0); w0 = imax(w0, 0);
    h1 = imin(h1, p.H); w1 = imin(w1, p.W);
    return (h1 - h0) * (w1 - w0);
}

extern "C" __global__ void avgpool(float* y, const float* x, Pool p, int include_pad) {
    int n = p.N * p.C * p.OH * p.OW;
    GRID_LOOP(i, n) {
        int ow = i % p.OW, oh = (i / p.OW) % p.OH, nc = i / (p.OW * p.OH);
        const float* xp = x + (long long)nc * p.H * p.W;
        float s = 0.0f;
        for (int a = 0; a < p.kh; ++a) {
            int h = oh * p.sh - p.ph + a;
            if (h < 0 || h >= p.H) continue;
            for (int b = 0; b < p.kw; ++b) {
                int w = ow * p.sw - p.pw + b;
                if (w < 0 || w >= p.W) continue;
                s += xp[h * p.W + w];
            }
        }
        int c = avg_count(p, oh, ow, include_pad);
        y[i] = c > 0 ? s / c : 0.0f;
    }
}

extern "C" __global__ void avgpool_grad(float* dx, const float* dy, Pool p, int include_pad) {
    int n = p.N * p.C * p.OH * p.OW;
    GRID_LOOP(i, n) {
        int ow = i % p.OW, oh = (i / p.OW) % p.OH, nc = i / (p.OW * p.OH);
        int c = avg_count(p, oh, ow, include_pad);
        if (c <= 0) continue;
        float g = dy[i] / c;
        float* dp = dx + (long long)nc * p.H * p.W;
        for (int a = 0; a < p.kh; ++a) {
            int h = oh * p.sh - p.ph + a;
            if (h < 0 || h >= p.H) continue;
            for (int b = 0; b < p.kw; ++b) {
                int w = ow * p.sw - p.pw + b;
                if (w < 0 || w >= p.W) continue;
                atomicAdd(&dp[h * p.W + w], g);
            }
        }
    }
}

// y[q] = mean of row q (length L); one warp per row.
extern "C" __global__ void row_mean(float* y, const float* x, int rows, int L) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= rows) return;
    const float* xr = x + (long long)q * L;
    float s = 0.0f;
    for (int j = lane; j < L; j += 32) s += xr[j];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) y[q] = s / L;
}

// Out-of-range indices give NaN rows.
extern "C" __global__ void embedding(float* y, const float* table, const long long* idx, int n_idx, int D, int V) {
    int n = n_idx * D;
    GRID_LOOP(i, n) {
        int r = i / D, d = i % D;
        long long k = idx[r];
        y[i] = (k >= 0 && k < V) ? table[k * D + d] : __int_as_float(0x7fc00000);
    }
}

extern "C" __global__ void embedding_grad(float* dt, const long long* idx, const float* dy, int n_idx, int D, int V) {
    int n = n_idx * D;
    GRID_LOOP(i, n) {
        int r = i / D, d = i % D;
        long long k = idx[r];
        if (k >= 0 && k < V) atomicAdd(&dt[k * D + d], dy[i]);
    }
}

__device__ float block_sum(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    float t = lane < nw ? sh[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
    return t;
}

// x viewed as [N, C, inner]; one block per channel. Saves mean and
// 1/sqrt(var + eps) (biased var) and updates the running statistics with the
// unbiased variance, as PyTorch.
extern "C" __global__ void bn_stats(float* mean, float* invstd, float* rmean, float* rvar, const float* x,
                                    int N, int C, int inner, float eps, float momentum) {
    int c = blockIdx.x;
    int M = N * inner;
    float s = 0.0f;
    for (int j = threadIdx.x; j < M; j += blockDim.x) {
        int nn = j / inner, k = j % inner;
        s += x[((long long)nn * C + c) * inner + k];
    }
    float mu = block_sum(s) / M;
    float v = 0.0f;
    for (int j = threadIdx.x; j < M; j += blockDim.x) {
        int nn = j / inner, k = j % inner;
        float d = x[((long long)nn * C + c) * inner + k] - mu;
        v += d * d;
    }
    float var = block_sum(v) / M;
    if (threadIdx.x == 0) {
        mean[c] = mu;
        invstd[c] = rsqrtf(var + eps);
        float unbiased = M > 1 ? var * M / (M - 1) : var;
        rmean[c] = (1.0f - momentum) * rmean[c] + momentum * mu;
        rvar[c] = (1.0f - momentum) * rvar[c] + momentum * unbiased;
    }
}

// One pass over x from DRAM: each (n, c) plane block sums its plane, then
// sums the squared deviations from the plane's own mean (a second read of
// the same plane, from cache). partial[c * N + n] = plane sum,
// partial[C * N + c * N + n] = plane M2. bn_stats_finish merges the planes
// in order with Chan's formula.
extern "C" __global__ void bn_plane_stats(float* partial, const float* x, int N, int C, int inner, int vec4) {
    int n = blockIdx.x, c = blockIdx.y;
    const float* p = x + ((long long)n * C + c) * inner;
    const float4* p4 = reinterpret_cast<const float4*>(p);
    int n4 = vec4 ? inner / 4 : 0;
    float s = 0.0f;
    for (int k = threadIdx.x; k < n4; k += blockDim.x) {
        float4 a = p4[k];
        s += (a.x + a.y) + (a.z + a.w);
    }
    for (int k = 4 * n4 + threadIdx.x; k < inner; k += blockDim.x) s += p[k];
    s = block_sum(s);
    float mu = s / inner;
    float m2 = 0.0f;
    for (int k = threadIdx.x; k < n4; k += blockDim.x) {
        float4 a = p4[k];
        float d0 = a.x - mu, d1 = a.y - mu, d2 = a.z - mu, d3 = a.w - mu;
        m2 += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
    }
    for (int k = 4 * n4 + threadIdx.x; k < inner; k += blockDim.x) {
        float d = p[k] - mu;
        m2 += d * d;
    }
    m2 = block_sum(m2);
    if (threadIdx.x == 0) {
        partial[c * N + n] = s;
        partial[C * N + c * N + n] = m2;
    }
}

extern "C" __global__ void bn_stats_finish(float* mean, float* invstd, float* rmean, float* rvar,
                                           const float* partial, int N, int C, int inner, float eps,
                                           float momentum) {
    GRID_LOOP(c, C) {
        int M = N * inner;
        float s = 0.0f;
        for (int n = 0; n < N; ++n) s += partial[c * N + n];
        float mu = s / M;
        float m2 = 0.0f;
        for (int n = 0; n < N; ++n) {
            float d = partial[c * N + n] / inner - mu;
            m2 += partial[C * N + c * N + n] + inner * d * d;
        }
        float var = m2 / M;
        mean[c] = mu;
        invstd[c] = rsqrtf(var + eps);
        float unbiased = M > 1 ? var * M / (M - 1) : var;
        rmean[c] = (1.0f - momentum) * rmean[c] + momentum * mu;
        rvar[c] = (1.0f - momentum) * rvar[c] + momentum * unbiased;
    }
}

extern "C" __global__ void bn_apply(float* y, const float* x, const float* mean, const float* invstd,
                                    const float* g, const float* b, int n, int C, int inner) {
    GRID_LOOP(i, n) {
        int c = (i / inner) % C;
        y[i] = (x[i] - mean[c]) * invstd[c] * g[c] + b[c];
    }
}

// bn_apply with planes along grid x (blockIdx.x = n * C + c, any count) and
// gridDim.y blocks per plane: no index division per element; vec4: four
// floats at a time (inner % 4 == 0, y and x 16-byte aligned; the host
// checks). Same arithmetic as bn_apply.
extern "C" __global__ void bn_apply_planes(float* y, const float* x, const float* mean, const float* invstd,
                                           const float* g, const float* b, int C, int inner, int vec4) {
    long long p = blockIdx.x;
    int c = (int)(p % C);
    float mc = mean[c], is = invstd[c], gc = g[c], bc = b[c];
    long long base = p * inner;
    int step = blockDim.x * gridDim.y;
    int first = blockIdx.y * blockDim.x + threadIdx.x;
    if (vec4) {
        const float4* x4 = reinterpret_cast<const float4*>(x + base);
        float4* y4 = reinterpret_cast<float4*>(y + base);
        for (int j = first; j < inner / 4; j += step) {
            float4 a = x4[j];
            float4 o;
            o.x = (a.x - mc) * is * gc + bc;
            o.y = (a.y - mc) * is * gc + bc;
            o.z = (a.z - mc) * is * gc + bc;
            o.w = (a.w - mc) * is * gc + bc;
            y4[j] = o;
        }
    } else {
        for (int j = first; j < inner; j += step) y[base + j] = (x[base + j] - mc) * is * gc + bc;
    }
}

// One block per channel: dbeta = sum dy, dgamma = sum dy * xhat.
extern "C" __global__ void bn_grad_reduce(float* dg, float* db, const float* x, const float* mean, const float* invstd,
                                          const float* dy, int N, int C, int inner) {
    int c = blockIdx.x;
    int M = N * inner;
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = threadIdx.x; j < M; j += blockDim.x) {
        int nn = j / inner, k = j % inner;
        long long at = ((long long)nn * C + c) * inner + k;
        s1 += dy[at];
        s2 += dy[at] * (x[at] - mean[c]) * invstd[c];
    }
    s1 = block_sum(s1);
    s2 = block_sum(s2);
    if (threadIdx.x == 0) { db[c] = s1; dg[c] = s2; }
}

// bn_grad_reduce over N x C plane blocks: partial[c * N + n] = sum dy and
// partial[C * N + c * N + n] = sum dy * xhat over the plane, then one thread
// per channel adds its planes in order.
extern "C" __global__ void bn_grad_plane(float* partial, const float* x, const float* mean, const float* invstd,
                                         const float* dy, int N, int C, int inner, int vec4) {
    int n = blockIdx.x, c = blockIdx.y;
    long long at = ((long long)n * C + c) * inner;
    float mu = mean[c], is = invstd[c];
    int n4 = vec4 ? inner / 4 : 0;
    const float4* x4 = reinterpret_cast<const float4*>(x + at);
    const float4* g4 = reinterpret_cast<const float4*>(dy + at);
    float s1 = 0.0f, s2 = 0.0f;
    for (int k = threadIdx.x; k < n4; k += blockDim.x) {
        float4 a = x4[k], g = g4[k];
        s1 += (g.x + g.y) + (g.z + g.w);
        s2 += (g.x * (a.x - mu) * is + g.y * (a.y - mu) * is) + (g.z * (a.z - mu) * is + g.w * (a.w - mu) * is);
    }
    for (int k = 4 * n4 + threadIdx.x; k < inner; k += blockDim.x) {
        float g = dy[at + k];
        s1 += g;
        s2 += g * (x[at + k] - mu) * is;
    }
    s1 = block_sum(s1);
    s2 = block_sum(s2);
    if (threadIdx.x == 0) {
        partial[c * N + n] = s1;
        partial[C * N + c * N + n] = s2;
    }
}

extern "C" __global__ void bn_grad_finish(float* dg, float* db, const float* partial, int N, int C) {
    GRID_LOOP(c, C) {
        float s1 = 0.0f, s2 = 0.0f;
        for (int n = 0; n < N; ++n) {
            s1 += partial[c * N + n];
            s2 += partial[C * N + c * N + n];
        }
        db[c] = s1;
        dg[c] = s2;
    }
}

extern "C" __global__ void bn_grad_dx(float* dx, const float* x, const float* g, const float* mean, const float* invstd,
                                      const float* dy, const float* dg, const float* db, int n, int C, int inner, int M) {
    GRID_LOOP(i, n) {
        int c = (i / inner) % C;
        float xh = (x[i] - mean[c]) * invstd[c];
        dx[i] = g[c] * invstd[c] / M * (M * dy[i] - db[c] - xh * dg[c]);
    }
}

// bn_grad_dx over planes, as bn_apply_planes (same arithmetic as bn_grad_dx).
extern "C" __global__ void bn_grad_dx_planes(float* dx, const float* x, const float* g, const float* mean,
                                             const float* invstd, const float* dy, const float* dg, const float* db,
                                             int C, int inner, int M, int vec4) {
    long long p = blockIdx.x;
    int c = (int)(p % C);
    float mc = mean[c], is = invstd[c], dgc = dg[c], dbc = db[c];
    float k = g[c] * is / M;
    float fm = (float)M;
    long long base = p * inner;
    int step = blockDim.x * gridDim.y;
    int first = blockIdx.y * blockDim.x + threadIdx.x;
    if (vec4) {
        const float4* x4 = reinterpret_cast<const float4*>(x + base);
        const float4* d4 = reinterpret_cast<const float4*>(dy + base);
        float4* o4 = reinterpret_cast<float4*>(dx + base);
        for (int j = first; j < inner / 4; j += step) {
            float4 a = x4[j], d = d4[j];
            float4 o;
            o.x = k * (fm * d.x - dbc - (a.x - mc) * is * dgc);
            o.y = k * (fm * d.y - dbc - (a.y - mc) * is * dgc);
            o.z = k * (fm * d.z - dbc - (a.z - mc) * is * dgc);
            o.w = k * (fm * d.w - dbc - (a.w - mc) * is * dgc);
            o4[j] = o;
        }
    } else {
        for (int j = first; j < inner; j += step) {
            float xh = (x[base + j] - mc) * is;
            dx[base + j] = k * (fm * dy[base + j] - dbc - xh * dgc);
        }
    }
}
