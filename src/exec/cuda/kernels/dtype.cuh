// Element types of the kernels, compiled in front of every kernels/*.cu
// source (device.rs). No CUDA header is included: the 16-bit types are their
// bit patterns (`unsigned short`), converted with PTX and integer arithmetic,
// so NVRTC needs no include path (NVRTC ships cuda_fp16.h and cuda_bf16.h
// only for an -I path to a toolkit or to headers it first extracts).
//
// A kernel written once reads through load(const T*) -> float and writes
// through store(T*, float); the arithmetic is f32 in registers and a half
// result is rounded once, at the store, to nearest even: bit for bit what
// half::f16::from_f32 and half::bf16::from_f32 give on the CPU.

// IEEE binary16 (fp16), as its bits.
struct f16 {
    unsigned short bits;
};

// bfloat16: the upper 16 bits of an f32.
struct bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float v) { return v; }

// Exact: every fp16 value is an f32 value.
__device__ __forceinline__ float to_f32(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

// Exact: the bits are the f32's upper half.
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((unsigned int)v.bits) << 16); }

// f32 -> fp16, round to nearest even (PTX `cvt.rn`, every architecture).
__device__ __forceinline__ f16 f32_to_f16(float v) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
}

// f32 -> bf16, round to nearest even, in integer arithmetic (the same steps
// as half::bf16::from_f32, so also on architectures before sm_80, which
// lack `cvt.rn.bf16.f32`): a NaN keeps its sign and upper payload and is
// made quiet; otherwise add 0x7fff plus the kept part's lowest bit and
// truncate (a carry rounds up into the exponent, to infinity past the
// largest finite value).
__device__ __forceinline__ bf16 f32_to_bf16(float v) {
    unsigned int u = __float_as_uint(v);
    bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return h;
}

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const f16* p) { return to_f32(*p); }
__device__ __forceinline__ float load(const bf16* p) { return to_f32(*p); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(f16* p, float v) { *p = f32_to_f16(v); }
__device__ __forceinline__ void store(bf16* p, float v) { *p = f32_to_bf16(v); }

// Element types chosen at run time, for fused kernels whose tensors' types
// vary by graph (fuse/softmax.rs): 0 f32, 1 fp16, 2 bf16 (softmax_dt in
// ops). The branch is uniform over a launch.
__device__ __forceinline__ float load_dt(const void* p, long long i, int dt) {
    if (dt == 1) return load((const f16*)p + i);
    if (dt == 2) return load((const bf16*)p + i);
    return ((const float*)p)[i];
}

__device__ __forceinline__ void store_dt(void* p, long long i, float v, int dt) {
    if (dt == 1) store((f16*)p + i, v);
    else if (dt == 2) store((bf16*)p + i, v);
    else ((float*)p)[i] = v;
}

// v as a tensor of type dt holds it: rounded to nearest even for a half type.
__device__ __forceinline__ float round_dt(float v, int dt) {
    if (dt == 1) return to_f32(f32_to_f16(v));
    if (dt == 2) return to_f32(f32_to_bf16(v));
    return v;
}
